"""Multi-turn KV-cache reuse on the real default pair: the second turn, decoded with the caches kept
from the first, is token-identical to a fresh engine without reuse and to the target's own
Hugging Face greedy decoding of the whole conversation."""
from __future__ import annotations

import pytest
from conftest import REFERENCE_TOKENS

from engine import SpeculativeEngine
from engine.core.prefix_cache import ConversationCache
from engine.tuning.tree_store import build_tree

pytestmark = pytest.mark.real_pair


def test_second_turn_with_reuse_equals_fresh_engine_and_hf_generate(real_pair, chat_prompts, greedy_references,
                                                                     multiturn_reference):
    target, draft, _ = real_pair
    tree = build_tree(8, 4)
    engine = SpeculativeEngine(target, draft)
    cache = ConversationCache(target, draft)
    first = engine.generate(chat_prompts[0], max_new_tokens=REFERENCE_TOKENS, tree=tree, cache=cache)
    assert first.tokens == greedy_references[0]

    prompt = multiturn_reference["prompt"]
    with_reuse = engine.generate(prompt, max_new_tokens=REFERENCE_TOKENS, tree=tree, cache=cache)
    reused = with_reuse.reused_tokens
    without = SpeculativeEngine(target, draft).generate(prompt, max_new_tokens=REFERENCE_TOKENS, tree=tree)
    assert reused >= len(chat_prompts[0]), "the first turn's prompt should have been reused"
    assert with_reuse.tokens == without.tokens == multiturn_reference["reference"]
    print(f"turn 2: {len(prompt)} prompt tokens, {reused} reused from turn 1")
