"""What one client may cost the server: how long it may take to send a request, how many
connections may be open at once, how large a request body may be (on every route, Gradio's
included) and how many events Gradio's queue holds.

Gradio starts uvicorn itself, with uvicorn's defaults: a keep-alive timeout, but no concurrency
limit and no read timeout at all. A client that sent half a request head, or a ``Content-Length``
and part of the body, held its connection (and, past ``--host 0.0.0.0``, before any key was
checked) for as long as it liked, and nothing capped how many did. Here:

- :class:`DeadlineH11Protocol` is uvicorn's own h11 protocol with two deadlines: a request head
  must arrive whole within ``header_timeout_s`` of its first byte (or of the connection's
  opening), a body within ``body_timeout_s`` of the head's end. Past either the connection is
  closed (a late body first gets ``408 Request Timeout``, and the application sees the client
  gone). Between requests uvicorn's keep-alive timeout closes an idle connection.
- Connections past ``max_connections`` are closed as soon as they are accepted, and uvicorn's
  ``limit_concurrency`` answers ``503`` to requests past the same number.
- h11's cap on a request head (``h11_max_incomplete_event_size``) stays at its 16 KiB.
- :class:`BodyLimitMiddleware` refuses a body over ``max_body_bytes`` on every route: ``413`` at
  once for a ``Content-Length`` over it, and a body sent without one (chunked) is cut off as it
  passes the limit (the application sees the client gone; the rest is discarded unread).

:func:`serving_with` applies these settings to the uvicorn server Gradio's ``launch`` starts.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass

import h11
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 200
MAX_BODY_BYTES = 8 << 20       # every request body (app.api.openai_requests.MAX_BODY_BYTES: the same)
QUEUE_SIZE = 64                # events waiting in Gradio's queue (the worker's own queue is behind it)
KEEP_ALIVE_S = 5               # uvicorn's default, stated
MAX_HEAD_BYTES = 16 * 1024     # h11's default, stated
API_PREFIX = "/v1"


@dataclass(frozen=True)
class ServerLimits:
    """The limits above (seconds, counts, bytes); the defaults are ``launch.py``'s."""

    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    max_body_bytes: int = MAX_BODY_BYTES
    queue_size: int = QUEUE_SIZE
    keep_alive_s: float = KEEP_ALIVE_S

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "max_connections", "max_body_bytes", "queue_size",
                     "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")

    def protocol(self) -> type[DeadlineH11Protocol]:
        """uvicorn's h11 protocol class with these deadlines and this connection cap."""
        return type("DeadlineH11Protocol", (DeadlineH11Protocol,), {"limits": self})

    def configure(self, config) -> None:
        """Set these limits on a ``uvicorn.Config`` before its server starts."""
        config.http = self.protocol()
        config.limit_concurrency = self.max_connections + 1  # uvicorn counts the asking connection too
        config.timeout_keep_alive = self.keep_alive_s
        config.h11_max_incomplete_event_size = MAX_HEAD_BYTES


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with the head and body deadlines and the connection cap of
    ``limits`` (set on the subclass :meth:`ServerLimits.protocol` makes)."""

    limits: ServerLimits = ServerLimits()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._owed: str | None = None  # what the client is late with: "head" or "body"

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.logger.warning("Too many open connections (%d): closing a new one.", len(self.connections))
            self.transport.close()
            return
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch(between_requests=True)

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._cancel()  # the connection is the WebSocket protocol's from here on
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        super().connection_lost(exc)

    def _cancel(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._owed = None, None

    def _watch(self, between_requests: bool = False) -> None:
        """Arm (or keep, or drop) the deadline for what the client now owes: the rest of a
        request head, or of a body. Idle between two requests, it owes nothing (uvicorn's
        keep-alive timeout holds then) until the next request's first byte."""
        if self.transport is None or self.transport.is_closing() or self.transport.get_protocol() is not self:
            self._cancel()
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            owed = "head" if not between_requests or self.conn.trailing_data[0] else None
        elif state is h11.SEND_BODY:
            owed = "body"
        else:
            owed = None
        if owed == self._owed:
            return  # a deadline runs from the start of what it covers, not from the latest byte
        self._cancel()
        if owed is not None:
            timeout = self.limits.header_timeout_s if owed == "head" else self.limits.body_timeout_s
            self._owed, self._deadline = owed, self.loop.call_later(timeout, self._too_late)

    def _too_late(self) -> None:
        owed, self._deadline, self._owed = self._owed, None, None
        if self.transport.is_closing() or self.transport.get_protocol() is not self:
            return
        cycle = self.cycle
        if cycle is not None:  # the application sees the client gone, and nothing more it sends goes out
            cycle.disconnected = True
            cycle.message_event.set()
        self.logger.info("Closing a connection that sent its request %s too slowly.", owed)
        if owed == "body" and cycle is not None and not cycle.response_started:
            message = f"the request body did not arrive within {self.limits.body_timeout_s:g} s\n".encode()
            try:
                self.transport.write(self.conn.send(h11.Response(status_code=408, reason=b"Request Timeout", headers=[
                    (b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(message)).encode()),
                    (b"connection", b"close")])))
                self.transport.write(self.conn.send(h11.Data(data=message)))
                self.transport.write(self.conn.send(h11.EndOfMessage()))
            except h11.LocalProtocolError:
                pass
        self.transport.close()


class BodyLimitMiddleware:
    """``413`` for a request body over ``max_bytes``, on every route (OpenAI's error shape under
    ``/v1``): at once when ``Content-Length`` says so, and as soon as a body sent without one
    passes the limit (the application then receives a disconnect, and its answer is dropped)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "").strip()
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, send)
            return
        received, refused, started = 0, False, False

        async def counted() -> Message:
            nonlocal received, refused, started
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    if not started:
                        started = True
                        await self._refuse(scope, send)
                    return {"type": "http.disconnect"}
            return message

        async def sending(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the application's answer to a body it never got whole
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted, sending)
        except Exception:
            if not refused:
                raise  # otherwise: the application failed on the disconnect it was given

    async def _refuse(self, scope: Scope, send: Send) -> None:
        message = f"the request body is larger than {self.max_bytes / (1 << 20):g} MiB"
        path = scope.get("path", "")
        if path == API_PREFIX or path.startswith(API_PREFIX + "/"):
            body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                         "code": "request_too_large"}}).encode()
            media = b"application/json"
        else:
            body, media = message.encode(), b"text/plain; charset=utf-8"
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", media), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def serving_with(limits: ServerLimits) -> Iterator[None]:
    """While inside, the uvicorn servers Gradio's ``launch`` starts take ``limits`` (Gradio
    makes the ``uvicorn.Config`` itself and passes none of these settings through)."""
    from gradio import http_server

    original = http_server.Server

    class LimitedServer(original):  # type: ignore[misc, valid-type]
        def __init__(self, config, *args, **kwargs) -> None:
            limits.configure(config)
            super().__init__(config, *args, **kwargs)

    http_server.Server = LimitedServer
    try:
        yield
    finally:
        http_server.Server = original


def check_served_with(server, limits: ServerLimits) -> None:
    """Raise RuntimeError unless ``server`` (Gradio's running uvicorn server) took ``limits``."""
    http = getattr(getattr(server, "config", None), "http", None)
    if not (isinstance(http, type) and issubclass(http, DeadlineH11Protocol) and http.limits == limits):
        raise RuntimeError("Gradio's server did not take the connection limits: check app.server_limits "
                           "against this Gradio")
