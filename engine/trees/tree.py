"""Token-tree topology and tree attention.

A tree has ``size`` nodes in canonical breadth-first order: node 0 is the root (the last committed
token), ``parents[0] == -1``, ``parents[i] < i`` and parents never decrease, so the children of a
node are contiguous, in rank order (rank 1 = the draft's first choice), after those of every
earlier node; depths never decrease either, so each level is a contiguous slice. The engine drafts
a level's children in exactly this order, so a node's index is where its token and q lie.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from engine.errors import InvalidTreeError
from engine.trees import dp
from engine.trees.dp import expected_tokens_table  # noqa: F401  (public: engine.trees.tree.expected_tokens_table)


@dataclass(frozen=True)
class Tree:
    """A rooted token tree; build it with ``chain``, ``k_ary`` or ``from_parents``."""

    parents: tuple[int, ...]
    depths: tuple[int, ...] = field(init=False, repr=False)
    ranks: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        parents = tuple(int(p) for p in self.parents)
        _validate_parents(parents)
        depths, ranks, seen = [0], [0], [0] * len(parents)
        for i in range(1, len(parents)):
            depths.append(depths[parents[i]] + 1)
            seen[parents[i]] += 1
            ranks.append(seen[parents[i]])
        if any(b < a for a, b in zip(parents[1:], parents[2:])):
            raise InvalidTreeError("tree nodes must be in canonical breadth-first order (each node's children "
                                   "after those of every earlier node, so parents never decrease); "
                                   "build it with Tree.from_parents()")
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "depths", tuple(depths))
        object.__setattr__(self, "ranks", tuple(ranks))

    # ----- constructors -------------------------------------------------------------------
    @classmethod
    def chain(cls, depth: int) -> "Tree":
        """A single path of ``depth`` draft tokens (size ``depth + 1``)."""
        _check_count("depth", depth, minimum=0)
        return cls(tuple(range(-1, depth)))

    @classmethod
    def k_ary(cls, branching: int, depth: int) -> "Tree":
        """The complete tree where every node above ``depth`` has ``branching`` children."""
        _check_count("branching", branching, minimum=1)
        _check_count("depth", depth, minimum=0)
        parents, level = [-1], [0]
        for _ in range(depth):
            next_level = []
            for node in level:
                for _ in range(branching):
                    parents.append(node)
                    next_level.append(len(parents) - 1)
            level = next_level
        return cls(tuple(parents))

    @classmethod
    def k_independent(cls, k: int, depth: int) -> "Tree":
        """``k`` independent chains of ``depth`` tokens hanging from the root (SpecInfer-style)."""
        _check_count("k", k, minimum=1)
        _check_count("depth", depth, minimum=0)
        if depth == 0:
            return cls((-1,))
        parents = [-1] + [0] * k
        for level in range(1, depth):
            first_of_prev = 1 + (level - 1) * k
            parents += [first_of_prev + j for j in range(k)]
        return cls(tuple(parents))

    @classmethod
    def from_parents(cls, parents: list[int] | tuple[int, ...]) -> "Tree":
        """Any parent array with ``parents[0] == -1`` and ``parents[i] < i``.

        Nodes are renumbered in breadth-first order visiting children in rank order (a child's
        rank is its order of appearance among its siblings), so two arrays describing the same
        ranked tree give the same ``tree.parents``: the canonical numbering of step records.
        """
        parents = [int(p) for p in parents]
        _validate_parents(parents)
        kids: list[list[int]] = [[] for _ in parents]
        for i, p in enumerate(parents[1:], start=1):
            kids[p].append(i)
        order, new_index, new_parents = [0], {0: 0}, [-1]
        for old in order:  # grows while iterated: a breadth-first traversal
            for child in kids[old]:
                new_index[child] = len(order)
                order.append(child)
                new_parents.append(new_index[old])
        return cls(tuple(new_parents))

    @classmethod
    def optimal(cls, acceptance, size: int, depth: int) -> "Tree":
        """Sequoia's tree: exactly ``size`` nodes, depth <= ``depth``, maximising expected tokens/step
        under the positional acceptance vector ``[p_1, ..., p_K]`` (no node gets more than K children)."""
        _check_count("size", size, minimum=1)
        _check_count("depth", depth, minimum=0)
        try:
            table = dp.solve(acceptance, size, depth)
            return cls.from_parents(dp.optimal_parents(table, size, depth))
        except ValueError as exc:
            raise InvalidTreeError(str(exc)) from None

    def expected_tokens(self, acceptance) -> float:
        """F(tree): expected tokens per step (bonus included) under positional acceptance."""
        return dp.expected_tokens(self.parents, self.ranks, acceptance)

    # ----- topology -----------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Number of nodes the target verifies, root included."""
        return len(self.parents)

    @property
    def depth(self) -> int:
        """Draft tokens on the longest root-to-leaf path."""
        return self.depths[-1]

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Children of each node, in rank order."""
        kids: list[list[int]] = [[] for _ in self.parents]
        for i, p in enumerate(self.parents[1:], start=1):
            kids[p].append(i)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def level_slices(self) -> tuple[slice, ...]:
        """``level_slices[l]`` selects the nodes at depth ``l`` (contiguous in BFS order)."""
        bounds = [0]
        for d in range(1, self.depth + 1):
            bounds.append(self.depths.index(d))
        bounds.append(self.size)
        return tuple(slice(a, b) for a, b in zip(bounds, bounds[1:]))

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node``, both included."""
        path = [node]
        while self.parents[path[-1]] != -1:
            path.append(self.parents[path[-1]])
        return path[::-1]

    @cached_property
    def ancestor_matrix(self) -> torch.Tensor:
        """Bool ``[size, size]``: ``[i, j]`` is True when j is i or an ancestor of i."""
        n = self.size
        anc = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            anc[i, i] = True
            if i:
                anc[i] |= anc[self.parents[i]]
        return anc

    # ----- attention ----------------------------------------------------------------------
    def attention_mask(self, prefix_len: int, dtype: torch.dtype = torch.float32,
                       nodes: slice | None = None, columns: slice | None = None) -> torch.Tensor:
        """Additive 4-D mask ``[1, 1, q, prefix_len + c]`` for verifying the tree after a prefix.

        Rows are the query nodes (``nodes``, default all); the last ``c`` key columns are the
        tree nodes in ``columns`` (default all). Each node sees the whole prefix plus itself and
        its ancestors: 0 where attention is allowed, ``finfo(dtype).min`` elsewhere.
        """
        allowed = self.ancestor_matrix[nodes or slice(0, self.size), columns or slice(0, self.size)]
        q, c = allowed.shape
        return additive_mask(allowed, prefix_len + c - q, prefix_len + c, dtype)

    def position_ids(self, prefix_len: int, nodes: slice | None = None) -> torch.Tensor:
        """``[1, q]`` positions ``prefix_len + depth`` of the query nodes."""
        depths = torch.tensor(self.depths[nodes or slice(0, self.size)], dtype=torch.long)
        return (prefix_len + depths)[None]

    # ----- serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"parents": list(self.parents), "size": self.size, "depth": self.depth}


