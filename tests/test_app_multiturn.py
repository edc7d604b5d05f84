"""The worker keeps each session's KV caches between turns (tiny pair, real tokenizer): the next
turn prefills only its new tokens and answers exactly what a fresh engine answers, sessions never
share a cache, and the store stays within its byte budget."""
from __future__ import annotations

import pytest
import test_app_support as support

from engine.core.settings import DecodeSettings
from app.serving.jobs import GenerationRequest
from app.serving.pair import make_engine
from app.serving.worker import Worker, WorkerPolicy
from engine.models.prompts import encode_chat
from engine.tuning.tree_store import build_tree

TREE = build_tree(8, 4)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    yield from support.one_torch_thread()


@pytest.fixture(scope="module")
def pair():
    target, draft = support.tiny_pair()
    return target, draft, support.tokenizer()


def new_worker(pair, **options) -> Worker:
    target, draft, tokenizer = pair
    return Worker(make_engine(target, draft, tokenizer), tokenizer, {"target": "tiny"}, policy=WorkerPolicy(**options))


def turn(worker, messages, session=None, max_new=12, **kwargs):
    """(answer tokens, the main phase's finished data) of one chat turn."""
    request = GenerationRequest(settings=DecodeSettings(max_new_tokens=max_new, tree=TREE), messages=messages,
                                system=support.SYSTEM, **kwargs)
    events = worker.submit(request, session=session).wait(60)
    assert events[-1].kind == "done", events[-1]
    tokens = [t for e in events if e.kind == "step" and e.phase == "main" for t in e.data.committed]
    return tokens, events[-1].data["main"]


def fresh_answer(pair, messages, max_new=12):
    target, draft, tokenizer = pair
    ids = encode_chat(tokenizer, [{"role": "system", "content": support.SYSTEM}, *messages])
    return make_engine(target, draft, tokenizer).generate(ids, max_new_tokens=max_new, tree=TREE).tokens, ids


def test_a_session_reuses_its_conversation_and_answers_exactly(pair):
    tokenizer = pair[2]
    worker = new_worker(pair)
    try:
        history = [{"role": "user", "content": "Write a haiku about trees"}]
        answer1, first = turn(worker, history, session="s")
        assert first["reused_tokens"] == 0 and first["first_token_s"] > 0
        assert worker.kv_store.keys() == ["s"]
        history += [{"role": "assistant", "content": tokenizer.decode(answer1, skip_special_tokens=True)},
                    {"role": "user", "content": "And one about rivers"}]
        answer2, second = turn(worker, history, session="s")
        expected, ids = fresh_answer(pair, history)
        assert answer2 == expected
        prompt1 = encode_chat(tokenizer, [{"role": "system", "content": support.SYSTEM}, *history[:1]])
        assert second["reused_tokens"] >= len(prompt1)  # the whole first prompt, and the answer's tokens
        assert second["reused_tokens"] < len(ids)
        # regenerate the last answer: everything but the prompt's last token is reused
        again, third = turn(worker, history, session="s")
        assert again == answer2 and third["reused_tokens"] == len(ids) - 1
        # edit the first message: only the system prompt and the template's head are shared
        edited = [{"role": "user", "content": "Write a limerick about lakes"}]
        answer, fourth = turn(worker, edited, session="s")
        assert answer == fresh_answer(pair, edited)[0]
        assert 0 < fourth["reused_tokens"] < len(prompt1)
    finally:
        worker.close()


def test_sessions_keep_separate_caches_and_jobs_without_one_keep_none(pair):
    worker = new_worker(pair)
    try:
        a = [{"role": "user", "content": "Question from tab A"}]
        b = [{"role": "user", "content": "Question from tab B, which is different"}]
        turn(worker, a, session="A")
        answer_b, _ = turn(worker, b, session="B")
        assert answer_b == fresh_answer(pair, b)[0]
        assert worker.kv_store.keys() == ["A", "B"]
        turn(worker, b)  # no session: nothing kept
        assert worker.kv_store.keys() == ["A", "B"]
        _, data = turn(worker, b, cache_key="api:user-1")  # an explicit key, as the API sends
        assert data["reused_tokens"] == 0 and worker.kv_store.keys() == ["A", "B", "api:user-1"]
        _, data = turn(worker, a, session="A")
        assert data["reused_tokens"] == len(fresh_answer(pair, a)[1]) - 1
        assert worker.forget("A") and worker.kv_store.keys() == ["B", "api:user-1"]
    finally:
        worker.close()


def test_the_store_evicts_the_least_recently_used_conversation_under_its_budget(pair):
    probe = new_worker(pair)
    try:
        turn(probe, [{"role": "user", "content": "Question one"}], session="x")
        one = probe.kv_store.nbytes
    finally:
        probe.close()
    worker = new_worker(pair, kv_cache_bytes=int(one * 1.5))  # room for one conversation of this size
    try:
        turn(worker, [{"role": "user", "content": "Question one"}], session="A")
        turn(worker, [{"role": "user", "content": "Question two"}], session="B")
        assert worker.kv_store.keys() == ["B"] and worker.kv_store.nbytes <= worker.kv_store.budget_bytes
        _, data = turn(worker, [{"role": "user", "content": "Question one"}], session="A")
        assert data["reused_tokens"] == 0  # A's cache was evicted
    finally:
        worker.close()
    off = new_worker(pair, kv_cache_bytes=0)
    try:
        turn(off, [{"role": "user", "content": "Question one"}], session="A")
        assert off.kv_store.keys() == []
    finally:
        off.close()


def test_a_model_swap_empties_the_store(pair):
    target, draft, tokenizer = pair

    def loader(model_id, dtype, device, trust_remote_code, draft_format="none"):
        return (target if model_id == "org/target" else draft), tokenizer

    worker = Worker.from_models(target, draft, tokenizer, "a", "b", loader=loader)
    try:
        turn(worker, [{"role": "user", "content": "Hello"}], session="s")
        assert worker.kv_store.keys() == ["s"]
        assert worker.load_models("org/target", "org/draft").wait(30)[-1].kind == "done"
        assert worker.kv_store.keys() == []
    finally:
        worker.close()


def test_measuring_the_target_alone_leaves_the_sessions_cache(pair):
    """"Measure the target alone" runs in the tab's session; the next turn still reuses the chat."""
    from app.page.handlers import ChatApp

    tokenizer = pair[2]
    worker = new_worker(pair)
    try:
        history = [{"role": "user", "content": "Write a haiku about trees"}]
        answer1, _ = turn(worker, history, session="s")
        measure = ChatApp._baseline_request(0.0, 1.0)
        assert worker.submit(measure, session="s").wait(60)[-1].kind == "done"
        history += [{"role": "assistant", "content": tokenizer.decode(answer1, skip_special_tokens=True)},
                    {"role": "user", "content": "And one about rivers"}]
        _, second = turn(worker, history, session="s")
        assert second["reused_tokens"] > 0  # it was 0: the measurement had taken the session's cache
    finally:
        worker.close()
