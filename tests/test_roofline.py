"""This machine's limits in "Why this tree" (engine.tuning.roofline, app.views.roofline_figures and the
panel's handler): the numbers shown are the ones computed from a hand-made profile and hand-made limits;
the what-ifs move the optimizer's pick the expected way; the handler returns figures. No timing is
asserted: the one measurement here is only checked to be a measurement."""
from __future__ import annotations

import pytest
import test_app_support as support
import tiny_models as tm
import torch

from app.views import roofline_figures as rf
from engine.backends.draft_vocabulary import with_draft_vocabulary
from engine.backends.kquant_model import kquant_model
from engine.core.records import StepRecord, StepTimings
from engine.kernels.build import kernels_available
from engine.tuning import roofline as rl
from engine.tuning.optimizer import choose_tree
from engine.tuning.profile import HardwareProfile
from test_explain import Q4K, app, tuner_for  # noqa: F401  (the tiny app fixture)

LIMITS = rl.MachineLimits(bandwidth_gbs=40.0, int8_gops=1000.0, measured_at="2026-01-02T03:04:05Z", threads=2)
PROFILE = HardwareProfile(device="cpu-test", pair="t+d", dtype="float32", prefix_len=128,
                          target={1: 0.030, 2: 0.032, 4: 0.040, 8: 0.067, 16: 0.117, 32: 0.228, 64: 0.484},
                          draft={1: 0.0115, 2: 0.0123, 4: 0.015, 8: 0.027, 16: 0.048})
# a chat calibration's shape: the draft's first choice accepted ~0.8 of the time, then a long tail
VECTOR = (0.8, 0.08, 0.03, 0.015, 0.008, 0.005, 0.003, 0.002)
ROOF = rl.Roofline(LIMITS, PROFILE, target_bytes=1_000_000_000, draft_bytes=250_000_000,
                   target_macs=1_500_000_000, draft_macs=400_000_000)


@pytest.fixture(autouse=True)
def one_thread():
    yield from support.one_torch_thread()


def traces(figure) -> dict:
    return {t.meta["kind"]: t for t in figure.data}


def test_the_floor_the_roof_and_where_rows_turn_compute_bound():
    assert ROOF.target_floor_s == pytest.approx(1e9 / 40e9)           # 25 ms
    assert ROOF.draft_floor_s == pytest.approx(2.5e8 / 40e9)          # 6.25 ms
    assert ROOF.compute_s(4) == pytest.approx(2 * 1.5e9 * 4 / 1e12)   # 12 ms
    assert ROOF.roof(4) == pytest.approx(0.025) and ROOF.roof(16) == pytest.approx(0.048)
    assert ROOF.compute_bound_from == 9                                # 8 rows: 24 ms, 9 rows: 27 ms
    assert ROOF.compute_s(9) > ROOF.target_floor_s > ROOF.compute_s(8)
    assert ROOF.measured_target() == PROFILE.target and ROOF.measured_draft() == PROFILE.draft
    assert rl.achieved_gops(ROOF) == pytest.approx(2 * 1.5e9 * 64 / 0.484 / 1e9)


def test_the_chart_shows_the_computed_numbers_and_the_pick():
    steps = [step(0, [-1, 0, 1], verify_s=0.035, draft_s=0.024),        # a chain of 2: 3 rows, 2 levels
             step(1, [-1, 0, 0, 1, 2], verify_s=0.045, draft_s=0.03),   # depth 2, 3 nodes with children
             step(2, [-1], verify_s=0.031, draft_s=0.0)]                # the target alone: no draft level
    pick = choose_tree(VECTOR, PROFILE, 64, 16)
    figure = rf.roofline_figure(ROOF, (pick.size, PROFILE.target_time(pick.size)), steps)
    t = traces(figure)
    xs = list(t["floor"].x)
    assert xs == [1, 2, 4, 8, 16, 32, 64]
    assert list(t["floor"].y) == pytest.approx([25.0] * len(xs))
    assert list(t["compute"].y) == pytest.approx([3.0 * n for n in xs])
    assert list(t["roof"].y) == pytest.approx([max(25.0, 3.0 * n) for n in xs])
    assert list(t["target"].x) == list(PROFILE.target)
    assert list(t["target"].y) == pytest.approx([v * 1e3 for v in PROFILE.target.values()])
    assert list(t["draft"].y) == pytest.approx([v * 1e3 for v in PROFILE.draft.values()])
    assert list(t["draft_floor"].y) == pytest.approx([6.25, 6.25])
    assert list(t["pick"].x) == [pick.size]
    assert list(t["pick"].y) == pytest.approx([PROFILE.target_time(pick.size) * 1e3])
    assert list(t["steps_verify"].x) == [3, 5, 1]
    assert list(t["steps_verify"].y) == pytest.approx([35.0, 45.0, 31.0])
    assert list(t["steps_draft"].x) == pytest.approx([1.0, 1.5])       # 2 nodes over 2 levels, 3 over 2
    assert list(t["steps_draft"].y) == pytest.approx([12.0, 15.0])
    assert "1.00 GB at 40 GB/s = 25.0 ms" in t["floor"].name


