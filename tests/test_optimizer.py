"""The hardware-aware optimizer on synthetic profiles, and profile interpolation."""
from __future__ import annotations

import pytest

from engine.trees.tree import Tree
from engine.tuning.optimizer import choose_tree, predict
from engine.tuning.profile import HardwareProfile

ACCEPTANCE = [0.7, 0.12, 0.05, 0.03, 0.02, 0.01]
SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def synthetic(target_ms, draft_ms=lambda w: 1.0) -> HardwareProfile:
    return HardwareProfile(device="synthetic", pair="test", dtype="float32", prefix_len=128,
                           target={n: target_ms(n) / 1e3 for n in SIZES},
                           draft={w: draft_ms(w) / 1e3 for w in (1, 2, 4, 8, 16, 32, 64)})


def test_flat_verification_cost_picks_a_large_tree():
    choice = choose_tree(ACCEPTANCE, synthetic(lambda n: 30.0))  # GPU-like: n tokens cost as one
    assert choice.size >= 64
    assert choice.predicted_speedup > 3


def test_steep_verification_cost_picks_a_small_tree():
    choice = choose_tree(ACCEPTANCE, synthetic(lambda n: 30.0 * n, draft_ms=lambda w: 3.0))  # cost linear in n
    assert choice.size <= 4


def test_expensive_draft_means_no_speculation():
    choice = choose_tree(ACCEPTANCE, synthetic(lambda n: 30.0, draft_ms=lambda w: 60.0))
    assert choice.size == 1 and choice.predicted_speedup == pytest.approx(1.0)


def test_middle_ground_grows_with_flatness():
    steep = choose_tree(ACCEPTANCE, synthetic(lambda n: 30.0 + 4.0 * n))
    flat = choose_tree(ACCEPTANCE, synthetic(lambda n: 30.0 + 0.2 * n))
    assert steep.size < flat.size


def test_prediction_formula():
    profile = synthetic(lambda n: 10.0 + n, draft_ms=lambda w: 2.0)
    tree = Tree.chain(3)
    choice = predict(tree, ACCEPTANCE, profile)
    step = (10.0 + 4) / 1e3 + 3 * 2.0 / 1e3   # verify 4 tokens + 3 draft levels with children
    assert choice.step_time_s == pytest.approx(step)
    assert choice.predicted_speedup == pytest.approx(tree.expected_tokens(ACCEPTANCE) * 11.0 / 1e3 / step)


def test_profile_interpolates_and_round_trips():
    profile = synthetic(lambda n: 10.0 + n)
    assert profile.target_time(3) == pytest.approx((10.0 + 3) / 1e3)
    assert profile.target_time(512) == pytest.approx((10.0 + 512) / 1e3)
    assert HardwareProfile.from_json(profile.to_json()) == profile


def test_a_step_overhead_is_paid_by_every_step_and_favours_drafting():
    """S = G (t_T(1) + o) / (t_T(n) + draft + o): with the target alone just ahead without an
    overhead, a per-step cost that every step pays makes a chain pay for itself."""
    profile = synthetic(lambda n: 90.0 + 15.0 * (n - 1), draft_ms=lambda w: 54.0)
    chain = Tree.chain(1)
    bare = predict(chain, ACCEPTANCE, profile)
    assert bare.predicted_speedup < 1.0 and choose_tree(ACCEPTANCE, profile).size == 1
    profile.step_overhead = 0.040
    paid = predict(chain, ACCEPTANCE, profile)
    assert paid.step_time_s == pytest.approx(bare.step_time_s + 0.040)
    assert paid.predicted_speedup == pytest.approx(paid.expected_tokens * 0.130 / paid.step_time_s)
    assert paid.predicted_speedup > 1.0 and choose_tree(ACCEPTANCE, profile).size > 1
    assert profile.token_time() == pytest.approx(0.130)
    assert HardwareProfile.from_json(profile.to_json()) == profile


