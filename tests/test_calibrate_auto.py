"""Calibration and tree="auto" on tiny models."""
from __future__ import annotations

import pytest
import tiny_models as tm
import torch

from engine import SpeculativeEngine, Tree
from engine.tuning.calibrate import Acceptance, calibrate
from engine.tuning.optimizer import AutoTuner, choose_tree, predict
from engine.tuning.profile import HardwareProfile, measure_profile

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
    result = calibrate(SpeculativeEngine(target, clone, stop_token_ids=[]), PROMPTS, temperature=0.0, k=4,
                       positions=30, tokens_per_prompt=12, progress=False)
    assert result.positions == 30 and result.vector == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_calibration_counts_ranks(models, temperature):
    target, noisy, _ = models
    result = calibrate(SpeculativeEngine(target, noisy, stop_token_ids=[]), PROMPTS, temperature=temperature,
                       k=8, positions=40, tokens_per_prompt=10, progress=False)
    assert result.positions == 40 and sum(result.counts) <= 40
    assert result.vector == [c / 40 for c in result.counts]
    assert result.vector[0] > 0.3 and result.none_accepted >= 0
    assert Acceptance.from_json(result.to_json()) == result


def test_auto_tree_uses_the_optimizer_and_stays_exact(models):
    target, noisy, _ = models
    flat = HardwareProfile("synthetic", "tiny", "float32", 8, target={1: 0.01, 64: 0.011},
                           draft={1: 0.001, 64: 0.001})
    tuner = AutoTuner(flat, {(0.0, 1.0): [0.8, 0.1, 0.05]}, max_size=32, max_depth=8)
    engine = SpeculativeEngine(target, noisy, stop_token_ids=[], tuner=tuner)
    result = engine.generate(PROMPTS[0], max_new_tokens=24, tree="auto")
    assert engine.last_tree_choice is not None and engine.last_tree_choice.size > 8
    assert result.steps[0].tree_size == engine.last_tree_choice.size
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
                        lambda model, prefix, n, repeats, runner, draft_level: calls.append(n) or next(readings))
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
    engine = SpeculativeEngine(target, noisy, stop_token_ids=[], tuner=tuner)
    result = engine.generate(PROMPTS[0], max_new_tokens=16, tree="auto", method=method)
    chosen = engine.last_tree_choice.tree
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
