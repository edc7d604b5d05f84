"""Calibration and tree="auto" on tiny models."""
from __future__ import annotations

import pytest
import torch

import tiny_models as tm
from engine import SpeculativeEngine, Tree
from engine.calibrate import Acceptance, calibrate
from engine.optimizer import AutoTuner
from engine.profile import HardwareProfile, measure_profile, nondecreasing

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
    for curve in (profile.target, profile.draft):
        times = [curve[n] for n in sorted(curve)]
        assert times == sorted(times)


def test_nondecreasing_pools_readings_that_dip():
    """The bundled CPU profile once read n=4 at 175 ms between n=1 at 280 and n=8 at 259."""
    fitted = nondecreasing({1: 0.280, 2: 0.291, 4: 0.175, 8: 0.259, 16: 0.334})
    assert list(fitted) == [1, 2, 4, 8, 16]
    assert fitted[1] == fitted[2] == fitted[4] == pytest.approx((0.280 + 0.291 + 0.175) / 3)
    assert (fitted[8], fitted[16]) == (0.259, 0.334)
    assert nondecreasing({1: 1.0, 2: 2.0, 3: 3.0}) == {1: 1.0, 2: 2.0, 3: 3.0}
    assert nondecreasing({4: 5.0, 1: 1.0, 2: 3.0}) == {1: 1.0, 2: 3.0, 4: 5.0}
