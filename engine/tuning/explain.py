"""Why the optimizer picks the tree it picks: the tables behind :func:`engine.tuning.optimizer.choose_tree`,
laid out for display (the app words them: :mod:`app.views.explain_text`).

For every tree size n and depth bound d on a grid:

- ``G(n, d)``: expected tokens per step of Sequoia's DP tree (:mod:`engine.trees.dp`; the bonus token included);
- with a hardware profile, the step's predicted cost (the target's verification of n tokens, the
  draft's forwards, as :func:`engine.core.copy_policy.draft_cost` charges them) and the predicted speedup
  ``S(n, d) = G(n, d) * t_T(1) / (t_T(n) + draft cost)`` (:func:`engine.tuning.optimizer.predict`).

Pure functions, no model runs; the tables are cached per acceptance vector and profile.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from engine.trees import dp
from engine.trees.tree import Tree
from engine.tuning.optimizer import TreeChoice, predict
from engine.tuning.profile import HardwareProfile

Grid = tuple[tuple[float | None, ...], ...]  # [depth index][size index]


@dataclass(frozen=True)
class Tables:
    """``sizes`` (x) and ``depths`` (y) of the grid and, per cell ``[depth][size]``, G and (with a
    profile) the predicted verify and draft seconds per step and speedup. None where no tree
    exists: more children than the acceptance vector has ranks, or, for ``chains_only``, n != d + 1.
    Size 1 is the target alone (G = 1, speedup 1) at every depth."""

    sizes: tuple[int, ...]
    depths: tuple[int, ...]
    expected: Grid
    verify_s: Grid | None = None
    draft_s: Grid | None = None
    speedup: Grid | None = None

    def cell(self, size: int, depth: int) -> dict | None:
        """The values at (size, depth), or None off the grid or where no tree exists."""
        if size not in self.sizes or depth not in self.depths:
            return None
        i, j = self.depths.index(depth), self.sizes.index(size)
        if self.expected[i][j] is None:
            return None
        out = {"size": size, "depth": depth, "expected_tokens": self.expected[i][j]}
        if self.speedup is not None:
            out.update(verify_s=self.verify_s[i][j], draft_s=self.draft_s[i][j], speedup=self.speedup[i][j])
        return out

    def best(self) -> dict | None:
        """The cell of highest predicted speedup (smallest tree on ties), None without a profile."""
        if self.speedup is None:
            return None
        cells = [(s, -self.sizes[j], -self.depths[i]) for i, row in enumerate(self.speedup)
                 for j, s in enumerate(row) if s is not None]
        speed, size, depth = max(cells)
        return self.cell(-size, -depth)


def profile_key(profile: HardwareProfile | None) -> str | None:
    """A hashable form of ``profile`` (for caches): its JSON, every field included."""
    return None if profile is None else profile.to_json()


def tables(acceptance, profile: HardwareProfile | None, max_size: int = 64, max_depth: int = 16,
           chains_only: bool = False) -> Tables:
    """:class:`Tables` for sizes 1..``max_size`` and depths 1..``max_depth`` (cached)."""
    return _tables(tuple(float(p) for p in acceptance), profile_key(profile), int(max_size), int(max_depth),
                   bool(chains_only))


@lru_cache(maxsize=32)
def _tables(acceptance: tuple[float, ...], key: str | None, max_size: int, max_depth: int,
            chains_only: bool) -> Tables:
    profile = None if key is None else HardwareProfile.from_json(key)
    table = dp.solve(acceptance, max_size, max_depth)
    sizes, depths = tuple(range(1, max_size + 1)), tuple(range(1, max_depth + 1))
    grids: dict[str, list[list[float | None]]] = {
        name: [[None] * len(sizes) for _ in depths] for name in ("expected", "verify_s", "draft_s", "speedup")}
    trees: dict[tuple[int, ...], TreeChoice] = {}  # the same tree serves every depth bound it fits
    for i, d in enumerate(depths):
        for j, n in enumerate(sizes):
            if n == 1:
                tree = Tree.chain(0)
            elif chains_only:
                if n != d + 1:
                    continue
                tree = Tree.chain(d)
            else:
                if float(table.best[n, min(d, n - 1) + 1]) == float("-inf"):
                    continue
                tree = Tree.from_parents(dp.optimal_parents(table, n, min(d, n - 1)))
            grids["expected"][i][j] = tree.expected_tokens(acceptance)
            if profile is None:
                continue
            choice = trees.get(tree.parents)
            if choice is None:
                choice = trees[tree.parents] = predict(tree, acceptance, profile)
            verify = profile.target_time(n)
            grids["verify_s"][i][j] = verify
            grids["draft_s"][i][j] = choice.step_time_s - verify - profile.step_overhead
            grids["speedup"][i][j] = choice.predicted_speedup
    frozen = {name: tuple(tuple(row) for row in grid) for name, grid in grids.items()}
    if profile is None:
        return Tables(sizes, depths, frozen["expected"])
    return Tables(sizes, depths, frozen["expected"], frozen["verify_s"], frozen["draft_s"], frozen["speedup"])
