"""Hardening: bad input, cancellation at random moments and concurrent clients, on the tiny pair.

The app must answer every bad input with a clear message, lose nothing it had, and keep serving;
Stop must leave the engine ready within one step, every time; concurrent clients must each get
their own correct answers.
"""
from __future__ import annotations

import gc
import json
import os
import random
import threading
import time
from pathlib import Path

import pytest
import test_app_support as support
from gradio_client import Client  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402

from app.views.conversation import clean_text, import_conversation
from engine.core.settings import DecodeSettings
from app.serving.jobs import GenerationRequest
from app.serving.pair import make_engine
from engine.models.prompts import encode_chat
from engine.tuning.tree_store import build_tree

CHATBOT, STATUS, EXPORT = 0, 6, 9
TREE = build_tree(8, 4)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    yield from support.one_torch_thread()


@pytest.fixture(scope="module")
def server():
    yield from support.tiny_server()


def chat_args(message, max_new=6, temperature=0.0, top_p=1.0, size=8, depth=4, seed=0):
    # message, system, temperature, top_p, max_new, seed, method, size, depth, auto, compare, highlight
    return (message, "", temperature, top_p, max_new, seed, "sequoia", size, depth, False, False, False)


def client(url) -> Client:
    return Client(url, verbose=False, download_files=False)


def text_of(message) -> str:
    content = message["content"]
    return "".join(part["text"] for part in content) if isinstance(content, list) else content


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ----- bad input -------------------------------------------------------------------------------
def test_bad_messages_get_a_clear_answer_and_lose_nothing(server):
    _, url = server
    c = client(url)
    first = c.predict(*chat_args("Hello there"), api_name="/chat")
    assert len(first[CHATBOT]) == 2
    long = c.predict(*chat_args("word " * 20_000), api_name="/chat")  # 100,000 characters
    assert "Not sent" in long[STATUS] and "shorten it" in long[STATUS]
    blank = c.predict(*chat_args(" \n\t "), api_name="/chat")
    assert "Empty message ignored" in blank[STATUS]
    controls = c.predict(*chat_args("a\x00b\x07c\x1b[31m\u202ed\ufeff"), api_name="/chat")
    assert "Done" in controls[STATUS]
    chat = controls[CHATBOT]
    assert [m["role"] for m in chat] == ["user", "assistant"] * 2  # the refused ones left no trace
    assert text_of(chat[0]) == "Hello there" and text_of(chat[1]) == text_of(first[CHATBOT][1])


@pytest.mark.parametrize("field, value, bound", [
    ("temperature", -1, "minimum"), ("temperature", 2.5, "maximum"), ("top_p", 0, "minimum"),
    ("top_p", 1.5, "maximum"), ("size", 0, "minimum"), ("size", 10_000, "maximum"),
    ("max_new", 0, "minimum"), ("max_new", 10**9, "maximum")])
def test_out_of_range_parameters_are_refused_by_the_api(server, field, value, bound):
    """The API names the bound; the sliders in the UI cannot go past it (they clamp)."""
    _, url = server
    c = client(url)
    with pytest.raises(AppError, match=bound):
        c.predict(*chat_args("hi", **{field: value}), api_name="/chat")
    assert "Done" in c.predict(*chat_args("still here?"), api_name="/chat")[STATUS]


def test_depth_not_below_size_and_fractional_seed_are_clamped(server):
    _, url = server
    c = client(url)
    out = c.predict(*chat_args("hi", size=4, depth=9, seed=1.5), api_name="/chat")
    assert "Done" in out[STATUS] and "chain: 4 nodes, depth 3" in out[STATUS]


def test_lone_surrogates_become_replacement_characters():
    assert clean_text("ok \ud800 end \U0001F600") == "ok \ufffd end \U0001F600"
    system, history = import_conversation('{"system": "s\\udfff", "messages": [{"role": "user", "content": "x\\ud800"}]}')
    assert (system, history[0]["content"]) == ("s\ufffd", "x\ufffd")
    encode_chat(support.tokenizer(), history)  # the tokenizer accepts it


