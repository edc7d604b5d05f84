"""Every GGUF block type llama-quantize writes, packed *as stored* for the batch-invariant kernels.

:func:`pack_blocks` turns a GGUF matrix's raw blocks into one of the kernels' kinds, keeping the
file's own integers and scales exactly (no re-quantisation); :func:`unpack` and :func:`reference`
are the pure-torch weight and product of the kinds added here (``engine.backends.kquant`` holds the
Q4_K and Q6_K ones and dispatches). Layouts, per tile of 16 outputs (``o``), all tile-major:

* legacy ``q8_0 q4_0 q4_1 q5_0 q5_1`` (groups of 32 inputs, fp16 ``d`` and, for ``_1``, ``m``; only
  the ``G = in/32`` stored groups are kept, no padding to 256): ``d, m [NT, G, 16]`` fp16;
  ``qs`` int8 ``[NT, G, 8, 16, 4]`` for q8_0 (vector k holds inputs 4k..4k+3), or nibbles
  ``[NT, G, 4, 16, 4]`` for the 4/5-bit ones (load l: inputs 8l+i low, 8l+4+i high, as Q4_K);
  ``qh [NT, G, 16, 4]`` for the 5-bit ones: bit l of byte (o, i) is input 8l+i's fifth bit, bit
  4+l input 8l+4+i's. ``w = d*(q - c)`` (c = 8, 16, 0) or ``w = d*q + m``.
* ``q5k``: Q4_K's tensors (``qs, sc, mn, d, dmin``) plus ``qh [NT, NB, 8, 16, 4]`` (the legacy plane
  per sub-block of 32). ``w = d*sc*q - dmin*mn``, q in 0..31.
* ``q2k``: ``qs [NT, NB, 16, 16, 4]`` (bits 2l, 2l+1 of byte (o, i) of sub-block j: input 16j+4l+i),
  ``sc, mn [NT, NB, 16, 16]`` uint8 (4-bit), ``d, dmin [NT, NB, 16]`` fp16. ``w = d*sc*q - dmin*mn``.
* ``q3k``: Q6_K's form exactly: ``w = d*sc*(q-32)`` with ``sc = sc6 - 32`` and ``q = q3 + 32``.
* ``f32 f16 bf16``: ``w [NT, in, 16]`` in the stored float type (the model's width, no padding).
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from engine.backends.tiles import SUPER_BLOCK, TILE, _tile_q4k, _tile_q6k, _tiles, pack_q4k, pack_q6k

GROUP = 32  # inputs of a legacy block

SERVED_TYPES: frozenset[T] = frozenset({
    T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K})
LEGACY = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
FLOATS = ("f32", "f16", "bf16")
OFFSET = {"q8_0": 0, "q4_0": 8, "q4_1": 0, "q5_0": 16, "q5_1": 0}  # w = d*(q - c) (+ m for _1)


class UnsupportedBlockType(ValueError):
    """A GGUF block type no kernel serves as stored (IQ*, TQ*, MXFP4, ...)."""


def _tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).reshape(-1)


def _half(b: np.ndarray) -> np.ndarray:
    """``[..., 2]`` uint8 -> ``[...]`` fp16."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _tile_inputs4(per_output: np.ndarray) -> np.ndarray:
    """``[N, A, ..., 4]`` -> ``[NT, A, ..., 16 outputs, 4]``."""
    return np.moveaxis(_tiles(per_output), -1, -2)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """``q [N, A, 32]`` (0..15) -> ``[NT, A, 4, 16, 4]``: load l, byte (o, i): inputs 8l+i | 8l+4+i << 4."""
    q = q.reshape(*q.shape[:-1], 4, 2, 4)
    return _tile_inputs4((q[..., 0, :] | (q[..., 1, :] << 4)).astype(np.uint8))


