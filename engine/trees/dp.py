"""Sequoia's dynamic program: the tree of n nodes and depth <= d maximising expected tokens/step.

Under positional acceptance ``p = [p_1, ..., p_K]`` (the k-th ranked child is accepted with
probability p_k), a tree's expected tokens per step is the sum over nodes of the product of
p_rank along the root path (root = 1, the bonus token). With
``T[m, l, b]`` = best value of an m-node tree of at most l levels whose root has b children:

    T[1, l, 0] = 1
    T[m, l, b] = max_{1 <= y < m}  T[y, l, b-1] + p_b * max_b' T[m-y, l-1, b']

(the b-th child gets a subtree of m-y nodes). ``G(n, d) = max_b T[n, d+1, b]``. For fixed
(l, b) the max over y is a (max, +) convolution, computed for all m at once as an
``[m, y]`` matrix, so the whole table costs O(d * K) tensor operations of size n^2.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

NEG = float("-inf")


@dataclass
class DPTable:
    """Values and back-pointers of the dynamic program.

    ``best[m, l]``: best value with m nodes and at most l levels (-inf if impossible);
    ``best_b[m, l]``: the root's child count achieving it; ``split[m, l, b]``: the y of the
    recurrence (nodes kept for the first b-1 children and the root).
    """

    acceptance: torch.Tensor  # [K] float64
    best: torch.Tensor        # [N+1, L+1] float64
    best_b: torch.Tensor      # [N+1, L+1] int64
    split: torch.Tensor       # [N+1, L+1, K+1] int64


def check_acceptance(acceptance) -> torch.Tensor:
    """Validate ``[p_1..p_K]``: finite, each in [0, 1], sum <= 1 (+ rounding)."""
    p = torch.as_tensor(acceptance, dtype=torch.float64).flatten()
    if p.numel() == 0 or not torch.isfinite(p).all() or (p < 0).any() or (p > 1).any() or p.sum() > 1 + 1e-6:
        raise ValueError("acceptance must be a non-empty list of probabilities p_1..p_K with sum <= 1")
    return p


def solve(acceptance, max_size: int, max_depth: int) -> DPTable:
    """Fill the DP for all sizes 0..max_size and depths 0..max_depth.

    The table is filled with numpy, on the calling thread alone: the app calls this from its UI
    threads, and a torch op that large there would start an OpenMP team of that thread's own. With
    more OpenMP threads alive than cores, libgomp makes every waiting thread sleep almost at once,
    the engine's too: in the app that cost the decoding threads thousands of sleeps a second.
    """
    p = check_acceptance(acceptance).numpy()
    k_max = min(p.size, max(max_size - 1, 0))
    n, levels = max_size, max_depth + 1
    best = np.full((n + 1, levels + 1), NEG)
    best_b = np.zeros((n + 1, levels + 1), dtype=np.int64)
    split = np.zeros((n + 1, levels + 1, k_max + 1), dtype=np.int64)
    if n >= 1:
        best[1, 1:] = 1.0
    m_idx = np.arange(n + 1)[:, None]
    y_idx = np.arange(n + 1)[None, :]
    valid = (y_idx >= 1) & (y_idx < m_idx)
    gather = np.clip(m_idx - y_idx, 0, None)
    rows = np.arange(n + 1)
    for level in range(2, levels + 1):
        # subtree[m, y] = best value of the (m - y)-node subtree one level down; its -inf cells
        # (and y outside 1..m-1) go into an additive mask so p_b = 0 never makes 0 * -inf.
        subtree = best[:, level - 1][gather]
        mask = np.where(~valid | np.isinf(subtree), NEG, 0.0)
        subtree = np.where(np.isinf(subtree), 0.0, subtree)
        previous = np.full(n + 1, NEG)  # T[., level, b - 1], from b = 0
        if n >= 1:
            previous[1] = 1.0
        level_best, level_b = previous.copy(), np.zeros(n + 1, dtype=np.int64)
        for b in range(1, k_max + 1):
            candidates = (mask + previous[None, :]) + float(p[b - 1]) * subtree  # [m, y]
            arg = candidates.argmax(axis=1)  # the first maximum, as torch.max(dim=1) gives
            current = candidates[rows, arg]
            split[:, level, b] = arg
            improved = current > level_best
            level_best = np.where(improved, current, level_best)
            level_b[improved] = b
            previous = current
        best[:, level], best_b[:, level] = level_best, level_b
    return DPTable(torch.from_numpy(p), torch.from_numpy(best), torch.from_numpy(best_b), torch.from_numpy(split))


def expected_tokens_table(acceptance, max_size: int, max_depth: int) -> torch.Tensor:
    """``G[n, d]`` for n = 0..max_size, d = 0..max_depth (float64, -inf where no tree fits)."""
    return solve(acceptance, max_size, max_depth).best[:, 1:].clone()


def optimal_parents(table: DPTable, size: int, depth: int) -> list[int]:
    """Parent array (pre-order numbering) of the optimal tree with ``size`` nodes, depth <= ``depth``."""
    if not (1 <= size < table.best.shape[0] and 0 <= depth <= table.best.shape[1] - 2):
        raise ValueError(f"size {size} / depth {depth} outside the solved table")
    if table.best[size, depth + 1] == NEG:
        raise ValueError(f"no tree of {size} nodes fits in depth {depth} with {table.acceptance.numel()} ranks")
    parents: list[int] = []

    def build(m: int, levels: int, parent: int) -> None:
        node = len(parents)
        parents.append(parent)
        b = int(table.best_b[m, levels])
        # Peel children from the last rank down: child b gets m - y nodes, the rest keeps y.
        subtrees = []
        while b > 0:
            y = int(table.split[m, levels, b])
            subtrees.append(m - y)
            m, b = y, b - 1
        for child_size in reversed(subtrees):
            build(child_size, levels - 1, node)

    build(size, depth + 1, -1)
    return parents


def expected_tokens(parents: list[int] | tuple[int, ...], ranks: list[int] | tuple[int, ...], acceptance) -> float:
    """F(tree): sum over nodes of the product of p_rank on the root path (root contributes 1)."""
    p = check_acceptance(acceptance).tolist()
    reach = [1.0] * len(parents)
    for i in range(1, len(parents)):
        rank = ranks[i]
        reach[i] = reach[parents[i]] * (p[rank - 1] if rank <= len(p) else 0.0)
    return float(sum(reach))
