"""The k-quant target's kernels (engine/backends/kquant.py, engine/kernels/csrc/kquant.cpp, built by
engine/kernels/build.py) and
whole models of them (engine/backends/kquant_model.py): exact packing of GGUF blocks, the compiled
kernel equal bit for bit to the pure-torch reference, and rows that never depend on the rest of
the batch."""
from __future__ import annotations

import itertools
import platform

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine.backends import kquant
from engine.backends.kquant import (
    KQuantLinear,
    kquant_attention,
    pack_q4k,
    pack_q6k,
    quantize_q4k,
    reference_linear,
    unpack_weight,
)
from engine.backends.kquant_model import kquant_model, read_cache, write_cache
from engine.kernels import build, cpu

ROW_COUNTS = list(range(1, 33)) + [40, 64, 65, 150, 600]  # from 5 rows (AVX2) or 16 (VNNI): panels of up to 64 rows


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid random GGUF blocks ``[n, k/256, bytes]``: random quants and scales, sane fp16 d/dmin."""
    rng = np.random.default_rng(seed)
    size = 144 if kind == "q4k" else 210
    blocks = rng.integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)
    scales = rng.uniform(1e-4, 3e-3, size=(n, k // 256, 2)).astype(np.float16).view(np.uint8)
    if kind == "q4k":
        blocks[..., 0:4] = scales  # d and dmin
    else:
        blocks[..., 208:210] = scales[..., :2]  # d
    return blocks


def packed(kind: str, blocks: np.ndarray) -> dict[str, torch.Tensor]:
    return pack_q4k(blocks) if kind == "q4k" else pack_q6k(blocks)


@pytest.fixture(scope="module")
def compiled():
    if not build.kernels_available():
        pytest.fail("the k-quant kernels did not build: a C++ compiler and ninja are part of the install")
    return build.compiled_kernels()


@pytest.mark.parametrize("kind", ["q4k", "q6k"])
def test_packing_keeps_ggufs_own_weights_exactly(kind):
    blocks = random_blocks(kind, 32, 512)
    qtype = GGMLQuantizationType.Q4_K if kind == "q4k" else GGMLQuantizationType.Q6_K
    expected = torch.from_numpy(dequantize(blocks.reshape(32, -1), qtype)).reshape(32, 512)
    assert torch.equal(unpack_weight(kind, packed(kind, blocks), 32, 512), expected)


@pytest.mark.parametrize("kind", ["q4k", "q6k"])
def test_the_kernel_equals_the_torch_reference_bit_for_bit(kind, compiled):
    blocks = random_blocks(kind, 48, 768, seed=1)
    tensors = packed(kind, blocks)
    layer = KQuantLinear(kind, tensors, 768, 48)
    x = torch.randn(7, 768, generator=torch.Generator().manual_seed(4)) * torch.logspace(-2, 1, 768)  # uneven, as real activations
    assert torch.equal(layer(x), reference_linear(kind, x, tensors, 48))


def activations_at_rounding_edges(rows: int, k: int, seed: int) -> torch.Tensor:
    """``[rows, k]`` float32 activations whose super-block maxima make ``127 / amax`` (one rounding,
    the kernel's) differ from ``(1 / amax) * 127`` (two), with entries where that difference moves
    ``x * 127 / amax`` across a rounding edge: the int8 value then depends on which is computed."""
    generator = torch.Generator().manual_seed(seed)
    amax = torch.rand(20_000, generator=generator) * 10 + 0.01
    one, two = torch.full_like(amax, 127.0) / amax, amax.reciprocal() * 127
    amax, one, two = amax[one != two], one[one != two], two[one != two]
    blocks = []
    for i in range(rows * k // 256):
        level = torch.arange(1, 256, dtype=torch.float32) % 126 + 0.5  # k + 0.5: the edges
        x = level / one[i]
        for _ in range(4):  # nudge each x until the two scales round it to different integers
            differ = torch.round(x * one[i]) != torch.round(x * two[i])
            x = torch.where(differ, x, torch.nextafter(x, x + torch.sign(two[i] - one[i])))
        blocks.append(torch.cat([amax[i:i + 1], x.clamp(max=float(amax[i]))]))
    return torch.stack(blocks).reshape(rows, k)


def test_the_torch_reference_quantises_activations_with_the_kernels_one_rounding(compiled):
    """``127 / amax`` is one division in the kernel; the pure-torch fallback must not compute it as
    a reciprocal times 127 (torch's tensor ``127 / t``): at these activations the two give different
    int8 values, and only one division gives the kernel's bits."""
    x = activations_at_rounding_edges(7, 768, seed=12)
    blocks = x.reshape(-1, 256)
    amax = blocks.abs().amax(-1, keepdim=True)
    two_roundings = torch.round(blocks * (amax.reciprocal() * 127))
    assert bool((two_roundings != torch.round(blocks * (torch.full_like(amax, 127.0) / amax))).any())
    for kind in ("q4k", "q6k"):
        tensors = packed(kind, random_blocks(kind, 32, 768, seed=5))
        assert torch.equal(KQuantLinear(kind, tensors, 768, 32)(x), reference_linear(kind, x, tensors, 32)), kind


@pytest.mark.parametrize("kind", ["q4k", "q6k"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_largest_quants_and_activations_do_not_overflow_the_integer_sums(kind, sign, compiled):
    """Every quant at its maximum (15 or 63) times activations all at +-127: the SIMD paths' 16-bit
    partial sums sit at their largest; the result must still equal the reference bit for bit."""
    blocks = random_blocks(kind, 32, 512, seed=4)
    if kind == "q4k":
        blocks[..., 4:16] = 0xFF  # 6-bit scales and mins at 63
        blocks[..., 16:] = 0xFF  # every nibble 15
    else:
        blocks[..., :192] = 0xFF  # every 6-bit quant 63
        blocks[..., 192:208] = np.int8(-128).view(np.uint8)  # the largest scale magnitude
    tensors = packed(kind, blocks)
    x = torch.full((5, 512), sign)
    assert torch.equal(KQuantLinear(kind, tensors, 512, 32)(x), reference_linear(kind, x, tensors, 32))


@pytest.fixture(scope="module")
def every_path(compiled) -> dict:
    """The extension built for each SIMD path this CPU runs: ``{simd_path: module}``. The engine
    runs the native one; building the others lets a test prove a change on every path, not just
    the one of the machine that tests it."""
    marches = build.other_marches()  # built by `make test` before pytest starts (else here, a minute each)
    paths = {compiled.simd_path(): compiled} | {(e := build.compile_kernels(m)).simd_path(): e for m in marches}
    assert "portable" in paths or platform.machine() != "x86_64"
    return paths


def test_every_integer_path_computes_the_references_numbers(every_path):
    """The extension has an AVX-512 VNNI, an AVX2 and a portable path: each gives the reference's
    numbers bit for bit, at ordinary and at the largest quants."""
    paths = every_path
    for kind in ("q4k", "q6k"):
        saturated = random_blocks(kind, 32, 512, seed=4)  # every quant, scale and min at its largest
        saturated[..., slice(4, None) if kind == "q4k" else slice(0, 192)] = 0xFF
        for blocks, x in ((random_blocks(kind, 48, 768, seed=1), torch.randn(7, 768) * torch.logspace(-2, 1, 768)),
                          (random_blocks(kind, 48, 768, seed=2), torch.randn(100, 768) * torch.logspace(-2, 1, 768)),
                          (saturated, torch.full((5, 512), -1.0)), (saturated, torch.full((70, 512), -1.0))):
            tensors = packed(kind, blocks)
            n = blocks.shape[0]
            expected = reference_linear(kind, x, tensors, n)
            for path, extension in paths.items():
                kernel = extension.q4k_linear if kind == "q4k" else extension.q6k_linear
                got = kernel(x, *(tensors[name] for name in kquant.PACKED_NAMES[kind]), n)
                assert torch.equal(got, expected), (path, kind)


def test_every_path_attends_with_the_same_bits(every_path):
    """AVX-512 builds score 16 keys at a time, and AVX2 builds read each key once for up to four
    query heads, for the heads sharing a key/value head (head sizes 64 and 128); the portable path,
    and other head sizes, go one head and one key at a time. All must give the same bits: for causal
    chunks and tree masks with biases, key counts around the 16-key blocks, keys read from a larger
    buffer, and rows so sharp that most keys' weights underflow to 0."""
    generator = torch.Generator().manual_seed(5)
    cases = 0
    for heads, kv_heads, dim in ((12, 2, 128), (14, 2, 64), (4, 4, 64), (6, 3, 32)):
        for (length, rows), sharpness in itertools.product(((1, 1), (15, 1), (16, 2), (17, 3), (300, 2), (64, 16), (100, 37)),
                                                           (3, 40)):  # 40: many keys' weights underflow to 0
            q = torch.randn(heads, rows, dim, generator=generator) * sharpness
            k = torch.randn(kv_heads, length + 5, dim, generator=generator)[:, :length] * 3
            v = torch.randn(kv_heads, length + 5, dim, generator=generator)[:, :length]
            seen = torch.rand(rows, length, generator=generator) < 0.6
            seen[:, 0] = True
            bias = torch.randn(rows, length, generator=generator) * (torch.rand(rows, length, generator=generator) < 0.3)
            tree = torch.where(seen, bias, float("-inf")).contiguous()
            for mask in (torch.empty(0), tree):
                outs = {path: ext.attention(q, k, v, mask, dim ** -0.5) for path, ext in every_path.items()}
                first = next(iter(outs.values()))
                assert first.isfinite().all()
                for path, out in outs.items():
                    assert torch.equal(out, first), (path, heads, kv_heads, dim, length, rows, mask.numel())
                cases += 1
    assert cases == 112


def test_every_path_lets_a_nan_score_show(every_path):
    """Attention's exponential (fixed_exp.h) maps -inf to 0 for masked keys but keeps NaN: a NaN in
    a visible key reaches every row that sees it, on every path, and never a row that does not."""
    for heads, kv_heads, dim in ((12, 2, 128), (6, 3, 32)):
        q = torch.randn(heads, 3, dim)
        k, v = torch.randn(kv_heads, 40, dim), torch.randn(kv_heads, 40, dim)
        k[:, 38] = float("nan")  # key 38: seen by rows 1 and 2 of a causal chunk of 3 over 40 keys
        for path, ext in every_path.items():
            out = ext.attention(q, k, v, torch.empty(0), dim ** -0.5)  # [rows, heads, dim]
            assert out[0].isfinite().all() and out[1:].isnan().all(), (path, dim)


def test_every_path_keeps_a_zero_weight_from_an_infinite_value(every_path):
    """A key whose weight underflows to 0 adds nothing, not 0 * inf = NaN: the portable path skips it,
    and the vector paths that add zero weights without a test (when every value is finite) must see
    the infinite value and skip it too. Causal chunks (rows 1 to 40 over keys around the value blocks)
    and a tree mask, a value of inf or NaN at a key every row sees with weight 0."""
    generator = torch.Generator().manual_seed(11)
    for heads, kv_heads, dim in ((12, 2, 128), (6, 3, 32)):
        for length, rows, bad in ((40, 3, float("inf")), (70, 40, float("nan")), (33, 1, -float("inf"))):
            q = torch.rand(heads, rows, dim, generator=generator) + 0.5  # positive: key 5 scores far below the rest
            k = torch.randn(kv_heads, length, dim, generator=generator)
            k[:, 5] = -1000.0
            v = torch.randn(kv_heads, length, dim, generator=generator)
            v[:, 5, dim // 2] = bad
            for mask in (torch.empty(0), torch.zeros(rows, length)):
                outs = {path: ext.attention(q, k, v, mask, dim ** -0.5) for path, ext in every_path.items()}
                for path, out in outs.items():
                    assert out.isfinite().all(), (path, dim, length, rows, mask.numel())
                    assert torch.equal(out, outs["portable"]), (path, dim, length, rows, mask.numel())


def test_every_path_normalises_as_the_models_rms_norm_bit_for_bit(every_path):
    """The layers' RMSNorm by hand around ATen's sum equals the models' own formula (Qwen2RMSNorm,
    LlamaRMSNorm) bit for bit: widths of the default pair and odd ones, 1 to 17 rows, tiny, large
    and mixed scales."""
    generator = torch.Generator().manual_seed(9)
    for width in (7, 64, 100, 896, 1000, 1536, 3584):
        for rows in (1, 2, 3, 17):
            scale = torch.tensor([1e-3, 1.0, 40.0])[torch.randint(0, 3, (rows, 1), generator=generator)]
            x = torch.randn(1, rows, width, generator=generator) * scale
            weight = torch.randn(width, generator=generator)
            for eps in (1e-6, 1e-5):
                expected = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
                for path, ext in every_path.items():
                    assert torch.equal(ext.rms_norm(x, weight, eps), expected), (path, width, rows, eps)


def test_every_path_gives_the_nucleus_the_same_bits(every_path):
    """nucleus.cpp's exponential, sums and nucleus on AVX-512 and without it: the same bits, for
    peaked and flat rows, -inf entries, a row of -inf only, vocabularies around 16-lane blocks,
    temperature 0 (plain softmax), a tiny temperature, and top-p on and off."""
    generator = torch.Generator().manual_seed(6)
    cases = 0
    for vocab in (5, 16, 33, 1000, 151_936):
        logits = torch.randn(4, vocab, generator=generator) * torch.tensor([[0.2], [2.0], [9.0], [1.0]])
        logits[1, ::3] = float("-inf")
        logits[3] = float("-inf")
        for temperature, top_p in ((0.0, 1.0), (0.6, 0.9), (1.0, 0.5), (1e-30, 0.9), (1.3, 1.0)):
            outs = {path: ext.nucleus_probs(logits, temperature, top_p) for path, ext in every_path.items()}
            first, finite = next(iter(outs.values()))
            assert finite and first[:3].isfinite().all() and torch.equal(first[3], torch.full((vocab,), 1 / vocab)) \
                or top_p < 1
            for path, (out, ok) in outs.items():
                assert ok and torch.equal(out, first), (path, vocab, temperature, top_p)
            cases += 1
    assert cases == 25
    # a row of -inf after a row whose likely tokens leave out token 0: its nucleus is its own
    rows = torch.tensor([[-20.0, 5, 5, 5, 5], [float("-inf")] * 5])
    for extension in every_path.values():
        out, finite = extension.nucleus_probs(rows, 1.0, 0.5)
        assert finite and torch.equal(out[1], extension.nucleus_probs(rows[1:], 1.0, 0.5)[0][0])
        assert torch.equal(out[1] > 0, torch.tensor([True, True, True, False, False]))
        torch.testing.assert_close(out[1, :3], torch.full((3,), 1 / 3), rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", ["q4k", "q6k"])
def test_the_kernel_is_close_to_the_float_product(kind, compiled):
    blocks = random_blocks(kind, 64, 512, seed=2)
    tensors = packed(kind, blocks)
    x = torch.randn(5, 512)
    exact = x @ unpack_weight(kind, tensors, 64, 512).T
    error = (KQuantLinear(kind, tensors, 512, 64)(x) - exact).norm() / exact.norm()
    assert error < 0.02  # int8 activations per 256 inputs: about 0.7% on Gaussian inputs


@pytest.mark.parametrize("kind", ["q4k", "q6k"])
def test_every_row_is_independent_of_the_batch(kind, compiled):
    """Rows of an n-row product, n = 1..32 and prefill widths up to 600 (ten panels), at 1 to 4
    threads, equal the 1-row product of the same input on one thread bit for bit."""
    tensors = packed(kind, random_blocks(kind, 32, 512, seed=3))
    layer = KQuantLinear(kind, tensors, 512, 32)
    x = torch.randn(max(ROW_COUNTS), 512)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            for n in ROW_COUNTS:
                assert torch.equal(layer(x[:n]), alone[:n]), f"{n} rows, {threads} threads"
    finally:
        torch.set_num_threads(before)


def test_a_weight_without_gguf_is_quantised_to_q4k_within_its_grid():
    torch.manual_seed(0)
    weight = torch.randn(32, 512) * 0.05
    tensors = quantize_q4k(weight)
    error = (unpack_weight("q4k", tensors, 32, 512) - weight).norm() / weight.norm()
    assert error < 0.1  # 4 bits over a Gaussian's range: ~8%
    assert quantize_q4k(torch.zeros(16, 256))["qs"].count_nonzero() == 0


def test_shapes_the_kernel_cannot_tile_are_refused():
    with pytest.raises(ValueError, match="multiple"):
        quantize_q4k(torch.randn(16, 100))
    with pytest.raises(ValueError, match="multiples of 16"):
        pack_q4k(random_blocks("q4k", 8, 256))


@pytest.mark.parametrize("kind", ["q4k", "q6k"])
def test_the_kernels_refuse_outputs_and_scales_that_do_not_match_the_weight(kind, compiled):
    """Outputs not in whole tiles, or scale tensors of the wrong size, raise instead of reading past
    a tensor or leaving output columns unwritten."""
    tensors = packed(kind, random_blocks(kind, 32, 512, seed=6))
    kernel = compiled.q4k_linear if kind == "q4k" else compiled.q6k_linear
    parts = [tensors[name] for name in kquant.PACKED_NAMES[kind]]
    x = torch.randn(3, 512)
    assert torch.equal(kernel(x, *parts, 32), reference_linear(kind, x, tensors, 32))
    for n in (20, 0, -16):
        with pytest.raises(RuntimeError, match="outputs|does not match"):
            kernel(x, *parts, n)
    for i in range(1, len(parts)):
        short = [*parts[:i], parts[i][:-1], *parts[i + 1:]]
        with pytest.raises(RuntimeError, match="scales do not match"):
            kernel(x, *short, 32)


def _attention(q, k, v, mask):
    return kquant_attention(None, q, k, v, mask, scaling=q.shape[-1] ** -0.5)[0]


@pytest.mark.parametrize("dim", [32, 64, 128])
def test_attention_matches_torch_and_its_rows_are_independent(compiled, dim):
    torch.manual_seed(0)
    heads, kv_heads, length, rows = 4, 2, 40, 9
    q = torch.randn(1, heads, rows, dim)
    k, v = torch.randn(1, kv_heads, length, dim), torch.randn(1, kv_heads, length, dim)
    tree = torch.ones(rows, length, dtype=torch.bool)
    tree[:, -rows:] = torch.rand(rows, rows) < 0.5
    tree[:, -rows:] |= torch.eye(rows, dtype=torch.bool)
    for mask in (None, tree[None, None], torch.where(tree, 0.0, float("-inf"))[None, None]):
        out = _attention(q, k, v, mask)
        causal = mask is None
        bool_mask = torch.ones(rows, length, dtype=torch.bool).tril(length - rows) if causal else tree
        expected = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=bool_mask).transpose(1, 2)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        for i in range(rows):
            if causal:  # row i alone sees the keys a causal chunk's row i sees
                alone = _attention(q[:, :, i:i + 1], k[:, :, :length - rows + i + 1], v[:, :, :length - rows + i + 1], None)
            else:
                alone = _attention(q[:, :, i:i + 1], k, v, mask[:, :, i:i + 1])
            assert torch.equal(out[:, i:i + 1], alone), f"row {i}"



def test_attention_reads_cache_buffer_views_where_they_lie(compiled):
    """Keys/values as the leading slots of a larger buffer (the growing KV cache) or with rows not
    contiguous give the bits their contiguous copies give."""
    torch.manual_seed(1)
    heads, kv_heads, length, dim, rows = 4, 2, 23, 32, 3
    q = torch.randn(1, heads, rows, dim)
    buffer_k, buffer_v = torch.randn(1, kv_heads, 64, dim), torch.randn(1, kv_heads, 64, dim)
    k, v = buffer_k[:, :, :length], buffer_v[:, :, :length]
    assert not k.is_contiguous()
    expected = _attention(q, k.contiguous(), v.contiguous(), None)
    assert torch.equal(_attention(q, k, v, None), expected)
    transposed_k = k.contiguous().transpose(2, 3).contiguous().transpose(2, 3)  # rows strided
    assert torch.equal(_attention(q, transposed_k, v, None), expected)

def test_a_packed_target_is_cached_and_read_back_identically(tmp_path, compiled):
    import tiny_models as tm

    model = tm.qwen2(seed=1, vocab_size=32, hidden_size=256, layers=1)
    cache = tmp_path / "kquant.safetensors"
    first = kquant_model(model, cache_file=cache)
    assert cache.exists()
    again = kquant_model(model, cache_file=cache)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        assert torch.equal(first(ids).logits, again(ids).logits)
    other = tm.qwen2(seed=1, vocab_size=32, hidden_size=512, layers=1)  # another shape: the cache is not used
    assert kquant_model(other, cache_file=cache)(ids).logits.shape == (1, 4, 32)


@pytest.mark.parametrize("kind", ["q4k", "q6k"])
def test_a_cache_of_either_kind_is_read_back_instead_of_packing_again(tmp_path, kind):
    """A GGUF target has Q4_K and Q6_K layers: a cache holding either must be taken as it is (a
    size check that expected another layout once made every start pack the target again)."""
    import tiny_models as tm

    model = tm.qwen2(seed=1, vocab_size=32, hidden_size=256, layers=1)
    name = "model.layers.0.self_attn.q_proj"
    layer = KQuantLinear(kind, packed(kind, random_blocks(kind, 256, 256, seed=5)), 256, 256,
                         model.get_submodule(name).bias)
    cache = tmp_path / "kquant.safetensors"
    write_cache(cache, {name: layer})
    read = read_cache(cache, model)
    assert read is not None and read[name].kind == kind
    assert all(torch.equal(read[name].packed()[key], tensor) for key, tensor in layer.packed().items())


def test_building_the_int4_target_leaves_the_float_model_as_it_was(compiled):
    import tiny_models as tm

    model = tm.qwen2(seed=2, vocab_size=32, hidden_size=256, layers=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kquant_model(model)
    assert model.config._attn_implementation == "sdpa"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(type(m) is not KQuantLinear for m in model.modules())


def test_inputs_short_of_a_super_block_are_padded_with_zeros(compiled):
    """A 352-input layer (the 0.5B draft has 896) is packed as 384 + zeros: the kernel equals the
    reference, stays near the float product, and its rows stay independent of the batch."""
    torch.manual_seed(4)
    weight, x = torch.randn(32, 352) * 0.05, torch.randn(9, 352)
    layer = KQuantLinear("q4k", quantize_q4k(torch.nn.functional.pad(weight, (0, 160))), 352, 32)
    out = layer(x)
    assert torch.equal(out, reference_linear("q4k", torch.nn.functional.pad(x, (0, 160)), layer.packed(), 32))
    assert (out - x @ weight.T).norm() / (x @ weight.T).norm() < 0.1
    assert all(torch.equal(layer(x[i:i + 1]), out[i:i + 1]) for i in range(9))


def test_a_half_super_block_of_padding_is_neither_stored_nor_read(every_path):
    """896 inputs (the 0.5B draft's width) are 3.5 super-blocks: the zero half of the fourth is left
    out of the stored quants (1/8 of the bytes), and every integer path gives the bits of the whole,
    padded blocks, for every row count of the kernel's row blocks and prefill panels."""
    torch.manual_seed(5)
    weight, x = torch.randn(48, 896) * 0.05, torch.nn.functional.pad(torch.randn(70, 896), (0, 128))
    whole = quantize_q4k(torch.nn.functional.pad(weight, (0, 128)))
    layer = KQuantLinear("q4k", whole, 896, 48)
    stored = layer.packed()
    assert stored["qs"].numel() == whole["qs"].numel() * 7 // 8 == kquant.packed_bytes("q4k", 48, 896)
    assert torch.equal(kquant.unpack_weight("q4k", stored, 48, 1024), kquant.unpack_weight("q4k", whole, 48, 1024))
    expected = reference_linear("q4k", x, whole, 48)
    assert torch.equal(reference_linear("q4k", x, stored, 48), expected)
    for path, extension in every_path.items():
        for rows in (1, 2, 3, 7, 20, 70):  # 7 rows and more: the AVX2 panels
            for tensors in (stored, whole):
                got = extension.q4k_linear(x[:rows], *(tensors[name] for name in kquant.PACKED_NAMES["q4k"]), 48)
                assert torch.equal(got, expected[:rows]), (path, rows, tensors is whole)
    assert not kquant.has_half_tail(1024) and not kquant.has_half_tail(960) and kquant.has_half_tail(128)
    assert KQuantLinear("q4k", quantize_q4k(torch.zeros(16, 1024)), 960, 16).packed()["qs"].numel() == 16 * 512


def test_a_model_of_any_width_gets_kquant_layers_everywhere(compiled):
    """The q4k draft format: every linear of a 128-wide model becomes a padded k-quant layer, and
    its next-token logits stay close to the float model's."""
    import tiny_models as tm

    model = tm.qwen2(seed=3, vocab_size=64, hidden_size=128, layers=2)
    quantized = kquant_model(model)
    linears = [m for m in quantized.modules() if isinstance(m, (torch.nn.Linear, KQuantLinear))]
    assert linears and all(type(m) is KQuantLinear and m.padded_in % 256 == 0 for m in linears)
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.inference_mode():
        exact, approx = model(ids).logits, quantized(ids).logits
    assert (approx - exact).norm() / exact.norm() < 0.15


def test_the_native_build_is_keyed_by_the_cpus_instruction_sets(monkeypatch):
    """A ``-march=native`` build made on an AVX-512 machine must never be loaded on an AVX2 one (a
    shared home folder, a container image, a migrated VM): SIGILL. The key follows the flags line
    of /proc/cpuinfo (not the clock speed or anything else that moves), the portable builds not."""
    avx512 = frozenset({"sse4_2", "avx2", "f16c", "avx512f", "avx512bw", "avx512_vnni"})
    monkeypatch.setattr(cpu, "cpu_flags", lambda: avx512)
    keys = {march: build.build_key(march) for march in ("native", "x86-64", "x86-64-v3")}
    monkeypatch.setattr(cpu, "cpu_flags", lambda: avx512 - {"avx512f", "avx512bw", "avx512_vnni"})
    assert build.build_key("native") != keys["native"]
    assert build.build_key("x86-64") == keys["x86-64"] and build.build_key("x86-64-v3") == keys["x86-64-v3"]
    monkeypatch.setattr(cpu, "cpu_flags", lambda: avx512)
    assert build.build_key("native") == keys["native"]


def test_kernel_march_takes_only_a_path_this_cpu_runs(monkeypatch, caplog):
    """``$SEQUOIA_KERNEL_MARCH`` picks another path this CPU runs (the AVX2 one measured on an
    AVX-512 machine); a path it may not run (SIGILL) or a typo is refused with a warning."""
    monkeypatch.setattr(build, "other_marches", lambda: ["x86-64", "x86-64-v3"])
    for asked, built in (("", "native"), ("native", "native"), ("x86-64-v3", "x86-64-v3"), ("x86-64", "x86-64")):
        monkeypatch.setenv("SEQUOIA_KERNEL_MARCH", asked)
        assert build.kernel_march() == built
    monkeypatch.setattr(build, "other_marches", lambda: ["x86-64"])
    monkeypatch.setattr(build, "_REFUSED_MARCHES", set())
    for refused in ("x86-64-v3", "x86-64-v4", "znver9; rm -rf /"):
        monkeypatch.setenv("SEQUOIA_KERNEL_MARCH", refused)
        with caplog.at_level("WARNING", logger=build.log.name):
            assert build.kernel_march() == "native"
            assert "not a path this CPU runs" in caplog.text
            caplog.clear()
            assert build.kernel_march() == "native"
            assert not caplog.text, "said once is enough"


def test_cpu_flags_are_the_flags_line_only(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\ncpu MHz\t\t: 2445.406\nflags\t\t: fpu avx2 f16c\n\n"
                    "processor\t: 1\ncpu MHz\t\t: 2600.1\nflags\t\t: fpu avx2 f16c\n")
    real_path = cpu.Path
    monkeypatch.setattr(cpu, "Path", lambda p: info if p == "/proc/cpuinfo" else real_path(p))
    cpu.cpu_flags.cache_clear()
    cpu.cpu_model.cache_clear()
    try:
        assert cpu.cpu_flags() == frozenset({"fpu", "avx2", "f16c"})
        assert cpu.cpu_model() == "AMD EPYC"
    finally:
        cpu.cpu_flags.cache_clear()
        cpu.cpu_model.cache_clear()


def test_a_profiles_kernel_stamp_names_the_path_and_the_cpu(monkeypatch):
    """A hardware profile is "measured here" only with these kernels' sources, the path they are
    built for and this CPU: a profile timed on the AVX2 path of this machine, or on another CPU of
    the same ISA sharing the home folder, does not price this one's trees."""
    monkeypatch.setattr(build, "other_marches", lambda: ["x86-64", "x86-64-v3"])
    monkeypatch.delenv("SEQUOIA_KERNEL_MARCH", raising=False)
    here = build.kernel_digest()
    assert build.kernel_digest() == here
    monkeypatch.setenv("SEQUOIA_KERNEL_MARCH", "x86-64-v3")
    assert build.kernel_digest() != here
    monkeypatch.delenv("SEQUOIA_KERNEL_MARCH")
    monkeypatch.setattr(cpu, "cpu_model", lambda: "Another CPU of the same flags")
    assert build.kernel_digest() != here
