"""GPU benchmark on a random-weight pair with real shapes (default: Llama-2-7B target, Llama-68M draft).

``python -m bench.decode --device cuda --synthetic llama2-7b+llama-68m`` (or ``python -m
bench.gpu``) measures, in one process:

1. the hardware profile t_T(n), n = 1..1024, with static caches and CUDA graphs, and eagerly;
   the draft's t_D(w) per level width;
2. the optimizer's trees and predicted speedups for acceptance vectors calibrated on the real
   default pair (random models accept nothing, so acceptance must come from a real pair);
3. end to end: target-only tokens/s of this engine (graphs, eager, dynamic cache) and of HF
   ``generate``; the measured step time of the optimizer's tree, hence its projected tokens/s;
   HF assisted generation's measured tokens/s (at random acceptance: its overhead only);
4. with ``--offload``: the same profile with the target's layers streamed from pinned CPU memory
   (ours, double-buffered) and with accelerate's ``cpu_offload``, and the optimizer's choice there.

Writes ``bench-gpu-*.json`` and a plotly HTML of the profiles to ``--out``.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.core.runner import DynamicRunner, StaticRunner, synchronize
from engine.models.loading import DTYPES
from engine.models.synthetic import synthetic_model
from engine.tuning.optimizer import choose_tree
from engine.tuning.profile import HardwareProfile, device_name, measure_forward, powers_of_two


def default_pair_acceptance() -> dict[str, list[float]]:
    """The bundled calibrated vectors of the real default pair, by setting name."""
    from engine.tuning.calibrate import find_acceptance

    return {f"T={t:g} top-p={p:g}": vec for (t, p), vec in sorted(find_acceptance("default-target+default-draft").items())}


def profile_target(model, prefix: list[int], sizes: list[int], repeats: int, make,
                   draft_level: bool = False) -> dict[int, float]:
    """t(n) for each n, timing a runner ``make(max_len)`` (a fresh one per n); ``draft_level``
    includes the engine's per-level work on the logits (see :func:`measure_forward`)."""
    return {n: measure_forward(model, prefix, n, repeats, make(len(prefix) + n), draft_level) for n in sizes}


def static_runners(model, cuda_graphs: bool):
    """A factory of static runners of ``model`` (see :func:`profile_target`)."""
    return lambda max_len: StaticRunner(model, max_len, cuda_graphs=cuda_graphs)


def choices(acceptances: dict[str, list[float]], profile: HardwareProfile, max_size: int) -> dict[str, dict]:
    out = {}
    for name, acceptance in acceptances.items():
        c = choose_tree(acceptance, profile, max_size=max_size)
        out[name] = {"size": c.size, "depth": c.depth, "expected_tokens": c.expected_tokens,
                     "step_time_s": c.step_time_s, "predicted_speedup": c.predicted_speedup,
                     "parents": list(c.tree.parents)}
    return out


def timed(fn, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def end_to_end(target, draft, prompt: list[int], new_tokens: int, trees: dict, acceptances: dict) -> dict:
    from engine.core.speculative import SpeculativeEngine

    device = next(target.parameters()).device
    ids = torch.tensor([prompt], device=device)
    out: dict[str, dict] = {}

    def hf_generate(**kwargs):
        return lambda: target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kwargs)

    for name, fn in (("HF generate, target only", hf_generate()),
                     ("HF assisted generation (random draft)", hf_generate(assistant_model=draft))):
        fn()  # warm-up
        seconds = statistics.median(timed(fn, device) for _ in range(3))
        out[name] = {"tokens_per_s": new_tokens / seconds}
    for name, options in (("engine target-only, static cache + CUDA graphs", {}),
                          ("engine target-only, static cache, eager", {"cuda_graphs": False}),
                          ("engine target-only, dynamic cache, eager", {"static_cache": False})):
        engine = SpeculativeEngine(target, None, stop_token_ids=[], **options)
        engine.generate(prompt, max_new_tokens=8, tree=None, copies=False)
        runs = [engine.generate(prompt, max_new_tokens=new_tokens, tree=None, copies=False) for _ in range(3)]
        out[name] = {"tokens_per_s": statistics.median(r.tokens_per_second for r in runs)}
    baseline = out["engine target-only, static cache + CUDA graphs"]["tokens_per_s"]
    out.update(speculative_steps(SpeculativeEngine(target, draft, stop_token_ids=[]), prompt, new_tokens, trees,
                                 acceptances, baseline))
    return out


