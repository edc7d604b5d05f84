"""A profile the app can trust: repeats with medians and a spread, a monotone fit, refusal of a noisy
or inconsistent measurement, and the slices the worker measures it in. Fake clocks throughout: the
forwards' times are given, never measured."""
from __future__ import annotations

import dataclasses
import json

import pytest
import test_app_support as support
import tiny_models as tm
import torch

import engine.tuning.profile as profile_module
from engine.models.prompts import ASSETS
from engine.tuning.profile import (AGREEMENT, HardwareProfile, QuickProfiler, fit_monotone, monotone_profile,
                                   refusals, spread)

PREFIX, CHAT = [5, 17, 3, 42, 9, 11] * 3, [7, 8, 9]
# a quiet machine's curves (seconds): t_T(n) grows with n, one draft level costs a third of a token
QUIET_TARGET = {1: 0.075, 2: 0.085, 4: 0.100, 8: 0.140, 16: 0.220}
QUIET_DRAFT = {1: 0.025, 2: 0.028, 4: 0.034}
OVERHEAD = 0.015
LAUNCH_RATE = 1 / (QUIET_TARGET[1] + OVERHEAD)  # tokens/s the launch measured with the target alone


@pytest.fixture(scope="module")
def models():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    target = tm.qwen2(seed=2)
    yield target, tm.perturbed(target, 0.003)
    torch.set_num_threads(before)


def fake_clock(target=QUIET_TARGET, draft=QUIET_DRAFT, slow=lambda kind, n, repeat: 1.0):
    """A ``measure_forward`` stand-in: the given curve, times ``slow(kind, n, repeat)``, with a
    little deterministic jitter (±2%) so that repeats differ as they do."""
    calls: dict[tuple[str, int], int] = {}

    def forward(model, prefix, n, repeats, runner, draft_level=False, prefilled=False):
        kind = "draft" if draft_level else "target"
        repeat = calls[kind, n] = calls.get((kind, n), -1) + 1
        jitter = 1 + 0.02 * ((repeat % 3) - 1)
        return (draft if draft_level else target)[n] * jitter * slow(kind, n, repeat)
    return forward


def measured(models, forward, overhead=OVERHEAD, repeats=3) -> tuple[HardwareProfile, QuickProfiler]:
    target, draft = models
    profiler = QuickProfiler(target, draft, None, "tiny", repeats, clocks=(forward, lambda *args: overhead),
                             prompts=(PREFIX, CHAT))
    slices = 0
    while not profiler.done:
        assert profiler.slices_left == repeats + 2 - slices
        profiler.measure_slice()
        slices += 1
    assert slices == repeats + 2  # the prefix, a round per repeat, the step overhead
    return profiler.profile(), profiler


def test_a_quiet_consistent_measurement_is_accepted(models):
    profile, _ = measured(models, fake_clock())
    assert refusals(profile, LAUNCH_RATE) == []
    assert profile.repeats == 3 and profile.measured_at.endswith("Z")
    assert profile.target == pytest.approx(QUIET_TARGET) and profile.draft == pytest.approx(QUIET_DRAFT)
    assert profile.target_raw == profile.target and profile.draft_raw == profile.draft  # nothing to fit
    assert set(profile.target_spread) == set(QUIET_TARGET) and 0 < profile.max_spread() <= 0.03
    assert profile.step_overhead == OVERHEAD
    assert HardwareProfile.from_json(profile.to_json()) == profile


def test_one_slow_repeat_of_one_size_is_refused_for_its_spread(models):
    """A busy spell during one round slows t_T(4) 3x once: the median hardly moves, but the
    repeats disagree, and the profile is refused rather than trusted."""
    profile, _ = measured(models, fake_clock(slow=lambda kind, n, r: 3.0 if (kind, n, r) == ("target", 4, 1) else 1.0))
    assert profile.target[4] == pytest.approx(QUIET_TARGET[4], rel=0.03)
    assert profile.target_spread[4] > 0.9
    reasons = refusals(profile, LAUNCH_RATE)
    assert len(reasons) == 1 and reasons[0].startswith("t_T(4) varied") and "limit 30%" in reasons[0]


def test_one_size_slowed_3x_throughout_is_refused_as_non_monotone(models):
    """The observed t_T(4) = 297 ms over t_T(8) = 205 ms: one size slowed in every repeat. The fit
    would hide it, so the curve as measured is judged, and refused."""
    profile, _ = measured(models, fake_clock(slow=lambda kind, n, r: 3.0 if (kind, n) == ("target", 4) else 1.0))
    assert profile.target_raw[4] > profile.target_raw[8]
    assert list(profile.target.values()) == sorted(profile.target.values())  # fitted all the same
    reasons = refusals(profile, LAUNCH_RATE)
    assert reasons == ["t_T(4) = 300 ms above t_T(8) = 140 ms"]