def test_a_profile_saved_before_the_overhead_term_reads_as_no_overhead():
    import json

    raw = json.loads(synthetic(lambda n: 30.0).to_json())
    del raw["step_overhead"]
    assert HardwareProfile.from_json(json.dumps(raw)).step_overhead == 0.0


def test_cpu_profiles_are_named_by_the_isa_the_kernels_use(monkeypatch):
    """A profile measured on an AVX2 CPU must not price trees on an AVX-512 VNNI one (the k-quant
    kernels run several times faster there), so the CPU's ISA is part of the device name."""
    import torch

    from engine.kernels import cpu
    from engine.tuning.profile import cpu_isa, device_name

    for flags, isa in [({"avx2", "avx512f", "avx512bw", "avx512_vnni"}, "avx512vnni"),
                       ({"avx2", "avx512f"}, "avx2"), ({"sse4_2"}, "generic"), (set(), "generic")]:
        monkeypatch.setattr(cpu, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert cpu_isa() == isa
        assert device_name(torch.device("cpu")).endswith(f"-{isa}-{torch.get_num_threads()}threads")
    # the AVX2 path run on an AVX-512 CPU ($SEQUOIA_KERNEL_MARCH) is priced as the AVX2 path
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512bw", "avx512_vnni"}))
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    for march, isa in (("x86-64-v3", "avx2"), ("x86-64", "generic"), ("native", "avx512vnni")):
        monkeypatch.setenv("SEQUOIA_KERNEL_MARCH", march)
        assert cpu_isa() == isa


def test_a_device_without_a_profile_borrows_the_nearest_and_says_whose(tmp_path, monkeypatch):
    """4 threads where only 2- and 16-thread profiles exist: the 2-thread one of the same ISA (the
    nearest), labelled; a user-cache profile of exactly this device is "this machine", unless it was
    measured with other kernels than these (then this machine is measured again)."""
    import dataclasses

    import torch

    from engine.kernels.build import kernel_digest

    from engine.tuning import optimizer
    from engine.tuning.profile import device_name, profile_path

    pair = "t+d"
    here = device_name(torch.device("cpu"))
    kind = here.rsplit("-", 1)[0]
    bundled, user = tmp_path / "assets", tmp_path / "cache"
    for directory, device in ((bundled, f"{kind}-2threads"), (bundled, f"{kind}-16threads"),
                              (bundled, "cpu-x86_64-othersimd-4threads")):
        path = profile_path(directory / "profiles", device, pair, "float32")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dataclasses.replace(synthetic(lambda n: 0.01 * n), device=device).to_json())
    monkeypatch.setattr("engine.models.prompts.ASSETS", bundled)
    monkeypatch.setattr("engine.tuning.calibrate.find_calibrations",
                        lambda pair, directories=None: {(0.0, 1.0): type("V", (), {"vector": [0.8], "confidence": []})()})
    model = torch.nn.Linear(2, 2)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        tuner = optimizer.load_tuner(pair, model, cache=user)
        assert tuner is not None and not tuner.measured_here
        assert tuner.profile.device == f"{kind}-2threads" and f"{kind}-2threads" in tuner.origin
        assert optimizer.load_tuner(pair, model, cache=user, nearest=False) is None
        mine = profile_path(user / "profiles", device_name(torch.device("cpu")), pair, "float32")
        mine.parent.mkdir(parents=True)
        for stale in ("", "0123456789ab"):  # measured before kernels were recorded, or with other kernels
            mine.write_text(dataclasses.replace(synthetic(lambda n: 0.02 * n), kernels=stale).to_json())
            tuner = optimizer.load_tuner(pair, model, cache=user)
            assert not tuner.measured_here and f"{kind}-2threads" in tuner.origin
        mine.write_text(dataclasses.replace(synthetic(lambda n: 0.02 * n), kernels=kernel_digest()).to_json())
        tuner = optimizer.load_tuner(pair, model, cache=user)
        assert tuner.measured_here and tuner.origin == "this machine"
    finally:
        torch.set_num_threads(before)
