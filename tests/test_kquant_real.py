"""The int4 (k-quant) target on the real pair: rows of a verification bit-identical to decoding each
token alone, the lean forward equal to the model's own, and a chain grown by confidence
token-identical to the target's own ``generate`` (the other trees: tests/test_real_pair.py)."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import REFERENCE_TOKENS
from transformers import DynamicCache

from engine import SpeculativeEngine, Tree
from engine.backends.kquant import FixedSiLU, KQuantLinear

pytestmark = pytest.mark.real_pair

ROWS = 32


@pytest.fixture(scope="module")
def q4k_target(real_pair, greedy_references):
    """``(model, greedy references)``: the target the app serves, kept in its GGUF blocks, and its
    own greedy continuations (Hugging Face's ``generate``, taken before any engine saw it)."""
    return real_pair[0], greedy_references


def test_every_linear_but_the_embedding_is_a_gguf_block_layer(q4k_target):
    model = q4k_target[0]
    kinds = [m.kind for m in model.modules() if isinstance(m, KQuantLinear)]
    assert len(kinds) == 28 * 7 + 1 and kinds.count("q6k") == 14 + 14 + 1  # the Q4_K_M mix
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert all(isinstance(layer.mlp.act_fn, FixedSiLU) for layer in model.model.layers)


def test_each_row_of_an_n_token_forward_equals_decoding_that_token_alone(q4k_target, chat_prompts):
    """n = 1..32 new tokens after a cached prompt: every row's logits bit-identical to one-token
    forwards of the same tokens, one after another, through the same KV cache."""
    model = q4k_target[0]
    new = torch.randint(0, 150_000, (1, ROWS), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        prompt_cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([chat_prompts[0]]), past_key_values=prompt_cache, use_cache=True)
        cache = copy.deepcopy(prompt_cache)
        alone = torch.stack([model(input_ids=new[:, i:i + 1], past_key_values=cache, use_cache=True).logits[0, 0]
                             for i in range(ROWS)])
        for n in range(1, ROWS + 1):
            rows = model(input_ids=new[:, :n], past_key_values=copy.deepcopy(prompt_cache), use_cache=True).logits[0]
            assert torch.equal(rows, alone[:n]), f"{n} rows: max diff {(rows - alone[:n]).abs().max():.3g}"


def test_the_lean_forward_gives_the_models_own_logits_bit_for_bit(q4k_target, chat_prompts):
    """The real target's one-loop forward (two native calls a layer, engine/backends/lean.py) against
    its Hugging Face forward: a chat prompt, then a 13-node tree under its mask."""
    from engine.core.runner import run_model

    model = q4k_target[0]
    assert "lean_forward" in vars(model)
    tree = Tree.from_parents([-1, 0, 0, 0, 1, 1, 2, 4, 4, 5, 7, 7, 10])
    prompt = torch.tensor([chat_prompts[1]])
    start = prompt.shape[1]
    new = torch.randint(0, 150_000, (1, tree.size), generator=torch.Generator().manual_seed(1))
    lean_cache, own_cache = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with torch.inference_mode():
        lean = run_model(model, lean_cache, prompt, torch.arange(start)[None], None, 1)
        own = model(input_ids=prompt, past_key_values=own_cache, use_cache=True, logits_to_keep=1).logits[0]
        assert torch.equal(lean, own)
        lean = run_model(model, lean_cache, new, tree.position_ids(start), tree.attention_mask(start), 0)
        own = model(input_ids=new, past_key_values=own_cache, use_cache=True, position_ids=tree.position_ids(start),
                    attention_mask=tree.attention_mask(start)).logits[0]
    assert torch.equal(lean, own), f"max diff {(lean - own).abs().max():.3g}"


def test_a_chain_grown_by_confidence_on_the_int4_target_is_token_identical(q4k_target, real_pair, chat_prompts):
    """Growth by the draft's confidence (what the optimizer picks on this CPU): each answer equals the
    target's own, and chains of every length were verified along the way."""
    model, refs = q4k_target
    engine = SpeculativeEngine(model, real_pair[1])
    sizes = set()
    for ids, ref in zip(chat_prompts, refs):
        result = engine.generate(ids, max_new_tokens=REFERENCE_TOKENS, temperature=0.0, tree=Tree.chain(3),
                                 confidence=0.7, copies=False)  # the draft's chains alone
        assert result.tokens == ref
        sizes.update(len(step.tokens) for step in result.steps)
    assert sizes == {2, 3, 4}, sorted(sizes)
