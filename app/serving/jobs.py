"""What the worker (:mod:`app.serving.worker`) is asked and answers: the requests (decode, load a pair,
measure this machine), a queued :class:`Job` with its event queue and cancel flag, the
:class:`Event` records it emits (their kinds: :mod:`app.serving.worker`'s docstring) and the two
refusals, :class:`SessionBusy` and :class:`QueueFull`."""
from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from engine.core.settings import DecodeSettings

TERMINAL = ("done", "cancelled", "error")


@dataclass
class Event:
    kind: str
    data: Any = None
    phase: str = "main"


@dataclass
class GenerationRequest:
    """What to decode: the prompt and the :class:`~engine.core.settings.DecodeSettings` it is decoded
    with, which reach the engine as they are (the worker only tokenises ``prediction`` into them).

    The prompt is either ``input_ids`` or a conversation: ``messages`` (role/content turns) and an
    optional ``system`` prompt, which the worker tokenises with the chat template when the job
    runs, with the tokenizer of the pair in use then (a load queued before it may have changed
    the pair), dropping the oldest turns that do not fit the context."""

    input_ids: list[int] | None = None
    settings: DecodeSettings = field(default_factory=DecodeSettings)
    compare: bool = False  # then the target alone decodes the same prompt, for comparison
    system: str | None = None
    messages: list[dict] | None = None
    cache_key: str | None = None  # whose conversation cache to use (default: the job's session)
    keep_cache: bool = True  # False: decode from a fresh cache and leave the session's as it was
    prediction: str | None = None  # an expected answer (tokenised when the job runs) to copy from
    time_alone_every: int = 0  # the main phase gives its 2nd step and every n-th after it to the target alone, timed


@dataclass
class LoadRequest:
    target: str
    draft: str
    dtype: str = "float32"
    device: str = "cpu"
    trust_remote_code: bool = False


@dataclass
class ProfileRequest:
    """Measure this machine's hardware profile of the pair in use, for the optimizer."""


_ids = itertools.count(1)


class SessionBusy(RuntimeError):
    """A session asked for another job while one of its jobs is still waiting or running."""


class QueueFull(RuntimeError):
    """Refused: the queue holds :data:`app.serving.worker.MAX_WAITING` jobs, or this client already has
    :data:`app.serving.worker.MAX_PER_CLIENT` jobs waiting or running. ``retry_after``: seconds after which trying again is reasonable."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class Job:
    """One queued request: read ``events`` until a terminal event; ``cancel()`` to stop it."""

    request: GenerationRequest | LoadRequest | ProfileRequest
    session: str | None = None
    client: str | None = None  # who asked, for the per-client cap (None: not capped)
    id: int = field(default_factory=lambda: next(_ids))
    events: "queue.Queue[Event]" = field(default_factory=queue.Queue)
    worker: "Worker | None" = field(default=None, repr=False)
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def kind(self) -> str:
        return {LoadRequest: "load", ProfileRequest: "profile"}.get(type(self.request), "generate")

    def cancel(self) -> None:
        self._cancel.set()
        if self.worker is not None:
            self.worker._drop_pending(self)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def position(self) -> int | None:
        """Jobs ahead of this one (0: running now); None once finished."""
        return self.worker.position(self) if self.worker is not None else None

    def iter_events(self, timeout: float | None = None) -> Iterator[Event]:
        """Events until the terminal one (inclusive). ``timeout``: seconds to wait for each."""
        while True:
            event = self.events.get(timeout=timeout)
            yield event
            if event.kind in TERMINAL:
                return

    def wait(self, timeout: float | None = None) -> list[Event]:
        """Block until the job ends; all its events."""
        return list(self.iter_events(timeout))

    def _emit(self, kind: str, data: Any = None, phase: str = "main") -> None:
        self.events.put(Event(kind, data, phase))
        if kind in TERMINAL:
            self._done.set()
