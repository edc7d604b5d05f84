"""Every GGUF block type served as stored (engine/backends/blocks.py, engine/kernels/csrc/blocks.h):
the packed weight is GGUF's own dequantisation bit for bit, the kernels equal the pure-torch
reference bit for bit on every ISA path, and a row never depends on the rest of the batch."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from engine.backends import blocks, kquant
from engine.backends.blocks import SERVED_TYPES, UnsupportedBlockType, pack_blocks, pack_float
from engine.backends.kquant import KQuantLinear, padded_size, reference_linear, select_outputs, unpack_weight
from engine.kernels import build

K_SIZES = {T.Q2_K: 84, T.Q3_K: 110, T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}
D_AT = {T.Q2_K: 80, T.Q3_K: 108, T.Q4_K: 0, T.Q5_K: 0, T.Q6_K: 208}  # where a K block's fp16 d lies
TYPES = sorted(SERVED_TYPES)
WIDTHS = (256, 640, 896)


def shapes(qtype: T) -> list[int]:
    return [256] if qtype in K_SIZES else list(WIDTHS)  # K types: whole super-blocks only


CASES = [(qtype, k) for qtype in TYPES for k in shapes(qtype)]


def ids(case) -> str:
    return f"{case[0].name}-{case[1]}"


def random_blocks(qtype: T, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid GGUF rows ``[n, row_bytes]`` of ``qtype``: K types random bytes with fp16 d (and dmin)
    in [1e-3, 1e-1]; the others gguf's own quantisation of normal weights."""
    rng = np.random.default_rng(seed)
    if qtype not in K_SIZES:
        return quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    b = rng.integers(0, 256, size=(n, k // 256, K_SIZES[qtype]), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-1, size=(n, k // 256, 2)).astype(np.float16).view(np.uint8)
    at, count = D_AT[qtype], 4 if qtype in (T.Q2_K, T.Q4_K, T.Q5_K) else 2
    b[..., at:at + count] = scales[..., :count]
    return b.reshape(n, -1)


def layer_of(qtype: T, n: int, k: int, seed: int = 0) -> tuple[KQuantLinear, np.ndarray]:
    rows = random_blocks(qtype, n, k, seed)
    kind, tensors = pack_blocks(qtype, rows, k)
    return KQuantLinear(kind, tensors, k, n), rows


def activations(r: int, k: int, seed: int = 3) -> torch.Tensor:
    """Uneven activations, as real ones: a few large inputs set each super-block's int8 scale."""
    return torch.randn(r, k, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-2, 1, k)


def padded(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, padded_size(x.shape[-1]) - x.shape[-1]))


@pytest.fixture(scope="module")
def compiled():
    if not build.kernels_available():
        pytest.fail("the kernels did not build: a C++ compiler and ninja are part of the install")
    return build.compiled_kernels()


@pytest.fixture(scope="module")
def every_path(compiled):
    return [compiled] + [build.compile_kernels(march) for march in build.other_marches()]


@pytest.mark.parametrize("case", CASES, ids=ids)
@pytest.mark.parametrize("n", [16, 48])
def test_the_packed_weight_is_ggufs_own_dequantisation_bit_for_bit(case, n):
    qtype, k = case
    rows = random_blocks(qtype, n, k, seed=n)
    kind, tensors = pack_blocks(qtype, rows, k)
    expected = torch.from_numpy(dequantize(rows, qtype).reshape(n, k).astype(np.float32))
    assert torch.equal(unpack_weight(kind, tensors, n, k), expected)
    whole = unpack_weight(kind, tensors, n, padded_size(k))  # the padded width: zeros past the stored inputs
    assert torch.equal(whole[:, :k], expected) and not whole[:, k:].any()
    main = tensors[kquant.PACKED_NAMES[kind][0]]
    assert main.numel() * main.element_size() == kquant.packed_bytes(kind, n, k)


def test_the_common_types_are_stored_compactly():
    """Bits a weight of the quants (the scales aside): as few as the type has, not a wider form."""
    bits = {T.Q8_0: 8, T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q2_K: 2, T.Q4_K: 4, T.Q5_K: 5, T.Q6_K: 6,
            T.F16: 16, T.BF16: 16, T.F32: 32}
    for qtype, per_weight in bits.items():
        _, tensors = pack_blocks(qtype, random_blocks(qtype, 16, 256), 256)
        stored = sum(tensors[name].numel() * tensors[name].element_size() for name in ("qs", "qh", "w") if name in tensors)
        assert stored * 8 == per_weight * 16 * 256, qtype.name


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_the_kernel_equals_the_reference_and_rows_do_not_depend_on_the_batch(case, compiled):
    """Each row alone, within batches of 1 .. 64 rows (register blocks and panels), and with 1 or 2
    threads: the same bits as the pure-torch reference."""
    qtype, k = case
    layer, _ = layer_of(qtype, 48, k, seed=1)
    x = activations(64, k)
    expected = reference_linear(layer.kind, padded(x), layer.packed(), 48)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (1, 3, 8, 17, 64):
                assert torch.equal(layer(x[:rows]), expected[:rows]), (count, rows)
            assert torch.equal(torch.cat([layer(x[i:i + 1]) for i in range(0, 64, 9)]), expected[::9])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_isa_path_gives_the_same_bits(qtype, every_path):
    k = 896 if qtype not in K_SIZES else 512
    layer, _ = layer_of(qtype, 48, k, seed=2)
    x = padded(activations(20, k))
    parts = [layer._buffers[name] for name in kquant.PACKED_NAMES[layer.kind]]
    expected = reference_linear(layer.kind, x, layer.packed(), 48)
    for extension in every_path:
        for rows in (1, 5, 20):
            assert torch.equal(extension.block_linear(x[:rows], layer.kind, parts, 48), expected[:rows]), \
                (extension.simd_path(), rows)


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_the_result_is_close_to_the_float_product(case, compiled):
    """Float kinds: x @ W.T up to float32 summation order. Integer kinds: each activation is off by
    at most half a quantisation step, ``amax / 254`` of its group (round to nearest of
    ``x * 127 / amax``; the group: 32 inputs for the legacy kinds, a super-block of 256 for the
    k-quants), so ``|y - x @ W.T| <= sum_k |w_k| * amax(k) / 254`` per output; the float steps add a
    few ulps of the terms, covered by the 1% and the 1e-6 slack. The activations grow 1,000-fold
    across the inputs, so a legacy product quantised per 256 would break its per-32 bound."""
    qtype, k = case
    layer, _ = layer_of(qtype, 48, k, seed=4)
    x = activations(9, k, seed=5)
    w = unpack_weight(layer.kind, layer.packed(), 48, k)
    exact = (x.double() @ w.double().T)
    got = layer(x).double()
    if layer.kind in blocks.FLOATS:
        bound = 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-30
    else:
        group = blocks.GROUP if layer.kind in blocks.LEGACY else 256
        amax = padded(x).reshape(9, -1, group).abs().amax(-1).repeat_interleave(group, dim=1)[:, :k]
        bound = 1.01 * ((amax.double() / 254) @ w.double().abs().T) + 1e-6
    assert ((got - exact).abs() <= bound).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_select_outputs_re_tiles_any_kind(qtype, compiled):
    k = 640 if qtype not in K_SIZES else 256
    full, _ = layer_of(qtype, 64, k, seed=7)
    rows = torch.tensor([3, 60, 17, 0, 1, 2, 45, 44, 5, 33, 34, 8, 9, 62, 12, 40])
    part = KQuantLinear(full.kind, select_outputs(full.kind, full.packed(), 64, rows), k, 16)
    assert torch.equal(unpack_weight(full.kind, part.packed(), 16, k), unpack_weight(full.kind, full.packed(), 64, k)[rows])
    x = activations(3, k)
    assert torch.equal(part(x), full(x)[:, rows])
    with pytest.raises(ValueError, match="tiles of 16"):
        select_outputs(full.kind, full.packed(), 64, rows[:10])


def test_pack_float_is_the_float32_weight_exactly(compiled):
    weight = torch.randn(32, 200)
    kind, tensors = pack_float(weight)
    assert kind == "f32" and torch.equal(unpack_weight(kind, tensors, 32, 200), weight)
    layer = KQuantLinear(kind, tensors, 200, 32)
    x = activations(4, 200)
    assert torch.equal(layer(x), reference_linear(kind, padded(x), tensors, 32))


def test_types_without_a_kernel_and_untileable_outputs_are_refused(tmp_path):
    with pytest.raises(UnsupportedBlockType, match="IQ4_NL"):
        pack_blocks(T.IQ4_NL, np.zeros((16, 18 * 8), dtype=np.uint8), 256)
    with pytest.raises(ValueError, match="multiples of 16"):
        pack_blocks(T.Q8_0, random_blocks(T.Q8_0, 8, 256), 256)
    with pytest.raises(ValueError, match="multiples of 16"):
        KQuantLinear("q8_0", pack_blocks(T.Q8_0, random_blocks(T.Q8_0, 16, 256), 256)[1], 256, 24)


def test_pack_gguf_tensor_names_the_tensor_and_type_it_cannot_serve(tmp_path):
    from engine.backends.gguf_file import GGUFTensor
    from engine.backends.kquant_model import pack_gguf_tensor

    tensor = GGUFTensor("blk.0.ffn_down.weight", T.IQ2_XXS, (256, 16), 0)
    with pytest.raises(UnsupportedBlockType, match=r"blk\.0\.ffn_down\.weight.*IQ2_XXS"):
        pack_gguf_tensor(tmp_path / "model.gguf", tensor)


def lean_and_own_logits(hidden: int, kinds: dict[str, T]) -> tuple[torch.Tensor, torch.Tensor, set[str]]:
    """A tiny qwen2 of ``hidden`` inputs whose linears are re-stored as ``kinds`` (by leaf name):
    ``(lean forward's logits, the model's own logits, the kinds it ran)``."""
    import tiny_models as tm

    from engine.backends.kquant_model import kquant_model
    from engine.core.runner import run_model
    from transformers import DynamicCache

    model = kquant_model(tm.qwen2(seed=5, vocab_size=64, hidden_size=hidden, layers=2))
    for name, module in list(model.named_modules()):
        leaf = name.rpartition(".")[2]
        if isinstance(module, KQuantLinear) and leaf in kinds:
            w = unpack_weight(module.kind, module.packed(), module.out_features, module.padded_in)[:, :module.in_features]
            qtype = kinds[leaf]  # gguf's quantize writes no K types: those get random valid blocks
            stored = random_blocks(qtype, module.out_features, module.in_features) if qtype in K_SIZES \
                else quantize(w.contiguous().numpy(), qtype)
            kind, tensors = pack_blocks(qtype, stored, module.in_features)
            bias = module._parameters.get("bias")
            replacement = KQuantLinear(kind, tensors, module.in_features, module.out_features, bias)
            parent = model.get_submodule(name.rpartition(".")[0])
            setattr(parent, leaf, replacement)
    plain = copy.deepcopy(model)
    plain.__dict__.pop("lean_forward", None)
    prompt, positions = torch.tensor([[1, 5, 9, 2, 7]]), torch.arange(5)[None]
    with torch.inference_mode():
        lean = run_model(model, DynamicCache(config=model.config), prompt, positions, None, 0)
        own = plain(input_ids=prompt, past_key_values=DynamicCache(config=model.config), use_cache=True,
                    position_ids=positions).logits[0]
    return lean, own, {m.kind for m in model.modules() if isinstance(m, KQuantLinear)}


def test_the_lean_layer_runs_linears_of_every_new_kind(compiled):
    """A tiny qwen2 whose linears are Q8_0, Q5_0, Q4_1, F16, BF16, Q5_1 (its K = 128 allows only
    the legacy and float kinds) through the lean forward: the model's own logits, bit for bit."""
    lean, own, ran = lean_and_own_logits(128, {
        "q_proj": T.Q8_0, "k_proj": T.Q5_0, "v_proj": T.Q4_1, "o_proj": T.F16, "gate_proj": T.BF16,
        "up_proj": T.Q5_1, "down_proj": T.Q4_0})
    assert torch.equal(lean, own)
    assert ran >= {"q8_0", "q5_0", "f16", "bf16"}


def test_products_side_by_side_mix_activation_granularities(compiled):
    """q, k, v in one product call with a k-quant (activations per 256) beside legacy kinds (per
    32), as llama.cpp's Q4_K_M files mix them: each linear gets its own granularity, so the lean
    layer equals the model's own forward, which runs each linear alone."""
    lean, own, ran = lean_and_own_logits(256, {
        "q_proj": T.Q4_K, "k_proj": T.Q8_0, "v_proj": T.Q6_K, "gate_proj": T.Q5_0, "up_proj": T.Q5_K})
    assert torch.equal(lean, own)
    assert ran >= {"q4k", "q8_0", "q6k", "q5_0", "q5k"}
