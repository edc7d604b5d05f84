"""Scalability of tree shapes: tokens/step vs tree size for Sequoia's DP tree, k independent chains
and complete binary trees, measured on the real pair (the paper's scalability figure).

Greedy (T = 0) figures come from the exact replay (``engine.replay``): the bundled prompts'
greedy continuations are generated once, the draft's rank of every continuation token is taken
from one causal pass, and every tree is replayed over those ranks. The acceptance vector that
shapes the DP tree is measured on the even-numbered prompts; tokens/step is measured on the
odd-numbered ones, so the DP tree is not fitted to the text it is scored on. With
``--sampled-sizes`` the same shapes are also run through the engine itself at ``--temperature``.

``python -m engine.bench_trees`` writes ``results/trees-*.json`` and an HTML plot.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .replay import draft_ranks, greedy_acceptance, tokens_per_step
from .tree import Tree

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
    rows = []
    for n in sizes:
        sequoia = sequoia_tree(acceptance, n)
        chains = max(k_chain_options(n), key=lambda t: tokens_per_step(t, eval_ranks))
        binary = complete_binary(n)
        rows.append({
            "size": n,
            "sequoia": tokens_per_step(sequoia, eval_ranks), "sequoia_predicted": sequoia.expected_tokens(acceptance),
            "sequoia_depth": sequoia.depth,
            "k_chains": tokens_per_step(chains, eval_ranks), "k_chains_k": len(chains.children[0]),
            "binary": tokens_per_step(binary, eval_ranks),
        })
        r = rows[-1]
        print(f"n={n:4d}  sequoia {r['sequoia']:.2f} (DP predicts {r['sequoia_predicted']:.2f}, d={r['sequoia_depth']})"
              f"  best k-chains {r['k_chains']:.2f} (k={r['k_chains_k']})  binary {r['binary']:.2f}", flush=True)
    return rows


def sampled_scalability(engine, prompts: list[list[int]], acceptance: list[float], sizes: list[int],
                        temperature: float, top_p: float, steps: int) -> list[dict]:
    """Run each shape through the engine until ``steps`` steps are counted; tokens/step measured."""
    def measure(tree: Tree) -> float:
        tokens = done = 0
        for i, ids in enumerate(prompts * 50):
            result = engine.generate(ids, max_new_tokens=128, temperature=temperature, top_p=top_p, tree=tree,
                                     seed=i, method="sequoia")
            tokens, done = tokens + len(result.tokens), done + len(result.steps)
            if done >= steps:
                break
        return tokens / done

    rows = []
    for n in sizes:
        chains = Tree.k_independent(max(1, min(4, n - 1)), max(1, (n - 1) // min(4, n - 1)))
        row = {"size": n, "sequoia": measure(sequoia_tree(acceptance, n)),
               "sequoia_predicted": sequoia_tree(acceptance, n).expected_tokens(acceptance),
               "k_chains": measure(chains), "binary": measure(complete_binary(n))}
        print(f"T={temperature} n={n:4d}  sequoia {row['sequoia']:.2f}  k-chains {row['k_chains']:.2f}  "
              f"binary {row['binary']:.2f}", flush=True)
        rows.append(row)
    return rows


def plot(report: dict, path: Path) -> None:
    try:
        import plotly.graph_objects as go
    except ImportError:
        return
    fig = go.Figure()
    rows = report["greedy"]
    sizes = [r["size"] for r in rows]
    for key, name in (("sequoia", "Sequoia DP tree"), ("sequoia_predicted", "DP prediction"),
                      ("k_chains", "best k independent chains"), ("binary", "complete binary tree")):
        fig.add_trace(go.Scatter(x=sizes, y=[r[key] for r in rows], name=name, mode="lines+markers",
                                 line={"dash": "dot"} if key == "sequoia_predicted" else None))
    fig.update_layout(title="Tokens per step vs tree size (greedy, default pair)", xaxis_type="log",
                      xaxis_title="tree size n (nodes verified per step)", yaxis_title="tokens per step")
    fig.write_html(path)


def main(argv: list[str] | None = None) -> None:
    from .models import load_default_pair
    from .prompts import encode_chat, load_prompt_set
    from .speculative import SpeculativeEngine

    parser = argparse.ArgumentParser(prog="python -m engine.bench_trees", description=__doc__)
    parser.add_argument("--new-tokens", type=int, default=128, help="greedy continuation length per prompt")
    parser.add_argument("--sampled-sizes", default="", help="comma-separated sizes to also run sampled, e.g. 4,8,16")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=200, help="engine steps per sampled point")
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args(argv)

    target, draft, tokenizer = load_default_pair()
    engine = SpeculativeEngine(target, draft)
    prompts = [encode_chat(tokenizer, p["messages"]) for p in load_prompt_set("chat")]
    start = time.perf_counter()
    ranks = []
    for i, ids in enumerate(prompts):
        continuation = engine.generate(ids, max_new_tokens=args.new_tokens, tree=Tree.chain(4)).tokens
        ranks.append(draft_ranks(draft, ids, continuation))
        print(f"prompt {i}: {len(continuation)} greedy tokens ranked", flush=True)
    calib, held_out = ranks[0::2], ranks[1::2]
    acceptance = greedy_acceptance(calib)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "positions_calibration": sum(map(len, calib)),
              "positions_measured": sum(map(len, held_out)), "greedy_acceptance": acceptance,
              "greedy": greedy_scalability(acceptance, held_out)}
    if args.sampled_sizes:
        sizes = [int(s) for s in args.sampled_sizes.split(",")]
        report["sampled"] = {"temperature": args.temperature, "top_p": args.top_p, "steps": args.steps,
                             "rows": sampled_scalability(engine, prompts, acceptance, sizes, args.temperature,
                                                         args.top_p, args.steps)}
    report["seconds"] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"trees-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    plot(report, stem.with_suffix(".html"))
    print(f"saved {stem}.json")


if __name__ == "__main__":
    main()
