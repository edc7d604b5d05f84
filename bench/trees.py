"""Scalability of tree shapes: tokens/step vs tree size for Sequoia's DP tree, k independent chains
and complete binary trees, measured on the real pair (the paper's scalability figure).

Greedy (T = 0) figures come from the exact replay (``engine.tuning.replay``): the bundled prompts'
greedy continuations are generated once, the draft's rank of every continuation token is taken
from one causal pass, and every tree is replayed over those ranks. The acceptance vector that
shapes the DP tree is measured on the even-numbered prompts; tokens/step is measured on the
odd-numbered ones, so the DP tree is not fitted to the text it is scored on.

Sampled (T > 0) figures come from the exact sampled replay (``engine.tuning.sampled_replay``): steps
simulated from roots along the same texts, evaluating the models only where the walks go, with
the acceptance vector per (temperature, top-p) measured the same way on the even prompts. They
give the scalability at ``--temperature`` and the robustness grid (sequoia vs specinfer vs topk
verifying the same DP tree across temperatures and top-p).

``python -m bench.trees`` writes ``results/trees-*.json`` and an HTML plot.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from engine.trees.tree import Tree
from engine.tuning.replay import draft_ranks, greedy_acceptance, tokens_per_step
from engine.tuning.sampled_replay import Setting, rank_histogram, replay_sequence

SIZES = (2, 4, 8, 16, 32, 64, 128, 256)


def complete_binary(n: int) -> Tree:
    """The first n nodes, breadth-first, of an infinite binary tree."""
    return Tree.from_parents([-1] + [(i - 1) // 2 for i in range(1, n)])


def k_chain_options(n: int) -> list[Tree]:
    """k independent chains of equal depth with at most n nodes, for every k."""
    return [Tree.k_independent(k, (n - 1) // k) for k in range(1, n) if (n - 1) // k >= 1]


def sequoia_tree(acceptance: list[float], n: int, max_depth: int = 24) -> Tree:
    return Tree.optimal(acceptance, n, min(n - 1, max_depth))


def greedy_scalability(acceptance: list[float], eval_ranks: list[list[int]], sizes=SIZES) -> list[dict]:
    held_out_acceptance = greedy_acceptance(eval_ranks)  # the DP's prediction had it known the test text
    rows = []
    for n in sizes:
        sequoia = sequoia_tree(acceptance, n)
        chains = max(k_chain_options(n), key=lambda t: tokens_per_step(t, eval_ranks))
        binary = complete_binary(n)
        rows.append({
            "size": n,
            "sequoia": tokens_per_step(sequoia, eval_ranks), "sequoia_predicted": sequoia.expected_tokens(acceptance),
            "sequoia_predicted_held_out": sequoia.expected_tokens(held_out_acceptance),
            "sequoia_depth": sequoia.depth,
            "k_chains": tokens_per_step(chains, eval_ranks), "k_chains_k": len(chains.children[0]),
            "binary": tokens_per_step(binary, eval_ranks),
        })
        r = rows[-1]
        print(f"n={n:4d}  sequoia {r['sequoia']:.2f} (DP predicts {r['sequoia_predicted']:.2f}, d={r['sequoia_depth']})"
              f"  best k-chains {r['k_chains']:.2f} (k={r['k_chains_k']})  binary {r['binary']:.2f}", flush=True)
    return rows


def root_positions(prompt_len: int, sequence_len: int, count: int) -> list[int]:
    """``count`` evenly spaced roots in the continuation (a root ``r`` starts a step after ``sequence[:r + 1]``)."""
    first, last = prompt_len - 1, sequence_len - 2
    count = max(1, min(count, last - first + 1))
    return sorted({first + (last - first) * i // max(count - 1, 1) for i in range(count)})


def replay_all(target, draft, sequences: list[tuple[int, list[int]]], roots_per_sequence: int,
               settings: list[Setting], seeds: list[int], label: str) -> list[list[tuple[int, ...]]]:
    """Accepted ranks of every simulated step, per setting, over all sequences' roots."""
    from tqdm.auto import tqdm

    walks: list[list[tuple[int, ...]]] = [[] for _ in settings]
    for prompt_len, sequence in tqdm(sequences, desc=label):
        roots = root_positions(prompt_len, len(sequence), roots_per_sequence)
        for i, found in enumerate(replay_sequence(target, draft, sequence, roots, settings, seeds)):
            walks[i].extend(found)
    return walks


def mean_tokens(walks: list[tuple[int, ...]]) -> float:
    return sum(len(w) + 1 for w in walks) / len(walks)


