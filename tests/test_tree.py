"""Token-tree topology, validation and tree attention (engine/trees/tree.py). No models involved."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine.errors import EngineError, InvalidTreeError
from engine.trees.tree import Tree

IRREGULAR_NON_BFS = [-1, 0, 1, 0, 2, 3]  # valid (parents[i] < i) but depths go 0,1,2,1,3,2


def rank_paths(parents, ranks=None) -> Counter:
    """Multiset of root-to-node paths spelled as sibling ranks (1 = first child of its parent).

    Computed straight from a parent array, independently of Tree, so it can check Tree's output.
    """
    if ranks is None:
        seen: dict[int, int] = {}
        ranks = [0]
        for p in parents[1:]:
            seen[p] = seen.get(p, 0) + 1
            ranks.append(seen[p])
    paths = []
    for node in range(len(parents)):
        path = []
        while parents[node] != -1:
            path.append(ranks[node])
            node = parents[node]
        paths.append(tuple(reversed(path)))
    return Counter(paths)


def all_trees() -> list[Tree]:
    return [Tree.chain(0), Tree.chain(1), Tree.chain(4), Tree.k_ary(1, 3), Tree.k_ary(2, 2), Tree.k_ary(3, 2),
            Tree.k_independent(1, 2), Tree.k_independent(3, 2), Tree.from_parents(IRREGULAR_NON_BFS),
            Tree.from_parents([-1, 0, 0, 0, 1, 1, 2, 4, 4, 7])]


# ----- constructors --------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [0, 1, 2, 5])
def test_chain(depth):
    tree = Tree.chain(depth)
    assert tree.size == depth + 1
    assert tree.depth == depth
    assert tree.parents == tuple(range(-1, depth))
    assert tree.depths == tuple(range(depth + 1))
    assert tree.ranks == (0,) + (1,) * depth
    assert tree.path_to(depth) == list(range(depth + 1))


@pytest.mark.parametrize("branching,depth", [(1, 3), (2, 1), (2, 2), (2, 3), (3, 2), (4, 2)])
def test_k_ary(branching, depth):
    tree = Tree.k_ary(branching, depth)
    expected_size = depth + 1 if branching == 1 else (branching ** (depth + 1) - 1) // (branching - 1)
    assert tree.size == expected_size
    assert tree.depth == depth
    for node in range(tree.size):
        kids = tree.children[node]
        if tree.depths[node] < depth:
            assert len(kids) == branching
            assert [tree.ranks[k] for k in kids] == list(range(1, branching + 1))
            assert all(tree.parents[k] == node for k in kids)
        else:
            assert kids == ()
    # Level l holds branching ** l nodes.
    assert [s.stop - s.start for s in tree.level_slices] == [branching ** level for level in range(depth + 1)]
    # All rank paths of length <= depth occur exactly once.
    paths = rank_paths(tree.parents)
    assert len(paths) == tree.size and max(paths.values()) == 1


@pytest.mark.parametrize("k,depth", [(1, 3), (2, 3), (3, 1), (4, 2)])
def test_k_independent(k, depth):
    tree = Tree.k_independent(k, depth)
    assert tree.size == 1 + k * depth
    assert tree.depth == depth
    assert len(tree.children[0]) == k
    assert [tree.ranks[c] for c in tree.children[0]] == list(range(1, k + 1))
    leaves = [n for n in range(tree.size) if not tree.children[n]]
    assert len(leaves) == k
    chains = [tree.path_to(leaf) for leaf in leaves]
    # k disjoint chains of depth tokens below the shared root; below the root only first choices.
    assert all(len(chain) == depth + 1 and chain[0] == 0 for chain in chains)
    assert len({n for chain in chains for n in chain[1:]}) == k * depth
    assert sorted(tree.ranks[chain[1]] for chain in chains) == list(range(1, k + 1))
    assert all(tree.ranks[n] == 1 for chain in chains for n in chain[2:])


def test_k_independent_depth_zero_is_root_only():
    assert Tree.k_independent(3, 0).parents == (-1,)


def test_from_parents_renumbers_breadth_first():
    tree = Tree.from_parents(IRREGULAR_NON_BFS)
    assert tree.size == len(IRREGULAR_NON_BFS)
    assert tree.parents == (-1, 0, 0, 1, 2, 3)
    assert list(tree.depths) == sorted(tree.depths)
    assert tree.depths == (0, 1, 1, 2, 2, 3)
    # Old node 1 (first child of the root) stays rank 1, old node 3 (second child) stays rank 2.
    assert tree.ranks == (0, 1, 2, 1, 1, 1)
    assert rank_paths(tree.parents, tree.ranks) == rank_paths(IRREGULAR_NON_BFS)


def test_from_parents_keeps_sibling_order_and_shape():
    # A bushier irregular tree: root has 3 children, given out of depth order.
    parents = [-1, 0, 1, 1, 0, 2, 0, 4, 2]
    tree = Tree.from_parents(parents)
    assert list(tree.depths) == sorted(tree.depths)
    assert rank_paths(tree.parents, tree.ranks) == rank_paths(parents)
    assert Counter(len(k) for k in tree.children) == Counter(Counter(parents[1:]).get(i, 0)
                                                             for i in range(len(parents)))


def test_from_parents_is_identity_on_bfs_arrays():
    for tree in all_trees():
        assert Tree.from_parents(list(tree.parents)) == tree


def test_from_parents_numbering_is_canonical():
    # Same tree (root -> two children, each with one child) given with cousins in either order.
    a = Tree.from_parents([-1, 0, 0, 2, 1])
    b = Tree.from_parents([-1, 0, 0, 1, 2])
    assert rank_paths(a.parents, a.ranks) == rank_paths(b.parents, b.ranks)
    assert a.parents == b.parents == (-1, 0, 0, 1, 2)


def test_tree_constructor_rejects_non_bfs_order():
    with pytest.raises(InvalidTreeError, match="from_parents"):
        Tree(tuple(IRREGULAR_NON_BFS))


@pytest.mark.parametrize("parents", [(-1, 0, 0, 2, 1), (-1, 0, 1, 0, 2, 3), (-1, 0, 0, 1, 2, 2, 1)])
def test_tree_constructor_rejects_cousins_out_of_parent_order(parents):
    """Breadth-first by depth but not canonical: the drafter lays a level's children out parent by
    parent, so a tree whose node order differs would pair nodes with another node's token and q."""
    with pytest.raises(InvalidTreeError, match="from_parents"):
        Tree(parents)
    canonical = Tree.from_parents(parents)
    assert list(canonical.parents[1:]) == sorted(canonical.parents[1:])


