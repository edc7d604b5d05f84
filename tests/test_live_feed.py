"""The live feed's server side (app/page/live_feed.py) over a real local server: records in order as
server-sent events, a reconnect replays them, an unknown token is a 404, closed feeds expire."""
from __future__ import annotations

import json
import threading
import time

import pytest
import requests
import test_app_support as support
import uvicorn
from fastapi import FastAPI

from app.page import live_feed
from app.page.live_feed import LiveFeeds


@pytest.fixture(scope="module")
def served():
    app, feeds = FastAPI(), LiveFeeds()
    live_feed.mount(app, feeds)
    port = support.free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert support.wait_until(lambda: server.started, 30)
    yield feeds, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def read_events(url: str) -> list[dict]:
    with requests.get(url, stream=True, timeout=30) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        return [json.loads(line[len(b"data: "):]) for line in response.iter_lines() if line.startswith(b"data: ")]


def test_records_arrive_in_order_while_they_are_put_and_a_reconnect_replays_them(served):
    feeds, base = served
    feed = feeds.open()

    def produce():
        assert support.wait_until(lambda: feed.subscribed, 10)  # the reader is there before the first record
        for i in range(3):
            time.sleep(0.05)
            feed.put(text=f"t{i}")
        feed.close()

    producer = threading.Thread(target=produce)
    producer.start()
    events = read_events(f"{base}/sc-live/{feed.token}")
    producer.join()
    assert events == [{"text": "t0"}, {"text": "t1"}, {"text": "t2"}, {"end": True}]
    assert not feed.subscribed
    assert read_events(f"{base}/sc-live/{feed.token}") == events  # a reconnect (or a late reader) gets them all


def test_an_unknown_token_is_a_404_and_closed_feeds_expire(served, monkeypatch):
    feeds, base = served
    assert requests.get(f"{base}/sc-live/not-a-token", timeout=10).status_code == 404
    old = feeds.open()
    old.close()
    monkeypatch.setattr(live_feed, "KEEP_CLOSED_S", 0.0)
    fresh = feeds.open()
    assert feeds.get(old.token) is None and feeds.get(fresh.token) is fresh
    assert len(fresh.token) >= 24 and fresh.token != old.token