@pytest.mark.parametrize("payload, reason", [
    ([{"role": "tool", "content": "x"}], "only 'user' and 'assistant'"),
    ([{"role": "user", "content": {"text": "x"}}], "content must be text"),
    ({"messages": "hi"}, "must be a list"), ([{"role": "user"}], "must be an object")])
def test_imports_with_wrong_shapes_are_refused(payload, reason):
    with pytest.raises(ValueError, match=reason):
        import_conversation(json.dumps(payload))


# ----- cancellation ----------------------------------------------------------------------------
def test_stop_at_random_moments_100_times(server):
    """Generations stopped at random moments (while drafting, verifying or between steps) and
    model loads stopped mid-way: after each, the engine is ready within one step; every tenth
    time the next answer is checked against a fresh engine's; memory does not grow."""
    worker, _ = server
    tokenizer = worker.tokenizer
    ids = encode_chat(tokenizer, [{"role": "user", "content": "Count slowly to one hundred"}])
    fresh = make_engine(worker.engine.target, worker.engine.draft, tokenizer)
    reference = fresh.generate(ids, max_new_tokens=12, tree=TREE).tokens
    rng = random.Random(0)
    worker.engine.delay = 0.004
    rss, original_loader = [], worker.loader
    try:
        for i in range(100):
            if i % 25 == 12:  # cancel a model load half-way: the pair stays
                before = worker.info.copy()
                gate = threading.Event()
                worker.loader = lambda *a, gate=gate, **kw: (gate.wait(5), (worker.engine.target, tokenizer))[1]
                job = worker.load_models("org/target", "org/draft")
                time.sleep(rng.uniform(0, 0.02))
                job.cancel()
                gate.set()
                assert job.wait(10)[-1].kind == "cancelled"
                assert worker.info == before
                continue
            job = worker.submit(GenerationRequest(ids, settings=DecodeSettings(max_new_tokens=400, tree=TREE)))
            time.sleep(rng.uniform(0, 0.06))
            steps_at_stop = worker.engine.steps_run
            job.cancel()
            events = job.wait(10)
            assert events[-1].kind in ("cancelled", "done"), events[-1]
            assert worker.engine.steps_run - steps_at_stop <= 1, "ran on after Stop"
            if i % 10 == 9:
                answer = worker.submit(GenerationRequest(ids, settings=DecodeSettings(max_new_tokens=12, tree=TREE))).wait(30)
                assert [t for e in answer if e.kind == "step" for t in e.data.committed] == reference
                gc.collect()
                rss.append(rss_bytes())
    finally:
        worker.engine.delay = 0.0
        worker.loader = original_loader
    assert rss[-1] - rss[0] < 64 * 2**20, f"RSS grew by {(rss[-1] - rss[0]) / 2**20:.0f} MiB over 90 stops"


# ----- concurrency -----------------------------------------------------------------------------
def test_four_clients_five_requests_each(server):
    """4 gradio clients, each its own session, each sending 5 turns, all at once: all complete,
    and every answer equals what the engine alone gives for that client's own conversation."""
    worker, url = server
    tokenizer = worker.tokenizer
    fresh = make_engine(worker.engine.target, worker.engine.draft, tokenizer)

    def conversation(k):
        c = client(url)
        finals = []
        for turn in range(5):
            finals.append(c.predict(*chat_args(f"Client {k} asks question {turn}", max_new=5), api_name="/chat"))
        return finals

    results = support.run_in_threads([lambda k=k: conversation(k) for k in range(4)])
    for k, finals in enumerate(results):
        assert all("Done" in final[STATUS] for final in finals)
        messages = json.loads(Path(finals[-1][EXPORT]["value"]["path"]).read_text())["messages"]
        assert [m["content"] for m in messages[::2]] == [f"Client {k} asks question {t}" for t in range(5)]
        for turn in range(5):
            expected, _ = support.reference_text(fresh, tokenizer, messages[:2 * turn + 1], max_new_tokens=5,
                                                 tree=TREE)
            assert messages[2 * turn + 1]["content"] == expected, (k, turn)
