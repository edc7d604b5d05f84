"""Exactness of tree speculative decoding on the real default pair (Qwen2.5-Coder 1.5B / 0.5B) as the
app serves it: the int4 target on the CPU."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import REFERENCE_PROMPTS, REFERENCE_TOKENS
from transformers import DynamicCache

from engine import SpeculativeEngine, Tree
from engine.backends.quantize import draft_format
from engine.core.settings import settings_from
from engine.core.speculative import forward
from engine.core.step import Decoding

pytestmark = pytest.mark.real_pair

NEW_TOKENS = REFERENCE_TOKENS
GREEDY_PROMPTS = REFERENCE_PROMPTS
TREES = {
    **{f"chain{d}": Tree.chain(d) for d in range(1, 7)},
    "binary3": Tree.k_ary(2, 3),
    "4ary2": Tree.k_ary(4, 2),
    "irregular": Tree.from_parents([-1, 0, 0, 0, 1, 1, 2, 4, 4, 5, 7, 7, 10]),
}


@pytest.fixture(scope="module")
def bundled_tuner(real_pair):
    """The optimizer on the bundled AVX2 profile of this pair (any profile serves exactness)."""
    from engine.models.loading import pair_name
    from engine.models.prompts import ASSETS
    from engine.tuning.calibrate import find_acceptance
    from engine.tuning.optimizer import AutoTuner
    from engine.tuning.profile import HardwareProfile

    pair = pair_name("default-target", "default-draft", real_pair[1], real_pair[0])
    profile = ASSETS / "profiles" / "cpu-x86_64-avx2-2threads__default-target_q4k_default-draft_q4k__float32.json"
    return AutoTuner(HardwareProfile.from_json(profile.read_text()), find_acceptance(pair), pair=pair)


@pytest.fixture(scope="module")
def engine(real_pair) -> SpeculativeEngine:
    target, draft, _ = real_pair
    return SpeculativeEngine(target, draft)


def test_references_cover_an_early_eos(greedy_references, engine):
    stops = [ref for ref in greedy_references if ref[-1] in engine.stop_token_ids and len(ref) < NEW_TOKENS]
    assert stops, "at least one prompt must end with EOS before the budget"


def test_autoregressive_path_matches_target_generate(engine, chat_prompts, greedy_references):
    for ids, ref in list(zip(chat_prompts, greedy_references))[3:]:  # the other prompts run below
        result = engine.generate(ids, max_new_tokens=NEW_TOKENS, tree=None, copies=False)
        assert result.tokens == ref
        assert all(step.tree_size == 1 for step in result.steps)


@pytest.mark.parametrize("name", list(TREES))
def test_greedy_tree_decoding_is_token_identical(name, engine, chat_prompts, greedy_references):
    """A whole 64-token answer with this tree; the prompt rotates so every prompt (the early-EOS one
    included) is covered by several trees."""
    which = list(TREES).index(name) % GREEDY_PROMPTS
    ids, ref = chat_prompts[which], greedy_references[which]
    result = engine.generate(ids, max_new_tokens=NEW_TOKENS, temperature=0.0, tree=TREES[name])
    assert result.tokens == ref, f"{name}: speculative output differs from the target's greedy output"
    assert result.finish_reason == ("stop" if len(ref) < NEW_TOKENS else "length")
    assert sum(step.accepted_draft_tokens for step in result.steps) > 0, "no draft token was ever accepted"


def test_every_tree_on_every_prompt_switching_tree_each_step(engine, chat_prompts, greedy_references):
    """All five prompts, the tree changing at every step through all nine shapes: each shape verifies
    steps of every prompt, and the caches stay right across changes of shape."""
    trees = list(TREES.values())
    used = set()
    for ids, ref in zip(chat_prompts, greedy_references):
        params = engine._prepare(ids, settings_from(max_new_tokens=NEW_TOKENS, temperature=0.0, top_p=1.0,
            tree=trees[0], seed=0, stop_token_ids=None, copies=False))
        state = Decoding(engine, list(ids), params)
        state.prefill()
        tokens = []
        while not state.finished:
            tree = trees[state.steps % len(trees)]
            state.params = dataclasses.replace(params, decision=dataclasses.replace(params.decision, tree=tree))
            tokens += state.step().committed
            used.add(tree)
        assert tokens == ref
    assert len(used) == len(trees)


def test_tree_forward_logits_equal_causal_path_logits(real_pair, chat_prompts):
    """One target forward over a tree == a causal forward over prefix + each node's path, bit for
    bit (the int4 target's rows depend on nothing but their own token and visible keys)."""
    target = real_pair[0]
    prefix = chat_prompts[0]
    tree = Tree.from_parents([-1, 0, 0, 1, 1, 2, 3, 3, 5, 6])
    generator = torch.Generator().manual_seed(0)
    tokens = [prefix[-1]] + torch.randint(0, 150000, (tree.size - 1,), generator=generator).tolist()
    p = len(prefix) - 1
    with torch.inference_mode():
        cache = DynamicCache(config=target.config)
        forward(target, cache, prefix[:-1], start=0, logits_to_keep=1)
        tree_logits = forward(target, cache, tokens, start=p, mask=tree.attention_mask(p),
                               positions=tree.position_ids(p))
        for node in range(tree.size):
            path = [tokens[i] for i in tree.path_to(node)]
            causal = forward(target, DynamicCache(config=target.config), prefix[:-1] + path, start=0,
                              logits_to_keep=1)[-1]
            assert torch.equal(tree_logits[node], causal), \
                f"node {node}: max |tree - causal| = {(tree_logits[node] - causal).abs().max().item():.2e}"


def test_kv_caches_after_20_steps_equal_a_fresh_prefill(real_pair, chat_prompts, engine):
    """After compaction the caches hold exactly the committed sequence, as if run from scratch.

    A k-quant model's cache (the int4 target; the q4k draft) matches bit for bit: its rows never
    depend on the batch. An int4 draft (activations rounded to bf16, a rounding that depends on
    the batch) matches to 1e-3 of the cache's scale, a float32 one to 1e-4; a cache misaligned by
    one slot misses by far more, so compaction errors cannot hide in that. (An int8 draft, one
    activation scale for the whole batch, is no default: see
    :func:`engine.backends.quantize.fastest_format`.)"""
    target, draft, _ = real_pair
    params = engine._prepare(chat_prompts[1], settings_from(max_new_tokens=200, temperature=0.0, top_p=1.0,
        tree=Tree.k_ary(2, 3), seed=0, stop_token_ids=[], copies=False))
    state = Decoding(engine, list(chat_prompts[1]), params)
    state.prefill()
    for _ in range(20):
        state.step()
    for model, cache, length in ((target, state.target_runner.cache, len(state.seq) - 1),
                                 (draft, state.draft_runner.cache, state.draft_len)):
        fresh = DynamicCache(config=model.config)
        with torch.inference_mode():
            forward(model, fresh, state.seq[:length], start=0, logits_to_keep=1)
        assert cache.get_seq_length() == length
        scale = max(layer.keys.abs().max().item() for layer in fresh.layers)
        tolerance = 1e-4 if draft_format(model) == "none" else 1e-3 * scale
        for got, want in zip(cache.layers, fresh.layers):
            got_keys, got_values = got.keys[:, :, :length], got.values[:, :, :length]
            if draft_format(model) == "q4k":
                assert torch.equal(got_keys, want.keys) and torch.equal(got_values, want.values)
            torch.testing.assert_close(got_keys, want.keys, atol=tolerance, rtol=1e-4)
            torch.testing.assert_close(got_values, want.values, atol=tolerance, rtol=1e-4)
        misaligned = max((got.keys[:, :, 1:] - want.keys[:, :, :-1]).abs().max().item()
                         for got, want in zip(cache.layers, fresh.layers))
        assert misaligned > 20 * tolerance


METHOD_TREES = {
    "sequoia": Tree.optimal([0.875, 0.069, 0.025, 0.014], 12, 5),
    "specinfer": Tree.k_independent(2, 3),
    "chain": Tree.chain(4),
    "topk": Tree.k_ary(3, 2),
    "autoregressive": Tree.chain(3),  # ignored: the target alone
}


@pytest.mark.parametrize("method", list(METHOD_TREES))
def test_every_method_is_greedy_exact_at_temperature_zero(method, engine, chat_prompts, greedy_references):
    which = list(METHOD_TREES).index(method) % GREEDY_PROMPTS
    for ids, ref in [(chat_prompts[which], greedy_references[which])]:
        result = engine.generate(ids, max_new_tokens=NEW_TOKENS, temperature=0.0, tree=METHOD_TREES[method],
                                 method=method)
        assert result.tokens == ref
        if method == "autoregressive":
            assert all(step.tree_size == 1 for step in result.steps)


def test_sampling_on_the_real_pair_is_seeded_and_readable(engine, chat_prompts, real_pair):
    tokenizer = real_pair[2]
    runs = [engine.generate(chat_prompts[2], max_new_tokens=24, temperature=0.7, top_p=0.9,
                            tree=Tree.k_ary(2, 2), seed=seed) for seed in (11, 11, 12)]
    assert runs[0].tokens == runs[1].tokens and runs[0].tokens != runs[2].tokens
    text = tokenizer.decode(runs[0].tokens, skip_special_tokens=True)
    assert len(text.split()) >= 5, text
    assert sum(s.accepted_draft_tokens for s in runs[0].steps) > 0


def test_eight_seeded_answers_with_free_drafts_are_one_answer(engine, real_pair):
    """Free drafts on (the default): copies' statistics are each sampled answer's own and no clock
    shapes its trees, so the same seed gives the same answer every time on the same engine."""
    from engine.models.prompts import encode_chat

    line = "def area(radius):\n    return 3.14159 * radius * radius\n"
    ids = encode_chat(real_pair[2], [{"role": "user", "content": f"Repeat this code exactly:\n{line}{line}"}])
    runs = [engine.generate(ids, max_new_tokens=32, temperature=0.7, top_p=0.9, tree=Tree.chain(2), seed=21)
            for _ in range(8)]
    assert any("copy" in step.sources for step in runs[0].steps), "no copy proposed: the test proves little"
    assert all(run.tokens == runs[0].tokens for run in runs)
    assert all([s.parents for s in run.steps] == [s.parents for s in runs[0].steps] for run in runs)


THREAD_TREES = {"chain4": Tree.chain(4), "3ary2": Tree.k_ary(3, 2),
                "irregular": Tree.from_parents([-1, 0, 0, 0, 1, 1, 2, 4, 4, 5, 7, 7, 10]), "auto": "auto"}


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_greedy_answers_to_a_long_prompt_are_the_targets_at_any_thread_count(threads, real_pair, long_reference,
                                                                              bundled_tuner):
    """The int4 target at 1, 2, 3 and 4 torch threads (more threads than this machine's cores
    included): a prompt of more than one prefill chunk, then the chain, k-ary, irregular and
    optimizer-chosen trees, each answer equal to the target's own Hugging Face ``generate`` (taken
    at the default thread count). The prompt is prefilled once per thread count; each later
    answer reuses its caches (the multi-turn path), so chunked prefill, cache reuse and
    verification rows all run at this thread count."""
    from engine.core.prefix_cache import ConversationCache
    from engine.tuning.planner import TreePlanner

    target, draft, _ = real_pair
    prompt, reference = long_reference
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engine = SpeculativeEngine(target, draft, planner=TreePlanner(bundled_tuner.pair, bundled_tuner))
        cache = ConversationCache(target, draft)
        reused = []
        for name, tree in THREAD_TREES.items():
            result = engine.generate(prompt, max_new_tokens=len(reference), temperature=0.0, tree=tree, cache=cache)
            assert result.tokens == reference, f"{name} at {threads} threads"
            reused.append(result.reused_tokens)
        assert len(prompt) > engine.prefill_chunk and reused[0] == 0 and min(reused[1:]) > engine.prefill_chunk
    finally:
        torch.set_num_threads(before)