def speculative_steps(engine, prompt: list[int], new_tokens: int, trees: dict, acceptances: dict,
                      baseline_tps: float) -> dict:
    """Measured step time of each tree (random draft) and the tokens/s it projects at the real
    pair's acceptance: G(tree) / step time, and its ratio to ``baseline_tps``."""
    out = {}
    for setting, tree in trees.items():
        if tree.size == 1:
            continue
        engine.generate(prompt, max_new_tokens=new_tokens, tree=tree, copies=False)  # captures every width's graph
        result = engine.generate(prompt, max_new_tokens=new_tokens, tree=tree, copies=False)
        steps = result.steps
        step_s = result.decode_s / len(steps)
        expected = tree.expected_tokens(acceptances[setting])
        out[f"sequoia n={tree.size} d={tree.depth} ({setting})"] = {
            "measured_step_s": step_s,
            "draft_s": statistics.mean(s.timings.draft_s for s in steps),
            "verify_s": statistics.mean(s.timings.verify_s for s in steps),
            "bookkeeping_s": statistics.mean(s.timings.bookkeeping_s for s in steps),
            "tokens_per_step_random_draft": result.tokens_per_step,
            "expected_tokens_real_acceptance": expected,
            "projected_tokens_per_s": expected / step_s,
            "projected_speedup": expected / step_s / baseline_tps}
    return out


def offload_section(plan: "GpuPlan", draft, prefix: list[int], sizes: list[int], draft_profile: dict,
                    acceptances: dict, pair: str, new_tokens: int) -> dict:
    """The target streamed from pinned host memory layer by layer: its profile, the optimizer's
    trees for it, and decoding end to end (``new_tokens``), against accelerate's own offload."""
    from engine.backends.offload import accelerate_offload, stream_layers
    from engine.core.speculative import SpeculativeEngine
    from engine.trees.tree import Tree

    shape, dtype = plan.target_shape, plan.dtype
    result: dict = {}
    target = synthetic_model(shape, "cuda", dtype, seed=0)
    streamer = stream_layers(target, "cuda")
    result["host_gib"] = streamer.host_bytes / 2**30
    streamed = profile_target(target, prefix, sizes, 2, static_runners(target, False))
    result["streamed_target"] = streamed
    profile = HardwareProfile(device=torch.cuda.get_device_name(), pair=pair + " (offloaded)",
                              dtype=str(dtype).removeprefix("torch."), prefix_len=len(prefix),
                              target=streamed, draft=draft_profile)
    result["choices"] = choices(acceptances, profile, max(sizes))
    engine = SpeculativeEngine(target, None, stop_token_ids=[])
    engine.generate(prefix, max_new_tokens=2, tree=None, copies=False)
    baseline = engine.generate(prefix, max_new_tokens=new_tokens, tree=None, copies=False).tokens_per_second
    result["end_to_end"] = {"engine target-only, offloaded": {"tokens_per_s": baseline}}
    trees = {name: Tree.from_parents(c["parents"]) for name, c in result["choices"].items()}
    result["end_to_end"].update(speculative_steps(SpeculativeEngine(target, draft, stop_token_ids=[]), prefix,
                                                  new_tokens, trees, acceptances, baseline))
    del target, streamer, engine
    _free()
    target = accelerate_offload(synthetic_model(shape, "cuda", dtype, seed=0), "cuda")
    result["accelerate_target"] = {}
    for n in (1, 64):  # its parameters sit on "meta": the runner is told the device
        result["accelerate_target"][n] = measure_forward(target, prefix, n, 2, DynamicRunner(target, torch.device("cuda")))
    del target
    _free()
    return result


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class GpuPlan:
    """What :func:`run` measures: random-weight models of these shapes in ``dtype`` on ``device``,
    target forwards of up to ``max_tokens`` rows and draft levels up to ``max_width`` after a
    ``prefix_len``-token prefix (``repeats`` each), ``new_tokens`` decoded end to end, and with
    ``offload`` the target streamed from host memory."""

    target_shape: str
    draft_shape: str
    dtype: torch.dtype
    max_tokens: int
    prefix_len: int
    new_tokens: int
    repeats: int
    offload: bool = False
    device: str = "cuda"
    max_width: int = 64