def test_to_dict():
    assert Tree.k_ary(2, 2).to_dict() == {"parents": [-1, 0, 0, 1, 1, 2, 2], "size": 7, "depth": 2}


# ----- validation ----------------------------------------------------------------------------
@pytest.mark.parametrize("parents", [
    [],                 # no root
    [0],                # parents[0] != -1
    [1, 0],             # parents[0] != -1
    [-1, 1],            # parent equal to own index
    [-1, 0, 3, 1],      # parent after own index
    [-1, -1],           # a second root
    [-1, 0, -2],        # negative parent
])
@pytest.mark.parametrize("build", [Tree.from_parents, lambda p: Tree(tuple(p))], ids=["from_parents", "Tree"])
def test_invalid_parents(parents, build):
    with pytest.raises(InvalidTreeError) as info:
        build(parents)
    assert isinstance(info.value, ValueError) and isinstance(info.value, EngineError)
    message = str(info.value)
    assert message and "\n" not in message


@pytest.mark.parametrize("call", [
    lambda: Tree.chain(-1), lambda: Tree.chain(1.5), lambda: Tree.chain(True),
    lambda: Tree.k_ary(0, 2), lambda: Tree.k_ary(2, -1), lambda: Tree.k_ary(2.0, 2),
    lambda: Tree.k_independent(0, 2), lambda: Tree.k_independent(2, -1),
])
def test_invalid_constructor_arguments(call):
    with pytest.raises(InvalidTreeError) as info:
        call()
    message = str(info.value)
    assert message and "\n" not in message


def test_invalid_tree_error_is_value_error():
    assert issubclass(InvalidTreeError, ValueError)
    assert issubclass(InvalidTreeError, EngineError)


# ----- structure -----------------------------------------------------------------------------
@pytest.mark.parametrize("tree", all_trees(), ids=lambda t: str(list(t.parents)))
def test_level_slices_cover_nodes_by_depth(tree):
    slices = tree.level_slices
    assert len(slices) == tree.depth + 1
    assert slices[0] == slice(0, 1)
    covered = []
    for level, s in enumerate(slices):
        nodes = list(range(tree.size))[s]
        assert nodes, f"level {level} is empty"
        assert all(tree.depths[n] == level for n in nodes)
        covered += nodes
    assert covered == list(range(tree.size))


@pytest.mark.parametrize("tree", all_trees(), ids=lambda t: str(list(t.parents)))
def test_children_and_paths(tree):
    for node in range(tree.size):
        kids = tree.children[node]
        assert list(kids) == [i for i in range(tree.size) if tree.parents[i] == node]
        assert [tree.ranks[k] for k in kids] == list(range(1, len(kids) + 1))
        path = tree.path_to(node)
        assert path[0] == 0 and path[-1] == node and len(path) == tree.depths[node] + 1
        assert all(tree.parents[b] == a for a, b in zip(path, path[1:]))


