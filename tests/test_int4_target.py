"""The int4 target (``--target-format int4``): the k-quant model of :mod:`engine.backends.kquant`, whose
whole forward is batch-invariant, so the engine reproduces its own greedy decoding exactly on any
tree; and the draft's int4 product, whose rows do not depend on the rest of the batch either."""
from __future__ import annotations

import pytest
import tiny_models as tm
import torch

from engine import SpeculativeEngine, Tree
from engine.backends.kquant_model import kquant_model
from engine.backends.quantize import TARGET_FORMATS, Int4Linear, int4_draft, target_quantization
from engine.models.loading import pair_name

# the target's linear shapes (out, in): q, k/v, o, gate/up, down, and the output head
TARGET_SHAPES = [(1536, 1536), (256, 1536), (8960, 1536), (1536, 8960), (151936, 1536)]


def test_target_formats():
    assert set(TARGET_FORMATS) == {"float32", "int4", "auto"}
    assert target_quantization("float32") == "none" and target_quantization("int4") == "q4k"
    assert target_quantization("auto") == "q4k"
    assert target_quantization("auto", model_on_cpu_fp32=False) == "none"
    with pytest.raises(ValueError, match="CPU"):
        target_quantization("int4", model_on_cpu_fp32=False)
    with pytest.raises(ValueError, match="target format"):
        target_quantization("int3")


def test_pair_names_tag_a_quantised_target():
    target = kquant_model(tm.qwen2(seed=1, hidden_size=256))
    draft = int4_draft(tm.qwen2(seed=2))
    assert pair_name("t", "d", draft) == "t+d@int4"
    assert pair_name("t", "d", draft, target) == "t@q4k+d@int4"
    assert pair_name("t", "d", None, tm.qwen2(seed=3)) == "t+d"


@pytest.mark.parametrize("out_features,in_features", TARGET_SHAPES, ids=lambda v: str(v))
def test_the_drafts_int4_rows_are_bit_identical_whatever_the_batch(out_features, in_features):
    """Each row of an n-row product equals the 1-row product of that row, bit for bit, n = 1..32:
    the kernel's rows do not depend on the batch (so a verified row is the token decoded alone)."""
    torch.manual_seed(out_features + in_features)
    weight = torch.randn(out_features if out_features < 100_000 else 4096, in_features) * 0.02
    linear = torch.nn.Linear(in_features, weight.shape[0], bias=False)
    linear.weight.data = weight
    layer = Int4Linear(linear)
    x = torch.randn(32, in_features)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(32)])
    for n in (2, 3, 4, 5, 8, 13, 16, 32):
        assert torch.equal(layer(x[:n]), alone[:n]), f"{n} rows"


@pytest.mark.parametrize("tree", [Tree.chain(4), Tree.k_ary(2, 3), Tree.from_parents([-1, 0, 1, 0, 2, 3, 3])],
                         ids=["chain4", "2ary3", "irregular"])
def test_greedy_equals_the_int4_targets_own_decoding(tree):
    """The reference is Hugging Face's greedy decoding on another int4 copy of the same float
    target, one that no engine has touched. The whole forward is batch-invariant (the spread
    between verified rows and rows decoded alone is exactly 0), so no near-tie can break it."""
    float_target = tm.qwen2(seed=7, hidden_size=256)
    reference_model, target = kquant_model(float_target), kquant_model(float_target)
    prompt = [5, 17, 3, 42, 9, 11]
    reference = tm.hf_greedy(reference_model, prompt, 32)
    assert batch_spread(reference_model, prompt) == 0.0
    engine = SpeculativeEngine(target, tm.perturbed(float_target, 0.003), stop_token_ids=[])
    assert engine.generate(prompt, max_new_tokens=32, tree=tree).tokens == reference
    assert engine.generate(prompt, max_new_tokens=32, tree=None).tokens == reference


def batch_spread(model: torch.nn.Module, prompt: list[int], n: int = 8) -> float:
    """Largest |logit| difference between n tokens verified in one tree forward (a chain) and the
    same tokens decoded one at a time, after ``prompt``."""
    from transformers import DynamicCache

    from engine.core.speculative import forward

    tokens, p = prompt[-1:] + [3, 9, 27, 1, 12, 7, 30][:n - 1], len(prompt) - 1
    with torch.inference_mode():
        one, many = DynamicCache(config=model.config), DynamicCache(config=model.config)
        for cache in (one, many):
            forward(model, cache, prompt[:-1], start=0, logits_to_keep=1)
        alone = torch.stack([forward(model, one, [t], start=p + i)[-1] for i, t in enumerate(tokens)])
        chain = Tree.chain(len(tokens) - 1)
        rows = forward(model, many, tokens, start=p, mask=chain.attention_mask(p), positions=chain.position_ids(p))
    return float((rows - alone).abs().max())
