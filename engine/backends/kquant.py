"""A target kept in its GGUF k-quant blocks, with batch-invariant CPU kernels.

The embedded target's GGUF stores most matrices as Q4_K (super-blocks of 256 inputs, sub-blocks of
32 with 6-bit scales and mins: ``w = d*sc*q - dmin*m``, q in 0..15) and the rest as Q6_K
(sub-blocks of 16 with int8 scales: ``w = d*sc*(q - 32)``). :class:`KQuantLinear` keeps those
integers exactly and multiplies them with activations quantised to int8 per super-block, as
llama.cpp does, in a C++ kernel (``engine/kernels/csrc/kquant.cpp``: AVX-512 VNNI or AVX2 where the CPU
has them, portable C++ elsewhere; :func:`engine.kernels.build.simd_path` says which).

Exactness by construction: each output row is computed by the same instructions in the same
order whatever the number of rows and threads, :func:`kquant_attention` does the same for
attention and :class:`FixedSiLU` for the activation, so a row of an n-token verification is
bit-identical to decoding that token alone (see
``tests/test_kquant.py``). Greedy tree decoding then reproduces the model's own greedy decoding
exactly, not by luck at near-ties.

Without a C++ compiler the linear layers run :func:`reference_linear` (pure torch, the same
numbers, slower) and attention falls back to torch's SDPA (then rows are no longer guaranteed
batch-invariant; :func:`engine.kernels.build.kernels_available` says which).

Every other type llama-quantize writes (Q8_0, Q4_0/1, Q5_0/1, Q2_K, Q3_K, Q5_K, F32/F16/BF16) is
served as stored too, by the kinds of :mod:`engine.backends.blocks` through the same layer.

This module holds the layers and their packing; the kernels they call are built and loaded by
:mod:`engine.kernels.build`, and a whole model of them (from a float model or a GGUF's blocks,
cached packed) is built by :mod:`engine.backends.kquant_model`.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.backends.tiles import SUPER_BLOCK, TILE, _tile_q4k, _tiles, pack_q4k, pack_q6k  # noqa: F401 (re-exported)
from engine.kernels.build import compiled_kernels

ATTENTION_NAME = "kquant"
CACHE_FORMAT = 5  # bump when the packed layout changes (2: Q6_K at 6 bits a weight, not 8; 3: d, dmin as fp16;
#                  4: a Q4_K weight's zero half super-block not stored; 5: every GGUF type served as
#                  stored, engine/backends/blocks.py: no more Q4_K re-quantisations in a cache)


# ---- packing GGUF blocks into the kernel's tiles ----------------------------------------------

def quantize_q4k(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The kernel's Q4_K tensors for a float ``weight [N, K]`` of a model that has no GGUF: per
    sub-block of 32 an affine 4-bit grid over [min(w, 0), max(w)], its step and offset rounded to
    6 bits of the super-block's fp16 ``d`` and ``dmin`` (GGUF's Q4_K form, simpler rounding)."""
    n, k = weight.shape
    if k % SUPER_BLOCK:
        raise ValueError(f"Q4_K needs the input size ({k}) to be a multiple of {SUPER_BLOCK}")
    w = weight.detach().float().reshape(n, k // SUPER_BLOCK, 8, 32)
    low = w.amin(-1).clamp(max=0)
    step = (w.amax(-1) - low) / 15
    d = (step.amax(-1) / 63).half().float()
    dmin = ((-low).amax(-1) / 63).half().float()
    sc = torch.where(d[..., None] > 0, torch.round(step / d[..., None].clamp(min=1e-30)), 0).clamp(0, 63)
    mn = torch.where(dmin[..., None] > 0, torch.round(-low / dmin[..., None].clamp(min=1e-30)), 0).clamp(0, 63)
    scale, offset = (d[..., None] * sc)[..., None], (dmin[..., None] * mn)[..., None]
    q = torch.where(scale > 0, torch.round((w + offset) / scale.clamp(min=1e-30)), 0).clamp(0, 15)
    as_np = lambda t, dtype: t.numpy().astype(dtype)  # noqa: E731
    return _tile_q4k(as_np(q.reshape(n, -1, SUPER_BLOCK), np.uint8), as_np(sc, np.uint8), as_np(mn, np.uint8),
                     as_np(d, np.float16), as_np(dmin, np.float16))  # d, dmin are fp16 values: exact


def unpack_weight(kind: str, tensors: dict[str, torch.Tensor], out_features: int, in_features: int) -> torch.Tensor:
    """The float32 weight ``[N, K]`` that packed tensors stand for, by GGUF's own formula, bit for
    bit (``d*sc*q - dmin*m`` for Q4_K, ``(d*sc)*(q-32)`` for Q6_K and Q3_K, the other kinds in
    :func:`engine.backends.blocks.unpack`; zeros past the stored inputs): for tests and references."""
    if kind not in ("q4k", "q6k", "q3k"):
        from engine.backends import blocks
        return blocks.unpack(kind, tensors, out_features, in_features)
    q, scale, offset = _integer_weight(kind, tensors, out_features, in_features)
    if kind == "q4k":
        return (scale * q.float() - offset).reshape(out_features, in_features)
    return (scale * (q - 32).float()).reshape(out_features, in_features)  # GGUF's one rounding


def select_outputs(kind: str, tensors: dict[str, torch.Tensor], out_features: int, rows: torch.Tensor
                   ) -> dict[str, torch.Tensor]:
    """The packed tensors (stored layout) of the weight whose outputs are ``rows`` (int64, a
    multiple of 16 of them) of the weight packed as ``tensors``: the same blocks, re-tiled. Every
    packed tensor is ``[tiles, A, 16 outputs, B]`` (B = 4 inputs for the quants, 1 otherwise)."""
    if rows.numel() % TILE:
        raise ValueError(f"the kernels take outputs in tiles of {TILE}, got {rows.numel()}")
    nt, kept = out_features // TILE, rows.numel() // TILE
    tiles, lanes = rows // TILE, rows % TILE
    selected = {}
    for name in PACKED_NAMES[kind]:
        inner = 4 if name in ("qs", "qh") else 1
        chosen = tensors[name].reshape(nt, -1, TILE, inner)[tiles, :, lanes]  # [rows, A, B]: one gather
        selected[name] = chosen.reshape(kept, TILE, -1, inner).transpose(1, 2).contiguous().reshape(-1)
    return selected


HALF_BLOCK_BYTES = TILE * SUPER_BLOCK // 4  # a tile's quants of half a Q4_K super-block (4 sub-blocks)


def has_half_tail(in_features: int) -> bool:
    """Whether a Q4_K weight of ``in_features`` inputs is stored without the zero half of its last
    super-block (896 inputs: 3.5 super-blocks, 12.5% fewer bytes to read than padding to 1024)."""
    return padded_size(in_features) - in_features >= SUPER_BLOCK // 2


def drop_half_tail(qs: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """Q4_K quants packed over whole super-blocks ``[N/16 * NB * 2048]`` -> the stored layout: the
    last super-block's zero half left out of every tile when :func:`has_half_tail` (else ``qs``)."""
    nt, nb = out_features // TILE, padded_size(in_features) // SUPER_BLOCK
    if not has_half_tail(in_features) or qs.numel() != nt * nb * 2 * HALF_BLOCK_BYTES:
        return qs
    return qs.reshape(nt, 2 * nb, HALF_BLOCK_BYTES)[:, :-1].reshape(-1).clone()


def _whole_blocks(qs: torch.Tensor, nt: int, nb: int) -> torch.Tensor:
    """Stored Q4_K quants -> whole super-blocks ``[N/16 * NB * 2048]`` (a left-out half as zeros)."""
    if qs.numel() == nt * nb * 2 * HALF_BLOCK_BYTES:
        return qs
    halves = qs.reshape(nt, 2 * nb - 1, HALF_BLOCK_BYTES)
    return torch.cat([halves, halves.new_zeros(nt, 1, HALF_BLOCK_BYTES)], dim=1).reshape(-1)


def packed_bytes(kind: str, out_features: int, in_features: int) -> int:
    """Bytes of a layer's first packed tensor (``qs``, ``w`` for the float kinds): 4 bits a weight
    for Q4_K (less a zero half super-block, :func:`has_half_tail`), 6 for Q6_K and Q3_K, the other
    kinds' in :func:`engine.backends.blocks.stored_bytes`."""
    if kind not in ("q4k", "q6k", "q3k"):
        from engine.backends import blocks
        return blocks.stored_bytes(kind, out_features, in_features)
    if kind == "q4k":
        half_tail = has_half_tail(in_features) * out_features // TILE * HALF_BLOCK_BYTES
        return padded_size(in_features) * out_features // 2 - half_tail
    return padded_size(in_features) * out_features * 6 // 8


def padded_size(in_features: int) -> int:
    """``in_features`` rounded up to whole super-blocks (a 896-wide layer is packed as 1024)."""
    return -(-in_features // SUPER_BLOCK) * SUPER_BLOCK


def _integer_weight(kind: str, t: dict[str, torch.Tensor], n: int, k: int):
    """``(q [N, NB, S, G] int, scale [N, NB, S, 1] float, offset [N, NB, S, 1] float)`` with
    ``w = scale*q - offset`` per sub-block of ``G`` inputs (S sub-blocks a super-block)."""
    nt, nb = n // TILE, k // SUPER_BLOCK
    subs, group = (8, 32) if kind == "q4k" else (16, 16)
    untile = lambda x, *inner: x.reshape(nt, nb, *inner, TILE).movedim(-1, 1).reshape(n, nb, *inner)  # noqa: E731
    d = untile(t["d"]).float()[..., None, None]
    if kind == "q4k":
        raw = _whole_blocks(t["qs"], nt, nb).reshape(nt, nb, 8, 4, TILE, 4).movedim(4, 1).reshape(n, nb, 8, 4, 4)
        q = torch.stack([raw & 0x0F, raw >> 4], dim=-2).reshape(n, nb, subs, group)
        sc, mn = untile(t["sc"], subs).float()[..., None], untile(t["mn"], subs).float()[..., None]
        return q, d * sc, untile(t["dmin"]).float()[..., None, None] * mn
    raw = t["qs"].reshape(nt, nb, 16, 3, 64).int()
    loads = [((raw[..., l // 2, :] >> (4 * (l % 2))) & 0x0F) | (((raw[..., 2, :] >> (2 * l)) & 0x03) << 4)
             for l in range(4)]
    q = torch.stack(loads, dim=3).reshape(nt, nb, 16, 4, TILE, 4).movedim(4, 1).reshape(n, nb, subs, group)
    scale = d * untile(t["sc"], subs).float()[..., None]
    return q, scale, 32 * scale


# ---- the pure-torch reference (the kernel's numbers, bit for bit) ----------------------------

def quantize_activations(x: torch.Tensor, group: int = SUPER_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, K]`` float32 -> ``(xq [R, K] int, sx [R, K/group] float32)``, ``x ~= sx * xq`` per
    group (256: a super-block, the k-quants; 32: the legacy kinds), ``xq = round(x * 127 / max|x|)``
    (half to even), as the kernel does."""
    r, k = x.shape
    blocks = x.reshape(r, k // group, group)
    amax = blocks.abs().amax(-1)
    # one division, as the kernel's 127.f / amax (``127 / amax`` on a tensor is a reciprocal times 127)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    xq = torch.round(torch.clamp(blocks * inv[..., None], -127, 127)).to(torch.int64)
    return xq.reshape(r, k), amax / 127


def reference_linear(kind: str, x: torch.Tensor, tensors: dict[str, torch.Tensor], out_features: int) -> torch.Tensor:
    """``x [..., K] @ W.T`` for a packed weight, bit-identical to the C++ kernel (integer products
    are exact; the float work per super-block is the same IEEE operations in the same order)."""
    rows = x.reshape(-1, x.shape[-1]).float()
    r, k = rows.shape
    if kind not in ("q4k", "q6k", "q3k"):
        from engine.backends import blocks
        return blocks.reference(kind, rows, tensors, out_features, quantize_activations) \
            .reshape(*x.shape[:-1], out_features)
    xq, sx = quantize_activations(rows)
    q, _, _ = _integer_weight(kind, tensors, out_features, k)
    nb, subs, group = q.shape[1], q.shape[2], q.shape[3]
    xg = xq.reshape(r, nb, subs, group).double()
    dots = torch.einsum("nbsg,rbsg->rnbs", q.double(), xg).round().long()  # exact: |dot| < 2^53
    sums = xq.reshape(r, nb, subs, group).sum(-1)  # [r, nb, subs]
    tile = lambda name, *inner: tensors[name].reshape(out_features // TILE, nb, *inner, TILE).movedim(-1, 1) \
        .reshape(out_features, nb, *inner)  # noqa: E731
    d = tile("d").float()
    if kind == "q4k":
        a = (tile("sc", subs).long()[None] * dots).sum(-1)
        b = (tile("mn", subs).long()[None] * sums[:, None]).sum(-1)
        dmin = tile("dmin").float()
    else:
        a = (tile("sc", subs).long()[None] * (dots - 32 * sums[:, None])).sum(-1)
    y = torch.zeros(r, out_features)
    for blk in range(nb):
        step = (sx[:, blk, None] * d[None, :, blk]) * a[:, :, blk].float()
        if kind == "q4k":
            step = step - (sx[:, blk, None] * dmin[None, :, blk]) * b[:, :, blk].float()
        y = y + step
    return y.reshape(*x.shape[:-1], out_features)


# ---- modules -----------------------------------------------------------------------------------

PACKED_NAMES = {
    "q4k": ("qs", "sc", "mn", "d", "dmin"), "q6k": ("qs", "sc", "d"), "q3k": ("qs", "sc", "d"),
    "q5k": ("qs", "qh", "sc", "mn", "d", "dmin"), "q2k": ("qs", "sc", "mn", "d", "dmin"),
    "q8_0": ("qs", "d"), "q4_0": ("qs", "d"), "q4_1": ("qs", "d", "m"), "q5_0": ("qs", "qh", "d"),
    "q5_1": ("qs", "qh", "d", "m"), "f32": ("w",), "f16": ("w",), "bf16": ("w",),
}  # engine/backends/blocks.py describes the kinds past q4k and q6k


class KQuantLinear(torch.nn.Module):
    """``y = x @ W.T + b`` with ``W [out, in]`` kept as a GGUF type's own integers and scales (Q4_K,
    Q6_K: see the module docstring; every other kind: :mod:`engine.backends.blocks`). ``forward``: ``x [..., in]`` float32 -> ``[..., out]`` float32; every row is
    independent of the other rows of ``x``."""

    def __init__(self, kind: str, tensors: dict[str, torch.Tensor], in_features: int, out_features: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if kind not in PACKED_NAMES:
            raise ValueError(f"unknown k-quant kind {kind!r}")
        if out_features % TILE:
            raise ValueError(f"the kernels take outputs in multiples of {TILE}, got {out_features}")
        self.kind, self.in_features, self.out_features = kind, in_features, out_features
        self.padded_in = padded_size(in_features)  # the packed weight's inputs: zeros past in_features
        if kind == "q4k":
            tensors = {**tensors, "qs": drop_half_tail(tensors["qs"], out_features, in_features)}
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)

    def packed(self) -> dict[str, torch.Tensor]:
        return {name: self._buffers[name] for name in PACKED_NAMES[self.kind]}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ext = compiled_kernels()
        buffers = self._buffers  # read directly: nn.Module's attribute lookup is most of a small layer's Python cost
        x = x.float()
        if self.padded_in != self.in_features:  # zero inputs leave each super-block's scale and sums as they are
            x = torch.nn.functional.pad(x, (0, self.padded_in - self.in_features))
        if ext is None:
            out = reference_linear(self.kind, x, self.packed(), self.out_features)
        else:
            out = ext.block_linear(x, self.kind, [buffers[name] for name in PACKED_NAMES[self.kind]], self.out_features)
        bias = self._parameters.get("bias")
        return out if bias is None else out.add_(bias)

    def extra_repr(self) -> str:
        return f"{self.kind}, in_features={self.in_features}, out_features={self.out_features}"


class FixedSiLU(torch.nn.Module):
    """The k-quant models' MLP activation: SiLU through the kernels' ``silu`` (``fixed_exp.h``), whose
    every element depends on nothing but itself. ATen's ``silu`` computes whole vectors with Sleef
    and each parallel chunk's tail with libm, and the chunk edges move with the thread count and
    the number of rows: a verification row would then differ from the same token decoded alone.
    The lean forward computes the same function, so both forwards keep the same bits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ext = compiled_kernels()
        if ext is None or x.dtype != torch.float32 or x.device.type != "cpu":
            return torch.nn.functional.silu(x)
        return ext.silu(x)


class FixedGELU(torch.nn.Module):
    """Gemma's MLP activation (GELU, tanh approximation) through the kernels' ``gelu_tanh``
    (``fixed_exp.h``): each element's bits depend on nothing but itself, as :class:`FixedSiLU`'s,
    and the lean forward computes the same function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ext = compiled_kernels()
        if ext is None or x.dtype != torch.float32 or x.device.type != "cpu":
            return torch.nn.functional.gelu(x, approximate="tanh")
        return ext.gelu_tanh(x)


FIXED_ACTIVATIONS = {"silu": FixedSiLU, "gelu_pytorch_tanh": FixedGELU}


def activation_name(config) -> str | None:
    """The gated MLP's activation as the config names it (Gemma's ``hidden_activation``, else ``hidden_act``)."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)


def use_fixed_activation(model: torch.nn.Module) -> None:
    """Give every gated MLP of ``model`` the kernels' fixed version of its activation (SiLU: :class:`FixedSiLU`,
    GELU-tanh: :class:`FixedGELU`); other activations stay the model's own."""
    fixed = FIXED_ACTIVATIONS.get(activation_name(getattr(model, "config", None)))
    if fixed is None:
        return
    for module in model.modules():
        if hasattr(module, "gate_proj") and isinstance(getattr(module, "act_fn", None), torch.nn.Module):
            module.act_fn = fixed()


def kquant_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs):
    """Attention for Hugging Face models (registered as ``"kquant"``): ``query [1, H, R, D]``,
    ``key/value [1, KVH, L, D]``, mask ``[1, 1, R, L]`` (bool: True attends; float: additive) or
    None (causal). Returns ``([1, R, H, D], None)``; each row is computed alone, in a fixed order."""
    ext = compiled_kernels()
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if ext is None or query.shape[0] != 1 or query.dtype != torch.float32 or query.shape[-1] % 16:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    r, l = query.shape[2], key.shape[2]
    if attention_mask is None:
        mask = torch.empty(0)
    else:
        mask = attention_mask[0, 0, :, -l:] if attention_mask.shape[-1] >= l else attention_mask[0, 0]
        mask = torch.where(mask, 0.0, float("-inf")) if mask.dtype == torch.bool else mask.float()
        mask = mask.expand(r, l).contiguous()
    out = ext.attention(query[0].contiguous(), key[0], value[0], mask, float(scaling))
    return out[None], None


def register_attention() -> None:
    """Make ``"kquant"`` an attention implementation Hugging Face models can be switched to."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, kquant_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