def _plane(high: np.ndarray) -> np.ndarray:
    """``high [N, A, 32]`` (0/1) -> ``[NT, A, 16, 4]``: bit 4h+l of byte (o, i) is input 8l+4h+i."""
    h = high.reshape(*high.shape[:-1], 4, 2, 4).astype(np.uint8)  # [..., l, h, i]
    bits = sum(h[..., l, half, :] << (4 * half + l) for l in range(4) for half in range(2))
    return _tile_inputs4(bits.astype(np.uint8))


def _check_outputs(n: int) -> None:
    if n % TILE:
        raise ValueError(f"the kernels need outputs in multiples of {TILE}, got {n}")


# ---- packing -------------------------------------------------------------------------------

def _pack_legacy(kind: str, blocks: np.ndarray) -> dict[str, torch.Tensor]:
    """``blocks [N, G, bytes]`` of a legacy type -> its tensors."""
    n, g = blocks.shape[:2]
    d = _half(blocks[..., 0:2])
    out = {"d": _tensor(_tiles(d))}
    at = 2
    if kind in ("q4_1", "q5_1"):
        out["m"] = _tensor(_tiles(_half(blocks[..., 2:4])))
        at = 4
    if kind == "q8_0":
        q = blocks[..., 2:34].view(np.int8).reshape(n, g, 8, 4)
        return {"qs": _tensor(_tile_inputs4(q)), **out}
    high = None
    if kind in ("q5_0", "q5_1"):
        qh = np.ascontiguousarray(blocks[..., at:at + 4]).view("<u4")  # [n, g, 1]
        high = (qh >> np.arange(32, dtype=np.uint32)) & 1  # [n, g, 32]
        at += 4
    qs = blocks[..., at:at + 16]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # inputs 0..15 low nibbles, 16..31 high
    packed = {"qs": _tensor(_nibbles(low))}
    if high is not None:
        packed["qh"] = _tensor(_plane(high))
    return {**packed, **out}


