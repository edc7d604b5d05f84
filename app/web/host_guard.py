"""The Host allowlist in front of the whole server (UI, Gradio's API, ``/v1``, the live feed).

A web page can point a name it controls at 127.0.0.1 (DNS rebinding) and then talk to the app as
a same-origin page; Gradio also trusts any Origin whenever the Host is not exactly a loopback
name. Browsers always send the Host they connected to, so refusing unknown Hosts closes both: only
the loopback names, the interface the server was told to bind, and ``--allowed-hosts`` get in.
"""
from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
ANY_INTERFACE = frozenset({"0.0.0.0", "::", ""})


def host_name(host_header: str) -> str:
    """The name in a Host header, lower-cased, without its port or IPv6 brackets."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host[1:]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def interface_addresses() -> set[str]:
    """The IPv4 and IPv6 addresses of this machine's network interfaces (psutil, which the model
    stack already installs; none when it cannot be imported), without an IPv6 zone."""
    try:
        import psutil
    except ImportError:
        return set()
    try:
        interfaces = psutil.net_if_addrs()
    except (OSError, RuntimeError):
        return set()
    return {entry.address.split("%", 1)[0].lower() for entries in interfaces.values() for entry in entries
            if entry.family in (socket.AF_INET, socket.AF_INET6)}


def this_machines_names() -> set[str]:
    """This machine's host name, the addresses it resolves to and its interfaces' addresses (what
    a LAN neighbour types when the server binds every interface: the name often resolves to
    127.0.1.1 or 127.0.0.1 alone, never to the address the neighbour reaches)."""
    names = {socket.gethostname().lower(), socket.getfqdn().lower()}
    for name in list(names):
        try:
            names.update(info[4][0].split("%", 1)[0].lower() for info in socket.getaddrinfo(name, None))
        except OSError:
            continue
    return names | interface_addresses()


def reachable_addresses() -> list[str]:
    """This machine's addresses a neighbour may use (every interface's but loopback), IPv4 first:
    what the startup line lists when the server binds every interface."""
    found = set()
    for name in this_machines_names():
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            continue
        if not address.is_loopback:
            found.add(address)
    return [str(a) for a in sorted(found, key=lambda a: (a.version, a.is_link_local, a))]


def allowed_hosts(bind: str, extra: Iterable[str] = ()) -> frozenset[str] | None:
    """The Host names to accept when serving on ``bind``; ``None`` (accept any) when ``extra``
    holds ``*``. Binding every interface (``0.0.0.0``, ``::``) adds this machine's own names and
    addresses, its interfaces' included."""
    extra = [host_name(h) for h in extra if h.strip()]
    if "*" in extra:
        return None
    names = set(LOOPBACK_NAMES) | set(extra)
    bind = host_name(bind or "")
    if bind in ANY_INTERFACE:
        names |= this_machines_names()
    else:
        names.add(bind)
    return frozenset(names)


def _is_loopback_literal(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class HostGuardMiddleware:
    """Answers 403 to HTTP requests and closes WebSockets whose Host is not allowed."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str] | None) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.allowed is None or scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        name = host_name(Headers(scope=scope).get("host", ""))
        if name in self.allowed or _is_loopback_literal(name):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        response = PlainTextResponse(
            f"Host {name!r} is not allowed. This server answers to: {', '.join(sorted(self.allowed))} "
            "(add names with --allowed-hosts).", status_code=403)
        await response(scope, receive, send)
