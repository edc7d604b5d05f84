"""What the one tree decision (:func:`engine.core.settings.decide_tree`) asks of a pair: its
acceptance calibration (DP trees of a given size) and, where this machine has a hardware profile,
the optimizer's pick (:class:`engine.tuning.optimizer.AutoTuner`)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from engine.core.settings import DecodeSettings, TreeDecision, decide_tree
from engine.trees.tree import Tree
from engine.tuning.acceptance import EMBEDDED_PAIR, Calibration, calibration_for
from engine.tuning.optimizer import AutoTuner, TreeChoice
from engine.tuning.tree_store import build_tree


@dataclass
class TreePlanner:
    """The pair ``pair`` (as calibrations name it) and, when this machine has a profile of it, its
    ``tuner``. Calibrations come from the tuner when there is one (the optimizer's own), else from
    the pair's files (the embedded pair's, borrowed, when it has none)."""

    pair: str = EMBEDDED_PAIR
    tuner: AutoTuner | None = None
    _trees: dict = field(default_factory=dict, repr=False)

    @property
    def profile(self):
        """The hardware profile that prices steps (None without a tuner)."""
        return self.tuner.profile if self.tuner is not None else None

    def calibration(self, temperature: float, top_p: float) -> Calibration:
        """The acceptance calibration nearest to (temperature, top_p)."""
        if self.tuner is not None:
            return self.tuner.calibration(temperature, top_p)
        return _pair_calibration(self.pair, round(float(temperature), 3), round(float(top_p), 3))

    def sized_tree(self, size: int, depth: int, temperature: float, top_p: float) -> Tree:
        """Sequoia's DP tree of ``size`` nodes and depth <= ``depth`` for this setting's calibration
        (a chain when ``size == depth + 1``), memoised."""
        vector = self.calibration(temperature, top_p).vector
        key = (size, depth, vector)
        if key not in self._trees:
            self._trees[key] = build_tree(size, depth, list(vector))
        return self._trees[key]

    def choose(self, temperature: float, top_p: float, method: str) -> TreeChoice | None:
        """The optimizer's pick for this setting and method (None without a profile)."""
        return self.tuner.choose(temperature, top_p, method) if self.tuner is not None else None

    def decide(self, settings: DecodeSettings) -> TreeDecision:
        """:func:`engine.core.settings.decide_tree` with this planner."""
        return decide_tree(settings, self)


@functools.lru_cache(maxsize=64)
def _pair_calibration(pair: str, temperature: float, top_p: float) -> Calibration:
    return calibration_for(pair, temperature, top_p)