def _pack_q5k(blocks: np.ndarray) -> dict[str, torch.Tensor]:
    """Q5_K ``[N, NB, 176]`` -> Q4_K's tensors of the low nibbles plus the fifth-bit plane."""
    n, nb, _ = blocks.shape
    as_q4k = np.concatenate([blocks[..., :16], blocks[..., 48:]], axis=-1)  # d, dmin, scales, ql
    packed = pack_q4k(as_q4k)
    qh = blocks[..., 16:48].reshape(n, nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    return {**packed, "qh": _tensor(_plane(qh & 1))}


def _pack_q2k(blocks: np.ndarray) -> dict[str, torch.Tensor]:
    """Q2_K ``[N, NB, 84]`` -> 2-bit quants, 4-bit scales and mins as bytes, fp16 d and dmin."""
    n, nb, _ = blocks.shape
    scales, qs = blocks[..., :16], blocks[..., 16:80]
    q = (qs.reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3
    q = q.reshape(n, nb, 16, 4, 4)  # [sub-block j, l, i]: input 16j + 4l + i
    bits = sum(q[..., l, :] << (2 * l) for l in range(4)).astype(np.uint8)
    return {"qs": _tensor(_tile_inputs4(bits)), "sc": _tensor(_tiles(scales & 0x0F)),
            "mn": _tensor(_tiles(scales >> 4)), "d": _tensor(_tiles(_half(blocks[..., 80:82]))),
            "dmin": _tensor(_tiles(_half(blocks[..., 82:84])))}


def _pack_q3k(blocks: np.ndarray) -> dict[str, torch.Tensor]:
    """Q3_K ``[N, NB, 110]`` -> Q6_K's form: ``sc = sc6 - 32`` (int8), ``q = q3 + 32`` (28..35)."""
    n, nb, _ = blocks.shape
    hmask, qs, scales = blocks[..., :32], blocks[..., 32:96], blocks[..., 96:108]
    low = (scales[..., :8, None] >> np.array([0, 4], dtype=np.uint8)).swapaxes(-1, -2).reshape(n, nb, 16) & 0x0F
    high = (scales[..., 8:12, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)).swapaxes(-1, -2).reshape(n, nb, 16) & 3
    sc = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
    ql = (qs.reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3
    hb = (hmask.reshape(n, nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    q = ql.reshape(n, nb, 256).astype(np.int16) - 4 * (1 - hb.reshape(n, nb, 256).astype(np.int16))
    return _tile_q6k((q + 32).astype(np.uint8), sc, _half(blocks[..., 108:110]))


def _pack_float_values(w: np.ndarray, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``w [N, K]`` (any float or raw 16-bit type) -> ``{"w": [NT, K, 16]}`` of ``dtype``."""
    n, k = w.shape
    _check_outputs(n)
    tiled = np.ascontiguousarray(w.reshape(n // TILE, TILE, k).swapaxes(1, 2))
    return {"w": torch.from_numpy(tiled).reshape(-1).view(dtype)}


_K_TYPES = {T.Q2_K: ("q2k", 84, _pack_q2k), T.Q3_K: ("q3k", 110, _pack_q3k), T.Q4_K: ("q4k", 144, pack_q4k),
            T.Q5_K: ("q5k", 176, _pack_q5k), T.Q6_K: ("q6k", 210, pack_q6k)}
_LEGACY_TYPES = {T.Q8_0: ("q8_0", 34), T.Q4_0: ("q4_0", 18), T.Q4_1: ("q4_1", 20), T.Q5_0: ("q5_0", 22),
                 T.Q5_1: ("q5_1", 24)}


# Raw bytes of blocks packed at a time: numpy's temporaries (unpacked quants, shifted copies) take
# several times the blocks they come from, so a whole 152,064-row output matrix (447 MB of Q6_K)
# packed at once peaked at about 3 GB above the packed result; packed in row chunks they take a
# few times this (the tiles of 16 rows are independent: the same bytes either way).
PACK_CHUNK_BYTES = 4 << 20


def pack_blocks(qtype: T, blocks: np.ndarray, cols: int) -> tuple[str, dict[str, torch.Tensor]]:
    """``(kind, tensors)`` serving the GGUF matrix ``blocks [rows, row_bytes]`` (uint8) of ``cols``
    inputs exactly as stored. Raises :class:`UnsupportedBlockType` for a type without a kernel
    and ValueError when the rows are not a multiple of 16.

    Every layout is tile-major (its tensors ``[rows / 16, ...]``), so the rows are packed a chunk of
    whole tiles at a time (:data:`PACK_CHUNK_BYTES`) straight into the result's tensors: the
    temporaries stay tens of megabytes whatever the matrix, the result the same bytes."""
    rows = blocks.shape[0]
    _check_outputs(rows)
    step = max(TILE, PACK_CHUNK_BYTES // max(1, blocks.shape[1]) // TILE * TILE)
    if rows <= step:
        return _pack_rows(qtype, blocks, cols)
    kind, first = _pack_rows(qtype, blocks[:step], cols)
    tiles, first_tiles = rows // TILE, step // TILE
    packed = {name: torch.empty(t.numel() // first_tiles * tiles, dtype=t.dtype) for name, t in first.items()}
    for start in range(0, rows, step):
        part = first if start == 0 else _pack_rows(qtype, blocks[start:start + step], cols)[1]
        for name, t in part.items():
            at = start // TILE * (packed[name].numel() // tiles)
            packed[name][at:at + t.numel()] = t
    return kind, packed


def _pack_rows(qtype: T, blocks: np.ndarray, cols: int) -> tuple[str, dict[str, torch.Tensor]]:
    """:func:`pack_blocks` of ``blocks`` in one go (their rows a multiple of 16)."""
    rows = blocks.shape[0]
    if qtype in _K_TYPES:
        kind, size, pack = _K_TYPES[qtype]
        return kind, pack(blocks.reshape(rows, cols // SUPER_BLOCK, size))
    if qtype in _LEGACY_TYPES:
        kind, size = _LEGACY_TYPES[qtype]
        return kind, _pack_legacy(kind, blocks.reshape(rows, cols // GROUP, size))
    if qtype == T.F32:
        return "f32", _pack_float_values(blocks.view(np.float32).reshape(rows, cols), torch.float32)
    if qtype in (T.F16, T.BF16):
        kind, dtype = ("f16", torch.float16) if qtype == T.F16 else ("bf16", torch.bfloat16)
        return kind, _pack_float_values(blocks.view(np.int16).reshape(rows, cols), dtype)
    raise UnsupportedBlockType(f"no kernel serves GGUF type {T(qtype).name}")


def pack_float(weight: torch.Tensor) -> tuple[str, dict[str, torch.Tensor]]:
    """``("f32", tensors)`` for a float ``weight [N, K]``: an explicitly requested dequantised fallback."""
    return "f32", _pack_float_values(weight.detach().float().contiguous().numpy(), torch.float32)


# ---- sizes, unpacking and the pure-torch reference of these kinds ------------------------------

ELEMENT = {"f32": 4, "f16": 2, "bf16": 2}


def stored_bytes(kind: str, n: int, k: int) -> int:
    """Bytes of the first packed tensor (``qs`` or ``w``) of an ``n x k`` weight of a kind here."""
    per_weight = {"q8_0": 8, "q4_0": 4, "q4_1": 4, "q5_0": 4, "q5_1": 4, "q5k": 4, "q2k": 2}
    if kind in FLOATS:
        return n * k * ELEMENT[kind]
    width = -(-k // GROUP) * GROUP if kind in LEGACY else -(-k // SUPER_BLOCK) * SUPER_BLOCK
    return n * width * per_weight[kind] // 8


def _untile(t: torch.Tensor, n: int, *inner: int) -> torch.Tensor:
    """``[NT, A, *inner, 16]`` (flat) -> ``[N, A, *inner]``."""
    x = t.reshape(n // TILE, -1, *inner, TILE)
    return x.movedim(-1, 1).reshape(n, -1, *inner)


def _untile4(t: torch.Tensor, n: int, *inner: int) -> torch.Tensor:
    """``[NT, A, *inner, 16, 4]`` (flat) -> ``[N, A, *inner, 4]``."""
    x = t.reshape(n // TILE, -1, *inner, TILE, 4)
    return x.movedim(-2, 1).reshape(n, -1, *inner, 4)


def _from_nibbles(qs: torch.Tensor, n: int) -> torch.Tensor:
    """``[NT, A, 4, 16, 4]`` -> ``q [N, A, 32]`` int32 (0..15), inputs in order."""
    raw = _untile4(qs, n, 4).int()  # [n, A, l, i]
    return torch.stack([raw & 0x0F, raw >> 4], dim=-2).reshape(n, -1, 32)


def _from_plane(qh: torch.Tensor, n: int) -> torch.Tensor:
    """``[NT, A, 16, 4]`` -> ``[N, A, 32]`` fifth bits (0/1), inputs in order."""
    raw = _untile4(qh, n).int()[..., None, None, :]  # [n, A, 1, 1, i]
    shift = (torch.arange(2).reshape(1, 2, 1) * 4 + torch.arange(4).reshape(4, 1, 1))  # [l, h, 1]
    return ((raw >> shift) & 1).reshape(n, -1, 32)


def integer_quants(kind: str, t: dict[str, torch.Tensor], n: int) -> torch.Tensor:
    """The stored integers ``q [N, A, S]`` int32 per scale group (legacy: A = G groups of 32, q in
    the stored range, q8_0 signed; q5k: A = NB*8 groups of 32; q2k: A = NB*16 groups of 16)."""
    if kind == "q8_0":
        return _untile4(t["qs"], n, 8).int().reshape(n, -1, 32)
    if kind == "q2k":
        raw = _untile4(t["qs"], n, 16).int()[..., None, :]  # [n, nb, j, 1, i]
        return ((raw >> (2 * torch.arange(4).reshape(4, 1))) & 3).reshape(n, -1, 16)
    q = _from_nibbles(t["qs"], n)
    return q | (_from_plane(t["qh"], n) << 4) if "qh" in t else q


def _pad_to(w: torch.Tensor, k: int) -> torch.Tensor:
    return torch.nn.functional.pad(w, (0, k - w.shape[1])) if k > w.shape[1] else w[:, :k]


def unpack(kind: str, t: dict[str, torch.Tensor], n: int, k: int) -> torch.Tensor:
    """The float32 weight ``[n, k]`` of a kind here, by GGUF's own formula (zeros past the stored inputs)."""
    if kind in FLOATS:
        return _pad_to(_untile(t["w"], n).float(), k)
    q = integer_quants(kind, t, n).float()
    if kind in LEGACY:
        d = _untile(t["d"], n).float()[..., None]
        if kind in ("q4_1", "q5_1"):
            w = d * q + _untile(t["m"], n).float()[..., None]
        else:
            w = d * (q - OFFSET[kind]) if OFFSET[kind] else q * d
        return _pad_to(w.reshape(n, -1), k)
    subs = 8 if kind == "q5k" else 16
    d, dmin = _untile(t["d"], n).float()[..., None], _untile(t["dmin"], n).float()[..., None]
    scale = (d * _untile(t["sc"], n, subs).float()).reshape(n, -1, 1)
    offset = (dmin * _untile(t["mn"], n, subs).float()).reshape(n, -1, 1)
    return _pad_to((scale * q - offset).reshape(n, -1), k)


def reference(kind: str, rows: torch.Tensor, t: dict[str, torch.Tensor], n: int,
              quantize_activations) -> torch.Tensor:
    """``rows [R, K] @ W.T`` for a kind here, bit-identical to the kernels: floats in input order
    (mul then add); integer kinds with int8 activations, one float step per scale group (legacy,
    its activations quantised per group of 32 too) or per super-block (q5k, q2k), as the C++ does."""
    r, k = rows.shape
    if kind in FLOATS:
        w = _untile(t["w"], n).float()  # [n, kf]
        y = torch.zeros(r, n)
        for i in range(w.shape[1]):
            y = y + rows[:, i, None] * w[None, :, i]
        return y
    xq, sx = quantize_activations(rows, GROUP if kind in LEGACY else SUPER_BLOCK)
    q = integer_quants(kind, t, n).double()  # [n, A, S]
    groups, size = q.shape[1], q.shape[2]
    xg = xq[:, :groups * size].reshape(r, groups, size)
    dots = torch.einsum("nas,ras->rna", q, xg.double()).round().long()  # exact
    sums = xg.sum(-1)  # [r, A]
    if kind in LEGACY:
        d = _untile(t["d"], n).float()
        m = _untile(t["m"], n).float() if "m" in t else None
        a = (dots - OFFSET[kind] * sums[:, None]).float()
        y = torch.zeros(r, n)
        for g in range(groups):
            s = sx[:, g, None]
            step = (s * d[None, :, g]) * a[:, :, g]
            if m is not None:
                step = step + (s * m[None, :, g]) * sums[:, None, g].float()
            y = y + step
        return y
    subs = 8 if kind == "q5k" else 16
    nb = groups // subs
    sc, mn = _untile(t["sc"], n, subs).long(), _untile(t["mn"], n, subs).long()  # [n, nb, subs]
    a = (sc[None] * dots.reshape(r, n, nb, subs)).sum(-1)
    b = (mn[None] * sums.reshape(r, 1, nb, subs)).sum(-1)
    d, dmin = _untile(t["d"], n).float(), _untile(t["dmin"], n).float()
    y = torch.zeros(r, n)
    for blk in range(nb):
        step = (sx[:, blk, None] * d[None, :, blk]) * a[:, :, blk].float()
        y = y + (step - (sx[:, blk, None] * dmin[None, :, blk]) * b[:, :, blk].float())
    return y
