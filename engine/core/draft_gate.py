"""Whether drafting pays on this answer: the optimizer's pick, checked against what the answer keeps.

The optimizer sizes ``tree="auto"`` by acceptance calibrated on many answers; one answer may keep
far fewer drafts (prose after code, a language the draft knows less). :class:`DraftGate` weighs
the pick's predicted speedup against the answer's own steps, both priced by the hardware profile,

    S = (w·G + Σ tokens) · t_alone / (w·C + Σ cost)

(``G``, ``C``: the pick's predicted tokens and seconds per step, ``w`` pseudo-steps of it; the sums
run over this answer's drafting steps, each older one weighed down by ``decay``), and a step drafts
while S ≥ 1. Below it the target decodes alone (a speedup of 1 by definition), except that every
``probe_every``-th step drafts still, so that the estimate follows the answer back into text the
draft knows.

Prices come from the profile, not the wall clock: both sides of the comparison pay the same host
(another program, a page drawing), so the decision does not drift with them. The decision reads
only steps already committed, so any output law is kept: each step's verification is exact for
whatever tree it drafts.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.copy_policy import step_cost
from engine.core.records import StepRecord
from engine.trees.copies import SOURCE_COPY
from engine.trees.tree import Tree

PRIOR_STEPS = 8.0  # the prediction counts as this many drafting steps: one poor step is no evidence
DECAY = 0.9        # per drafting step: about the last ten count
PROBE_EVERY = 4    # while paused, one step in this many drafts all the same


@dataclass
class DraftGate:
    """One answer's running check that drafting beats the target alone (see the module's docstring)."""

    predicted_tokens: float   # G: the pick's expected tokens per step
    predicted_cost: float     # C: the pick's predicted seconds per step (profile)
    alone_cost: float         # seconds per target-alone step (profile, its step overhead included)
    prior_steps: float = PRIOR_STEPS
    decay: float = DECAY
    probe_every: int = PROBE_EVERY
    tokens: float = 0.0       # decayed sums over this answer's drafting steps
    cost: float = 0.0
    paused_steps: int = 0     # steps the target decoded alone, in all
    paused_run: int = 0       # ... since the last drafting step

    def speedup(self) -> float:
        """S: the estimated speedup of drafting over the target alone on this answer so far."""
        tokens = self.prior_steps * self.predicted_tokens + self.tokens
        cost = self.prior_steps * self.predicted_cost + self.cost
        return tokens * self.alone_cost / cost if cost > 0 else 1.0

    def drafts(self) -> bool:
        """Whether the next step should draft: S ≥ 1, or it is time for a probe."""
        return self.speedup() >= 1.0 or self.paused_run + 1 >= self.probe_every

    def observe(self, tokens: int, drafted: Tree, rows: int, profile) -> None:
        """A drafting step committed ``tokens`` from ``drafted`` (the draft's tree as drafted),
        verifying ``rows`` target rows; priced by ``profile``
        (:class:`engine.tuning.profile.HardwareProfile`)."""
        cost = step_cost(drafted, rows, profile)
        self.tokens = self.decay * self.tokens + tokens
        self.cost = self.decay * self.cost + cost
        self.paused_run = 0

    def pause(self) -> None:
        """The next step decodes with the target alone."""
        self.paused_steps += 1
        self.paused_run += 1


def drafted_tree(step: StepRecord) -> Tree:
    """The draft's own tree of a recorded step: its nodes less those copied from the context
    (which hang from the root and cost the draft nothing)."""
    if not step.sources or SOURCE_COPY not in step.sources:
        return Tree.from_parents(step.parents)
    kept = [i for i, source in enumerate(step.sources) if source != SOURCE_COPY]
    index = {node: i for i, node in enumerate(kept)}
    return Tree.from_parents([-1 if step.parents[node] < 0 else index[step.parents[node]] for node in kept])


def priced_speedup(steps: Sequence[StepRecord], profile) -> float | None:
    """An answer's speedup over the target alone as ``profile`` prices its steps: its tokens at the
    target alone's step time over its steps' priced seconds. Neither the page nor the host's speed
    that hour enters it, which a measured ratio's both sides do only when timed together."""
    tokens = sum(len(step.committed) for step in steps)
    seconds = sum(step_cost(drafted_tree(step), step.tree_size, profile) for step in steps)
    return tokens * profile.token_time() / seconds if tokens and seconds > 0 else None