@pytest.mark.parametrize("tree", all_trees(), ids=lambda t: str(list(t.parents)))
def test_ancestor_matrix(tree):
    expected = torch.zeros(tree.size, tree.size, dtype=torch.bool)
    for i in range(tree.size):
        expected[i, tree.path_to(i)] = True
    assert torch.equal(tree.ancestor_matrix, expected)


# ----- attention -----------------------------------------------------------------------------
@pytest.mark.parametrize("tree", all_trees(), ids=lambda t: str(list(t.parents)))
@pytest.mark.parametrize("prefix_len", [0, 1, 5])
def test_attention_mask(tree, prefix_len):
    n = tree.size
    mask = tree.attention_mask(prefix_len)
    assert mask.shape == (1, 1, n, prefix_len + n)
    assert mask.dtype == torch.float32
    neg = torch.finfo(torch.float32).min
    assert torch.all(mask[0, 0, :, :prefix_len] == 0)
    for i in range(n):
        visible = set(tree.path_to(i))
        for j in range(n):
            value = mask[0, 0, i, prefix_len + j].item()
            assert value == (0.0 if j in visible else neg), (i, j)


def test_attention_mask_dtype():
    mask = Tree.k_ary(2, 2).attention_mask(3, dtype=torch.float16)
    assert mask.dtype == torch.float16
    assert mask.min().item() == torch.finfo(torch.float16).min
    assert mask[0, 0, 4, 3 + 2].item() == torch.finfo(torch.float16).min  # node 4 (child of 1) cannot see node 2


@pytest.mark.parametrize("tree", [Tree.k_ary(2, 3), Tree.from_parents(IRREGULAR_NON_BFS), Tree.chain(4)],
                         ids=["k_ary", "irregular", "chain"])
def test_attention_mask_slicing(tree):
    """The draft's per-level forwards: rows = one level, columns = tree nodes 1..end of that level."""
    prefix_len = 4
    full = tree.attention_mask(prefix_len)
    for level in range(1, tree.depth + 1):
        nodes = tree.level_slices[level]
        columns = slice(1, nodes.stop)
        part = tree.attention_mask(prefix_len, nodes=nodes, columns=columns)
        q, c = nodes.stop - nodes.start, nodes.stop - 1
        assert part.shape == (1, 1, q, prefix_len + c)
        assert torch.all(part[..., :prefix_len] == 0)
        assert torch.equal(part[..., prefix_len:], full[..., nodes, prefix_len + 1: prefix_len + nodes.stop])
        for row, i in enumerate(range(nodes.start, nodes.stop)):
            allowed = {j - 1 for j in tree.path_to(i) if j >= 1}
            zeros = {j for j in range(c) if part[0, 0, row, prefix_len + j].item() == 0}
            assert zeros == allowed


@pytest.mark.parametrize("tree", all_trees(), ids=lambda t: str(list(t.parents)))
def test_position_ids(tree):
    pos = tree.position_ids(7)
    assert pos.shape == (1, tree.size) and pos.dtype == torch.long
    assert pos[0].tolist() == [7 + d for d in tree.depths]
    if tree.depth:
        nodes = tree.level_slices[tree.depth]
        assert tree.position_ids(7, nodes=nodes)[0].tolist() == [7 + tree.depth] * (nodes.stop - nodes.start)


def test_every_tree_mask_comes_from_one_function():
    """Verification, draft levels, CUDA-graph buffers and the sampled replay all mask through
    ``engine.trees.tree.additive_mask``; written in place it equals the fresh one."""
    import engine.core.runner
    import engine.tuning.sampled_replay
    from engine.trees.tree import additive_mask

    assert engine.core.runner.additive_mask is additive_mask and engine.tuning.sampled_replay.additive_mask is additive_mask
    tree = Tree.k_ary(2, 2)
    tail = tree.ancestor_matrix[3:, 1:]
    fresh = additive_mask(tail, start=5 + 2, width=12, dtype=torch.float32)
    buffer = torch.zeros(1, 1, 4, 12)
    assert additive_mask(tail, 7, 12, torch.float32, out=buffer) is buffer and torch.equal(buffer, fresh)
    assert torch.all(fresh[..., :5] == 0) and torch.all(fresh[..., 11:] == torch.finfo(torch.float32).min)
    assert torch.equal(fresh[0, 0, :, 5:11] == 0, tail)