def test_a_small_dip_is_repaired_by_the_monotone_fit(models):
    """t_D(2) 5% under t_D(1), within noise: kept, the curve fitted to never decrease (the two
    pooled to their mean), the medians as measured kept beside it."""
    draft = {1: 0.025, 2: 0.02375, 4: 0.034}
    profile, _ = measured(models, fake_clock(draft=draft))
    assert refusals(profile, LAUNCH_RATE) == []
    assert profile.draft_raw == pytest.approx(draft)
    assert profile.draft[1] == pytest.approx(profile.draft[2]) == pytest.approx((0.025 + 0.02375) / 2)
    assert profile.draft[4] == pytest.approx(0.034)


def test_a_target_alone_60_percent_slower_than_the_launch_rate_is_refused(models):
    """Another program kept a core busy while t_T(1) was measured: 60% slower than the launch's
    own target-alone rate implies, beyond the ±15% the two may differ by."""
    slow_one = fake_clock(slow=lambda kind, n, r: 1.6 if kind == "target" else 1.0)
    profile, _ = measured(models, slow_one)
    assert refusals(profile) == []  # consistent in itself: only the launch's rate shows it
    reasons = refusals(profile, LAUNCH_RATE)
    assert len(reasons) == 1 and "measured at launch" in reasons[0] and f"±{AGREEMENT:.0%}" in reasons[0]
    # within the margin either way it passes
    assert refusals(profile, 1 / profile.token_time() * 1.12) == []
    assert refusals(profile, 1 / profile.token_time() / 1.12) == []


def test_fit_monotone_pools_adjacent_violators():
    assert fit_monotone({1: 124, 2: 150, 4: 297, 8: 205, 16: 300}) == {1: 124, 2: 150, 4: 251, 8: 251, 16: 300}
    assert fit_monotone({1: 3.0, 2: 2.0, 4: 1.0}) == {1: 2.0, 2: 2.0, 4: 2.0}
    assert fit_monotone({1: 1.0}) == {1: 1.0} and fit_monotone({}) == {}
    assert spread([1.0]) == 0.0 and spread([1.0, 1.0, 1.0]) == 0.0
    assert spread([1.0, 1.0, 3.0]) == pytest.approx(1.0)  # (3 - 1) / 2 over the median 1


def test_monotone_profile_keeps_what_was_measured():
    raw = HardwareProfile("d", "p", "float32", 8, target={1: 0.2, 2: 0.1}, draft={1: 0.01})
    fitted = monotone_profile(raw)
    assert fitted.target == {1: pytest.approx(0.15), 2: pytest.approx(0.15)} and fitted.target_raw == raw.target
    assert monotone_profile(fitted) == fitted  # fitted again from the same raw medians


def test_old_profile_json_without_the_new_fields_loads():
    old = {"device": "cpu-x86_64-avx2-2threads", "pair": "a+b", "dtype": "float32", "prefix_len": 128,
           "target": {"1": 0.07, "4": 0.09}, "draft": {"1": 0.02}, "step_overhead": 0.01, "kernels": "abc"}
    profile = HardwareProfile.from_json(json.dumps(old))
    assert profile.target == {1: 0.07, 4: 0.09} and profile.kernels == "abc"
    assert profile.measured_at == "" and profile.repeats == 0 and profile.max_spread() == 0.0
    assert profile.target_raw == {} and refusals(profile) == []
    # a field a later version adds is ignored
    assert HardwareProfile.from_json(json.dumps({**old, "later": 1})) == profile
    for path in (ASSETS / "profiles").glob("*.json"):  # the bundled ones, as written before
        bundled = HardwareProfile.from_json(path.read_text())
        assert bundled.target and bundled.measured_at == ""


def test_the_caption_shows_the_date_and_spread():
    from app.views import explain_figures as xf

    profile = HardwareProfile("d", "p", "float32", 128, {1: 0.07}, {1: 0.02}, measured_at="2026-11-29T06:50:12Z",
                              repeats=3, target_spread={1: 0.04}, draft_spread={1: 0.02})
    caption = xf.profile_caption(profile, "measured on this machine")
    assert "measured 2026-11-29 06:50 UTC, medians of 3 repeats that varied ≤ 4%" in caption
    assert "date of measurement not kept" in xf.profile_caption(dataclasses.replace(profile, measured_at="", repeats=0), "")


# ----- the worker: slices between answers, refusal and retries ------------------------------------

@pytest.fixture()
def worker(monkeypatch, tmp_path):
    from app.serving.pair import make_engine
    from app.serving.worker import Worker
    from engine.tuning.optimizer import AutoTuner

    from app.serving.jobs import GenerationRequest
    from engine.core.settings import DecodeSettings

    monkeypatch.setattr(profile_module, "measure_step_overhead", lambda *args: OVERHEAD)
    tokenizer = support.tokenizer()
    target, draft = support.tiny_pair()
    w = Worker(make_engine(target, draft, tokenizer), tokenizer, {"target": "tiny-target", "draft": "tiny-draft"})
    # a first answer loads what the engine builds in the user cache, before the cache moves to tmp_path
    assert w.submit(GenerationRequest([5, 17, 3], settings=DecodeSettings(max_new_tokens=2))).wait(600)[-1].kind == "done"
    monkeypatch.setenv("SEQUOIA_CACHE", str(tmp_path))
    bundled = HardwareProfile("test", "tiny", "float32", 128, target={1: 0.010, 16: 0.013}, draft={1: 0.001})
    w.set_tuner(AutoTuner(bundled, {(0.0, 1.0): [0.8, 0.1, 0.05]}, pair="tiny", max_size=16, max_depth=4,
                          origin="nearest bundled profile, measured on test"))
    yield w
    w.close()


