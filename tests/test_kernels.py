"""The packed linear path computes the same float32 product as F.linear (to rounding), can be undone
exactly, and is what the loaders prepare CPU float32 models with (never the engine itself)."""
from __future__ import annotations

import copy

import pytest
import tiny_models as tm
import torch
import torch.nn.functional as F

from engine import SpeculativeEngine, Tree
from engine.backends.kernels import is_packed, pack_linears, packing_available, prepare, unpack_linears

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("shape", [(1, 96), (3, 96), (2, 5, 96), (17, 96), (64, 96)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_matches_f_linear(shape, bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 80, bias=bias)
    weight, x = layer.weight.detach().clone(), torch.randn(*shape)
    expected = F.linear(x, weight, layer.bias)
    assert pack_linears(torch.nn.Sequential(layer)) == 1 and is_packed(layer)
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == (*shape[:-1], 80)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_packing_is_idempotent_and_undone_exactly():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    dense = copy.deepcopy(model)
    x = torch.randn(4, 64)
    assert pack_linears(model) == 2 and pack_linears(model) == 0
    with torch.inference_mode():
        torch.testing.assert_close(model(x), dense(x), atol=1e-5, rtol=1e-5)
    twin = copy.deepcopy(model)  # a packed model copies into an independent packed model
    assert is_packed(twin[0]) and twin[0].weight is not model[0].weight
    with torch.inference_mode():
        assert torch.equal(twin(x), model(x))
    assert unpack_linears(model) == 2 and unpack_linears(model) == 0
    for a, b in zip(model.parameters(), dense.parameters()):
        assert not a.is_mkldnn and torch.equal(a, b)
    assert torch.equal(model(x), dense(x))  # torch's own forward again
    copy.deepcopy(model)  # dense models copy again


def test_non_float32_and_non_linear_layers_are_left_alone():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32).to(torch.bfloat16), torch.nn.Embedding(10, 32))
    assert pack_linears(model) == 0


def test_prepare_packs_cpu_fp32_models_and_skips_the_rest():
    target, draft = tm.qwen2(seed=1), tm.qwen2(seed=2).to(torch.bfloat16)
    prepare(target, draft, None)
    assert is_packed(target.lm_head) and is_packed(target.model.layers[0].mlp.up_proj)
    assert not any(is_packed(m) for m in draft.modules())


def _snapshot(model: torch.nn.Module) -> dict:
    """What an engine could change on a model: every tensor (value and layout) and every patched method."""
    return {"tensors": {k: (v.is_mkldnn, v.clone()) for k, v in model.state_dict(keep_vars=True).items()},
            "patched": sorted(n for n, m in model.named_modules() if "forward" in vars(m))}


def test_building_and_running_an_engine_leaves_the_callers_models_as_they_were():
    target, draft = tm.qwen2(seed=5), tm.perturbed(tm.qwen2(seed=5), 0.003)
    before = {role: _snapshot(model) for role, model in (("target", target), ("draft", draft))}
    engine = SpeculativeEngine(target, draft, stop_token_ids=[])
    engine.generate([5, 17, 3, 42], max_new_tokens=8, tree=Tree.k_ary(2, 2))
    for role, model in (("target", target), ("draft", draft)):
        after = _snapshot(model)
        assert after["patched"] == before[role]["patched"] == [], role
        for name, (mkldnn, value) in before[role]["tensors"].items():
            assert after["tensors"][name][0] == mkldnn is False, (role, name)
            assert torch.equal(after["tensors"][name][1], value), (role, name)


@pytest.mark.parametrize("tree", [Tree.chain(4), Tree.k_ary(2, 3), Tree.from_parents([-1, 0, 1, 0, 2, 3, 3])],
                         ids=["chain4", "2ary3", "irregular"])
def test_packed_engine_stays_token_identical_to_stock_greedy_decoding(tree):
    """The reference is Hugging Face's greedy decoding on the stock (unpacked) weights."""
    target = tm.qwen2(seed=5)
    prompt = [5, 17, 3, 42, 9, 11]
    reference = tm.hf_greedy(target, prompt, 32)
    draft = tm.perturbed(target, 0.003)
    prepare(target, draft)
    engine = SpeculativeEngine(target, draft, stop_token_ids=[])
    assert is_packed(target.lm_head)
    assert engine.generate(prompt, max_new_tokens=32, tree=tree).tokens == reference
    assert engine.generate(prompt, max_new_tokens=32, tree=None).tokens == reference
