"""Who may call the server from another web origin: nobody, unless ``--cors-origins`` names it,
and then only ``/v1``, without credentials.

Gradio's own CORS middleware answers any Origin with ``Access-Control-Allow-Credentials: true``
whenever the Host is not exactly ``localhost``, ``127.0.0.1`` or ``0.0.0.0`` (``[::1]``, a LAN
address under ``--host 0.0.0.0``): a page the user visits could then drive the UI with the user's
login cookie. This middleware replaces it (a Starlette ``CORSMiddleware`` in the app's middleware
list makes Gradio's step aside):

- a request from a foreign Origin (not the Host it was sent to) that could change something (any
  method but GET and HEAD) is refused with 403 before it reaches a route, and so is any preflight;
- on ``/v1`` an Origin listed in ``--cors-origins`` gets CORS headers (no credentials: the API key
  travels as a Bearer header the calling page must hold), with preflights for ``Authorization``
  and ``Content-Type``;
- responses never carry ``Access-Control-Allow-Credentials``.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

API_PREFIX = "/v1"
SAFE_METHODS = ("GET", "HEAD")
API_METHODS = "GET, POST, OPTIONS"
API_HEADERS = "Authorization, Content-Type"


def normalise_origin(origin: str) -> str:
    """``scheme://host[:port]``, lower-cased, without a trailing slash (how browsers send Origin)."""
    return origin.strip().rstrip("/").lower()


def parse_origins(values: Iterable[str]) -> frozenset[str]:
    """The ``--cors-origins`` list: full origins (``https://app.example:8443``). Raises ValueError
    with one line for anything else (a bare name, a path, ``*``)."""
    origins = set()
    for value in values:
        value = value.strip()
        if not value:
            continue
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/") \
                or parts.query or parts.fragment:
            raise ValueError(f"--cors-origins takes full origins such as https://app.example:8443, got {value!r}")
        origins.add(normalise_origin(value))
    return frozenset(origins)


def same_origin(origin: str, host: str) -> bool:
    """Whether ``origin`` (the Origin header) names the server the request was sent to (``host``)."""
    netloc = urlsplit(origin).netloc.lower()
    return bool(netloc) and netloc == host.strip().lower()


def _refuse(api: bool, origin: str) -> Response:
    message = (f"cross-origin requests from {origin} are not allowed"
               + (" (the server's --cors-origins lists the pages that may call /v1)" if api else ""))
    if api:  # OpenAI's error shape
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "cors"}}
        return Response(json.dumps(body), status_code=403, media_type="application/json")
    return Response(message, status_code=403, media_type="text/plain")


class CrossOriginMiddleware:
    """The policy above, in front of every route (after the Host allowlist)."""

    def __init__(self, app: ASGIApp, api_origins: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.api_origins = api_origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if origin is None or same_origin(origin, headers.get("host", "")):
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        api = path == API_PREFIX or path.startswith(API_PREFIX + "/")
        allowed = api and normalise_origin(origin) in self.api_origins
        method = scope["method"]
        if method == "OPTIONS" and "access-control-request-method" in headers:
            if not allowed:
                await _refuse(api, origin)(scope, receive, send)
                return
            await Response(status_code=204, headers={
                "Access-Control-Allow-Origin": origin, "Access-Control-Allow-Methods": API_METHODS,
                "Access-Control-Allow-Headers": API_HEADERS, "Access-Control-Max-Age": "600",
                "Vary": "Origin"})(scope, receive, send)
            return
        if not allowed and method not in SAFE_METHODS:
            await _refuse(api, origin)(scope, receive, send)
            return

        async def send_with_policy(message: Message) -> None:
            if message["type"] == "http.response.start":
                response_headers = MutableHeaders(scope=message)
                for name in ("access-control-allow-origin", "access-control-allow-credentials"):
                    del response_headers[name]
                if allowed:
                    response_headers["Access-Control-Allow-Origin"] = origin
                    response_headers.add_vary_header("Origin")
            await send(message)

        await self.app(scope, receive, send_with_policy)