@dataclass(frozen=True)
class SampledPlan:
    """What :func:`sampled_measurements` measures: tree ``sizes`` at ``scalability_setting`` (T,
    top-p), the three verifiers on a ``robust_size`` DP tree over the (T, top-p) ``grid``, from
    ``roots`` positions and ``seeds`` seeds, acceptance vectors of ``k`` ranks."""

    sizes: tuple[int, ...]
    scalability_setting: tuple[float, float]
    grid: list[tuple[float, float]]
    robust_size: int
    roots: int
    seeds: int
    k: int = 32


def sampled_measurements(target, draft, calibration: list[tuple[int, list[int]]], held_out: list[tuple[int, list[int]]],
                         plan: SampledPlan) -> dict:
    """T > 0 scalability and robustness from the exact sampled replay (``engine.tuning.sampled_replay``).

    Acceptance vectors per (temperature, top-p) come from one-level K-child walks on the
    calibration sequences; tokens/step from walks on the held-out ones. Every shape is verified
    by Sequoia's rule in the scalability part; the robustness part verifies the same DP tree
    with ``sequoia``, ``specinfer`` and ``topk``.
    """
    sizes, scalability_setting, grid, k = plan.sizes, plan.scalability_setting, plan.grid, plan.k
    robust_size, roots, seeds = plan.robust_size, plan.roots, plan.seeds
    settings_needed = sorted(set(grid) | {scalability_setting})
    calib_settings = [Setting(Tree.k_ary(k, 1), "sequoia", t, p) for t, p in settings_needed]
    calib_walks = replay_all(target, draft, calibration, roots, calib_settings, list(range(4 * seeds)),
                             "calibrating (sampled replay)")
    acceptance = {}
    for (t, p), walks in zip(settings_needed, calib_walks):
        acceptance[(t, p)] = [c / len(walks) for c in rank_histogram(walks, k)]

    t0, p0 = scalability_setting
    measured: list[tuple[str, Setting]] = []
    for n in sizes:
        measured.append((f"scal|{n}|sequoia", Setting(sequoia_tree(acceptance[(t0, p0)], n), "sequoia", t0, p0)))
        measured.append((f"scal|{n}|binary", Setting(complete_binary(n), "sequoia", t0, p0)))
        for kk in (1, 2, 4, 8):
            if (n - 1) // kk >= 1:
                measured.append((f"scal|{n}|chains{kk}", Setting(Tree.k_independent(kk, (n - 1) // kk), "sequoia", t0, p0)))
    for t, p in grid:
        tree = sequoia_tree(acceptance[(t, p)], robust_size)
        for method in ("sequoia", "specinfer", "topk"):
            measured.append((f"rob|{t}|{p}|{method}", Setting(tree, method, t, p)))
    walks = replay_all(target, draft, held_out, roots, [s for _, s in measured], list(range(seeds)),
                       "measuring (sampled replay)")
    tokens = {name: mean_tokens(w) for (name, _), w in zip(measured, walks)}
    steps = len(walks[0])

    scalability = []
    for n in sizes:
        chains = {kk: tokens[f"scal|{n}|chains{kk}"] for kk in (1, 2, 4, 8) if f"scal|{n}|chains{kk}" in tokens}
        best_k = max(chains, key=chains.get)
        tree = sequoia_tree(acceptance[(t0, p0)], n)
        scalability.append({"size": n, "sequoia": tokens[f"scal|{n}|sequoia"],
                            "sequoia_predicted": tree.expected_tokens(acceptance[(t0, p0)]), "sequoia_depth": tree.depth,
                            "k_chains": chains[best_k], "k_chains_k": best_k, "binary": tokens[f"scal|{n}|binary"]})
        r = scalability[-1]
        print(f"T={t0} top-p={p0} n={n:4d}  sequoia {r['sequoia']:.2f} (DP predicts {r['sequoia_predicted']:.2f})"
              f"  best k-chains {r['k_chains']:.2f} (k={best_k})  binary {r['binary']:.2f}", flush=True)
    robustness = []
    for t, p in grid:
        row = {"temperature": t, "top_p": p, "size": robust_size,
               **{m: tokens[f"rob|{t}|{p}|{m}"] for m in ("sequoia", "specinfer", "topk")}}
        robustness.append(row)
        print(f"T={t} top-p={p} n={robust_size}: sequoia {row['sequoia']:.2f}  specinfer {row['specinfer']:.2f}  "
              f"topk {row['topk']:.2f}", flush=True)
    return {"steps_per_point": steps, "calibration_positions": len(calib_walks[0]),
            "acceptance": {f"T{t}_p{p}": v for (t, p), v in acceptance.items()},
            "scalability_setting": {"temperature": t0, "top_p": p0}, "scalability": scalability,
            "robustness": robustness}


def plot(report: dict, path: Path) -> None:
    """Scalability (greedy, and sampled when measured) and robustness panels in one HTML file."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    sampled = report.get("sampled")
    panels = [("greedy", "T = 0")]
    if sampled:
        s = sampled["scalability_setting"]
        panels.append(("sampled", f"T = {s['temperature']}, top-p = {s['top_p']}"))
    fig = make_subplots(rows=1, cols=len(panels) + bool(sampled),
                        subplot_titles=[f"tokens/step vs tree size, {t}" for _, t in panels] +
                        ([f"verification at n = {sampled['robustness'][0]['size']}"] if sampled else []))
    styles = (("sequoia", "Sequoia DP tree", "#1f77b4", None), ("sequoia_predicted", "DP prediction", "#1f77b4", "dot"),
              ("k_chains", "best k independent chains", "#ff7f0e", None), ("binary", "complete binary tree", "#2ca02c", None))
    for col, (key, _) in enumerate(panels, start=1):
        rows = report["greedy"] if key == "greedy" else sampled["scalability"]
        for field, name, colour, dash in styles:
            fig.add_trace(go.Scatter(x=[r["size"] for r in rows], y=[r[field] for r in rows], name=name,
                                     mode="lines+markers", line={"color": colour, "dash": dash},
                                     legendgroup=field, showlegend=col == 1), row=1, col=col)
        fig.update_xaxes(type="log", title_text="tree size n", row=1, col=col)
    if sampled:
        labels = [f"T={r['temperature']} p={r['top_p']}" for r in sampled["robustness"]]
        for method in ("sequoia", "specinfer", "topk"):
            fig.add_trace(go.Bar(x=labels, y=[r[method] for r in sampled["robustness"]], name=method),
                          row=1, col=len(panels) + 1)
    fig.update_yaxes(title_text="tokens per step", row=1, col=1)
    fig.update_layout(title="Sequoia on the default pair (exact replay; held-out prompts)", height=480,
                      width=520 * (len(panels) + bool(sampled)))
    fig.write_html(path)


def main(argv: list[str] | None = None) -> None:
    from engine.core.speculative import SpeculativeEngine
    from engine.models.loading import load_default_pair
    from engine.models.prompts import encode_chat, load_prompt_set

    parser = argparse.ArgumentParser(prog="python -m bench.trees", description=__doc__)
    parser.add_argument("--new-tokens", type=int, default=96, help="greedy continuation length per prompt")
    parser.add_argument("--no-sampled", action="store_true", help="greedy scalability only")
    parser.add_argument("--temperature", type=float, default=0.6, help="sampled scalability temperature")
    parser.add_argument("--top-p", type=float, default=1.0, help="sampled scalability top-p")
    parser.add_argument("--temperatures", default="0.2,0.6,1.0", help="robustness grid")
    parser.add_argument("--top-ps", default="0.8,0.9,1.0", help="robustness grid")
    parser.add_argument("--robust-size", type=int, default=16, help="tree size of the robustness comparison")
    parser.add_argument("--roots", type=int, default=10, help="sampled step roots per prompt")
    parser.add_argument("--seeds", type=int, default=4, help="sampled steps per root")
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args(argv)

    target, draft, tokenizer = load_default_pair()
    engine = SpeculativeEngine(target, draft)
    prompts = [encode_chat(tokenizer, p["messages"]) for p in load_prompt_set("chat")]
    start = time.perf_counter()
    ranks, sequences = [], []
    for i, ids in enumerate(prompts):
        continuation = engine.generate(ids, max_new_tokens=args.new_tokens, tree=Tree.chain(4), copies=False).tokens
        ranks.append(draft_ranks(draft, ids, continuation))
        sequences.append((len(ids), ids + continuation))
        print(f"prompt {i}: {len(continuation)} greedy tokens ranked", flush=True)
    calib, held_out = ranks[0::2], ranks[1::2]
    acceptance = greedy_acceptance(calib)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "positions_calibration": sum(map(len, calib)),
              "positions_measured": sum(map(len, held_out)), "greedy_acceptance": acceptance,
              "greedy_acceptance_held_out": greedy_acceptance(held_out),
              "greedy": greedy_scalability(acceptance, held_out)}
    if not args.no_sampled:
        grid = [(float(t), float(p)) for t in args.temperatures.split(",") for p in args.top_ps.split(",")]
        report["sampled"] = sampled_measurements(
            target, draft, sequences[0::2], sequences[1::2],
            SampledPlan(SIZES, (args.temperature, args.top_p), grid, args.robust_size, args.roots, args.seeds))
    report["seconds"] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"trees-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    plot(report, stem.with_suffix(".html"))
    print(f"saved {stem}.json and .html ({report['seconds']:.0f} s)")


if __name__ == "__main__":
    from engine.backends.hugepages import restart_with_huge_pages

    restart_with_huge_pages()
    main()
