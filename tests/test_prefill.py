"""The prompt is prefilled in chunks: the same caches and answers as one forward, and a stop
request is honoured between chunks."""
from __future__ import annotations

import pytest
import tiny_models as tm
import torch
from transformers import DynamicCache

from engine.core.settings import settings_from
from engine.core.speculative import SpeculativeEngine, forward
from engine.core.step import Decoding
from engine.errors import GenerationCancelled
from engine.trees.tree import Tree

PROMPT = [(7 * i + 3) % tm.VOCAB for i in range(150)]


@pytest.fixture(scope="module")
def models():
    target = tm.qwen2(seed=0)
    draft = tm.clone(target)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn_like(param) * 0.01)
    return target, draft


def count_forwards(models) -> tuple[dict, list]:
    calls = {"target": 0, "draft": 0}

    def hook(name):
        def pre_hook(module, args):
            calls[name] += 1
        return pre_hook

    return calls, [m.register_forward_pre_hook(hook(n)) for n, m in zip(("target", "draft"), models)]


def engine_for(models, chunk: int, static: bool = False) -> SpeculativeEngine:
    engine = SpeculativeEngine(*models, stop_token_ids=[], static_cache=static)
    engine.prefill_chunk = chunk
    return engine


def layers(runner, length: int):
    return [(layer.keys[:, :, :length], layer.values[:, :, :length]) for layer in runner.cache.layers]


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_prefill_runs_in_chunks_and_fills_the_caches_of_one_forward(models, static):
    engine = engine_for(models, 16, static)
    state = Decoding(engine, list(PROMPT), engine._prepare(list(PROMPT), settings_from(max_new_tokens=8, temperature=0.0, top_p=1.0,
        tree=Tree.chain(3), seed=0, stop_token_ids=[], copies=False)))
    calls, handles = count_forwards(models)
    try:
        state.prefill()
    finally:
        for handle in handles:
            handle.remove()
    assert calls == {"target": 10, "draft": 10}  # 149 tokens in chunks of 16, both models
    assert state.draft_len == len(PROMPT) - 1
    for model, runner in zip(models, (state.target_runner, state.draft_runner)):
        fresh = DynamicCache(config=model.config)
        with torch.inference_mode():
            forward(model, fresh, PROMPT[:-1], start=0, logits_to_keep=1)
        for (k, v), layer in zip(layers(runner, len(PROMPT) - 1), fresh.layers):
            assert torch.allclose(k, layer.keys, atol=1e-5) and torch.allclose(v, layer.values, atol=1e-5)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("tree", [None, Tree.chain(3), Tree.k_ary(2, 2)], ids=["target", "chain3", "2ary2"])
def test_chunked_prefill_gives_the_one_shot_answer(models, static, tree):
    answers = {chunk: engine_for(models, chunk, static).generate(PROMPT, max_new_tokens=24, tree=tree, copies=False).tokens
               for chunk in (4096, 16, 7)}
    assert answers[16] == answers[7] == answers[4096] == tm.hf_greedy(models[0], PROMPT, 24)


def test_should_stop_is_consulted_between_prefill_chunks(models):
    engine = engine_for(models, 16)
    calls, handles = count_forwards(models)
    try:
        with pytest.raises(GenerationCancelled, match="stopped"):
            engine.generate(PROMPT, max_new_tokens=8, tree=Tree.chain(2), should_stop=lambda: calls["target"] >= 2, copies=False)
    finally:
        for handle in handles:
            handle.remove()
    assert calls == {"target": 2, "draft": 0}  # two chunks, then it stopped: no draft, no step


