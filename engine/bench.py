"""Benchmark: target-only decoding vs greedy tree speculative decoding, side by side in one process.

``python -m engine.bench --quick`` prints a table (tokens/s, ratio to target-only, tokens/step,
draft/verify split) and writes the raw figures to ``results/bench-*.json``. Runs are
interleaved per prompt so machine noise hits every configuration alike; figures are medians.
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .generate import DEFAULT_ACCEPTANCE
from .tree import Tree


@dataclass
class ConfigRuns:
    """Per-prompt measurements of one configuration."""

    name: str
    tree: Tree | None
    tokens_per_s: list[float] = field(default_factory=list)
    tokens_per_step: list[float] = field(default_factory=list)
    draft_share: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)

    def summary(self, baseline_tps: float) -> dict:
        tps = statistics.median(self.tokens_per_s)
        return {"name": self.name, "tree": self.tree.to_dict() if self.tree else None,
                "tokens_per_s": tps, "speedup": tps / baseline_tps,
                "tokens_per_step": statistics.median(self.tokens_per_step),
                "draft_share": statistics.median(self.draft_share),
                "runs_tokens_per_s": self.tokens_per_s}


def configurations(quick: bool) -> list[ConfigRuns]:
    configs = [ConfigRuns("target-only", None)]
    configs += [ConfigRuns(f"chain d={d}", Tree.chain(d)) for d in range(2, 7)]
    if not quick:
        configs += [ConfigRuns(f"sequoia n={n} d={d}", Tree.optimal(DEFAULT_ACCEPTANCE, n, d))
                    for n, d in ((8, 4), (16, 5), (32, 6))]
    return configs


def run(prompts: int, new_tokens: int, quick: bool, out_dir: Path) -> dict:
    from .models import load_default_pair
    from .prompts import encode_chat, load_prompt_set
    from .speculative import SpeculativeEngine

    target, draft, tokenizer = load_default_pair()
    engine = SpeculativeEngine(target, draft)
    prompt_ids = [encode_chat(tokenizer, p["messages"]) for p in load_prompt_set("chat")[:prompts]]
    configs = configurations(quick)
    engine.generate(prompt_ids[0], max_new_tokens=4, tree=Tree.chain(2))  # warm-up
    for i, ids in enumerate(prompt_ids):
        for config in configs:
            result = engine.generate(ids, max_new_tokens=new_tokens, tree=config.tree)
            config.tokens_per_s.append(result.tokens_per_second)
            config.tokens_per_step.append(result.tokens_per_step)
            config.draft_share.append(sum(s.timings.draft_s for s in result.steps) / result.decode_s)
            config.outputs.append(result.tokens)
            print(f"prompt {i}: {config.name:<22} {result.tokens_per_second:6.2f} tok/s "
                  f"{result.tokens_per_step:5.2f} tok/step", flush=True)
    baseline = statistics.median(configs[0].tokens_per_s)
    identical = all(c.outputs == configs[0].outputs for c in configs)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "prompts": prompts,
        "new_tokens": new_tokens, "temperature": 0.0, "outputs_identical_to_target_only": identical,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "results": [c.summary(baseline) for c in configs],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2))
    print()
    print(markdown_table(report))
    print(f"\noutputs identical to target-only: {identical}; peak RSS {report['peak_rss_gib']:.1f} GiB; saved {path}")
    return report


def markdown_table(report: dict) -> str:
    rows = ["| configuration | tokens/s | vs target-only | tokens/step | draft share |", "|---|---|---|---|---|"]
    for r in report["results"]:
        rows.append(f"| {r['name']} | {r['tokens_per_s']:.2f} | {r['speedup']:.2f}× | "
                    f"{r['tokens_per_step']:.2f} | {r['draft_share']:.0%} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2 prompts x 64 tokens, chains only")
    parser.add_argument("--prompts", type=int, default=None, help="number of bundled prompts (default 2 quick, 6 full)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per run (default 64 quick, 128 full)")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--device", default="cpu", help="cpu (the default pair) or cuda (see --synthetic)")
    parser.add_argument("--synthetic", default=None, metavar="TARGET+DRAFT",
                        help="GPU benchmark on random-weight models of these shapes, e.g. llama2-7b+llama-68m "
                             "(python -m engine.bench_gpu --help for its options)")
    args, rest = parser.parse_known_args(argv)
    if args.device != "cpu" or args.synthetic:
        from . import bench_gpu
        return bench_gpu.main(["--synthetic", args.synthetic or "llama2-7b+llama-68m", "--out", str(args.out), *rest])
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    prompts = args.prompts or (2 if args.quick else 6)
    new_tokens = args.new_tokens or (64 if args.quick else 128)
    run(prompts, new_tokens, args.quick, args.out)


if __name__ == "__main__":
    main()