def step(index: int, parents: list[int], verify_s: float, draft_s: float) -> StepRecord:
    n = len(parents)
    return StepRecord(index=index, tokens=list(range(n)), parents=parents, ranks=[0] + [1] * (n - 1),
                      draft_probs=[1.0] * n, target_probs=[1.0] * n, accepted=[0], committed=[7],
                      timings=StepTimings(draft_s=draft_s, verify_s=verify_s))


def test_what_if_moves_the_pick_the_expected_way():
    here = rl.what_if(ROOF, VECTOR)
    assert (here.pick.size, here.pick.depth) == (choose_tree(VECTOR, PROFILE, 64, 16).size,
                                                 choose_tree(VECTOR, PROFILE, 64, 16).depth)
    assert here.tables.best()["speedup"] >= here.pick.predicted_speedup - 1e-9
    cheaper = rl.what_if(ROOF, VECTOR, draft_cost_scale=0.25)
    bigger = rl.what_if(ROOF, VECTOR, target_scale=7 / 1.5)
    dearer = rl.what_if(ROOF, VECTOR, draft_cost_scale=2.0)
    assert cheaper.pick.size > here.pick.size and cheaper.pick.predicted_speedup > here.pick.predicted_speedup
    assert bigger.pick.size > here.pick.size
    assert dearer.pick.size <= here.pick.size and dearer.pick.predicted_speedup < here.pick.predicted_speedup
    assert bigger.roofline.target_floor_s == pytest.approx(ROOF.target_floor_s * 7 / 1.5)
    assert bigger.roofline.profile.target_time(4) == pytest.approx(PROFILE.target_time(4) * 7 / 1.5)
    assert cheaper.roofline.profile.draft_time(2) == pytest.approx(PROFILE.draft_time(2) * 0.25)
    assert cheaper.roofline.profile.target == PROFILE.target
    with pytest.raises(ValueError):
        rl.what_if(rl.Roofline(LIMITS, None, 1, 1, 1), VECTOR)


def test_rescaled_profiles_follow_the_first_order_model():
    faster_rows = rl.rescaled(PROFILE, compute=2.0)
    assert faster_rows.target_time(1) == pytest.approx(0.030)
    assert faster_rows.target_time(8) == pytest.approx(0.030 + (0.067 - 0.030) / 2)
    slower_memory = rl.rescaled(PROFILE, bandwidth=0.5)
    assert slower_memory.target_time(8) == pytest.approx(0.060 + 0.037)
    assert slower_memory.draft_time(1) == pytest.approx(0.023)


def test_the_sentence_says_the_numbers_and_what_would_make_a_bigger_tree_pay():
    what = rl.what_if(ROOF, VECTOR)
    text = rl.one_sentence(what)
    assert "streams 1.00 GB of weights: at 40 GB/s its floor is 25 ms" in text
    assert "t_T(1) measures 30 ms (1.20× its floor)" in text
    assert "rows turn compute-bound past n = 8" in text
    assert f"The draft's level costs 12 ms, its floor is 6.2 ms: {0.0115 / 0.00625:.1f}× its floor" in text
    assert "A bigger tree would not pay" in text and "It would pay with draft levels at ≤" in text
    cheaper = float(text.split("draft levels at ≤ ")[1].split(" ms")[0]) / 1e3
    assert cheaper < PROFILE.draft_time(1)  # a cheaper draft, found by re-running the optimizer
    bigger = rl.what_if(rl.Roofline(LIMITS, rl.rescaled(PROFILE, draft=cheaper / PROFILE.draft_time(1) * 0.98),
                                    1_000_000_000, 250_000_000, 1_500_000_000), VECTOR)
    assert bigger.pick.size > what.pick.size


