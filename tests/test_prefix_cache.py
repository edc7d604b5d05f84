"""Multi-turn KV-cache reuse (engine.prefix_cache) on tiny models: the next turn prefills only the
tokens the conversation cache does not hold yet, edits fall back to the longest common prefix, and
every answer stays the target's own greedy decoding."""
from __future__ import annotations

import pytest
import test_app_support as support
import tiny_models as tm
import torch
from transformers import DynamicCache

from engine.core.prefix_cache import CacheStore, ConversationCache, common_prefix
from engine.core.speculative import SpeculativeEngine, forward
from engine.errors import GenerationCancelled, InvalidParameterError
from engine.trees.tree import Tree

TURN1 = [5, 17, 3, 42, 9, 11, 30, 2, 8]
USER2 = [21, 4, 33, 12, 6]
NEW = 16
TREES = {"none": None, "chain3": Tree.chain(3), "2ary2": Tree.k_ary(2, 2)}


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    yield from support.one_torch_thread()


@pytest.fixture(scope="module")
def models():
    target = tm.qwen2(seed=2)
    return target, tm.perturbed(target, noise=0.003)


def engine_for(models, **kwargs) -> SpeculativeEngine:
    return SpeculativeEngine(*models, stop_token_ids=kwargs.pop("stop_token_ids", []), **kwargs)


def prefilled_tokens(model):
    """A counter of the tokens each forward of ``model`` takes (index 0: the first forward)."""
    seen: list[int] = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[1]),
                                             with_kwargs=True)
    return seen, handle


def no_near_ties(target, prompt, answer):
    assert tm.min_top2_gap(target, prompt + answer, len(prompt)) > 1e-4, "choose prompts without near ties"


@pytest.mark.parametrize("tree_name", list(TREES))
def test_second_turn_prefills_only_new_tokens_and_stays_exact(models, tree_name):
    tree = TREES[tree_name]
    engine, cache = engine_for(models), ConversationCache(*models)
    first = engine.generate(TURN1, max_new_tokens=NEW, tree=tree, cache=cache, copies=False)
    answer1 = first.tokens
    assert answer1 == tm.hf_greedy(models[0], TURN1, NEW)
    assert first.reused_tokens == 0
    held = list(cache.tokens["target"])  # all but the next step's root, or all when a step was cut short
    assert held == (TURN1 + answer1)[:len(held)] and len(held) >= len(TURN1) + len(answer1) - 1

    prompt2 = TURN1 + answer1 + USER2
    reference = tm.hf_greedy(models[0], prompt2, NEW)
    no_near_ties(models[0], prompt2, reference)
    seen, handle = prefilled_tokens(models[0])
    try:
        second = engine.generate(prompt2, max_new_tokens=NEW, tree=tree, cache=cache, copies=False)
        answer2 = second.tokens
    finally:
        handle.remove()
    assert second.reused_tokens == len(held)
    assert seen[0] == len(prompt2) - 1 - len(held)  # the first target forward: only what was not cached
    fresh = engine_for(models).generate(prompt2, max_new_tokens=NEW, tree=tree, copies=False).tokens
    assert answer2 == fresh == reference


def test_an_edit_falls_back_to_the_longest_common_prefix(models):
    engine, cache = engine_for(models), ConversationCache(*models)
    answer1 = engine.generate(TURN1, max_new_tokens=NEW, tree=Tree.chain(3), cache=cache, copies=False).tokens
    edited = TURN1[:4] + [60, 61] + USER2  # the first message changed at token 4
    result = engine.generate(edited, max_new_tokens=NEW, tree=Tree.chain(3), cache=cache, copies=False)
    answer = result.tokens
    assert result.reused_tokens == 4
    assert answer == tm.hf_greedy(models[0], edited, NEW)
    # regenerate: the same prompt again reuses all of it but its last token
    again = engine.generate(edited, max_new_tokens=NEW, tree=Tree.chain(3), cache=cache, copies=False)
    assert again.reused_tokens == len(edited) - 1 and again.tokens == answer
    # a prompt sharing nothing starts from an empty cache
    other = [40, 41, 42]
    fresh = engine.generate(other, max_new_tokens=8, tree=Tree.chain(3), cache=cache, copies=False)
    assert fresh.tokens == tm.hf_greedy(models[0], other, 8)
    assert fresh.reused_tokens == 0 and answer1


