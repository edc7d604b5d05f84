"""The Host allowlist's rules (app/host_guard.py); tests/test_openai_api.py checks it on a real server."""
from __future__ import annotations

import asyncio
import ipaddress
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.web.host_guard import LOOPBACK_NAMES, HostGuardMiddleware, allowed_hosts, host_name, reachable_addresses


@pytest.mark.parametrize("header, name", [("localhost:7860", "localhost"), ("127.0.0.1", "127.0.0.1"),
                                          ("[::1]:7860", "::1"), ("[::1]", "::1"), ("Example.COM:80", "example.com"),
                                          ("::1", "::1"), ("", "")])
def test_host_name_drops_the_port_and_brackets(header, name):
    assert host_name(header) == name


def test_loopback_binding_allows_only_loopback_names_and_the_extra_ones():
    assert allowed_hosts("127.0.0.1") == LOOPBACK_NAMES
    assert allowed_hosts("127.0.0.1", ["chat.lan:7860", " "]) == LOOPBACK_NAMES | {"chat.lan"}
    assert "192.168.1.5" in allowed_hosts("192.168.1.5")
    assert allowed_hosts("127.0.0.1", ["*"]) is None


def test_binding_every_interface_adds_this_machines_names():
    import socket

    names = allowed_hosts("0.0.0.0")
    assert LOOPBACK_NAMES <= names and socket.gethostname().lower() in names
    assert "evil.example" not in names


def _interface(address: str, family=socket.AF_INET):
    return SimpleNamespace(family=family, address=address)


def test_binding_every_interface_adds_the_interfaces_addresses(monkeypatch):
    """The host name often resolves to 127.0.1.1 alone: a LAN neighbour's Host (the machine's
    address on the network) got 403 under --host 0.0.0.0 unless --allowed-hosts named it."""
    import psutil

    monkeypatch.setattr(psutil, "net_if_addrs", lambda: {
        "lo": [_interface("127.0.0.1"), _interface("::1", socket.AF_INET6)],
        "eth0": [_interface("192.168.1.23"), _interface("fe80::1c2:3%eth0", socket.AF_INET6),
                 _interface("2001:db8::5", socket.AF_INET6), _interface("02:fc:00:00:00:01", psutil.AF_LINK)]})
    for bind in ("0.0.0.0", "::", "[::]"):
        names = allowed_hosts(bind)
        assert {"192.168.1.23", "fe80::1c2:3", "2001:db8::5"} <= names, bind
        assert "02:fc:00:00:00:01" not in names
    assert "192.168.1.23" not in allowed_hosts("127.0.0.1")
    assert reachable_addresses()[:3] == ["192.168.1.23", "2001:db8::5", "fe80::1c2:3"]

    guard = HostGuardMiddleware(_ok, allowed_hosts("0.0.0.0"))
    for host, status in (("192.168.1.23:7860", 200), ("[2001:db8::5]:7860", 200), ("192.168.1.24:7860", 403),
                         ("evil.example:7860", 403)):
        assert _status(guard, host) == status, host


def _system_addresses() -> set[str]:
    """This machine's interface addresses, read without psutil: IPv4 by ioctl (SIOCGIFADDR) on each
    interface, IPv6 from /proc/net/if_inet6 (Linux)."""
    import fcntl
    import struct

    found = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            found.add(socket.inet_ntoa(packed[20:24]))
    inet6 = Path("/proc/net/if_inet6")
    if inet6.exists():
        for line in inet6.read_text().splitlines():
            raw = line.split()[0]
            found.add(str(ipaddress.IPv6Address(int(raw, 16))))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the interfaces the Linux way")
def test_this_machines_own_interface_addresses_are_allowed():
    names = allowed_hosts("0.0.0.0")
    system = _system_addresses()
    assert system and system <= names, system - names
    assert set(reachable_addresses()) == {a for a in system if not ipaddress.ip_address(a).is_loopback}


async def _ok(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def _status(app, host: str) -> int:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/", "headers": [(b"host", host.encode())]}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"]


def test_cors_origins_must_be_full_origins():
    from app.web.cross_origin import parse_origins, same_origin

    assert parse_origins(["https://A.example:8443/", " ", "http://localhost:3000"]) == {
        "https://a.example:8443", "http://localhost:3000"}
    for bad in ("*", "a.example", "https://a.example/path", "ftp://a.example", "https://a.example/?q=1"):
        with pytest.raises(ValueError, match="full origins"):
            parse_origins([bad])
    assert same_origin("http://127.0.0.1:7860", "127.0.0.1:7860")
    assert not same_origin("http://127.0.0.1:7861", "127.0.0.1:7860") and not same_origin("null", "127.0.0.1:7860")