def test_should_stop_is_consulted_between_steps(models):
    engine = engine_for(models, 16)
    steps = []
    with pytest.raises(GenerationCancelled):
        for record in engine.stream(PROMPT, max_new_tokens=64, tree=Tree.chain(2),
                                    should_stop=lambda: len(steps) >= 3, copies=False):
            steps.append(record)
    assert len(steps) == 3
    assert engine.generate(PROMPT, max_new_tokens=8, tree=Tree.chain(2), should_stop=lambda: False, copies=False).tokens == \
        engine.generate(PROMPT, max_new_tokens=8, tree=Tree.chain(2), copies=False).tokens


def test_the_prefill_reports_its_progress_after_every_chunk(models):
    """``on_prefill`` hears after each chunk: the target's tokens read, then the draft's share of the
    work, the fraction growing to 1; it changes nothing in the answer."""
    engine = engine_for(models, 16)
    reports = []
    with_reports = engine.generate(PROMPT, max_new_tokens=12, tree=Tree.chain(2), on_prefill=reports.append, copies=False).tokens
    assert with_reports == engine.generate(PROMPT, max_new_tokens=12, tree=Tree.chain(2), copies=False).tokens
    assert len(reports) == 20  # 149 tokens in chunks of 16, both models
    assert [r.done for r in reports[:10]] == [min(16 * (i + 1), 149) for i in range(10)]
    assert all(r.done == r.total == 149 for r in reports[10:])
    fractions = [r.fraction for r in reports]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert fractions[9] == pytest.approx(0.5)  # the draft here is the target's twin: half of the work
    assert reports[0].eta_s is not None and reports[-1].eta_s == 0.0
    alone = []
    engine.generate(PROMPT, max_new_tokens=4, tree=None, on_prefill=alone.append, copies=False)
    assert len(alone) == 10 and alone[-1].fraction == 1.0  # the target alone: no draft to prefill


def test_the_prefill_progress_counts_tokens_a_conversation_cache_held(models):
    from engine.core.prefix_cache import ConversationCache

    engine = engine_for(models, 16)
    cache = ConversationCache(*models)
    engine.generate(PROMPT[:100], max_new_tokens=4, tree=Tree.chain(2), cache=cache, copies=False)
    reports = []
    engine.generate(PROMPT, max_new_tokens=4, tree=Tree.chain(2), cache=cache, on_prefill=reports.append, copies=False)
    assert reports[0].done > 99 and reports[-1].fraction == 1.0  # only the new tokens are read



def deferring_engine(models, static: bool = False) -> SpeculativeEngine:
    """An engine whose draft leaves a prompt of more than 100 tokens for the steps, 16 a step."""
    engine = engine_for(models, 16, static)
    engine.draft_deferral, engine.draft_catch_up = 100, 16
    return engine


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_a_long_prompts_first_token_waits_for_the_target_alone(models, static):
    """Past ``draft_deferral`` tokens the draft reads none of the prompt before the first token; it
    reads up to ``draft_catch_up`` tokens before each later step, the steps taken while it is still
    behind verify the root alone, and once level it drafts trees again. The answer is the target's
    greedy one all the same."""
    engine = deferring_engine(models, static)
    calls, handles = count_forwards(models)
    steps, draft_calls = [], []
    try:
        for record in engine.stream(PROMPT, max_new_tokens=40, tree=Tree.chain(3), copies=False):
            steps.append(record)
            draft_calls.append(calls["draft"])
    finally:
        for handle in handles:
            handle.remove()
    assert draft_calls[0] == 0  # the first token: the target's prefill and one step, no draft forward
    catching_up = 10  # before step k >= 1 the draft lags 149 + k - 16 (k - 1) tokens: 16 or fewer first at k = 10
    assert all(len(s.tokens) == 1 for s in steps[:catching_up])
    assert draft_calls[1:catching_up] == list(range(1, catching_up))  # one 16-token read before each
    assert [s.draft_behind for s in steps[:catching_up + 1]] == [150 - 15 * k for k in range(catching_up)] + [0]
    assert len(steps[catching_up].tokens) == 4  # the rest read (15 tokens) before this step, which drafts
    assert [s.timings.reading_s > 0 for s in steps[:catching_up + 2]] == [False] + [True] * catching_up + [False]
    answer = [t for s in steps for t in s.committed]
    assert answer == tm.hf_greedy(models[0], PROMPT, 40)
    generation = engine.stream(PROMPT, max_new_tokens=40, tree=Tree.chain(3), copies=False)
    result = generation.collect()  # what generate returns
    reading = sum(s.timings.reading_s for s in result.steps)  # prompt reading: in prefill_s, not in decode_s
    assert result.tokens == answer and reading > 0
    assert result.prefill_s == pytest.approx(generation.prefill_s + reading)
    assert result.decode_s == pytest.approx(sum(s.timings.draft_s + s.timings.verify_s + s.timings.bookkeeping_s
                                                for s in result.steps))
    assert result.first_token_s == pytest.approx(result.prefill_s - sum(s.timings.reading_s for s in result.steps)
                                                 + result.steps[0].timings.total_s)
    engine.draft_deferral = 10_000  # the draft reads the prompt up front: the same answer
    assert engine.generate(PROMPT, max_new_tokens=40, tree=Tree.chain(3), copies=False).tokens == answer