def run(plan: GpuPlan, out_dir: Path) -> dict:
    """The whole benchmark; ``device="cpu"`` runs everything but offloading (a smoke test)."""
    target_shape, draft_shape, dtype, device = plan.target_shape, plan.draft_shape, plan.dtype, plan.device
    max_tokens, prefix_len, new_tokens, repeats = plan.max_tokens, plan.prefix_len, plan.new_tokens, plan.repeats
    max_width = plan.max_width
    pair = f"{target_shape}+{draft_shape} (random weights)"
    started = time.perf_counter()
    target = synthetic_model(target_shape, device, dtype, seed=0)
    draft = synthetic_model(draft_shape, device, dtype, seed=1)
    prefix = torch.randint(3, 32000, (prefix_len,), generator=torch.Generator().manual_seed(0)).tolist()
    sizes = powers_of_two(max_tokens)
    widths = powers_of_two(max_width)
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "gpu": device_name(torch.device(device)),
                    "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "pair": pair,
                    "prefix_len": prefix_len, "new_tokens": new_tokens}
    graphs = profile_target(target, prefix, sizes, repeats, static_runners(target, True))
    eager = profile_target(target, prefix, sizes, repeats, static_runners(target, False))
    draft_graphs = profile_target(draft, prefix, widths, repeats, static_runners(draft, True), draft_level=True)
    draft_eager = profile_target(draft, prefix, widths, repeats, static_runners(draft, False), draft_level=True)
    report["profile"] = {"target_graphs": graphs, "target_eager": eager,
                         "draft_graphs": draft_graphs, "draft_eager": draft_eager}
    profile = HardwareProfile(device=report["gpu"], pair=pair, dtype=report["dtype"], prefix_len=prefix_len,
                              target=graphs, draft=draft_graphs)
    acceptances = default_pair_acceptance()
    report["choices"] = choices(acceptances, profile, max_tokens)
    from engine.trees.tree import Tree
    trees = {name: Tree.from_parents(c["parents"]) for name, c in report["choices"].items()}
    report["end_to_end"] = end_to_end(target, draft, prefix, new_tokens, trees, acceptances)
    print_report(report)
    if plan.offload:
        del target
        _free()
        report["offload"] = offload_section(plan, draft, prefix, sizes, draft_graphs, acceptances, pair, new_tokens=16)
        print_offload(report["offload"])
    report["seconds"] = time.perf_counter() - started
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"bench-gpu-{stamp}.json"
    path.write_text(json.dumps(report, indent=2))
    plot(report, out_dir / f"bench-gpu-{stamp}.html")
    print(f"saved {path} ({report['seconds']:.0f} s)")
    return report


