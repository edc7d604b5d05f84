"""Statistical exactness of the stochastic verifiers, driven by lookup-table "models".

The target and the draft are deterministic functions from a token context to a distribution
over a 6-token vocabulary. A small driver runs the real drafting (``sample_children``) and
verification functions step by step until two tokens are committed; the empirical joint law of
those two tokens is compared with the target's exact law ``p(x1) * p(x2 | x1)``.

Thresholds: chi-square p-value > 1e-3 (cells with expected count < 5 pooled) and a total
variation below what exact sampling itself stays under with probability 0.9999 at the same
number of samples (:func:`tv_bound`, simulated from the exact law), with 8,000 samples a test.
The seeds are fixed, so each test's verdict is reproducible. A wrong verifier must fail them. sequoia,
specinfer and topk run on two branching trees (binary and a DP tree) at every temperature and
top-p; the law of three tokens is checked on the DP tree too.
"""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from engine.core.sampling import logits_to_probs, sample_children
from engine.core.verify import JudgedRecorder, verify_stochastic, verify_topk
from engine.trees.tree import Tree

VOCAB = 6
SAMPLES = 8_000
P_MIN = 1e-3
NULL_QUANTILE = 0.9999


def tv_bound(exact: np.ndarray, samples: int, quantile: float = NULL_QUANTILE) -> float:
    """The total variation between ``exact`` and the empirical law of ``samples`` exact draws from
    it, at its ``quantile`` (20,000 simulated multinomial samples): a sampler whose TV exceeds it
    is off by more than exact sampling's own noise."""
    flat = exact.ravel() / exact.sum()
    simulated = np.random.default_rng(0).multinomial(samples, flat, size=20_000) / samples
    return float(np.quantile(0.5 * np.abs(simulated - flat).sum(axis=1), quantile))


def assert_exact(counts: np.ndarray, exact: np.ndarray) -> None:
    """The chi-square p-value and the total variation of ``counts`` against ``exact`` both pass."""
    p_value, tv = exactness_stats(counts, exact)
    bound = tv_bound(exact, int(counts.sum()))
    assert p_value > P_MIN and tv < bound, f"p-value {p_value:.2e}, TV {tv:.4f} (bound {bound:.4f})"
ACCEPTANCE = [0.6, 0.2, 0.1]


def _logits(context: tuple[int, ...], role: str, sharpness: float) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(f"{role}:{context}".encode()).digest()[:4], "little")
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * sharpness


class LookupPair:
    """Target and draft distributions as functions of the context (the draft is a noisy target)."""

    def __init__(self, temperature: float, top_p: float) -> None:
        self.temperature, self.top_p = temperature, top_p
        self._memo: dict[tuple, torch.Tensor] = {}

    def target(self, context: tuple[int, ...]) -> torch.Tensor:
        return self._distribution("target", context)

    def draft(self, context: tuple[int, ...]) -> torch.Tensor:
        return self._distribution("draft", context)

    def _distribution(self, role: str, context: tuple[int, ...]) -> torch.Tensor:
        key = (role, context)
        if key not in self._memo:
            logits = _logits(context, "target", 0.6)
            if role == "draft":
                logits = logits + _logits(context, "draft", 0.5)
            self._memo[key] = logits_to_probs(logits, self.temperature, self.top_p).double()
        return self._memo[key]

    def exact_joint(self) -> np.ndarray:
        p1 = self.target(())
        return np.array([[p1[a] * self.target((a,))[b] for b in range(VOCAB)] for a in range(VOCAB)])


def run_step(pair: LookupPair, tree: Tree, context: tuple[int, ...], method: str, generator, verifier=None):
    """One draft/verify step at ``context``: returns the committed tokens."""
    tokens = [-1]
    paths: list[tuple[int, ...]] = [()]
    dists = {}
    for node in range(1, tree.size):
        parent = tree.parents[node]
        if parent not in dists:
            q = pair.draft(context + paths[parent])
            count = len(tree.children[parent])
            if method == "topk":
                picks = torch.topk(q, min(count, VOCAB)).indices.tolist()
            else:
                picks = sample_children(q, count, method != "specinfer", generator).tolist()
            dists[parent] = (q, picks)
        q, picks = dists[parent]
        token = picks[min(tree.ranks[node], len(picks)) - 1]
        tokens.append(token)
        paths.append(paths[parent] + (token,))
    target_probs = torch.stack([pair.target(context + path) for path in paths])
    if verifier is not None:
        accepted, bonus = verifier(tree, tokens, target_probs, {k: v[0] for k, v in dists.items()}, generator)
    elif method == "topk":
        accepted, bonus = verify_topk(tree, tokens, target_probs, generator)
    else:
        accepted, bonus = verify_stochastic(tree, tokens, target_probs, {k: v[0] for k, v in dists.items()},
                                            method != "specinfer", generator)
    return [tokens[a] for a in accepted[1:]] + [bonus]


def empirical_joint(pair: LookupPair, tree: Tree, method: str, seed: int, verifier=None) -> np.ndarray:
    generator = torch.Generator().manual_seed(seed)
    counts = np.zeros((VOCAB, VOCAB))
    for _ in range(SAMPLES):
        out: list[int] = []
        while len(out) < 2:
            out += run_step(pair, tree, tuple(out), method, generator, verifier)
        counts[out[0], out[1]] += 1
    return counts


