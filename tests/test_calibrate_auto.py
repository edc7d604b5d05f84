"""Calibration and tree="auto" on tiny models."""
from __future__ import annotations

import pytest
import tiny_models as tm
import torch

from engine import SpeculativeEngine, Tree
from engine.tuning.calibrate import CalibrationPlan, Acceptance, calibrate
from engine.tuning.optimizer import AutoTuner, choose_tree, predict
from engine.tuning.profile import HardwareProfile, measure_profile
from engine.tuning.planner import TreePlanner

PROMPTS = [[5, 17, 3, 42, 9, 11], [7, 8, 9], [1, 2, 3, 4]]


@pytest.fixture(scope="module")
def models():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    target = tm.qwen2(seed=2)
    yield target, tm.perturbed(target, 0.003), tm.clone(target)
    torch.set_num_threads(before)


def test_a_clone_draft_is_always_accepted_at_rank_1(models):
    target, _, clone = models
    result = calibrate(SpeculativeEngine(target, clone, stop_token_ids=[]), PROMPTS, temperature=0.0, plan=CalibrationPlan(k=4, positions=30, tokens_per_prompt=12), progress=False)
    assert result.positions == 30 and result.vector == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_calibration_counts_ranks(models, temperature):
    target, noisy, _ = models
    result = calibrate(SpeculativeEngine(target, noisy, stop_token_ids=[]), PROMPTS, temperature=temperature,
                       plan=CalibrationPlan(k=8, positions=40, tokens_per_prompt=10), progress=False)
    assert result.positions == 40 and sum(result.counts) <= 40
    assert result.vector == [c / 40 for c in result.counts]
    assert result.vector[0] > 0.3 and result.none_accepted >= 0
    assert Acceptance.from_json(result.to_json()) == result


def test_auto_tree_uses_the_optimizer_and_stays_exact(models):
    target, noisy, _ = models
    flat = HardwareProfile("synthetic", "tiny", "float32", 8, target={1: 0.01, 64: 0.011},
                           draft={1: 0.001, 64: 0.001})
    tuner = AutoTuner(flat, {(0.0, 1.0): [0.8, 0.1, 0.05]}, max_size=32, max_depth=8)
    engine = SpeculativeEngine(target, noisy, stop_token_ids=[], planner=TreePlanner(tuner=tuner))
    result = engine.generate(PROMPTS[0], max_new_tokens=24, tree="auto", copies=False)
    assert result.decision.choice is not None and result.decision.choice.size > 8
    assert result.steps[0].tree_size == result.decision.choice.size
    assert result.tokens == tm.hf_greedy(target, PROMPTS[0], 24)


def test_measured_profile_has_every_point(models):
    target, noisy, _ = models
    profile = measure_profile(target, noisy, PROMPTS[0] * 3, sizes=[1, 2, 4], widths=[1, 2], pair="tiny",
                              repeats=1, progress=False)
    assert set(profile.target) == {1, 2, 4} and set(profile.draft) == {1, 2}
    assert all(t > 0 for t in [*profile.target.values(), *profile.draft.values()])


def test_profile_times_sizes_round_robin_and_keeps_medians(models, monkeypatch):
    """Rounds over all sizes (a slow spell hits every size alike), medians per size."""
    import engine.tuning.profile as profile_module

    target, noisy, _ = models
    calls, readings = [], iter([5, 1, 7, 9, 2, 8, 6, 3, 4])
    monkeypatch.setattr(profile_module, "measure_forward",
                        lambda model, prefix, n, repeats, runner, draft_level, prefilled: calls.append(n) or next(readings))
    profile = measure_profile(target, None, PROMPTS[0], sizes=[1, 2, 4], widths=[], pair="tiny", repeats=3,
                              progress=False)
    assert calls == [1, 2, 4] * 3
    assert profile.target == {1: 6, 2: 2, 4: 7}  # medians of (5, 9, 6), (1, 2, 3), (7, 8, 4)


@pytest.mark.parametrize("method", ["chain", "sequoia", "specinfer", "topk"])
def test_auto_honours_the_methods_constraint(models, method):
    """On a profile where a branching tree wins, auto with method ``chain`` picks the best chain
    (and runs, greedy-exact); the other methods keep the branching tree."""
    target, noisy, _ = models
    flat = HardwareProfile("synthetic", "tiny", "float32", 8, target={1: 0.01, 64: 0.011},
                           draft={1: 0.001, 64: 0.001})
    tuner = AutoTuner(flat, {(0.0, 1.0): [0.8, 0.1, 0.05]}, max_size=32, max_depth=8)
    engine = SpeculativeEngine(target, noisy, stop_token_ids=[], planner=TreePlanner(tuner=tuner))
    result = engine.generate(PROMPTS[0], max_new_tokens=16, tree="auto", method=method, copies=False)
    chosen = result.decision.choice.tree
    is_chain = chosen.size == chosen.depth + 1
    assert is_chain == (method == "chain")
    if method == "chain":
        best = max((predict(Tree.chain(d), [0.8, 0.1, 0.05], flat) for d in range(1, 9)),
                   key=lambda c: c.predicted_speedup)
        assert chosen == best.tree and chosen.depth > 1
    assert result.tokens == tm.hf_greedy(target, PROMPTS[0], 16)


