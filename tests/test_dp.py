"""Sequoia's dynamic program against brute force over every ordered tree up to 8 nodes."""
from __future__ import annotations

import functools

import pytest
import torch

from engine.errors import InvalidTreeError
from engine.trees.tree import Tree, expected_tokens_table


@functools.lru_cache(maxsize=None)
def plane_trees(n: int) -> tuple[tuple[int, ...], ...]:
    """All ordered rooted trees with n nodes, as pre-order parent arrays."""
    if n == 1:
        return ((-1,),)
    out = []
    for forest in _forests(n - 1):
        parents = [-1]
        for subtree in forest:
            offset = len(parents)
            parents += [0 if p == -1 else p + offset for p in subtree]
        out.append(tuple(parents))
    return tuple(out)


def _forests(n: int) -> list[list[tuple[int, ...]]]:
    if n == 0:
        return [[]]
    return [[first] + rest for k in range(1, n + 1) for first in plane_trees(k) for rest in _forests(n - k)]


def brute_force(acceptance, n: int, d: int) -> float:
    best = float("-inf")
    for parents in plane_trees(n):
        tree = Tree.from_parents(parents)
        if tree.depth <= d and max(len(c) for c in tree.children) <= len(acceptance):
            best = max(best, tree.expected_tokens(acceptance))
    return best


def random_acceptance(k: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    raw = torch.rand(k + 1, generator=g, dtype=torch.float64)
    return (raw[:k] / raw.sum()).sort(descending=True).values.tolist()


def test_plane_tree_enumeration_counts_catalan_numbers():
    assert [len(plane_trees(n)) for n in range(1, 9)] == [1, 1, 2, 5, 14, 42, 132, 429]


@pytest.mark.parametrize("seed,k", [(0, 1), (1, 2), (2, 3), (3, 5), (4, 8)])
def test_dp_equals_brute_force_up_to_8_nodes(seed, k):
    acceptance = random_acceptance(k, seed)
    table = expected_tokens_table(acceptance, 8, 7)
    for n in range(1, 9):
        for d in range(0, 8):
            expected = brute_force(acceptance, n, d)
            assert table[n, d].item() == pytest.approx(expected, abs=1e-9) if expected > float("-inf") \
                else table[n, d].item() == float("-inf")
            if expected > float("-inf"):
                tree = Tree.optimal(acceptance, n, d)
                assert tree.size == n and tree.depth <= d
                assert tree.expected_tokens(acceptance) == pytest.approx(expected, abs=1e-9)


def test_table_is_monotone_in_size_and_depth():
    acceptance = random_acceptance(6, 7)
    g = expected_tokens_table(acceptance, 64, 10)
    finite = torch.isfinite(g)
    assert finite[1, 0] and not finite[2, 0] and finite[7, 1] and not finite[8, 1] and finite[64, 3]
    # where a tree of n + 1 nodes fits, one of n nodes fits and is no better; deeper never hurts
    both_n = finite[2:, :] & finite[1:-1, :]
    assert (finite[1:-1, :] | ~finite[2:, :]).all()
    assert (g[2:, :][both_n] >= g[1:-1, :][both_n] - 1e-12).all(), "G must not decrease with n"
    assert (finite[:, 1:] | ~finite[:, :-1]).all()
    both_d = finite[:, 1:] & finite[:, :-1]
    assert (g[:, 1:][both_d] >= g[:, :-1][both_d] - 1e-12).all(), "G must not decrease with d"


def test_built_tree_value_equals_table_value_at_scale():
    acceptance = random_acceptance(12, 3)
    g = expected_tokens_table(acceptance, 128, 8)
    for n, d in ((16, 4), (64, 6), (128, 8)):
        tree = Tree.optimal(acceptance, n, d)
        assert tree.size == n and tree.depth <= d
        assert tree.expected_tokens(acceptance) == pytest.approx(g[n, d].item(), abs=1e-9)
        assert max(len(c) for c in tree.children) <= len(acceptance)


def test_a_large_table_is_built():
    g = expected_tokens_table(random_acceptance(32, 5), 1024, 16)
    assert g.shape == (1025, 17)
    larger, smaller = g[2:, 1:], g[1:-1, 1:]  # where a tree of n nodes fits in d levels at all
    assert bool(((larger >= smaller - 1e-12) | larger.isinf()).all()), "a larger budget never expects fewer tokens"


def test_sequoia_tree_beats_chains_and_k_ary_trees_at_equal_size():
    acceptance = [0.55, 0.15, 0.08, 0.05, 0.03, 0.02]
    for n in (15, 31, 63):
        sequoia = Tree.optimal(acceptance, n, n - 1).expected_tokens(acceptance)
        binary = Tree.k_ary(2, {15: 3, 31: 4, 63: 5}[n]).expected_tokens(acceptance)
        chains = max(Tree.k_independent(k, (n - 1) // k).expected_tokens(acceptance)
                     for k in range(1, n) if (n - 1) % k == 0)
        assert sequoia >= binary and sequoia >= chains


@pytest.mark.parametrize("bad", [[], [1.2], [0.7, 0.6], [float("nan")], [-0.1]])
def test_bad_acceptance_vectors_are_refused(bad):
    with pytest.raises(InvalidTreeError):
        Tree.optimal(bad, 4, 2)