def exactness_stats(counts: np.ndarray, exact: np.ndarray) -> tuple[float, float]:
    """(chi-square p-value with cells of expected count < 5 pooled, total variation)."""
    observed, expected = counts.ravel(), exact.ravel() * counts.sum()
    small = expected < 5
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    assert observed[~keep].sum() == 0, "tokens outside the target's support were produced"
    p_value = chisquare(observed[keep], expected[keep] * observed.sum() / expected[keep].sum()).pvalue
    tv = 0.5 * np.abs(counts / counts.sum() - exact).sum()
    return float(p_value), float(tv)


TREES = {"chain3": Tree.chain(3), "binary2": Tree.k_ary(2, 2), "dp8": Tree.optimal(ACCEPTANCE, 8, 3)}
SETTINGS = [(t, p) for t in (0.3, 0.7, 1.0) for p in (1.0, 0.8)]
# sequoia and specinfer, the verifiers that differ on branching trees, run on both branching trees at
# every setting; chain is defined on chains only; topk's matching runs on both branching trees too.
GRID = [(method, temperature, top_p, tree_name)
        for method, tree_names in (("sequoia", ("binary2", "dp8")), ("specinfer", ("binary2", "dp8")),
                                   ("chain", ("chain3",)), ("topk", ("binary2", "dp8")))
        for temperature, top_p in SETTINGS for tree_name in tree_names]


def test_the_grid_covers_every_branching_case():
    for method in ("sequoia", "specinfer", "topk"):
        for setting in SETTINGS:
            assert {name for m, t, p, name in GRID if m == method and (t, p) == setting} == {"binary2", "dp8"}
    assert all(TREES[name].size > TREES[name].depth + 1 for m, *_, name in GRID if m != "chain")


@pytest.mark.parametrize("method,temperature,top_p,tree_name", GRID)
def test_output_follows_the_target_distribution(method, temperature, top_p, tree_name):
    pair = LookupPair(temperature, top_p)
    assert (pair.exact_joint() > 0.01).sum() >= 4, "degenerate target: the test would be vacuous"
    counts = empirical_joint(pair, TREES[tree_name], method, seed=GRID.index((method, temperature, top_p, tree_name)))
    assert_exact(counts, pair.exact_joint())


DEEP_SAMPLES = 12_000  # 216 cells


def test_the_law_of_three_tokens_on_a_dp_tree(method="sequoia"):
    """Three committed tokens (so a step after an accepted path and its bonus counts) on the DP
    tree at T = 0.7, top-p 0.8, against p(x1) p(x2 | x1) p(x3 | x1 x2): chi-square p-value > 1e-3
    (cells of expected count < 5 pooled) and TV under :func:`tv_bound`, over 12,000 samples."""
    pair = LookupPair(0.7, 0.8)
    generator = torch.Generator().manual_seed(7)
    counts = np.zeros((VOCAB,) * 3)
    for _ in range(DEEP_SAMPLES):
        out: list[int] = []
        while len(out) < 3:
            out += run_step(pair, TREES["dp8"], tuple(out), method, generator)
        counts[tuple(out[:3])] += 1
    exact = np.einsum("a,ab,abc->abc", pair.target(()).numpy(),
                      np.array([pair.target((a,)).numpy() for a in range(VOCAB)]),
                      np.array([[pair.target((a, b)).numpy() for b in range(VOCAB)] for a in range(VOCAB)]))
    assert_exact(counts, exact)


def _accept_when_p_ge_q(tree, tokens, target_probs, draft_probs, generator):
    """A plausible-looking but wrong verifier: accept a child whenever p(x) >= q(x)."""
    node, path = 0, [0]
    while True:
        p = target_probs[node]
        nxt = next((c for c in tree.children[node] if p[tokens[c]] >= draft_probs[node][tokens[c]]), None)
        if nxt is None:
            return path, int(torch.multinomial(p, 1, generator=generator).item())
        node = nxt
        path.append(node)


def _no_residual(tree, tokens, target_probs, draft_probs, generator):
    """Wrong: rejection sampling without the residual correction (bonus drawn from p itself)."""
    node, path = 0, [0]
    while True:
        p, q = target_probs[node], draft_probs.get(node)
        nxt = None
        for c in tree.children[node]:
            if torch.rand((), generator=generator).item() < min(1.0, (p[tokens[c]] / q[tokens[c]]).item()):
                nxt = c
                break
        if nxt is None:
            return path, int(torch.multinomial(p, 1, generator=generator).item())
        node = nxt
        path.append(node)


@pytest.mark.parametrize("wrong", [_accept_when_p_ge_q, _no_residual])
def test_a_wrong_verifier_fails_the_same_test(wrong):
    pair = LookupPair(0.7, 1.0)
    counts = empirical_joint(pair, TREES["binary2"], "sequoia", seed=1, verifier=wrong)
    with pytest.raises(AssertionError, match="p-value"):
        assert_exact(counts, pair.exact_joint())


@pytest.mark.parametrize("method,q_used", [("sequoia", 2 / 3), ("specinfer", 0.2)])
def test_the_verifier_reports_the_residual_p_and_the_q_it_judged_a_later_sibling_on(method, q_used):
    """p(0) = 0: the first child is always rejected; the second is judged on relu(p - q) normalised
    and on q with the first child removed (sequoia) or unchanged (specinfer)."""
    tree = Tree.k_ary(2, 1)
    p = torch.tensor([[0.0, 0.6, 0.4], [1 / 3] * 3, [1 / 3] * 3], dtype=torch.float64)
    q = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    recorder = JudgedRecorder()
    verify_stochastic(tree, [2, 0, 1], p, {0: q}, method == "sequoia", torch.Generator().manual_seed(0), recorder)
    used = recorder.used
    assert used[1] == (0.0, pytest.approx(0.7))
    assert used[2] == (pytest.approx(0.4 / 0.7), pytest.approx(q_used))
