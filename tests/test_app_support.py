"""Shared pieces of the app tests (no tests here): the real tokenizer, a tiny random Qwen2 pair
over its vocabulary, engine wrappers that slow down or fail on demand, and an in-process server.

The real model weights are never loaded: only the tokenizer files of the embedded pair.
"""
from __future__ import annotations

import functools
import socket
import threading
import time

import torch

SYSTEM = "You are a helpful assistant."


def one_torch_thread():
    """Generator for a module fixture: torch on one thread (the machine is shared), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@functools.lru_cache(maxsize=1)
def _tokenizer():
    from app.serving.pair import load_tokenizer
    return load_tokenizer()


def tokenizer():
    """The embedded pair's Qwen2.5 tokenizer. A missing or corrupted model install is an error
    of the test run (it fails the tests that need it), never a reason to skip them."""
    return _tokenizer()


@functools.lru_cache(maxsize=1)
def _pair():
    from app.serving.pair import tiny_pair
    return tiny_pair(_tokenizer(), noise=0.003)


def tiny_pair():
    """(target, draft): a random 2-layer Qwen2 with the real vocabulary and a perturbed copy."""
    tokenizer()
    return _pair()


def tiny_worker():
    """Generator for a module fixture: a worker on the tiny pair (the app's own engine), closed after."""
    from app.serving.pair import make_engine
    from app.serving.worker import Worker

    target, draft = tiny_pair()
    worker = Worker(make_engine(target, draft, tokenizer()), tokenizer(), {"target": "tiny-target", "draft": "tiny-draft"})
    try:
        yield worker
    finally:
        worker.close()


class SlowEngine:
    """Wraps an engine: sleeps ``delay`` seconds before each step and, when ``fail_after`` is set,
    raises after that many steps of the next generation."""

    def __init__(self, engine, delay: float = 0.0) -> None:
        self._engine = engine
        self.delay = delay
        self.fail_after: int | None = None
        self.steps_run = 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def stream(self, input_ids, settings=None, **kwargs):
        inner = self._engine.stream(input_ids, settings, **kwargs)  # validates now, like the engine
        fail_after, self.fail_after = self.fail_after, None
        return Slowed(inner, self._steps(inner, fail_after))

    def _steps(self, inner, fail_after):
        for count, record in enumerate(inner):
            if fail_after is not None and count >= fail_after:
                raise RuntimeError("simulated engine failure")
            if self.delay:
                time.sleep(self.delay)
            self.steps_run += 1
            yield record


class Slowed:
    """A generation seen through :class:`SlowEngine`: its records slowed, its attributes the engine's."""

    def __init__(self, inner, steps) -> None:
        self._inner, self._steps = inner, steps

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._steps)

    def close(self) -> None:
        self._steps.close()
        self._inner.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(worker, options: dict | None = None):
    """The real app on a local port, in this process; returns ``(demo, url)``."""
    from app.page import ui
    demo = ui.build_demo(worker, worker.tokenizer, options)
    _, url, _ = ui.launch(demo, server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True,
                          quiet=True)
    return demo, url.rstrip("/") + "/"


def tiny_server(delay: float = 0.0):
    """A generator for module fixtures: yields ``(worker, url)`` of the app serving the tiny pair
    (wrapped in :class:`SlowEngine`), and shuts both down afterwards."""
    from app.serving.pair import make_engine
    from app.serving.worker import Worker
    tok = tokenizer()
    target, draft = tiny_pair()
    engine = SlowEngine(make_engine(target, draft, tok), delay)
    worker = Worker(engine, tok, {"target": "tiny-target", "draft": "tiny-draft", "device": "cpu", "dtype": "float32"})
    demo, url = start_server(worker)
    yield worker, url
    demo.close()
    worker.close()


def reference_text(engine, tokenizer, messages: list[dict], **kwargs) -> tuple[str, list[int]]:
    """What the engine alone answers (text with special tokens skipped, and the tokens)."""
    from engine.models.prompts import encode_chat
    result = engine.generate(encode_chat(tokenizer, messages), **kwargs)
    return tokenizer.decode(result.tokens, skip_special_tokens=True), result.tokens


def wait_until(predicate, timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def run_in_threads(functions):
    """Run the callables at once; their results in order (exceptions re-raised)."""
    results, errors = [None] * len(functions), []

    def run(i, fn):
        try:
            results[i] = fn()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(functions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results