def test_auto_uses_the_calibration_nearest_to_the_setting(models):
    target, noisy, _ = models
    flat = HardwareProfile("synthetic", "tiny", "float32", 8, target={1: 0.01, 64: 0.011},
                           draft={1: 0.001, 64: 0.001})
    sharp, weak = [0.9, 0.05, 0.02], [0.3, 0.1, 0.05]
    tuner = AutoTuner(flat, {(0.0, 1.0): sharp, (1.0, 0.9): weak}, max_size=32, max_depth=8)
    assert tuner.calibration(0.1, 1.0).vector == tuple(sharp)
    assert tuner.calibration(0.9, 0.9).vector == tuple(weak)
    assert tuner.choose(0.1, 1.0).tree == choose_tree(sharp, flat, 32, 8).tree
    assert tuner.choose(0.9, 0.9).tree == choose_tree(weak, flat, 32, 8).tree


# ----- growth by confidence --------------------------------------------------------------------
# A CPU-like profile: a draft level costs a third of a target token and each verified row 15% more.
DEAR_DRAFT = HardwareProfile("synthetic", "tiny", "float32", 8, target={1: 0.030, 2: 0.0345, 4: 0.0435, 8: 0.0615},
                             draft={1: 0.010, 2: 0.011, 4: 0.013, 8: 0.017})
# The draft is sure (q 0.95, always accepted) at 60% of positions and unsure (q 0.2, accepted 30%) elsewhere.
SURE_OR_NOT = [(0.95, 1)] * 6 + [(0.2, 1)] * 3 + [(0.2, 0)] * 7


def test_calibration_records_what_growth_is_predicted_from(models):
    target, noisy, clone = models
    sure = calibrate(SpeculativeEngine(target, clone, stop_token_ids=[]), PROMPTS, temperature=0.0, plan=CalibrationPlan(k=4, positions=20, tokens_per_prompt=8), progress=False)
    assert len(sure.confidence) == 20 and all(accepted == 1 and 0 < q <= 1 for q, accepted in sure.confidence)
    sampled = calibrate(SpeculativeEngine(target, noisy, stop_token_ids=[]), PROMPTS, temperature=0.8, plan=CalibrationPlan(k=4, positions=20, tokens_per_prompt=8), progress=False)
    assert len(sampled.confidence) == 20 and {accepted for _, accepted in sampled.confidence} <= {0, 1}
    assert Acceptance.from_json(sampled.to_json()) == sampled


def test_a_grown_chain_is_predicted_exactly_in_the_limits():
    """Always sure and right: every step drafts and accepts the whole chain. Never sure: one level a
    step, costed as a fixed one-token chain."""
    from engine.tuning.optimizer import grown_chain

    sure = grown_chain([(1.0, 1)] * 1000, 4, 0.5, DEAR_DRAFT)
    assert sure.expected_tokens == 5 and sure.confidence == 0.5 and sure.tree == Tree.chain(4)
    assert sure.step_time_s == pytest.approx(DEAR_DRAFT.draft_time(2) + 3 * DEAR_DRAFT.draft_time(1)
                                             + DEAR_DRAFT.target_time(5))
    fixed = predict(Tree.chain(1), [0.5], DEAR_DRAFT)
    for samples, tokens in (([(0.1, 0)] * 100, 1.0), ([(0.1, 1), (0.1, 0)] * 50, 2.0)):  # a step skips the bonus
        unsure = grown_chain(samples, 4, 0.5, DEAR_DRAFT)
        assert unsure.step_time_s == pytest.approx(fixed.step_time_s) and unsure.expected_tokens == tokens


def test_the_optimizer_grows_chains_where_the_draft_is_sure_and_keeps_the_fixed_tree_apart():
    vector = [sum(a for _, a in SURE_OR_NOT) / len(SURE_OR_NOT)]
    tuner = AutoTuner(DEAR_DRAFT, {(0.0, 1.0): vector}, max_size=16, max_depth=8,
                      confidence={(0.0, 1.0): SURE_OR_NOT})
    grown, fixed = tuner.choose(0.0, 1.0), tuner.choose(0.0, 1.0, grown=False)
    assert grown.confidence > 0.2 and grown.depth >= 2 and grown.predicted_speedup > fixed.predicted_speedup
    assert fixed.confidence == 0 and fixed.tree == choose_tree(vector, DEAR_DRAFT, 16, 8).tree
    assert AutoTuner(DEAR_DRAFT, {(0.0, 1.0): vector}, max_size=16, max_depth=8).choose(0.0, 1.0) == fixed


def test_auto_runs_the_grown_chain_it_picked_and_stays_exact(models):
    target, noisy, _ = models
    tuner = AutoTuner(DEAR_DRAFT, {(0.0, 1.0): [0.6]}, max_size=16, max_depth=8, confidence={(0.0, 1.0): SURE_OR_NOT})
    engine = SpeculativeEngine(target, noisy, stop_token_ids=[], planner=TreePlanner(tuner=tuner))
    generation = engine.stream(PROMPTS[0], max_new_tokens=24, tree="auto", copies=False)
    steps = list(generation)
    choice = generation.decision.choice
    assert choice.confidence > 0
    # the tiny draft's laws are flat (q ~ 0.02): under any such threshold every step stops at one level
    assert all(step.parents == [-1, 0] for step in steps)
    assert [t for step in steps for t in step.committed] == tm.hf_greedy(target, PROMPTS[0], 24)
    forced = list(engine.stream(PROMPTS[0], max_new_tokens=24, tree="auto", confidence=0.0, copies=False))
    assert max(len(step.tokens) for step in forced) == choice.tree.size  # an explicit threshold wins
