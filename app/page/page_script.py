"""An ASGI middleware that puts a script at the top of every HTML page's ``<head>``, ahead of
the page's own modules (Gradio's ``head=`` is added by its JavaScript, after they have loaded)."""
from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HeadScriptMiddleware:
    """Inserts ``<script>{script}</script>`` right after ``<head>`` in uncompressed HTML responses
    to GET requests; every other response passes through untouched."""

    def __init__(self, app: ASGIApp, script: str) -> None:
        self.app = app
        self.tag = f"<script>{script}</script>".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "GET":
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def send_with_script(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                headers = MutableHeaders(raw=message["headers"])
                if headers.get("content-type", "").startswith("text/html") and "content-encoding" not in headers:
                    start = message  # held until the whole body is here
                    return
            elif message["type"] == "http.response.body" and start is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body"):
                    return
                body = b"".join(chunks).replace(b"<head>", b"<head>" + self.tag, 1)
                headers = MutableHeaders(raw=start["headers"])
                headers["content-length"] = str(len(body))
                await send(start)
                await send({"type": "http.response.body", "body": body})
                return
            await send(message)

        await self.app(scope, receive, send_with_script)
