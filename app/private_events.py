"""Gradio's by-name routes for the app's public events only.

Gradio 6 runs any event by its ``api_name`` at ``/gradio_api/call/<name>`` (and ``call/v2``,
``run``, ``api``), ``api_visibility="private"`` ones included: "private" only hides an event from
``/gradio_api/info`` and the API page. :class:`NamedEventsMiddleware` answers ``404`` on those
routes for every name that is not a public (or undocumented) event of the page, so a private
event, such as loading another model pair, runs only as the page submits it: through
``/gradio_api/queue/join``, by its index, within a session.
"""
from __future__ import annotations

from collections.abc import Iterable

from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

PREFIX = "/gradio_api/"
BY_NAME = ("call", "run", "api")  # /gradio_api/<route>/<api_name>[/...]


def callable_names(demo) -> frozenset[str]:
    """The ``api_name`` of each event of ``demo`` (a ``gr.Blocks``) that is not private."""
    return frozenset(fn.api_name for fn in demo.fns.values()
                     if isinstance(fn.api_name, str) and fn.api_visibility != "private")


def event_name(path: str) -> str | None:
    """The event name a by-name route of Gradio's names (``None`` for any other path)."""
    if not path.startswith(PREFIX):
        return None
    parts = path[len(PREFIX):].split("/")
    if len(parts) < 2 or parts[0] not in BY_NAME:
        return None
    if parts[0] == "call" and parts[1] == "v2" and len(parts) > 2:
        parts = parts[1:]
    return parts[1]


class NamedEventsMiddleware:
    """404 on Gradio's by-name routes for names outside ``allowed``."""

    def __init__(self, app: ASGIApp, allowed: Iterable[str]) -> None:
        self.app = app
        self.allowed = frozenset(allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            name = event_name(scope.get("path", ""))
            if name is not None and name not in self.allowed:
                await PlainTextResponse(f"no event is callable as {name!r} here", status_code=404)(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)
