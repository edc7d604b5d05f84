"""Quantised drafts: int4 and int8 copies that leave the original intact, and keep the engine exact
(the target alone decides the output, whatever the draft's numerics)."""
from __future__ import annotations

import pytest
import tiny_models as tm
import torch

from engine import SpeculativeEngine, Tree
from engine.backends.kernels import is_packed, prepare
from engine.backends.quantize import (
    DRAFT_FORMATS,
    Int4Linear,
    cpu_has_bf16,
    draft_format,
    fastest_format,
    int4_draft,
    int8_draft,
    pack_int4,
    quantize_draft,
)
from engine.kernels.build import kernels_available

QUANTIZERS = {"int4": int4_draft, "int8": int8_draft}


def test_int4_linear_reproduces_weights_already_on_a_4bit_grid():
    """A Q4-style weight (per-group scale and zero, 16 levels) is stored exactly: the product then
    differs from fp32 only by bf16 rounding (activations in, the kernel's result out)."""
    torch.manual_seed(0)
    out_features, in_features, group = 48, 96, 32
    scale = torch.rand(out_features, in_features // group, 1).mul(0.01).add(0.001).bfloat16().float()
    zero = torch.randn(out_features, in_features // group, 1).mul(0.02).bfloat16().float()
    levels = torch.randint(0, 16, (out_features, in_features // group, group)).float()
    levels[..., 0], levels[..., 1] = 0, 15  # every group spans the whole grid, as a Q4 block's min and max do
    weight = ((levels - 8) * scale + zero).reshape(out_features, in_features)
    linear = torch.nn.Linear(in_features, out_features)
    linear.weight.data, linear.bias.data = weight, torch.randn(out_features)
    x = torch.randn(3, 5, in_features)
    expected = torch.nn.functional.linear(x.bfloat16().float(), weight, linear.bias)
    got = Int4Linear(linear)(x)
    assert got.shape == (3, 5, out_features) and got.dtype == torch.float32
    bf16_step = 2.0 ** -7 * expected.abs().amax()  # one bf16 ulp at the largest output
    assert (got - expected).abs().max() <= bf16_step


def test_int4_quantisation_error_is_bounded_by_half_a_step():
    torch.manual_seed(1)
    weight = torch.randn(16, 64)
    packed, scales_zeros = pack_int4(weight)
    assert packed.dtype == torch.uint8 and packed.shape == (16, 32)
    assert scales_zeros.shape == (2, 16, 2) and scales_zeros.dtype == torch.bfloat16
    linear = torch.nn.Linear(64, 16, bias=False)
    linear.weight.data = weight
    identity = torch.eye(64)  # the product with the identity reads the stored weight back
    stored = Int4Linear(linear)(identity).T
    step = (weight.reshape(16, 2, 32).amax(-1) - weight.reshape(16, 2, 32).amin(-1)) / 15
    error = (stored - weight).abs().reshape(16, 2, 32).amax(-1)
    assert (error <= step * 0.5 + 0.02 * weight.abs().max()).all()  # half a step, plus bf16 rounding


def test_int4_refuses_inputs_not_a_multiple_of_the_group():
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_int4(torch.randn(8, 40))


@pytest.mark.parametrize("fmt", list(QUANTIZERS))
def test_quantised_draft_is_a_copy_with_memory_of_its_own(fmt):
    model = tm.qwen2(seed=3)
    model.lm_head.weight = model.get_input_embeddings().weight  # tied, as in many small drafts
    weights = {name: p.clone() for name, p in model.named_parameters()}
    loaded_storage = model.get_input_embeddings().weight.untyped_storage().data_ptr()
    draft = QUANTIZERS[fmt](model)
    assert draft_format(draft) == fmt and draft_format(model) == "none"
    assert not any(type(m) is torch.nn.Linear for m in draft.modules())
    for name, p in model.named_parameters():  # the original is untouched
        assert torch.equal(p, weights[name]), name
    embedding = draft.get_input_embeddings().weight  # same values, moved off the memory it was loaded in
    assert torch.equal(embedding, weights["model.embed_tokens.weight"])
    assert embedding.untyped_storage().data_ptr() != loaded_storage
    ids = torch.tensor([[5, 17, 3, 42, 9, 11, 30, 2]])
    with torch.inference_mode():
        exact, approx = model(ids).logits, draft(ids).logits
    assert approx.shape == exact.shape
    assert (approx.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.6  # close, not equal
    assert not torch.equal(approx, exact)


@pytest.mark.parametrize("fmt", list(QUANTIZERS))
def test_quantising_refuses_drafts_off_the_cpu_fp32_path(fmt):
    with pytest.raises(ValueError, match="CPU in float32"):
        QUANTIZERS[fmt](tm.qwen2(seed=0).to(torch.bfloat16))


def test_quantize_draft_formats():
    model = tm.qwen2(seed=4)
    assert quantize_draft(model, "none") is model
    bf16 = tm.qwen2(seed=4).to(torch.bfloat16)
    assert quantize_draft(bf16, "auto") is bf16  # auto leaves non-CPU-fp32 drafts alone
    assert draft_format(quantize_draft(model, "int4")) == "int4"
    assert draft_format(quantize_draft(model, "auto")) in DRAFT_FORMATS
    assert fastest_format() == ("q4k" if kernels_available() else "int4" if cpu_has_bf16() else "int8")
    with pytest.raises(ValueError, match="draft format must be one of"):
        quantize_draft(model, "int3")


@pytest.mark.parametrize("fmt", list(QUANTIZERS))
@pytest.mark.parametrize("tree", [Tree.chain(3), Tree.k_ary(2, 2), Tree.from_parents([-1, 0, 1, 0, 2, 3])],
                         ids=["chain3", "2ary2", "irregular"])
def test_greedy_stays_exact_with_a_quantised_draft_and_the_fast_target_path(fmt, tree):
    target = tm.qwen2(seed=2)
    reference = tm.hf_greedy(target, [5, 17, 3, 42, 9, 11], 24)
    draft = QUANTIZERS[fmt](tm.perturbed(target, 0.003))
    prepare(target, draft)  # as the loaders do: the fast target path
    engine = SpeculativeEngine(target, draft, stop_token_ids=[])
    assert is_packed(target.model.layers[0].mlp.up_proj)
    result = engine.generate([5, 17, 3, 42, 9, 11], max_new_tokens=24, tree=tree)
    assert result.tokens == reference
    assert result.tokens_per_step > 1.5  # the quantised draft still agrees often


def test_int4_cache_round_trips_and_refuses_another_model(tmp_path):
    """The first quantisation writes the cache, the next reads it back bit for bit (no
    recomputation: the cache's own bytes are used); a cache of another shape is ignored."""
    cache = tmp_path / "int4.safetensors"
    model = tm.qwen2(seed=5)
    fresh = int4_draft(model, cache)
    assert cache.exists()
    cached = int4_draft(model, cache)
    for (name, a), (_, b) in zip(fresh.named_buffers(), cached.named_buffers()):
        assert torch.equal(a, b), name
    ids = torch.randint(0, model.config.vocab_size, (1, 7))
    assert torch.equal(fresh(ids).logits, cached(ids).logits)

    from safetensors.torch import load_file, save_file
    tampered = {k: (v.clone().fill_(0) if k.endswith("packed") else v) for k, v in load_file(cache).items()}
    save_file(tampered, cache)
    assert all((layer.packed == 0).all() for layer in int4_draft(model, cache).modules()
               if isinstance(layer, Int4Linear))  # proof that a matching cache is what gets used
    other = tm.qwen2(seed=5, hidden_size=64)
    rebuilt = int4_draft(other, cache)  # shapes differ: quantised afresh, cache rewritten
    expected = int4_draft(other)
    assert all(torch.equal(a, b) for a, b in zip(rebuilt.buffers(), expected.buffers()))
    assert load_file(cache)["model.layers.0.mlp.up_proj.scales_zeros"].shape == (2, 128, 2)
