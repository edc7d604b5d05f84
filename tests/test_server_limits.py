"""What one client may cost the server (app/web/server_limits.py, app/web/private_events.py), on real
local servers (tiny pair) through raw sockets: slow request heads and bodies are closed after
their deadlines, connections past the cap are closed at once, a body over the limit gets 413 on
every route, and the Models panel's event is not callable by name (nor there at all when off)."""
from __future__ import annotations

import selectors
import socket
import time

import httpx
import pytest
import test_app_support as support
from gradio_client import Client

from app.api import openai_api

from app.page import ui
from app.serving.pair import make_engine
from app.web.private_events import callable_names, event_name
from app.web.server_limits import BodyLimitMiddleware, ServerLimits
from app.serving.worker import Worker

HEAD_S, BODY_S = 1.0, 1.5      # the deadlines of the `limited` server
SLACK_S = 10.0                 # how late past a deadline a socket may still be closed (a busy machine)
BODY_LIMIT = 1 << 20           # the `limited` server's body limit
CAP = 8                        # the `capped` server's connections


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    yield from support.one_torch_thread()


def serve(limits: ServerLimits, options: dict | None = None):
    """Generator for a module fixture: ``(demo, worker, root_url, port)`` of the app and its API."""
    tok = support.tokenizer()
    target, draft = support.tiny_pair()
    worker = Worker(make_engine(target, draft, tok), tok, {"target": "tiny-target", "draft": "tiny-draft"})
    demo = ui.build_demo(worker, tok, options)
    port = support.free_port()
    app, url, _ = ui.launch(demo, server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                            guards=ui.Guards(limits=limits))
    openai_api.mount(app, worker, {"tree_size": 8, "depth": 4})
    yield demo, worker, url.rstrip("/"), port
    demo.close()
    worker.close()


@pytest.fixture(scope="module")
def limited():
    yield from serve(ServerLimits(header_timeout_s=HEAD_S, body_timeout_s=BODY_S, max_body_bytes=BODY_LIMIT))


@pytest.fixture(scope="module")
def capped():
    """Long deadlines, eight connections, and no Models panel (as beyond loopback by default)."""
    yield from serve(ServerLimits(header_timeout_s=60, body_timeout_s=60, max_connections=CAP),
                     {"models_panel": False})


def connect(port: int, data: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if data:
        sock.sendall(data)
    return sock


def wait_closed(sockets: list[socket.socket], timeout: float) -> tuple[dict[int, float], dict[int, bytes]]:
    """Read each socket until the server closes it (end of stream or reset), for at most ``timeout``
    seconds: ``({index: seconds until closed}, {index: bytes received})``."""
    start = time.monotonic()
    closed, received = {}, {i: b"" for i in range(len(sockets))}
    with selectors.DefaultSelector() as selector:
        for i, sock in enumerate(sockets):
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ, i)
        while len(closed) < len(sockets) and time.monotonic() - start < timeout:
            for key, _ in selector.select(timeout=0.1):
                i = key.data
                try:
                    data = key.fileobj.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:  # reset
                    data = b""
                if data:
                    received[i] += data
                else:
                    closed[i] = time.monotonic() - start
                    selector.unregister(key.fileobj)
    return closed, received