def test_the_worker_refuses_an_inconsistent_profile_and_measures_again(worker, monkeypatch, tmp_path):
    monkeypatch.setattr(profile_module, "measure_forward",
                        fake_clock(slow=lambda kind, n, r: 1.6 if kind == "target" else 1.0))
    bundled = worker.tuner
    events = worker.measure_machine(reference_tokens_per_s=LAUNCH_RATE, checked=True, attempts=2, retry_after_s=0.05).wait(120)
    refused = [e.data for e in events if e.kind == "progress" and e.data.startswith("This machine's profile was refused")]
    assert len(refused) == 2 and "measuring again" in refused[0] and "(attempt 2 of 2)" in refused[0]
    assert "measured at launch" in refused[1] and "keeps the nearest bundled profile" in refused[1]
    assert events[-1].kind == "error" and events[-1].data.startswith("refused:")
    assert worker.tuner is bundled and not list(tmp_path.glob("profiles/*.json"))


def test_the_worker_measures_between_answers_and_keeps_a_consistent_profile(worker, monkeypatch, tmp_path):
    from app.serving.jobs import GenerationRequest
    from engine.core.settings import DecodeSettings
    from engine.trees.tree import Tree

    answer, after_the_answer = [], []  # per forward timed: had the answer finished?
    clock = fake_clock()
    monkeypatch.setattr(profile_module, "measure_forward",
                        lambda *a, **k: after_the_answer.append(answer[0].finished) or clock(*a, **k))
    job = worker.measure_machine(reference_tokens_per_s=LAUNCH_RATE, checked=True)
    answer.append(worker.submit(GenerationRequest([5, 17, 3, 42], settings=DecodeSettings(max_new_tokens=4, tree=Tree.chain(2)))))
    events = job.wait(300)
    assert answer[0].wait(60)[-1].kind == "done"
    assert events[-1].kind == "done", events[-1]
    # the answer waited a slice (the prefix, or one round over 8 sizes and widths), not the three rounds
    assert len(after_the_answer) == 8 * 3 and after_the_answer.count(False) <= 8
    tuner = worker.tuner
    assert tuner.measured_here and tuner.profile.target == pytest.approx(QUIET_TARGET, rel=0.03)
    kept = HardwareProfile.from_json(next(tmp_path.glob("profiles/*.json")).read_text())
    assert kept == tuner.profile and kept.repeats == 3 and kept.measured_at


def test_a_slice_waits_while_the_machine_is_busy(worker, monkeypatch):
    """With ``quiet_cores``, a timed slice is put off (re-queued a little later) while other work
    keeps more cores busy than that, then measured once the machine is quiet."""
    monkeypatch.setattr(profile_module, "measure_forward", fake_clock())
    monkeypatch.setattr(profile_module, "QUIET_RETRY_S", 0.01)
    busy = iter([1.5, 1.2])
    probes = []
    monkeypatch.setattr(profile_module, "others_busy", lambda: probes.append(1) or next(busy, 0.0))
    events = worker.measure_machine(reference_tokens_per_s=LAUNCH_RATE, quiet_cores=0.35, checked=True).wait(120)
    assert events[-1].kind == "done", events[-1]
    assert len(probes) == 2 + 4  # two busy looks, then one before each round and the step overhead


def test_the_launch_prints_each_refusal_and_the_end(capsys):
    from types import SimpleNamespace

    import launch
    from app.serving.jobs import Event

    refused = "This machine's profile was refused (t_T(4) = 300 ms above t_T(8) = 140 ms): the optimizer keeps the x."
    events = [Event("progress", "measuring this machine's forward times"), Event("progress", refused),
              Event("error", "refused: t_T(4) = 300 ms above t_T(8) = 140 ms")]
    launch.report_measurement(SimpleNamespace(iter_events=lambda: iter(events)), SimpleNamespace(tuner=None))
    lines = capsys.readouterr().out.splitlines()
    assert lines == [refused, "Measuring this machine did not finish (error: refused: t_T(4) = 300 ms above "
                              "t_T(8) = 140 ms); the bundled profile stays."]


def test_others_busy_reads_the_cpu_times_without_psutil(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "psutil", None)
    assert profile_module._busy_seconds() is None or profile_module._busy_seconds() > 0
    assert profile_module.others_busy(0.05) >= 0.0