def print_report(report: dict) -> None:
    p = report["profile"]
    print(f"\n{report['gpu']}, {report['dtype']}, {report['pair']}, prefix {report['prefix_len']}")
    print("| n | t_T(n) graphs (ms) | eager (ms) | ratio to n=1 |\n|---|---|---|---|")
    for n, t in p["target_graphs"].items():
        print(f"| {n} | {t * 1e3:.2f} | {p['target_eager'][n] * 1e3:.2f} | {t / p['target_graphs'][1]:.2f} |")
    print("| draft width | t_D graphs (ms) | eager (ms) |\n|---|---|---|")
    for w, t in p["draft_graphs"].items():
        print(f"| {w} | {t * 1e3:.2f} | {p['draft_eager'][w] * 1e3:.2f} |")
    print_choices(report["choices"])
    print_end_to_end(report["end_to_end"])


def print_end_to_end(rows: dict) -> None:
    print("| end to end | tokens/s | step (ms) | projected tokens/s | projected speedup |\n|---|---|---|---|---|")
    for name, r in rows.items():
        if "tokens_per_s" in r:
            print(f"| {name} | {r['tokens_per_s']:.1f} | | | |")
        else:
            print(f"| {name} | | {r['measured_step_s'] * 1e3:.2f} (draft {r['draft_s'] * 1e3:.2f}, verify "
                  f"{r['verify_s'] * 1e3:.2f}) | {r['projected_tokens_per_s']:.1f} | {r['projected_speedup']:.2f}× |")


def print_choices(choices_: dict) -> None:
    print("| acceptance (default pair) | n | d | tokens/step | predicted speedup |\n|---|---|---|---|---|")
    for name, c in choices_.items():
        print(f"| {name} | {c['size']} | {c['depth']} | {c['expected_tokens']:.2f} | {c['predicted_speedup']:.2f}× |")


def print_offload(o: dict) -> None:
    print(f"\noffloaded target ({o['host_gib']:.1f} GiB pinned on the host)")
    print("| n | streamed t_T(n) (ms) | accelerate cpu_offload (ms) |\n|---|---|---|")
    for n, t in o["streamed_target"].items():
        acc = o["accelerate_target"].get(n)
        print(f"| {n} | {t * 1e3:.1f} | {'' if acc is None else f'{acc * 1e3:.1f}'} |")
    print_choices(o["choices"])
    print_end_to_end(o["end_to_end"])


def plot(report: dict, path: Path) -> None:
    import plotly.graph_objects as go

    fig = go.Figure()
    series = {"target, CUDA graphs": report["profile"]["target_graphs"],
              "target, eager": report["profile"]["target_eager"],
              "draft, CUDA graphs": report["profile"]["draft_graphs"]}
    if "offload" in report:
        series["target offloaded (streamed)"] = report["offload"]["streamed_target"]
    for name, points in series.items():
        fig.add_scatter(x=list(points), y=[t * 1e3 for t in points.values()], mode="lines+markers", name=name)
    fig.update_layout(title=f"Forward latency vs tokens, {report['gpu']} ({report['dtype']})",
                      xaxis={"title": "tokens in the forward", "type": "log"},
                      yaxis={"title": "ms", "type": "log"})
    fig.write_html(path, include_plotlyjs="cdn")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--synthetic", default="llama2-7b+llama-68m", help="TARGET+DRAFT shapes (engine.models.synthetic)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float16")
    parser.add_argument("--max-tokens", type=int, default=1024, help="largest n profiled (powers of two)")
    parser.add_argument("--prefix", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--offload", action="store_true", help="also profile the offloaded target")
    parser.add_argument("--max-width", type=int, default=64, help="largest draft level width profiled")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (no offloading)")
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no CUDA GPU here (use --device cpu for a smoke run)")
    if args.offload and not args.device.startswith("cuda"):
        parser.error("--offload streams weights to a CUDA GPU")
    target_shape, draft_shape = args.synthetic.split("+")
    run(GpuPlan(target_shape, draft_shape, DTYPES[args.dtype], args.max_tokens, args.prefix, args.new_tokens,
                args.repeats, args.offload, args.device, args.max_width), args.out)


if __name__ == "__main__":
    main()