def _validate_parents(parents: list[int] | tuple[int, ...]) -> None:
    if len(parents) == 0:
        raise InvalidTreeError("a tree needs at least the root: parents must start with -1")
    if parents[0] != -1:
        raise InvalidTreeError(f"parents[0] must be -1 (the root), got {parents[0]}")
    for i, p in enumerate(parents[1:], start=1):
        if not 0 <= p < i:
            raise InvalidTreeError(
                f"parents[{i}] = {p} is invalid: every node's parent must be an earlier node (0 <= parent < {i})")


def _check_count(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidTreeError(f"{name} must be an integer >= {minimum}, got {value!r}")


def additive_mask(tail: torch.Tensor, start: int, width: int, dtype: torch.dtype,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Additive mask ``[1, 1, q, width]`` for ``q`` new tokens written at slots ``start..start+q-1``:
    the one way tree attention is masked (verification, draft levels, CUDA-graph buffers, replay).

    ``tail [q, c]`` (bool) says which of the last ``c`` slots up to the new tokens each new token
    sees: slots before ``start + q - c`` (the committed prefix) are visible, the next ``c`` follow
    ``tail``, and the rest (up to ``width``) are hidden. 0 where visible, ``finfo(dtype).min``
    elsewhere. Written into ``out`` when given.
    """
    q, c = tail.shape
    visible = start + q - c
    if out is None:
        out = torch.empty(1, 1, q, width, dtype=dtype, device=tail.device)
    out.fill_(torch.finfo(dtype).min)
    out[0, 0, :, :visible] = 0
    out[0, 0, :, visible:visible + c].masked_fill_(tail, 0)
    return out
