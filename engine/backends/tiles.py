"""The kernels' tile layout of GGUF's Q4_K and Q6_K blocks: 16 outputs side by side, so that one
vector load gives a tile's weights for a few inputs (``engine/kernels/csrc/kquant.cpp`` documents
the layouts). :mod:`engine.backends.kquant` (the layers) and :mod:`engine.backends.blocks` (the other
block types, some of which reuse these tiles) both pack through these functions.
"""
from __future__ import annotations

import numpy as np
import torch

SUPER_BLOCK = 256
TILE = 16


def _tiles(per_output: np.ndarray) -> np.ndarray:
    """``[N, NB, ...] -> [N/16, NB, ..., 16]``: the 16 outputs of a tile become the last axis."""
    n, nb = per_output.shape[:2]
    tiled = per_output.reshape(n // TILE, TILE, nb, *per_output.shape[2:])
    return np.moveaxis(tiled, 1, -1)


def pack_q4k(blocks: np.ndarray) -> dict[str, torch.Tensor]:
    """GGUF Q4_K blocks ``[N, K/256, 144]`` (uint8) -> the kernel's tensors (exact)."""
    from gguf.quants import Q4_K

    n, nb, _ = blocks.shape
    flat = blocks.reshape(n * nb, -1)
    d = flat[:, 0:2].copy().view(np.float16).reshape(n, nb)
    dmin = flat[:, 2:4].copy().view(np.float16).reshape(n, nb)
    sc, mn = Q4_K.get_scale_min(flat[:, 4:16].copy())
    qs = flat[:, 16:].reshape(n * nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(n, nb, SUPER_BLOCK)
    return _tile_q4k(q, sc.reshape(n, nb, 8), mn.reshape(n, nb, 8), d, dmin)


def _tile_q4k(q: np.ndarray, sc: np.ndarray, mn: np.ndarray, d: np.ndarray, dmin: np.ndarray) -> dict[str, torch.Tensor]:
    """``q [N, NB, 256]`` (0..15), ``sc, mn [N, NB, 8]`` (0..63), ``d, dmin [N, NB]`` (fp16 values) -> tiles."""
    n, nb = q.shape[:2]
    if n % TILE:
        raise ValueError(f"the Q4_K kernel needs outputs in multiples of {TILE}, got {n}")
    q = q.reshape(n, nb, 8, 4, 2, 4)  # [out, block, sub-block j, load l, nibble, i]
    nibbles = (q[..., 0, :] | (q[..., 1, :] << 4)).astype(np.uint8)  # [n, nb, 8, 4, 4]
    packed = np.moveaxis(_tiles(nibbles), -1, -2)  # [NT, nb, 8, 4, 16 outputs, 4 inputs]
    as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a)).reshape(-1)  # noqa: E731
    return {"qs": as_tensor(packed), "sc": as_tensor(_tiles(sc.astype(np.uint8))),
            "mn": as_tensor(_tiles(mn.astype(np.uint8))), "d": as_tensor(_tiles(d.astype(np.float16))),
            "dmin": as_tensor(_tiles(dmin.astype(np.float16)))}


def pack_q6k(blocks: np.ndarray) -> dict[str, torch.Tensor]:
    """GGUF Q6_K blocks ``[N, K/256, 210]`` (uint8) -> the kernel's tensors (exact)."""
    n, nb, _ = blocks.shape
    if n % TILE:
        raise ValueError(f"Q6_K kernel needs outputs in multiples of {TILE}, got {n}")
    flat = blocks.reshape(n * nb, -1)
    ql, qh = flat[:, :128], flat[:, 128:192]
    sc = flat[:, 192:208].copy().view(np.int8).reshape(n, nb, 16)
    d = flat[:, 208:210].copy().view(np.float16).reshape(n, nb)
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    return _tile_q6k((low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << 4)).reshape(n, nb, 256), sc, d)


def _tile_q6k(q: np.ndarray, sc: np.ndarray, d: np.ndarray) -> dict[str, torch.Tensor]:
    """``q [N, NB, 256]`` (0..63, inputs in order), ``sc [N, NB, 16]`` int8, ``d [N, NB]`` fp16 -> tiles."""
    n, nb = q.shape[:2]
    if n % TILE:
        raise ValueError(f"Q6_K kernel needs outputs in multiples of {TILE}, got {n}")
    q = q.reshape(n, nb, 16, 4, 4)
    per_load = np.moveaxis(_tiles(q.astype(np.uint8)), -1, -2).reshape(n // TILE, nb, 16, 4, 64)  # 16 outputs x 4 inputs
    nibbles = (per_load & 0x0F)[..., 0::2, :] | ((per_load & 0x0F)[..., 1::2, :] << 4)  # loads 0|1, 2|3
    highs = sum(((per_load[..., l, :] >> 4) & 0x03) << (2 * l) for l in range(4)).astype(np.uint8)
    packed = np.concatenate([nibbles, highs[..., None, :]], axis=-2)  # [NT, nb, 16, 3, 64]
    return {
        "qs": torch.from_numpy(np.ascontiguousarray(packed)).reshape(-1),
        "sc": torch.from_numpy(np.ascontiguousarray(_tiles(sc))).reshape(-1),
        "d": torch.from_numpy(np.ascontiguousarray(_tiles(d))).reshape(-1),
    }
