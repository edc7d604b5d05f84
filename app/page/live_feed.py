"""The live channel of a streaming answer: compact records (text deltas, the step's tree, the
status and stats lines) that a small script in the page (``assets/live_feed.js``) applies to the DOM
itself, over one server-sent-events response per answer, outside Gradio's update path.

Gradio re-renders a whole component on every update: the chat's Markdown and syntax highlighting,
with its layout, cost Chromium 60-85 ms a step on the cores that decode. Appending a text delta to
a text node costs it almost nothing. Each answer gets a fresh unguessable token, so only the page
that asked sees the answer's feed; a client that never subscribes (the Gradio API) keeps getting
the answer through Gradio's own updates.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, StreamingResponse

ROUTE = "/sc-live/{token}"
KEEP_CLOSED_S = 60.0  # a closed feed can still be read (a reconnect) this long
HEARTBEAT_S = 10.0


@dataclass
class Feed:
    """The records of one answer, in order. Thread-safe: the handler's thread puts, the server's
    event loop reads."""

    token: str
    records: list[str] = field(default_factory=list)  # JSON objects, one per update
    closed_at: float | None = None
    subscribers: int = 0
    changed: threading.Condition = field(default_factory=threading.Condition)

    @property
    def subscribed(self) -> bool:
        """Whether a page reads this feed (then Gradio's own per-step updates can stop)."""
        return self.subscribers > 0

    def put(self, **record) -> None:
        """Appends one record: ``text`` (a delta), ``reset`` (the whole text, when a delta cannot
        say it), ``tree`` (SVG markup), ``status`` and ``stats`` (HTML), ``end``."""
        with self.changed:
            self.records.append(json.dumps(record, ensure_ascii=False))
            self.changed.notify_all()

    def close(self) -> None:
        with self.changed:
            if self.closed_at is None:
                self.records.append(json.dumps({"end": True}))
                self.closed_at = time.monotonic()
            self.changed.notify_all()

    def wait(self, seen: int, timeout: float) -> tuple[list[str], bool]:
        """The records after the first ``seen`` (waiting up to ``timeout`` s for one), and whether
        the feed is closed."""
        with self.changed:
            if len(self.records) <= seen and self.closed_at is None:
                self.changed.wait(timeout)
            return self.records[seen:], self.closed_at is not None


class LiveFeeds:
    """The open feeds, by token."""

    def __init__(self) -> None:
        self._feeds: dict[str, Feed] = {}
        self._lock = threading.Lock()

    def open(self) -> Feed:
        now = time.monotonic()
        feed = Feed(secrets.token_urlsafe(18))
        with self._lock:
            for token in [t for t, f in self._feeds.items() if f.closed_at and now - f.closed_at > KEEP_CLOSED_S]:
                del self._feeds[token]
            self._feeds[feed.token] = feed
        return feed

    def get(self, token: str) -> Feed | None:
        with self._lock:
            return self._feeds.get(token)

    def __len__(self) -> int:
        return len(self._feeds)


async def _events(feed: Feed):
    """SSE ``data:`` lines for every record, from the first (a reconnect replays them all)."""
    feed.subscribers += 1
    try:
        seen = 0
        while True:
            records, closed = await asyncio.to_thread(feed.wait, seen, HEARTBEAT_S)
            if not records and not closed:
                yield ": heartbeat\n\n"
                continue
            seen += len(records)
            yield "".join(f"data: {record}\n\n" for record in records)
            if closed:  # the end record was among these (a closed feed gets no more)
                return
    finally:
        feed.subscribers -= 1


def mount(app: FastAPI, feeds: LiveFeeds) -> None:
    """Serves ``GET /sc-live/{token}`` on ``app`` (the Gradio app's server), ahead of its routes."""

    @app.get(ROUTE, include_in_schema=False)
    async def live(token: str):
        feed = feeds.get(token)
        if feed is None:
            return PlainTextResponse("no such feed", status_code=404)
        return StreamingResponse(_events(feed), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    app.router.routes.insert(0, app.router.routes.pop())