def test_a_deferred_draft_leaves_the_prefill_progress_to_the_target(models):
    reports = []
    deferring_engine(models).generate(PROMPT, max_new_tokens=4, tree=Tree.chain(2), on_prefill=reports.append, copies=False)
    assert [r.done for r in reports] == [min(16 * (i + 1), 149) for i in range(10)]
    assert reports[-1].fraction == 1.0


def test_a_conversation_cache_keeps_what_a_deferred_draft_has_read(models):
    """A turn that ends while the draft is still behind records what it read; the next turn's draft
    starts there, and the answers are the target's greedy ones."""
    from engine.core.prefix_cache import ConversationCache

    engine = deferring_engine(models)
    cache = ConversationCache(*models)
    first = engine.generate(PROMPT, max_new_tokens=3, tree=Tree.chain(2), cache=cache, copies=False).tokens
    assert first == tm.hf_greedy(models[0], PROMPT, 3)
    assert cache.tokens["draft"] == PROMPT[:2 * 16]  # read before the second and the third steps
    follow_up = PROMPT + first + [9, 4, 1]
    assert engine.generate(follow_up, max_new_tokens=30, tree=Tree.chain(2), cache=cache, copies=False).tokens == \
        tm.hf_greedy(models[0], follow_up, 30)


def test_the_engine_says_before_the_prefill_whether_the_draft_reads_later(models):
    """A generation's ``draft_deferred`` is set when ``stream`` returns (before any forward) and follows what
    the prefill then does: a conversation cache holding most of a long prompt leaves the draft
    little to read, so it reads up front; a target-alone run has no draft to defer."""
    from engine.core.prefix_cache import ConversationCache

    engine = deferring_engine(models)
    cache = ConversationCache(*models)
    calls, handles = count_forwards(models)
    try:
        stream = engine.stream(PROMPT, max_new_tokens=30, tree=Tree.chain(2), cache=cache, copies=False)
        assert stream.draft_deferred and calls == {"target": 0, "draft": 0}
        first = [t for record in stream for t in record.committed]  # the draft catches up on the way
        follow_up = PROMPT + first + [9, 4, 1]
        stream = engine.stream(follow_up, max_new_tokens=3, tree=Tree.chain(2), cache=cache, copies=False)
        assert not stream.draft_deferred
        drafted_before = calls["draft"]
        next(stream)
        assert calls["draft"] > drafted_before  # the draft read its few new tokens before the first token
    finally:
        for handle in handles:
            handle.remove()
    assert not engine.stream(follow_up, max_new_tokens=3, tree=None, copies=False).draft_deferred
    assert engine.stream(follow_up, max_new_tokens=3, tree=Tree.chain(2), copies=False).draft_deferred  # no cache: the whole prompt
