"""Gradio's by-name routes for the app's public events only.

Gradio 6 runs any event by its ``api_name`` at ``/gradio_api/call/<name>`` (and ``call/v2``),
``api_visibility="private"`` ones included: "private" only hides an event from
``/gradio_api/info`` and the API page. Its older routes ``/gradio_api/run/<name>`` and
``/gradio_api/api/<name>`` are worse: they run whatever event the body's ``fn_index`` names,
outside the queue (its size cap and concurrency limits), whatever the name in the path. The page
sends every event through ``/gradio_api/queue/join`` except those registered with
``queue=False``, which it sends to ``/run/<name>``.

:class:`NamedEventsMiddleware` answers ``404`` on ``/call`` for every name that is not a public
(or undocumented) event, and on ``/run`` and ``/api`` for every name but those of events the
page itself sends outside the queue (this app has none: there, any ``fn_index`` could follow).
A private event, such as loading another model pair, then runs only as the page submits it:
through the queue, by its index, within a session.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

PREFIX = "/gradio_api/"
BY_NAME = ("call", "run", "api")  # /gradio_api/<route>/<api_name>[/...]


@dataclass(frozen=True)
class CallableEvents:
    """The names each of Gradio's by-name routes may run."""

    call: frozenset[str]                   # /call/<name>: the events that are not private
    unqueued: frozenset[str] = frozenset()  # /run/<name>, /api/<name>: the page's events outside the queue


def callable_names(demo) -> CallableEvents:
    """The by-name routes' events of ``demo`` (a ``gr.Blocks``)."""
    fns = [fn for fn in demo.fns.values() if isinstance(fn.api_name, str)]
    return CallableEvents(frozenset(fn.api_name for fn in fns if fn.api_visibility != "private"),
                          frozenset(fn.api_name for fn in fns if not fn.queue and fn.fn is not None))


def event_name(path: str) -> tuple[str, str] | None:
    """``(route, event name)`` of a by-name route of Gradio's (``None`` for any other path)."""
    if not path.startswith(PREFIX):
        return None
    parts = path[len(PREFIX):].split("/")
    if len(parts) < 2 or parts[0] not in BY_NAME:
        return None
    if parts[0] == "call" and parts[1] == "v2" and len(parts) > 2:
        parts = [parts[0]] + parts[2:]
    return parts[0], parts[1]


class NamedEventsMiddleware:
    """404 on Gradio's by-name routes for the names ``allowed`` does not give them."""

    def __init__(self, app: ASGIApp, allowed: CallableEvents | Iterable[str]) -> None:
        self.app = app
        self.allowed = allowed if isinstance(allowed, CallableEvents) else CallableEvents(frozenset(allowed))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            named = event_name(scope.get("path", ""))
            if named is not None:
                route, name = named
                if name not in (self.allowed.call if route == "call" else self.allowed.unqueued):
                    await PlainTextResponse(f"no event is callable as {name!r} at /gradio_api/{route}",
                                            status_code=404)(scope, receive, send)
                    return
        await self.app(scope, receive, send)
