"""Property-based fuzzing (hypothesis) of trees, the DP and the verifiers: invariants hold on
random valid input, and invalid input raises only the documented errors."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.sampling import logits_to_probs
from engine.core.verify import TraceRecorder, verify_greedy, verify_stochastic, verify_topk
from engine.errors import InvalidDistributionError, InvalidTreeError
from engine.trees.tree import Tree, expected_tokens_table

EXAMPLES = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VOCAB = 6


@st.composite
def valid_parents(draw, max_size: int = 24) -> list[int]:
    """A rooted tree with every parent before its child (the documented contract), in any
    order otherwise: not breadth-first, children of a node not adjacent."""
    size = draw(st.integers(1, max_size))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, size)]


def is_valid_parent_array(parents: list[int]) -> bool:
    return len(parents) > 0 and parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i)


def level_sizes(parents: list[int]) -> list[int]:
    depth = {0: 0}

    def depth_of(node: int) -> int:
        if node not in depth:
            depth[node] = depth_of(parents[node]) + 1
        return depth[node]

    counts: dict[int, int] = {}
    for node in range(len(parents)):
        counts[depth_of(node)] = counts.get(depth_of(node), 0) + 1
    return [counts[d] for d in sorted(counts)]


@EXAMPLES
@given(valid_parents())
def test_from_parents_canonicalises_any_valid_tree(parents):
    tree = Tree.from_parents(parents)
    assert tree.size == len(parents) and tree.parents[0] == -1
    assert all(tree.parents[i] < i for i in range(1, tree.size))  # breadth-first order
    assert all(tree.depths[i] == tree.depths[tree.parents[i]] + 1 for i in range(1, tree.size))
    assert list(tree.depths) == sorted(tree.depths)
    assert level_sizes(list(tree.parents)) == level_sizes(parents)
    for node, kids in enumerate(tree.children):
        assert [tree.ranks[c] for c in kids] == list(range(1, len(kids) + 1))
        assert all(tree.parents[c] == node for c in kids)
    mask = tree.attention_mask(3)[0, 0]
    assert mask.shape == (tree.size, 3 + tree.size) and (mask[:, :3] == 0).all()
    for node in range(tree.size):
        allowed = {c for c in range(tree.size) if mask[node, 3 + c] == 0}
        ancestors, walk = {node}, node
        while walk:
            walk = tree.parents[walk]
            ancestors.add(walk)
        assert allowed == ancestors


@EXAMPLES
@given(st.lists(st.integers(-3, 30), min_size=0, max_size=20))
def test_from_parents_accepts_exactly_the_rooted_trees(parents):
    if is_valid_parent_array(parents):
        assert Tree.from_parents(parents).size == len(parents)
    else:
        with pytest.raises(InvalidTreeError):
            Tree.from_parents(parents)


@st.composite
def acceptance_vectors(draw) -> list[float]:
    raw = draw(st.lists(st.floats(0, 1), min_size=1, max_size=8))
    total = draw(st.floats(0.05, 1.0))
    mass = sum(raw)
    return [total * r / mass for r in raw] if mass > 0 else raw


@EXAMPLES
@given(acceptance_vectors(), st.integers(1, 40), st.integers(0, 8))
def test_optimal_tree_has_the_requested_shape_and_the_table_value(acceptance, size, depth):
    table = expected_tokens_table(acceptance, size, depth)
    best = float(table[size][depth])
    if math.isinf(best):
        with pytest.raises(InvalidTreeError):
            Tree.optimal(acceptance, size, depth)
        return
    tree = Tree.optimal(acceptance, size, depth)
    assert tree.size == size and tree.depth <= depth
    assert max((len(c) for c in tree.children), default=0) <= len(acceptance)
    assert tree.expected_tokens(acceptance) == pytest.approx(best, rel=1e-9, abs=1e-9)
    assert 1.0 <= tree.expected_tokens(acceptance) <= depth + 1 + 1e-9


@EXAMPLES
@given(st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-1, 2)), min_size=0, max_size=6))
def test_bad_acceptance_vectors_raise_the_documented_error(acceptance):
    valid = (len(acceptance) > 0 and all(math.isfinite(p) and 0 <= p <= 1 for p in acceptance)
             and sum(acceptance) <= 1 + 1e-6)
    if valid:
        assert Tree.optimal(acceptance, 1, 0).size == 1
    else:
        with pytest.raises(InvalidTreeError):
            Tree.optimal(acceptance, 4, 2)


@st.composite
def distributions(draw, rows: int) -> torch.Tensor:
    """``[rows, VOCAB]`` probability rows, some with zeros and some one-hot."""
    out = []
    for _ in range(rows):
        kind = draw(st.sampled_from(["dense", "sparse", "one-hot"]))
        if kind == "one-hot":
            row = [0.0] * VOCAB
            row[draw(st.integers(0, VOCAB - 1))] = 1.0
        else:
            row = draw(st.lists(st.floats(0, 1) if kind == "dense" else st.sampled_from([0.0, 0.0, 0.3, 1.0]),
                                min_size=VOCAB, max_size=VOCAB))
            if sum(row) == 0:
                row[0] = 1.0
        total = sum(row)  # normalised in float64: subnormal rows would vanish in float32
        out.append(torch.tensor([r / total for r in row], dtype=torch.float32))
    return torch.stack(out)


@st.composite
def verifier_cases(draw):
    tree = Tree.from_parents(draw(valid_parents(max_size=12)))
    tokens = [draw(st.integers(0, VOCAB - 1)) for _ in range(tree.size)]
    p = draw(distributions(tree.size))
    q = draw(distributions(tree.size))
    return tree, tokens, p, {node: q[node] for node in range(tree.size) if tree.children[node]}, draw(st.integers(0, 2**31))


def assert_path_of_tree(tree: Tree, path: list[int]) -> None:
    assert path[0] == 0
    assert all(b in tree.children[a] for a, b in zip(path, path[1:]))


@EXAMPLES
@given(verifier_cases(), st.booleans())
def test_stochastic_verifier_commits_a_tree_path_and_a_bonus_in_the_support(case, without_replacement):
    tree, tokens, p, q, seed = case
    path, bonus = verify_stochastic(tree, tokens, p, q, without_replacement, torch.Generator().manual_seed(seed))
    recorder = TraceRecorder()
    assert verify_stochastic(tree, tokens, p, q, without_replacement, torch.Generator().manual_seed(seed),
                             recorder) == (path, bonus), "the trace changed the walk"
    assert [e.child for e in recorder.events if e.accepted and e.rule == "sample"] == path[1:]
    assert_path_of_tree(tree, path)
    assert all(p[a, tokens[b]] > 0 for a, b in zip(path, path[1:])), "accepted a token the target cannot emit"
    assert p[path[-1], bonus] > 0


@EXAMPLES
@given(verifier_cases())
def test_topk_and_greedy_verifiers_commit_a_tree_path(case):
    tree, tokens, p, _, seed = case
    path, bonus = verify_topk(tree, tokens, p, torch.Generator().manual_seed(seed))
    assert verify_topk(tree, tokens, p, torch.Generator().manual_seed(seed), TraceRecorder()) == (path, bonus)
    assert_path_of_tree(tree, path)
    assert p[path[-1], bonus] > 0
    path, bonus = verify_greedy(tree, tokens, p.argmax(dim=-1))
    assert verify_greedy(tree, tokens, p.argmax(dim=-1), TraceRecorder(), p) == (path, bonus)
    assert_path_of_tree(tree, path)
    assert bonus == int(p[path[-1]].argmax())
    assert all(tokens[b] == int(p[a].argmax()) for a, b in zip(path, path[1:]))


@EXAMPLES
@given(verifier_cases(), st.sampled_from([float("nan"), float("inf"), -1.0]), st.booleans())
def test_broken_distributions_are_rejected_cleanly(case, bad, in_target):
    tree, tokens, p, q, seed = case
    if in_target:
        p = p.clone()
        p[seed % tree.size, seed % VOCAB] = bad
    elif tree.children[0]:
        q = dict(q)
        q[0] = q[0].clone()
        q[0][seed % VOCAB] = bad
    else:
        return  # a root-only tree never reads q
    with pytest.raises(InvalidDistributionError):
        verify_stochastic(tree, tokens, p, q, True, torch.Generator().manual_seed(seed))


@EXAMPLES
@given(st.lists(st.floats(-50, 50), min_size=VOCAB, max_size=VOCAB), st.floats(0, 2), st.floats(0.01, 1))
def test_logits_to_probs_gives_distributions_or_a_clear_error(logits, temperature, top_p):
    probs = logits_to_probs(torch.tensor(logits), temperature, top_p)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert float(probs.sum()) == pytest.approx(1.0, abs=1e-5)
    broken = torch.tensor(logits)
    broken[0] = float("nan")
    with pytest.raises(InvalidDistributionError):
        logits_to_probs(broken, temperature, top_p)