def head(method: str, path: str, port: int, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def response_head(sock: socket.socket, timeout: float = 15) -> bytes:
    """The response's status line and headers (raises TimeoutError when none comes)."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        if not part:
            break
        data += part
    return data


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length (head and body)."""
    data = response_head(sock)
    top, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in top.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return top + b"\r\n\r\n" + body


def close_all(sockets) -> None:
    for sock in sockets:
        sock.close()


# ----- read deadlines ---------------------------------------------------------------------------
def test_slow_heads_and_bodies_are_closed_after_their_deadlines(limited):
    """50 connections that send half a request head and 50 that send a head and part of the body
    (on /v1 and on Gradio's queue) are all closed within seconds of the deadlines; the bodies' first
    get 408. Before, all of them stayed open (past 60 s)."""
    demo, _, root, port = limited
    halves = [connect(port, f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUser-Ag".encode()) for _ in range(50)]
    bodies = [connect(port, head("POST", path, port, {"Content-Type": "application/json", "Content-Length": "1000"})
                      + b'{"model": "tiny-target", "messages": [')
              for path in ("/v1/chat/completions", "/gradio_api/queue/join") * 25]
    try:
        closed, received = wait_closed(halves + bodies, BODY_S + SLACK_S)
        assert len(closed) == 100, f"{100 - len(closed)} slow connections were still open"
        assert max(closed[i] for i in range(50)) < HEAD_S + SLACK_S
        assert all(received[i] == b"" for i in range(50))  # a head never finished gets no answer
        assert all(received[i].startswith(b"HTTP/1.1 408 ") for i in range(50, 100)), received[50][:200]
    finally:
        close_all(halves + bodies)
    assert len(demo._queue) == 0  # nothing was queued for them
    assert httpx.get(root + "/v1/models", timeout=30).status_code == 200  # and the server still answers


def test_a_head_sent_in_pieces_in_time_is_answered_and_an_idle_connection_may_wait(limited):
    """The head's deadline runs from its first byte: a keep-alive connection idle between two
    requests for longer than it is not closed (uvicorn's keep-alive timeout, 5 s, holds then)."""
    _, _, _, port = limited
    sock = connect(port)
    try:
        for _ in range(2):
            request = head("GET", "/v1/models", port, {})
            sock.sendall(request[:10])
            time.sleep(HEAD_S / 4)
            sock.sendall(request[10:])
            answer = read_response(sock)
            assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
            time.sleep(HEAD_S * 1.5)
    finally:
        sock.close()


def test_connections_past_the_cap_are_closed_at_once(capped):
    _, _, root, port = capped
    held = [connect(port) for _ in range(CAP + 4)]
    try:
        closed, _ = wait_closed(held, 5)
        assert len(closed) == 4, f"{len(closed)} of {CAP + 4} idle connections closed, not the 4 past the cap"
        with pytest.raises(httpx.TransportError):
            httpx.get(root + "/v1/models", timeout=10)
    finally:
        close_all(held)
    assert support.wait_until(lambda: _answers(root), 10)


def _answers(root: str) -> bool:
    try:
        return httpx.get(root + "/v1/models", timeout=10).status_code == 200
    except httpx.TransportError:
        return False


# ----- body size ---------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/gradio_api/queue/join", "/gradio_api/upload", "/v1/chat/completions", "/"])
def test_a_declared_oversized_body_gets_413_on_every_route(limited, path):
    """A 150 MB Content-Length is refused before its body is read (200 and a gigabyte of memory on
    /gradio_api/queue/join before); only a few kilobytes are sent here."""
    demo, _, _, port = limited
    sock = connect(port, head("POST", path, port, {"Content-Type": "application/json",
                                                   "Content-Length": str(150_000_000)}) + b"[" + b" " * 4096)
    try:
        answer = response_head(sock)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    if path.startswith("/v1"):
        assert b"application/json" in answer
    assert len(demo._queue) == 0


@pytest.mark.parametrize("path", ["/gradio_api/queue/join", "/v1/chat/completions"])
def test_a_chunked_body_is_cut_off_at_the_limit(limited, path):
    """Without Content-Length, the body is counted as it comes: past the limit the server answers
    413 while the client is still sending (the body never ends here)."""
    demo, _, _, port = limited
    sock = connect(port, head("POST", path, port, {"Content-Type": "application/json",
                                                   "Transfer-Encoding": "chunked"}))
    chunk = b" " * 65536
    try:
        for _ in range(BODY_LIMIT // len(chunk) + 1):
            sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        answer = response_head(sock)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert len(demo._queue) == 0


def test_gradio_s_queue_is_capped(limited):
    demo, _, _, _ = limited
    assert demo._queue.max_size == ServerLimits().queue_size


async def _collect(app, scope, messages):
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    return sent


def test_the_body_limit_gives_the_application_a_disconnect_and_drops_its_answer():
    import asyncio

    seen = []

    async def app(scope, receive, send):
        while True:
            message = await receive()
            seen.append(message["type"])
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    scope = {"type": "http", "path": "/gradio_api/queue/join", "headers": []}
    parts = [{"type": "http.request", "body": b"x" * 600, "more_body": True} for _ in range(3)]
    sent = asyncio.run(_collect(BodyLimitMiddleware(app, 1000), scope, parts))
    assert seen == ["http.request", "http.disconnect"]
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [413]
    small = asyncio.run(_collect(BodyLimitMiddleware(app, 1000), scope,
                                 [{"type": "http.request", "body": b"x" * 1000, "more_body": False}]))
    assert small[0]["status"] == 200


# ----- the Models panel ---------------------------------------------------------------------------
LOAD = {"data": ["sequoia-test-org/missing-model", "sequoia-test-org/missing-draft", "float32", "cpu", False]}


def test_loading_a_pair_is_not_callable_by_name(limited, monkeypatch):
    """On loopback the panel is there, but its event is private: a direct POST to
    /gradio_api/call/load_pair gets 404 (before: 200 and the server fetched whatever repository was
    named), it is not in the API's description, and the page's own way (its session's queue, by
    the event's index) still loads."""
    demo, worker, root, _ = limited
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    page = Client(root + "/", verbose=False, download_files=False)
    index = next(d["id"] for d in page.config["dependencies"] if d.get("api_name") == "load_pair")
    for path in ("/gradio_api/call/load_pair", "/gradio_api/call/v2/load_pair", "/gradio_api/run/load_pair",
                 "/gradio_api/run/chat", "/gradio_api/api/chat"):  # /run and /api run the body's fn_index, unqueued
        direct = httpx.post(root + path, json=LOAD | {"fn_index": index, "session_hash": "not-the-page"}, timeout=30)
        assert direct.status_code == 404, (path, direct.text)
    assert "/load_pair" not in httpx.get(root + "/gradio_api/info", timeout=30).json()["named_endpoints"]
    with pytest.raises(ValueError, match="Invalid function index"):  # Gradio's client refuses a private event
        page.predict(*LOAD["data"], fn_index=index)
    page.endpoints[index].is_valid = True  # as the page's own script: queue/join in its session, by index
    status = page.predict(*LOAD["data"], fn_index=index)[0]
    assert "Could not load the pair" in status
    assert worker.info["target"] == "tiny-target"
    assert httpx.post(root + "/gradio_api/call/stop", json={"data": []}, timeout=30).status_code == 200  # public


def test_without_the_models_panel_there_is_no_such_event(capped):
    demo, worker, root, _ = capped
    assert not any(fn.api_name == "load_pair" for fn in demo.fns.values())
    labels = [c.get("props", {}).get("label") or c.get("props", {}).get("value")
              for c in demo.get_config_file()["components"]]
    assert "Models" not in labels and "Load pair" not in labels
    direct = httpx.post(root + "/gradio_api/call/load_pair", json=LOAD, timeout=30)
    assert direct.status_code == 404
    assert worker.info["target"] == "tiny-target"


@pytest.mark.parametrize("path, named", [("/gradio_api/call/load_pair", ("call", "load_pair")),
                                         ("/gradio_api/call/v2/load_pair/abc", ("call", "load_pair")),
                                         ("/gradio_api/run/chat", ("run", "chat")),
                                         ("/gradio_api/api/x/", ("api", "x")),
                                         ("/gradio_api/queue/join", None), ("/gradio_api/call", None),
                                         ("/v1/chat/completions", None)])
def test_the_by_name_routes(path, named):
    assert event_name(path) == named


def test_the_routes_open_to_each_event(limited):
    """/call runs the public events; /run and /api (which run any fn_index, outside the queue) only
    the events the page itself sends outside the queue: none in this app."""
    demo, _, _, _ = limited
    events = callable_names(demo)
    assert {"chat", "stop", "clear"} <= events.call and "load_pair" not in events.call
    assert "tree_info" not in events.call  # private, like every event the page alone sends
    assert events.unqueued == frozenset()
