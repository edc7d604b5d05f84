"""The GPU benchmark's code path, run small on CPU (the real run needs a GPU; see docs/benchmarks.md)."""
from __future__ import annotations

import json

import torch

from bench import gpu as bench_gpu


def test_gpu_benchmark_runs_end_to_end_on_cpu(tmp_path, capsys):
    plan = bench_gpu.GpuPlan("llama-test", "llama-test", torch.float32, max_tokens=4, prefix_len=8, new_tokens=6,
                             repeats=1, offload=False, device="cpu", max_width=2)
    report = bench_gpu.run(plan, tmp_path)
    assert set(report["profile"]["target_graphs"]) == {1, 2, 4}
    assert all(t > 0 for t in report["profile"]["draft_eager"].values())
    assert set(report["choices"]) == {"T=0 top-p=1", "T=0.6 top-p=1"}
    for choice in report["choices"].values():
        assert 1 <= choice["size"] <= 4 and len(choice["parents"]) == choice["size"]
    e2e = report["end_to_end"]
    assert e2e["HF generate, target only"]["tokens_per_s"] > 0
    assert e2e["engine target-only, static cache + CUDA graphs"]["tokens_per_s"] > 0
    saved = json.loads(next(tmp_path.glob("bench-gpu-*.json")).read_text())
    assert saved["pair"] == report["pair"]
    assert next(tmp_path.glob("bench-gpu-*.html")).stat().st_size > 1000
    assert "| n | t_T(n) graphs (ms)" in capsys.readouterr().out
