"""``python -m bench.decode`` on the tiny pair: our engine and Hugging Face's generate / assisted
generation side by side, outputs compared, figures saved."""
from __future__ import annotations

import json

import pytest
import test_app_support as support

from bench import decode as bench


def test_bench_runs_ours_and_hugging_face_side_by_side(tmp_path, capsys):
    target, draft = support.tiny_pair()
    schedule = (draft.generation_config.num_assistant_tokens, draft.generation_config.num_assistant_tokens_schedule)
    report = bench.run(bench.BenchPlan(prompts=1, new_tokens=6, quick=True),
                       tmp_path, pair=(target, draft, support.tokenizer()))
    names = [r["name"] for r in report["results"]]
    assert names[:2] == ["target-only", "HF generate, target only"]
    assert "HF assisted generation (default schedule)" in names and "chain d=5" in names
    assert "sequoia n=16 d=6" in names
    ours = [r for r in report["results"] if r["step_ms"] is not None]
    assert ours and all(r["step_ms"]["verify"] > 0 for r in ours)
    # the constant schedule was set where HF reads it (the assistant's config) and undone after
    assert (draft.generation_config.num_assistant_tokens, draft.generation_config.num_assistant_tokens_schedule) == schedule
    assert report["outputs_identical_to_target_only"] and report["hf_outputs_identical_to_target_only"]
    assert all(r["tokens_per_s"] > 0 for r in report["results"])
    for r in report["results"]:  # one length a run; every token over every decode second
        assert r["runs_tokens_generated"] == [6]
        assert r["all_answers_tokens_per_s"] == pytest.approx(r["runs_tokens_per_s"][0])
    assert bench.all_answers_rate([2, 128], [40.0, 32.0]) == pytest.approx(130 / (2 / 40 + 128 / 32))
    assert json.loads(next(tmp_path.glob("bench-*.json")).read_text())["results"][0]["speedup"] == 1.0
    assert "plotly" in next(tmp_path.glob("bench-*.html")).read_text()
    assert "| HF assisted generation, 4 draft tokens |" in capsys.readouterr().out


def test_bench_samples_at_a_temperature(tmp_path):
    target, draft = support.tiny_pair()
    report = bench.run(bench.BenchPlan(prompts=1, new_tokens=4, quick=True, temperature=0.6, top_p=0.9, repeats=2),
                       tmp_path, pair=(target, draft, support.tokenizer()))
    assert (report["temperature"], report["top_p"], report["repeats"]) == (0.6, 0.9, 2)
    assert all(len(r["runs_tokens_per_s"]) == 2 for r in report["results"])  # one run per round
    assert all(r["ms_per_token"] == pytest.approx(1e3 / r["tokens_per_s"]) for r in report["results"])
    assert report["outputs_identical_to_target_only"] is False  # not compared when sampling
    methods = {r["name"]: r["method"] for r in report["results"]}
    assert methods["specinfer n=16 d=6"] == "specinfer" and methods["chain d=3"] == "chain"
    assert all(r["tokens_per_s"] > 0 for r in report["results"])


def test_step_profile_lists_the_operators_of_real_steps():
    import tiny_models as tm

    from engine import SpeculativeEngine, Tree
    from engine.cli.step_profile import profile_steps

    target = tm.qwen2(seed=1)
    engine = SpeculativeEngine(target, tm.perturbed(target, 0.01), stop_token_ids=[])
    table = profile_steps(engine, [3, 9, 27], Tree.chain(2), tokens=6, temperature=0.0, top_p=1.0)
    assert "tokens/step" in table and "verify" in table
    assert "aten::" in table  # the profiler's operator rows
