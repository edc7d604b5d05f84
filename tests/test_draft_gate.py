"""The draft gate: tree="auto" drafts only while the answer's own steps say drafting pays.

The gate's arithmetic on its own, then on tiny models: a draft that is kept far less than the
optimizer was told pauses drafting (greedy output unchanged, token for token), a draft that is
always kept never does, and an answer whose steps switch between drafting and the target alone
by what was sampled before still follows the target's law (KS test, p > 1e-3, as
tests/test_engine_sampling.py).
"""
from __future__ import annotations

import pytest
import test_app_support as support
import tiny_models as tm
import torch
from test_engine_sampling import PIT_SAMPLES, PROMPT, VOCAB, pit_values, sharpened
from test_verify_stats import P_MIN

from engine import SpeculativeEngine
from engine.core.draft_gate import DECAY, PRIOR_STEPS, PROBE_EVERY, DraftGate
from engine.trees.tree import Tree
from engine.tuning.optimizer import AutoTuner
from engine.tuning.profile import HardwareProfile
from engine.tuning.planner import TreePlanner

# Drafting is dear here (a draft level costs 0.3 of a target step), so the optimizer's pick pays
# only if the draft is kept as often as the acceptance vector says.
PROFILE = HardwareProfile("synthetic", "tiny", "float32", 8, target={1: 0.010, 2: 0.011, 8: 0.014, 64: 0.03},
                          draft={1: 0.003, 8: 0.0035, 64: 0.004})
OPTIMISTIC = [0.7, 0.1, 0.05]  # far more than the perturbed draft below is kept


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    yield from support.one_torch_thread()


@pytest.fixture(scope="module")
def target():
    return sharpened(tm.qwen2(seed=4, vocab_size=VOCAB, hidden_size=32, layers=1), 30.0)


def tuned_engine(target, draft) -> SpeculativeEngine:
    tuner = AutoTuner(PROFILE, {(0.0, 1.0): OPTIMISTIC, (0.7, 1.0): OPTIMISTIC}, max_size=16, max_depth=6)
    return SpeculativeEngine(target, draft, stop_token_ids=[], planner=TreePlanner(tuner=tuner))


def test_the_gate_pauses_when_steps_keep_less_than_predicted_and_probes_meanwhile():
    gate = DraftGate(predicted_tokens=3.0, predicted_cost=0.02, alone_cost=0.01)  # predicted 1.5x
    assert gate.speedup() == pytest.approx(1.5) and gate.drafts()
    chain = Tree.chain(5)
    step_cost = PROFILE.draft_time(2) + 4 * PROFILE.draft_time(1) + PROFILE.target_time(6) + PROFILE.step_overhead
    gate.observe(1, chain, chain.size, PROFILE)
    assert gate.drafts(), "one poor step is no evidence"
    for _ in range(11):  # one token per step at the price of a five-level chain
        gate.observe(1, chain, chain.size, PROFILE)
    weight = sum(DECAY ** k for k in range(12))
    assert gate.speedup() == pytest.approx((PRIOR_STEPS * 3.0 + weight) * 0.01
                                           / (PRIOR_STEPS * 0.02 + step_cost * weight))
    assert gate.speedup() < 1.0
    plan = []
    for _ in range(2 * PROBE_EVERY):
        drafts = gate.drafts()
        plan.append(drafts)
        gate.observe(1, chain, chain.size, PROFILE) if drafts else gate.pause()
    assert plan == ([False] * (PROBE_EVERY - 1) + [True]) * 2  # one probe in PROBE_EVERY steps
    assert gate.paused_steps == 2 * (PROBE_EVERY - 1)


def test_the_gate_keeps_drafting_while_steps_pay():
    gate = DraftGate(predicted_tokens=2.0, predicted_cost=0.015, alone_cost=0.01)
    chain = Tree.chain(2)
    for _ in range(30):
        assert gate.drafts()
        gate.observe(3, chain, chain.size, PROFILE)
    assert gate.speedup() > 1.5 and gate.paused_steps == 0