def test_weight_bytes_count_what_a_forward_streams():
    model = tm.qwen2(seed=3, vocab_size=64, hidden_size=32, layers=2)
    embedding = model.get_input_embeddings().weight
    tied = model.lm_head.weight.data_ptr() == embedding.data_ptr()
    everything = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    assert rl.weight_bytes(model) == everything - (0 if tied else embedding.nbytes)
    matrices = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert rl.multiply_adds(model) == matrices


@pytest.mark.skipif(not kernels_available(), reason="the k-quant kernels did not build")
def test_a_restricted_draft_streams_its_own_rows_of_the_head():
    draft = kquant_model(tm.qwen2(seed=8, vocab_size=64, hidden_size=128, layers=1))
    restricted = with_draft_vocabulary(draft, [1, 2, 3, 40, 63])
    head = sum(t.nbytes for t in draft.lm_head.buffers())
    part = sum(t.nbytes for t in restricted.lm_head.part.buffers()) + restricted.lm_head.kept.nbytes
    assert rl.weight_bytes(restricted) == rl.weight_bytes(draft) - head + part < rl.weight_bytes(draft)
    rows = restricted.lm_head.part.out_features
    assert rl.multiply_adds(restricted) == rl.multiply_adds(draft) - 64 * 128 + rows * 128


def test_measuring_the_machine_gives_a_measurement():
    limits = rl.measure_machine(0.5)
    assert limits.bandwidth_gbs > 0 and limits.int8_gops > 0 and limits.compute in ("int8", "float32")
    assert rl.machine_limits() is rl.machine_limits()  # once per process


# ----- the panel's handler -------------------------------------------------------------------------------
class Run:
    def __init__(self, steps):
        self.steps = steps


def test_the_handler_returns_the_chart_the_heatmap_and_the_sentence(app):  # noqa: F811
    chart, s_fig, text = app.explain.roofline(1.0, 1.0, None, "sequoia", 0.0, 1.0)
    assert "floor" in traces(chart) and "target" not in traces(chart)  # no profile: the limits alone
    assert "No profile" in text and not any(t.type == "heatmap" for t in s_fig.data)
    app.worker.set_tuner(tuner_for(Q4K))
    try:
        run = Run([step(0, [-1, 0, 1], verify_s=0.2, draft_s=0.1)])
        chart, s_fig, text = app.explain.roofline(1.0, 1.0, run, "sequoia", 0.0, 1.0)
        pick = app.worker.tuner.choose(0.0, 1.0)
        assert list(traces(chart)["pick"].x) == [pick.size]
        assert list(traces(chart)["steps_verify"].x) == [3]
        star = [t for t in s_fig.data if (t.meta or {}).get("kind") == "pick"][0]
        assert (star.x[0], star.y[0]) == (pick.size, max(pick.depth, 1))
        assert "A bigger tree would not pay" in text and "its floor is" in text
        cheap_chart, cheap_s, cheap_text = app.explain.roofline(0.25, 1.0, run, "sequoia", 0.0, 1.0)
        assert traces(cheap_chart)["pick"].x[0] > pick.size
        assert "What if: every draft level ×0.25" in cheap_text and "steps_verify" not in traces(cheap_chart)
        assert "if a draft level cost ×0.25" in cheap_s.layout.title.text
        big = app.explain.roofline(1.0, 4.0, run, "sequoia", 0.0, 1.0)[0]
        assert traces(big)["pick"].x[0] >= pick.size
        assert traces(big)["floor"].y[0] == pytest.approx(traces(chart)["floor"].y[0] * 4)
    finally:
        app.worker.set_tuner(None)
