"""What the one tree decision (:func:`engine.core.settings.decide_tree`) asks of a pair: its
acceptance calibration (DP trees of a given size) and, where this machine has a hardware profile,
the optimizer's pick (:class:`engine.tuning.optimizer.AutoTuner`), both moved toward a
conversation's own acceptance when there is some (:class:`engine.core.acceptance_evidence.RankCounts`).

A conversation's counts re-pick the tree only when the new pick is predicted :data:`REPICK_GAIN`
faster, under the conversation's acceptance, than the calibration's pick: a tree does not change
between answers for a hair's worth of prediction."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from engine.core.acceptance_evidence import PricedBy, RankCounts
from engine.core.settings import DecodeSettings, TreeDecision, decide_tree
from engine.trees.tree import Tree
from engine.tuning.acceptance import EMBEDDED_PAIR, Calibration, calibration_for
from engine.tuning.optimizer import AutoTuner, TreeChoice
from engine.tuning.tree_store import build_tree

REPICK_GAIN = 1.03   # a conversation's acceptance re-picks the tree when that is predicted 3% faster
MEMO_TREES = 256     # DP trees kept (a conversation's vectors vary: the oldest go)


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

    def acceptance(self, temperature: float, top_p: float, evidence: RankCounts | None = None) -> PricedBy:
        """The vector that shapes and prices trees at this setting: the calibration's, moved toward
        ``evidence`` when there is some."""
        vector = self.calibration(temperature, top_p).vector
        if not evidence:
            return PricedBy(tuple(vector))
        return PricedBy(evidence.blend(vector), evidence.steps)

    def sized_tree(self, size: int, depth: int, temperature: float, top_p: float,
                   evidence: RankCounts | None = None) -> Tree:
        """Sequoia's DP tree of ``size`` nodes and depth <= ``depth`` for this setting's acceptance
        (a chain when ``size == depth + 1``), memoised."""
        vector = self.acceptance(temperature, top_p, evidence).vector
        key = (size, depth, vector)
        if key not in self._trees:
            while len(self._trees) >= MEMO_TREES:
                self._trees.pop(next(iter(self._trees)))
            self._trees[key] = build_tree(size, depth, list(vector))
        return self._trees[key]

    def choose(self, temperature: float, top_p: float, method: str,
               evidence: RankCounts | None = None) -> TreeChoice | None:
        """The optimizer's pick for this setting and method (None without a profile); with
        ``evidence``, re-picked for the conversation's acceptance when that pays (:data:`REPICK_GAIN`)."""
        if self.tuner is None:
            return None
        calibrated = self.tuner.choose(temperature, top_p, method)
        if not evidence:
            return calibrated
        vector = self.acceptance(temperature, top_p, evidence).vector
        fresh = self.tuner.choose_for(vector, temperature, top_p, method, evidence.samples)
        kept = self.tuner.reprice(calibrated, vector, temperature, top_p, evidence.samples)
        return fresh if fresh.predicted_speedup > kept.predicted_speedup * REPICK_GAIN else kept

    def decide(self, settings: DecodeSettings, evidence: RankCounts | None = None) -> TreeDecision:
        """:func:`engine.core.settings.decide_tree` with this planner."""
        return decide_tree(settings, self, evidence)


@functools.lru_cache(maxsize=64)
def _pair_calibration(pair: str, temperature: float, top_p: float) -> Calibration:
    return calibration_for(pair, temperature, top_p)
