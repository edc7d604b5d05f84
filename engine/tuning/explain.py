"""Why the optimizer picks the tree it picks: the tables behind :func:`engine.tuning.optimizer.choose_tree`,
laid out for display, and the comparison of two settings in words.

For every tree size n and depth bound d on a grid:

- ``G(n, d)``: expected tokens per step of Sequoia's DP tree (:mod:`engine.trees.dp`; the bonus token included);
- with a hardware profile, the step's predicted cost (the target's verification of n tokens, the
  draft's forwards, as :func:`engine.core.copy_policy.draft_cost` charges them) and the predicted speedup
  ``S(n, d) = G(n, d) * t_T(1) / (t_T(n) + draft cost)`` (:func:`engine.tuning.optimizer.predict`).

Pure functions, no model runs; the tables are cached per acceptance vector and profile.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

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


def profile_source(profile: HardwareProfile, directories: list[tuple[str, Path]] | None = None) -> str:
    """Where ``profile`` comes from, in words: the file that holds exactly these measurements, the
    one bundled in ``assets/`` first (a user cache may hold a copy of it), then the user cache's;
    or "not saved"."""
    from engine.tuning.profile import profile_path

    if directories is None:
        from engine.user_cache import cache_dir
        from engine.models.prompts import ASSETS

        directories = [("bundled with the app", ASSETS), ("from the user cache", cache_dir())]
    for words, directory in directories:
        path = profile_path(Path(directory) / "profiles", profile.device, profile.pair, profile.dtype)
        try:
            if path.exists() and HardwareProfile.from_json(path.read_text()) == profile:
                shown = f"assets/profiles/{path.name}" if words == "bundled with the app" else str(path)
                return f"{words}: {shown}"
        except (OSError, ValueError, TypeError, KeyError, json.JSONDecodeError):
            continue
    return "not saved to a file (measured in this session)"


def describe_setting(choice: TreeChoice) -> str:
    if choice.size == 1:
        return "the target alone (no draft)"
    if choice.confidence > 0:
        return f"a chain of up to {choice.depth} grown while the draft's path confidence is ≥ {choice.confidence:g}"
    return f"{choice.size} nodes, depth {choice.depth}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def _numbers(choice: TreeChoice, profile: HardwareProfile) -> str:
    if choice.confidence > 0:  # the tree, so the verify and draft split, changes from step to step
        return (f"G = {choice.expected_tokens:.2f} tokens/step for {_ms(choice.step_time_s)} per step on average, "
                f"predicted {choice.predicted_speedup:.2f}×")
    verify, overhead = profile.target_time(choice.size), profile.step_overhead
    draft = choice.step_time_s - verify - overhead
    other = f" + {_ms(overhead)} other" if overhead > 0 else ""
    if choice.size == 1:
        return f"G = 1 token/step for {_ms(verify)} of target{other} per token, {choice.predicted_speedup:.2f}×"
    return (f"G = {choice.expected_tokens:.2f} tokens/step for {_ms(verify)} verify + {_ms(draft)} draft{other} = "
            f"{_ms(choice.step_time_s)} per step, predicted {choice.predicted_speedup:.2f}×")


def hardware_reason(profile: HardwareProfile) -> str:
    """Why drafting is dear on this device, from its profile: a draft forward in target tokens, and
    what verifying 4 and 8 tokens costs against one."""
    one = profile.target_time(1)
    return (f"on this device one draft forward costs {profile.draft_time(1) / one:.2f}–"
            f"{profile.draft_time(2) / one:.2f} of a target token and verifying 4 / 8 tokens costs "
            f"{profile.target_time(4) / one:.1f}× / {profile.target_time(8) / one:.1f}× one token")


def explain_choice(pick: TreeChoice, mine: TreeChoice, profile: HardwareProfile) -> str:
    """One line, in words and numbers, of why the optimizer's ``pick`` beats ``mine`` (the user's
    setting), or that they are the same. Speedups are over the target alone, predicted from the
    acceptance calibration and the profile."""
    if pick.tree.parents == mine.tree.parents and pick.confidence == mine.confidence:
        line = f"Your setting is the optimizer's pick: {describe_setting(pick)}, {_numbers(pick, profile)}."
        if pick.size == 1:
            line += (f" No tree is predicted to pay for itself: {hardware_reason(profile)}, so the extra "
                     f"accepted tokens never make up for the cost of the step.")
        return line
    if pick.size == 1:
        return (f"The optimizer drafts nothing (the target alone, predicted 1.00×) rather than your "
                f"{describe_setting(mine)}: {_numbers(mine, profile)}. The tree would write "
                f"{mine.expected_tokens:.2f} tokens per step but each step costs "
                f"{mine.step_time_s / profile.token_time():.1f} target tokens' time: {hardware_reason(profile)}.")
    gain = pick.predicted_speedup / mine.predicted_speedup if mine.predicted_speedup > 0 else float("inf")
    if mine.size == 1:
        return (f"The optimizer picks {describe_setting(pick)} over the target alone: {_numbers(pick, profile)}, "
                f"{gain:.2f}× the speed of your setting.")
    why = ("more tokens per step" if pick.expected_tokens > mine.expected_tokens and
           pick.step_time_s >= mine.step_time_s else
           "a cheaper step" if pick.step_time_s < mine.step_time_s and pick.expected_tokens <= mine.expected_tokens
           else "more tokens for a cheaper step" if pick.step_time_s < mine.step_time_s else
           "more tokens per second")
    return (f"The optimizer picks {describe_setting(pick)} over your {describe_setting(mine)} for {why}: "
            f"{_numbers(pick, profile)}, against {_numbers(mine, profile)} for yours "
            f"({gain:.2f}× faster).")
