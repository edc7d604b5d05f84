"""How much of a copied continuation to verify, and whether to draft with the model beside it.

Acceptance of copied tokens is measured online, during the generation, per match-length bucket
and per depth in the copied chain (:class:`CopyStats`). Each step :func:`plan_step` weighs three
trees by expected tokens per second with the hardware profile's costs: the draft model's tree
alone, the copied chain alone (no draft forward at all: it costs only verification width), or
both, the copy first. A copy that has not paid recently stops being proposed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.trees.copies import SOURCE_COPY, ContextIndex, CopyProposal, MergedTree
from engine.trees.tree import Tree

MATCH_BUCKETS = (3, 6, 12, 24)       # a match of m tokens falls in the last bucket whose bound is <= m
COPY_LENGTHS = (1, 2, 4, 6, 8, 12, 16, 24, 32)
FIRST_PRIOR = (0.25, 0.45, 0.65, 0.8, 0.9)  # prior acceptance of a copy's first token, per bucket
NEXT_PRIOR = 0.85                     # prior acceptance of each later token, given the one before
DEEPEST = 8  # copied tokens at this depth and below share one count: deep tokens are few, and alike
PRIOR_WEIGHT = 2.0                    # pseudo-observations behind each prior
# Without a profile: a step of n target rows costs 1 + 0.02 (n - 1) target steps, a draft level 0.3.
DEFAULT_ROW_COST, DEFAULT_LEVEL_COST = 0.02, 0.3


def bucket_of(match_len: int) -> int:
    """0 for matches shorter than ``MATCH_BUCKETS[0]``, then one bucket per bound reached."""
    return sum(1 for bound in MATCH_BUCKETS if match_len >= bound)


@dataclass
class CopyStats:
    """Online counts of copied tokens tried and kept, per match bucket and depth (1 = first copied token)."""

    tried: dict[tuple[int, int], int] = field(default_factory=dict)
    kept: dict[tuple[int, int], int] = field(default_factory=dict)

    def observe(self, match_len: int, length: int, accepted: int) -> None:
        """A copied chain of ``length`` tokens whose first ``accepted`` were kept (then one rejected,
        unless all were kept)."""
        bucket = bucket_of(match_len)
        for depth in range(1, min(accepted + 1, length) + 1):
            key = bucket, min(depth, DEEPEST)
            self.tried[key] = self.tried.get(key, 0) + 1
            if depth <= accepted:
                self.kept[key] = self.kept.get(key, 0) + 1

    def acceptance(self, match_len: int, depth: int) -> float:
        """Estimated P(copied token at ``depth`` kept | the one before kept), prior blended in."""
        bucket, depth = bucket_of(match_len), min(depth, DEEPEST)
        # a depth not tried yet is expected to go as the one above it went: a copy kept whole every
        # time is then tried longer, instead of never being seen past the length it started with
        prior = FIRST_PRIOR[bucket] if depth == 1 else NEXT_PRIOR if depth == 2 else self.acceptance(match_len, depth - 1)
        tried, kept = self.tried.get((bucket, depth), 0), self.kept.get((bucket, depth), 0)
        return (kept + PRIOR_WEIGHT * prior) / (tried + PRIOR_WEIGHT)

    def expected_tokens(self, match_len: int, length: int) -> float:
        """Expected copied tokens kept from a chain of ``length``."""
        total, alive = 0.0, 1.0
        for depth in range(1, length + 1):
            alive *= self.acceptance(match_len, depth)
            total += alive
        return total


@dataclass(frozen=True)
class StepPlan:
    """What one step verifies: ``copy_len`` copied tokens (0: none) and whether the model drafts."""

    copy_len: int
    draft: bool
    expected_tokens: float
    step_cost: float


def draft_cost(tree: Tree, profile: object | None) -> float:
    """The draft model's cost for ``tree``: the profile's seconds (a
    :class:`engine.tuning.profile.HardwareProfile`: one forward per level with children, the first
    with the catch-up token), or ``DEFAULT_LEVEL_COST`` target steps per level without one."""
    if profile is None:
        return DEFAULT_LEVEL_COST * tree.depth
    widths = [s.stop - s.start for s in tree.level_slices[:-1]]
    return sum(profile.draft_time(width + 1 if level == 0 else width) for level, width in enumerate(widths))


def step_cost(drafted: Tree, rows: int, profile: object) -> float:
    """The profile's seconds for a step whose draft drafted ``drafted`` (the draft's own tree; root
    only: no draft forward) and whose target verified ``rows`` rows, the step overhead included."""
    return profile.target_time(rows) + draft_cost(drafted, profile) + profile.step_overhead


def unmeasured_target_time(rows: int, profile: object | None) -> float:
    """Verifying ``rows`` as the profile says (with its step overhead), or in target steps without one."""
    return profile.target_time(rows) + profile.step_overhead if profile is not None \
        else 1.0 + DEFAULT_ROW_COST * (rows - 1)


@dataclass
class StepClock:
    """What steps cost while this answer decodes: verification seconds per tree width and the draft
    model's seconds per drafted step (moving averages; fed at T = 0 only, where the tree cannot
    change the answer: a sampled answer's trees depend on no clock, so a seed reproduces it). The profile's curve was measured
    after a short prefix; over a long conversation attention makes every extra row dearer, so
    copies are sized by what verification costs now. Widths not seen yet follow the profile (or
    the default costs), scaled by the measured width nearest to them."""

    verify: dict[int, float] = field(default_factory=dict)
    draft: float | None = None

    def observe(self, width: int, verify_s: float, draft_s: float | None = None) -> None:
        self.verify[width] = verify_s if width not in self.verify else 0.7 * self.verify[width] + 0.3 * verify_s
        if draft_s is not None:
            self.draft = draft_s if self.draft is None else 0.7 * self.draft + 0.3 * draft_s

    def target_time(self, rows: int, profile: object | None) -> float:
        """Seconds (or, with neither a profile nor a measurement, target steps) to verify ``rows``."""
        if rows in self.verify:
            return self.verify[rows]
        if not self.verify:
            return unmeasured_target_time(rows, profile)
        nearest = min(self.verify, key=lambda n: (abs(n - rows), n))
        return unmeasured_target_time(rows, profile) * self.verify[nearest] / unmeasured_target_time(nearest, profile)

    def draft_time(self, tree: Tree, profile: object | None) -> float:
        """The draft model's cost for ``tree``: measured, else the profile's scaled as verification is."""
        if self.draft is not None:
            return self.draft
        cost = draft_cost(tree, profile)
        if self.verify and 1 in self.verify:
            return cost * self.verify[1] / unmeasured_target_time(1, profile)
        return cost


def plan_step(stats: CopyStats, match_len: int, available: int, model_tree: Tree, model_tokens: float,
              profile: object | None, clock: StepClock | None = None) -> StepPlan:
    """The best of model-only, copy-only and both, by expected tokens per unit of step cost.

    ``available``: tokens the copy could give (0: no match). ``model_tree``: the model's tree for
    this step (root only: no drafting); ``model_tokens``: its expected tokens per step (G).
    ``clock``: measured costs (:class:`StepClock`), else the profile's (or the default ones).
    """
    clock = clock or StepClock()

    def cost(rows: int, drafting: float) -> float:
        return clock.target_time(rows, profile) + drafting

    drafting = clock.draft_time(model_tree, profile) if model_tree.size > 1 else 0.0
    best = StepPlan(0, model_tree.size > 1, model_tokens, cost(model_tree.size, drafting))
    best_rate = best.expected_tokens / best.step_cost
    first = stats.acceptance(match_len, 1)
    for length in COPY_LENGTHS:
        if length > available:
            break
        copied = stats.expected_tokens(match_len, length)
        plans = [StepPlan(length, False, 1.0 + copied, cost(1 + length, 0.0))]
        if model_tree.size > 1:
            plans.append(StepPlan(length, True, 1.0 + copied + (1.0 - first) * (model_tokens - 1.0),
                                  cost(model_tree.size + length, drafting)))
        for plan in plans:
            rate = plan.expected_tokens / plan.step_cost
            if rate > best_rate:
                best, best_rate = plan, rate
    return best


MAX_COPY = 32        # copied tokens verified in one step at most
PREDICTION_LEAD = 8  # prompt tokens put before an expected output, so its start matches the prompt's end


@dataclass
class CopyMemory:
    """What greedy answers learn about copies and carry to the next one (an engine holds one): the
    copies' acceptance, and each draft tree's tokens per step (by its parents)."""

    stats: CopyStats = field(default_factory=CopyStats)
    model_tokens: dict[tuple[int, ...], float] = field(default_factory=dict)


class CopyPolicy:
    """One generation's copies from the context, asked by each step: which continuations to verify
    beside the draft's tree (:meth:`plan`) and what the step's verdict teaches (:meth:`learn`).

    A sampled answer measures everything (copies' acceptance, the draft tree's tokens per step,
    step costs) afresh, so a seeded answer's trees depend on nothing an earlier one left behind. A
    greedy answer, whose tokens no tree can change, starts from what earlier greedy answers learnt
    and adds to it (``memory``). ``expected``: the draft tree's expected tokens per step before any
    is measured (the optimizer's prediction, else one per level half the time)."""

    def __init__(self, prompt: list[int], prediction: tuple[int, ...] | None, tree: Tree, expected: float,
                 memory: CopyMemory | None = None) -> None:
        self.index = ContextIndex()
        self.index.sync(prompt)
        if prediction:
            self.index.add_document(list(prompt[-PREDICTION_LEAD:]) + list(prediction))
        self.memory, self.key = memory, tree.parents
        self.stats = memory.stats if memory is not None else CopyStats()
        self.clock = StepClock()  # this generation's measured step costs (its context length's)
        self.model_tokens = memory.model_tokens.get(self.key, expected) if memory is not None else expected

    def plan(self, seq: list[int], tree: Tree, room: int | None, stops: frozenset[int], branches: int,
             profile: object | None) -> tuple[list[CopyProposal], bool]:
        """This step's copied continuations of ``seq`` (possibly none) and whether the draft model
        drafts ``tree`` beside them; ``room``: nodes the context leaves (None: no limit)."""
        self.index.sync(seq)
        budget = MAX_COPY if room is None else min(MAX_COPY, room // branches)
        proposals = self.index.lookup(budget, branches, stops) if budget > 0 else []
        if not proposals:
            return [], True
        plan = plan_step(self.stats, proposals[0].match_len, len(proposals[0].tokens), tree, self.model_tokens,
                         profile, self.clock)
        if plan.copy_len == 0:
            return [], True
        return [dataclasses.replace(p, tokens=p.tokens[:plan.copy_len]) for p in proposals], plan.draft

    def learn(self, merged: MergedTree, proposals: list[CopyProposal], accepted: list[int], drafted: bool) -> None:
        """Count what the copies and the draft's tree gave this step (the verifier tries the copies
        first, in order, and stops at the first whose first token it keeps); ``drafted``: the draft
        model drafted a tree this step."""
        kept = set(accepted)
        for proposal, chain in zip(proposals, merged.chains):
            taken = sum(1 for node in chain if node in kept)
            self.stats.observe(proposal.match_len, len(chain), taken)
            if taken:
                break
        if drafted and not any(merged.sources[a] == SOURCE_COPY for a in accepted):
            from_draft = sum(1 for a in accepted[1:] if merged.model_node[a] > 0)
            self.model_tokens = 0.9 * self.model_tokens + 0.1 * (1 + from_draft)
            if self.memory is not None:
                self.memory.model_tokens[self.key] = self.model_tokens
