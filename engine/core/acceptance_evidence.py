"""What a conversation's own steps say about acceptance, per rank, and the vector that prices a tree.

Sequoia prices a tree with a positional acceptance vector, p_k = the chance that at a tree node
the draft's k-th ranked child is the one kept. The pair's calibration measures it once over many
prompts; one conversation (prose after code, a language the draft knows less) may keep far
fewer. :class:`RankCounts` counts, over a conversation's drafting steps, how many verified nodes
offered a k-th child and how many kept it, and :meth:`RankCounts.blend` moves the calibration
toward those counts, the calibration weighing as :data:`PRIOR_WEIGHT` nodes at each rank so that a
few steps do not swing it:

    p_k = (W · calibration_k + kept_k) / (W + offered_k)

A chain grown while the draft is sure (``confidence``) is priced from (q, kept) samples at
successive positions (:func:`engine.tuning.optimizer.grown_chain`): the counts keep this
conversation's too (``samples``: the draft's first choice at each position its walk tried), which
the optimizer weighs against the calibration's as :data:`PRIOR_SAMPLES` positions. Below the first
level such a chain only holds positions the draft was sure of, so there only the first level
counts toward the ranks.

Only greedy answers use a conversation's counts (:meth:`engine.core.prefix_cache.ConversationCache.evidence_for`):
their output is the target's greedy whatever the tree, so the tree may follow earlier answers;
a sampled answer's tree, which its random draws depend on, follows nothing but its settings.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.trees.copies import SOURCE_COPY

PRIOR_WEIGHT = 32.0   # the calibration counts as this many verified nodes at every rank
PRIOR_SAMPLES = 32.0  # ... and as this many positions of (q, kept) samples for grown chains


@dataclass(frozen=True)
class RankCounts:
    """``offered[k - 1]``: verified nodes that had a k-th ranked draft child; ``accepted[k - 1]``:
    of those, the nodes whose kept child was the k-th; ``samples``: (q, kept 0/1) of the draft's
    first choice at each position a walk tried, in order; ``steps``: the drafting steps counted."""

    offered: tuple[int, ...] = ()
    accepted: tuple[int, ...] = ()
    steps: int = 0
    samples: tuple[tuple[float, int], ...] = ()

    def __bool__(self) -> bool:
        return self.steps > 0

    @classmethod
    def of_step(cls, step, grown: bool = False) -> "RankCounts":
        """The counts of one :class:`~engine.core.records.StepRecord`: along its accepted path, each
        node with draft children offered ranks 1..c and kept one of them (or none); ``grown``: the
        tree grew by the draft's confidence, so only its first level counts toward the ranks.
        Steps that drafted nothing (the target alone, a paused or catching-up draft) count
        nothing; a walk stops at a node whose kept child was copied from the context."""
        if len(step.tokens) <= 1 or step.draft_paused or step.timed_alone or step.draft_behind:
            return cls()
        children: dict[int, list[int]] = {}
        for node in range(1, len(step.tokens)):
            if not step.sources or step.sources[node] != SOURCE_COPY:
                children.setdefault(step.parents[node], []).append(node)
        offered: list[int] = []
        accepted: list[int] = []
        samples: list[tuple[float, int]] = []
        path = list(step.accepted)
        for i, node in enumerate(path):
            mine = children.get(node, [])
            kept = path[i + 1] if i + 1 < len(path) else None
            if not mine or (kept is not None and kept not in mine):
                break
            first = min(mine, key=lambda c: step.ranks[c])
            samples.append((float(step.draft_probs[first]), int(kept == first)))
            if not grown or i == 0:
                for k in range(1, max(step.ranks[c] for c in mine) + 1):
                    _bump(offered, k)
                if kept is not None:
                    _bump(accepted, step.ranks[kept])
            if kept is None:
                break
        if not samples:
            return cls()
        return cls(tuple(offered), tuple(accepted) + (0,) * (len(offered) - len(accepted)), 1, tuple(samples))

    @classmethod
    def of_steps(cls, steps: Sequence, grown: bool = False) -> "RankCounts":
        return cls.total(cls.of_step(step, grown) for step in steps)

    @classmethod
    def total(cls, parts: Iterable["RankCounts"]) -> "RankCounts":
        """The sum of ``parts`` in one pass (``+`` copies the samples each time: quadratic over a conversation)."""
        offered: list[int] = []
        accepted: list[int] = []
        samples: list[tuple[float, int]] = []
        steps = 0
        for part in parts:
            for total, counts in ((offered, part.offered), (accepted, part.accepted)):
                total.extend([0] * (len(counts) - len(total)))
                for k, count in enumerate(counts):
                    total[k] += count
            samples.extend(part.samples)
            steps += part.steps
        width = max(len(offered), len(accepted))
        return cls(tuple(offered) + (0,) * (width - len(offered)), tuple(accepted) + (0,) * (width - len(accepted)),
                   steps, tuple(samples))

    def blend(self, prior: Sequence[float], weight: float = PRIOR_WEIGHT) -> tuple[float, ...]:
        """The calibration ``prior`` (p_1..p_K) moved toward these counts (see the module's
        docstring); ranks these counts never offered keep the prior's value. Scaled down if the
        ranks' sum would pass 1."""
        out = []
        for k, p in enumerate(prior):
            offered = self.offered[k] if k < len(self.offered) else 0
            kept = self.accepted[k] if k < len(self.accepted) else 0
            out.append((weight * float(p) + kept) / (weight + offered))
        total = sum(out)
        return tuple(p / total for p in out) if total > 1.0 else tuple(out)


@dataclass(frozen=True)
class PricedBy:
    """The acceptance vector that priced a decision's tree and where it comes from: the pair's
    calibration (``steps == 0``), or the calibration moved toward ``steps`` of this conversation's."""

    vector: tuple[float, ...]
    steps: int = 0

    def label(self) -> str:
        return f"this conversation's after {self.steps} steps" if self.steps else "calibrated"


def _bump(counts: list[int], rank: int) -> None:
    while len(counts) < rank:
        counts.append(0)
    counts[rank - 1] += 1
