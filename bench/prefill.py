"""``python -m bench.prefill``: reading a pasted prompt (prefill), ours against llama.cpp.

Prompts of ``--lengths`` tokens (default 500, 1500 and 3000) are cut from real Python code, this
repository's own ``engine/`` sources, tokenised with the embedded pair's tokenizer. For each length,
in one run and on the same cores:

- ``ours, target``: the app's int4 target reads the prompt (the engine's chunked prefill);
- ``ours, target + draft``: the prompt's tokens over the pair's time to first token, what the app's
  user waits (the target's prefill and one step: a draft with a long prompt reads it between the
  first steps, see ``SpeculativeEngine.draft_deferral``); beside it, the seconds until that draft
  has read the whole prompt and drafts trees again (``draft level``);
- ``llama.cpp``: ``llama-server`` on the same ``target.gguf`` (2 threads, prompt cache off), its
  own ``timings.prompt_per_second``, when ``make peer`` has built it.

Rounds alternate ours and llama.cpp's per length, ``--repeats`` times; figures are medians. JSON
and an HTML plot go to ``results/`` (or ``--out``).

The AVX2 path on an AVX-512 machine: ``PEER_ISA=avx2 make peer`` builds an AVX2-only llama.cpp, and
``SEQUOIA_KERNEL_MARCH=x86-64-v3 SEQUOIA_PEER_BIN=<cache>/peer/llama.cpp-<version>/build-avx2/bin``
runs both on AVX2 instructions.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LENGTHS = (500, 1500, 3000)


def code_tokens(tokenizer, count: int) -> list[int]:
    """``count`` token ids of real Python: this repository's ``engine/`` sources, in path order."""
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "engine").rglob("*.py")))
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < count:
        raise ValueError(f"only {len(ids)} tokens of code to cut a {count}-token prompt from")
    return ids[:count]


def our_prefill_s(engine, prompt: list[int]) -> float:
    """Seconds the engine's prefill took on ``prompt`` (its first ``len - 1`` tokens are read)."""
    from engine.trees.tree import Tree

    generation = engine.stream(prompt, max_new_tokens=1, tree=None if engine.draft is None else Tree.chain(2),
                               copies=False)
    next(generation)
    return generation.prefill_s


def pair_first_token_s(engine, prompt: list[int]) -> tuple[float, float | None]:
    """Seconds from the request to the pair's first token on ``prompt``, and to its first step
    whose draft drafted (None if it never did within its budget)."""
    from engine.trees.tree import Tree

    start, first = time.perf_counter(), None
    budget = len(prompt) // max(1, engine.draft_catch_up) + 8
    for record in engine.stream(prompt, max_new_tokens=budget, tree=Tree.chain(2), copies=False):
        first = first or time.perf_counter() - start
        if len(record.tokens) > 1:
            return first, time.perf_counter() - start
    return first, None


def peer_prompt_rate(server, prompt: list[int]) -> tuple[float, int]:
    """llama-server's ``(prompt tokens/s, prompt tokens)`` for reading ``prompt`` (one token decoded)."""
    from bench.peer.llama_cpp import completion_request

    timings = server.post("/completion", completion_request(prompt, 1))["timings"]
    return float(timings["prompt_per_second"]), int(timings["prompt_n"])