def test_cache_contents_equal_caches_computed_from_scratch(models):
    engine, cache = engine_for(models), ConversationCache(*models)
    answer1 = engine.generate(TURN1, max_new_tokens=NEW, tree=Tree.k_ary(2, 2), cache=cache, copies=False).tokens
    engine.generate(TURN1 + answer1 + USER2, max_new_tokens=NEW, tree=Tree.k_ary(2, 2), cache=cache, copies=False)
    for role, model in zip(("target", "draft"), models):
        tokens = cache.tokens[role]
        assert len(tokens) > len(TURN1) + len(answer1)
        fresh = DynamicCache(config=model.config)
        with torch.inference_mode():
            forward(model, fresh, tokens, start=0, logits_to_keep=1)
        for kept, ref in zip(cache.runner(role).cache.layers, fresh.layers):
            n = len(tokens)
            assert torch.allclose(kept.keys[:, :, :n], ref.keys, atol=1e-5)
            assert torch.allclose(kept.values[:, :, :n], ref.values, atol=1e-5)


def test_a_stop_token_mid_step_keeps_a_valid_record(models):
    reference = tm.hf_greedy(models[0], TURN1, NEW)
    stop = next(t for k, t in enumerate(reference) if k >= 3 and t not in reference[:k])
    engine, cache = engine_for(models, stop_token_ids=[stop]), ConversationCache(*models)
    answer1 = engine.generate(TURN1, max_new_tokens=NEW, tree=Tree.chain(4), cache=cache, copies=False).tokens
    assert answer1[-1] == stop and answer1 == reference[:len(answer1)]
    assert cache.tokens["target"] == (TURN1 + answer1)[:len(cache.tokens["target"])]
    prompt2 = TURN1 + answer1 + USER2
    answer2 = engine.generate(prompt2, max_new_tokens=NEW, tree=Tree.chain(4), cache=cache, copies=False).tokens
    fresh = engine_for(models, stop_token_ids=[stop]).generate(prompt2, max_new_tokens=NEW, tree=Tree.chain(4), copies=False).tokens
    assert answer2 == fresh


def test_a_prefill_stopped_midway_leaves_a_usable_cache(models):
    engine, cache = engine_for(models), ConversationCache(*models)
    engine.prefill_chunk = 4
    prompt = TURN1 + USER2 + TURN1  # 23 tokens: 22 to prefill, in chunks of 4
    calls = []
    with pytest.raises(GenerationCancelled):
        engine.generate(prompt, max_new_tokens=8, tree=Tree.chain(2), cache=cache,
                        should_stop=lambda: len(calls.append(1) or calls) > 3, copies=False)
    assert cache.tokens["target"] == prompt[:12] and cache.tokens["draft"] == []
    result = engine.generate(prompt, max_new_tokens=8, tree=Tree.chain(2), cache=cache, copies=False)
    assert result.reused_tokens == 12
    assert result.tokens == tm.hf_greedy(models[0], prompt, 8)


def test_a_cache_of_other_models_is_refused(models):
    engine = engine_for(models)
    with pytest.raises(InvalidParameterError, match="ConversationCache"):
        engine.generate(TURN1, max_new_tokens=4, cache=ConversationCache(tm.qwen2(seed=3), models[1]), copies=False)
    with pytest.raises(InvalidParameterError, match="ConversationCache"):
        engine.generate(TURN1, max_new_tokens=4, cache=object(), copies=False)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2


def test_store_keeps_one_cache_per_key_and_evicts_least_recently_used(models):
    engine = engine_for(models)

    def filled(prompt):
        cache = ConversationCache(*models)
        engine.generate(prompt, max_new_tokens=4, tree=Tree.chain(2), cache=cache, copies=False)
        return cache

    a, b, c = filled(TURN1), filled(TURN1 + USER2), filled(USER2 + TURN1)
    assert a.nbytes() > 0 and b.nbytes() > a.nbytes()
    store = CacheStore(budget_bytes=a.nbytes() + b.nbytes())
    assert store.put("a", a) == [] and store.put("b", b) == []
    assert store.take("a") is a and store.keys() == ["b"]  # taken out while in use
    store.put("a", a)                                       # back: now the most recent
    assert store.put("c", c) == ["b"]                       # b was the least recently used
    assert store.keys() == ["a", "c"] and store.nbytes <= store.budget_bytes
    store.put("a", filled(TURN1))                           # one cache per key: replaced
    assert store.keys() == ["c", "a"]
    assert CacheStore(budget_bytes=a.nbytes() - 1).put("big", a) == ["big"]  # never over budget
    assert store.take("missing") is None
    store.clear()
    assert store.keys() == [] and store.nbytes == 0
