"""Sequoia's hardware-aware optimizer: pick the tree size and depth that maximise predicted speedup.

    S(n, d) = G(n, d) * (t_T(1) + o) / ( t_T(n) + draft cost of the tree + o )

The draft cost charges one draft forward per tree level that has children (the first one also
feeds the catch-up tokens) at the measured latency for that level's width; ``o`` is the profile's
step overhead, which every step pays, the target alone's included.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from engine.trees import dp
from engine.trees.tree import Tree
from engine.tuning.acceptance import nearest_calibration, nearest_setting
from engine.tuning.profile import HardwareProfile

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TreeChoice:
    """The optimizer's pick and what it predicts."""

    tree: Tree
    size: int
    depth: int
    expected_tokens: float      # G(n, d): tokens per step
    step_time_s: float          # predicted seconds per step
    predicted_speedup: float    # over target-only decoding


def candidate_sizes(max_size: int) -> list[int]:
    """Every size up to 16, then about 8 per octave (the table is exact; trees are rebuilt only here)."""
    sizes = list(range(1, min(max_size, 16) + 1))
    n = 16
    while n < max_size:
        n = min(max_size, int(n * 1.25) + 1)
        sizes.append(n)
    return sizes


def draft_cost(tree: Tree, profile: HardwareProfile) -> float:
    """One draft forward per level whose nodes have children; the root level includes catch-up."""
    cost = 0.0
    for level, nodes in enumerate(tree.level_slices[:-1]):
        width = nodes.stop - nodes.start
        cost += profile.draft_time(width + 1 if level == 0 else width)
    return cost


def predict(tree: Tree, acceptance, profile: HardwareProfile) -> TreeChoice:
    tokens = tree.expected_tokens(acceptance)
    step = profile.target_time(tree.size) + draft_cost(tree, profile) + profile.step_overhead
    return TreeChoice(tree, tree.size, tree.depth, tokens, step, tokens * profile.token_time() / step)


def choose_tree(acceptance, profile: HardwareProfile, max_size: int | None = None,
                max_depth: int = 16, chains_only: bool = False) -> TreeChoice:
    """The (n, d) maximising predicted speedup, with its DP tree (a chain of d = n - 1 when
    ``chains_only``, for methods that verify chains only). ``n = 1`` (no drafting) always competes."""
    max_size = max_size or max(profile.target)
    best = predict(Tree.chain(0), acceptance, profile)
    if chains_only:
        for d in range(1, min(max_depth, max_size - 1) + 1):
            choice = predict(Tree.chain(d), acceptance, profile)
            if choice.predicted_speedup > best.predicted_speedup:
                best = choice
        return best
    table = dp.solve(acceptance, max_size, max_depth)
    for n in candidate_sizes(max_size)[1:]:
        for d in range(1, min(max_depth, n - 1) + 1):
            value = float(table.best[n, d + 1])
            if value == float("-inf"):
                continue
            # cheap bound first: even with a free draft this (n, d) cannot win
            if value * profile.token_time() / (profile.target_time(n) + profile.step_overhead) <= best.predicted_speedup:
                continue
            choice = predict(Tree.from_parents(dp.optimal_parents(table, n, d)), acceptance, profile)
            if choice.predicted_speedup > best.predicted_speedup:
                best = choice
    return best


@dataclass
class AutoTuner:
    """What ``tree="auto"`` needs: a hardware profile and calibrated acceptance vectors.

    ``acceptance`` maps (temperature, top_p) to a vector; the nearest calibrated setting is used
    (:func:`engine.tuning.acceptance.nearest_setting`). Choices are memoised per setting and constraint.
    """

    profile: HardwareProfile
    acceptance: dict[tuple[float, float], list[float]]
    max_size: int | None = None
    max_depth: int = 16
    pair: str = ""

    def __post_init__(self) -> None:
        if not self.acceptance:
            raise ValueError("AutoTuner needs at least one calibrated acceptance vector")
        self._chosen: dict[tuple[float, float, bool], TreeChoice] = {}

    def calibration(self, temperature: float, top_p: float):
        """The :class:`engine.tuning.acceptance.Calibration` the optimizer uses at this setting."""
        return nearest_calibration(self.acceptance, temperature, top_p, self.pair)

    def choose(self, temperature: float, top_p: float, method: str = "sequoia") -> TreeChoice:
        """The best tree for this setting that ``method`` can verify (a chain for ``chain``)."""
        key = (*nearest_setting(self.acceptance, temperature, top_p), method == "chain")
        if key not in self._chosen:
            self._chosen[key] = choose_tree(self.acceptance[key[:2]], self.profile, self.max_size, self.max_depth,
                                            chains_only=key[2])
        return self._chosen[key]


def load_tuner(pair: str, target, cache: Path | None = None):
    """An :class:`engine.tuning.optimizer.AutoTuner` for ``pair`` ("target+draft" as the engine CLIs name
    it) from a hardware profile for this device/dtype and at least one acceptance vector, as
    written by ``python -m engine.cli.profile`` and ``python -m engine.cli.calibrate``. The user cache is
    searched first, then the measurements bundled in ``assets/`` for the embedded pair; None when
    either is missing."""
    from engine.models.loading import cache_dir
    from engine.models.prompts import ASSETS

    for directory in (cache or cache_dir(), ASSETS):
        tuner = _tuner_from(directory, pair, target)
        if tuner is not None:
            return tuner
    return None


def _tuner_from(directory: Path, pair: str, target):
    from engine.tuning.calibrate import find_acceptance
    from engine.tuning.profile import device_name, profile_path

    param = next(target.parameters())
    dtype = str(param.dtype).removeprefix("torch.")
    path = profile_path(directory / "profiles", device_name(param.device), pair, dtype)
    acceptance = find_acceptance(pair, [directory / "acceptance"])
    if not path.exists() or not acceptance:
        return None
    try:
        return AutoTuner(HardwareProfile.from_json(path.read_text()), acceptance, pair=pair)
    except (OSError, ValueError, TypeError, KeyError, json.JSONDecodeError) as exc:
        log.warning("ignoring the hardware profile %s: %s", path, exc)
        return None