def run(lengths: list[int], repeats: int, peer: bool, log=print, pair=None) -> dict:
    """Every length ``repeats`` times, ours then llama.cpp's each round; the report (medians inside).
    ``pair``: ``(target, draft, tokenizer)`` instead of the embedded pair."""
    import contextlib

    from engine.core.speculative import SpeculativeEngine
    from engine.models.loading import load_pair
    from bench.peer.llama_cpp import (DEFAULT_THREADS, PeerConfig, PeerServer, TARGET_ONLY, context_size,
                                       default_ggufs, free_port, peer_binaries, server_command)
    from engine.kernels.build import simd_path
    from engine.tuning.profile import cpu_isa

    target, draft, tokenizer = pair or load_pair()
    alone, pair = SpeculativeEngine(target, None, stop_token_ids=[]), SpeculativeEngine(target, draft, stop_token_ids=[])
    prompts = {n: code_tokens(tokenizer, n) for n in lengths}
    our_prefill_s(pair, prompts[min(lengths)])  # warm-up: kernels, caches, allocations
    figures = {n: {"ours, target": [], "ours, target + draft": [], "llama.cpp": []} for n in lengths}
    draft_level = {n: [] for n in lengths}
    binaries, why_not = peer_binaries() if peer else (None, "not asked for (--no-peer)")
    with contextlib.ExitStack() as stack:
        server = None
        if binaries is not None:
            command = server_command(binaries.server, PeerConfig(TARGET_ONLY), default_ggufs()[0], None, free_port(),
                                     threads=DEFAULT_THREADS, ctx=context_size(max(lengths), 8))
            server = stack.enter_context(PeerServer(command, int(command[command.index("--port") + 1])))
            peer_prompt_rate(server, prompts[min(lengths)])  # warm-up
        for round_ in range(repeats):
            for n, prompt in prompts.items():
                seconds = our_prefill_s(alone, prompt)
                figures[n]["ours, target"].append((len(prompt) - 1) / seconds)
                log(f"round {round_ + 1}, {n} tokens: {'ours, target':<22} {figures[n]['ours, target'][-1]:6.1f} "
                    f"prompt tokens/s ({seconds:.1f} s)", flush=True)
                seconds, level_s = pair_first_token_s(pair, prompt)
                figures[n]["ours, target + draft"].append((len(prompt) - 1) / seconds)
                draft_level[n].append(level_s)
                log(f"round {round_ + 1}, {n} tokens: {'ours, target + draft':<22} "
                    f"{figures[n]['ours, target + draft'][-1]:6.1f} prompt tokens/s (first token {seconds:.1f} s; "
                    f"draft level at {level_s if level_s is None else round(level_s, 1)} s)", flush=True)
                if server is not None:
                    rate, read = peer_prompt_rate(server, prompt)
                    figures[n]["llama.cpp"].append(rate)
                    log(f"round {round_ + 1}, {n} tokens: {'llama.cpp':<22} {rate:6.1f} prompt tokens/s "
                        f"({read} tokens, {read / rate:.1f} s)", flush=True)
    medians = {n: {name: statistics.median(v) for name, v in row.items() if v} for n, row in figures.items()}
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or platform.machine(),
            "isa": cpu_isa(), "kernels": simd_path(), "threads": torch.get_num_threads(), "repeats": repeats,
            "peer": f"llama.cpp llama-server ({binaries.server.parent}), same target.gguf" if binaries is not None
            else why_not,
            "runs": {str(n): row for n, row in figures.items()}, "medians": {str(n): row for n, row in medians.items()},
            "draft_level_s": {str(n): v for n, v in draft_level.items()},
            "ratio_to_llama_cpp": {str(n): {name: rate / row["llama.cpp"] for name, rate in row.items()
                                           if name != "llama.cpp"} for n, row in medians.items() if "llama.cpp" in row}}


def plot(report: dict, path: Path) -> None:
    """Grouped bars of the median prompt tokens/s per prompt length, one bar per system."""
    import plotly.graph_objects as go

    lengths = list(report["medians"])
    names = sorted({name for row in report["medians"].values() for name in row})
    fig = go.Figure([go.Bar(name=name, x=[f"{n} tokens" for n in lengths],
                            y=[report["medians"][n].get(name) for n in lengths],
                            text=[f"{report['medians'][n][name]:.1f}" if name in report["medians"][n] else ""
                                  for n in lengths]) for name in names])
    title = (f"Prefill, {report['isa']} CPU, {report.get('kernels', '?')} kernels, {report['threads']} threads "
             f"({report['date']})")
    fig.update_layout(barmode="group", title=title,
                      yaxis_title="prompt tokens/s", template="plotly_white", height=480)
    fig.write_html(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.prefill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-peer", action="store_true", help="leave llama.cpp out")
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    report = run(args.lengths, args.repeats, not args.no_peer)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bench-prefill-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2))
    plot(report, path.with_suffix(".html"))
    print(f"\nmedian prompt tokens/s ({report['isa']} CPU, {report['kernels']} kernels, {report['threads']} threads; "
          f"{report['peer']}):")
    for n, row in report["medians"].items():
        ratios = report["ratio_to_llama_cpp"].get(n, {})
        print(f"  {n:>5} tokens: " + ", ".join(
            f"{name} {rate:.1f}" + (f" ({ratios[name]:.2f}x llama.cpp)" if name in ratios else "")
            for name, rate in row.items()))
    print(f"wrote {path} and {path.with_suffix('.html').name}")


if __name__ == "__main__":
    from engine.backends.hugepages import restart_with_huge_pages

    restart_with_huge_pages()
    main()
