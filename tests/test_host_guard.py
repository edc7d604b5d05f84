"""The Host allowlist's rules (app/host_guard.py); tests/test_openai_api.py checks it on a real server."""
from __future__ import annotations

import pytest

from app.host_guard import LOOPBACK_NAMES, allowed_hosts, host_name


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


def test_cors_origins_must_be_full_origins():
    from app.cross_origin import parse_origins, same_origin

    assert parse_origins(["https://A.example:8443/", " ", "http://localhost:3000"]) == {
        "https://a.example:8443", "http://localhost:3000"}
    for bad in ("*", "a.example", "https://a.example/path", "ftp://a.example", "https://a.example/?q=1"):
        with pytest.raises(ValueError, match="full origins"):
            parse_origins([bad])
    assert same_origin("http://127.0.0.1:7860", "127.0.0.1:7860")
    assert not same_origin("http://127.0.0.1:7861", "127.0.0.1:7860") and not same_origin("null", "127.0.0.1:7860")