def test_an_answer_is_priced_by_its_steps_the_drafts_levels_and_its_rows():
    from engine import StepRecord
    from engine.core.draft_gate import priced_speedup

    def step(parents, committed, sources=()):
        n = len(parents)
        return StepRecord(index=0, tokens=list(range(n)), parents=list(parents), ranks=[0] + [1] * (n - 1),
                          draft_probs=[1.0] * n, target_probs=[1.0] * n, accepted=[0], committed=list(committed),
                          sources=list(sources))

    chain = step([-1, 0, 1], [7, 8, 9])                               # two levels drafted, three rows
    alone = step([-1], [7])                                            # a paused step
    copied = step([-1, 0, 0, 2], [7, 8], ["root", "draft", "copy", "copy"])  # one draft level beside a copy
    alone_s = PROFILE.target_time(1) + PROFILE.step_overhead
    seconds = (PROFILE.draft_time(2) + PROFILE.draft_time(1) + PROFILE.target_time(3) + alone_s
               + PROFILE.draft_time(2) + PROFILE.target_time(4) + PROFILE.step_overhead)
    assert priced_speedup([chain, alone, copied], PROFILE) == pytest.approx(6 * alone_s / seconds)
    assert priced_speedup([alone], PROFILE) == pytest.approx(1.0)
    assert priced_speedup([], PROFILE) is None


def test_a_draft_kept_less_than_calibrated_is_paused_and_the_output_is_the_targets(target):
    engine = tuned_engine(target, tm.perturbed(target, 0.3, seed=1))
    result = engine.generate(PROMPT, max_new_tokens=40, tree="auto", copies=False)
    assert result.decision.choice.predicted_speedup > 1.1 and result.decision.choice.depth >= 1
    paused = [step.draft_paused for step in result.steps]
    assert sum(paused) >= len(paused) // 2, paused
    assert all(step.tree_size == 1 for step in result.steps if step.draft_paused)
    drafted_after_a_pause = [i for i in range(1, len(paused)) if paused[i - 1] and not paused[i]]
    assert drafted_after_a_pause, "no probe: a paused answer would never draft again"
    assert result.tokens == tm.hf_greedy(target, PROMPT, 40)

    engine.gate_drafts = False  # the pick as it is, every step
    ungated = engine.generate(PROMPT, max_new_tokens=40, tree="auto", copies=False)
    assert not any(step.draft_paused for step in ungated.steps)
    assert all(step.tree_size > 1 for step in ungated.steps)
    assert ungated.tokens == result.tokens


def test_a_draft_that_is_always_kept_is_never_paused_and_manual_trees_are_never_gated(target):
    engine = tuned_engine(target, tm.clone(target))
    result = engine.generate(PROMPT, max_new_tokens=40, tree="auto", copies=False)
    assert not any(step.draft_paused for step in result.steps)
    poor = tuned_engine(target, tm.perturbed(target, 0.3, seed=1))
    manual = poor.generate(PROMPT, max_new_tokens=40, tree=poor.planner.choose(0.0, 1.0, "sequoia").tree, copies=False)
    assert not any(step.draft_paused for step in manual.steps)


def test_answers_that_switch_between_drafting_and_the_target_alone_follow_the_targets_law(target):
    """600 answers of 8 tokens at T = 0.7: whether a step drafts depends on what earlier steps
    sampled. KS test of the transformed values against the uniform law: p-value > 1e-3."""
    from scipy.stats import kstest

    engine = tuned_engine(target, tm.perturbed(target, 0.05, seed=1))
    generator = torch.Generator().manual_seed(31)
    values, paused, drafted = [], 0, 0
    for seed in range(PIT_SAMPLES):
        result = engine.generate(PROMPT, max_new_tokens=8, temperature=0.7, tree="auto", seed=seed, copies=False)
        values += pit_values(target, result.tokens, 0.7, 1.0, generator)
        paused += sum(step.draft_paused for step in result.steps)
        drafted += sum(step.tree_size > 1 for step in result.steps)
    assert paused > PIT_SAMPLES // 4 and drafted > PIT_SAMPLES, (paused, drafted)
    assert kstest(values, "uniform").pvalue > P_MIN
