"""Does the engine lose more to a busy neighbour *thread* (which shares its GIL) than to a busy
neighbour *process*? The question behind where the app runs its engine.

The embedded pair decodes the first bundled chat prompt (greedy, ``tree="auto"``) alone, then
beside a neighbour that runs pure Python for ``duty`` of every 100 ms (what a web server, its
handlers and a browser do to the decoding cores), once as a thread of this process and once as a
process of its own. Rounds alternate the three so that a noisy host spreads over all of them.
Prints each run's rate and median step times and writes ``results/neighbour-*.json`` with a
plotly chart beside it.

    python -m bench.neighbour --rounds 3 --duty 0.1 0.2
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import threading
import time
from pathlib import Path

PLACES = ("alone", "thread", "process")


def busy_neighbour(stop, duty: float, period_s: float = 0.1) -> None:
    """Pure-Python work for ``duty`` of every ``period_s``, until ``stop`` is set."""
    while not stop.is_set():
        started = time.perf_counter()
        while time.perf_counter() - started < period_s * duty:
            sum(i * i for i in range(200))
        time.sleep(period_s * (1.0 - duty))


def decode_once(engine, ids: list[int], max_new: int) -> dict:
    """One greedy answer: its decode rate and the median draft, verify and step times (ms)."""
    result = engine.generate(ids, max_new_tokens=max_new, temperature=0.0, tree="auto", copies=False)
    timings = [step.timings for step in result.steps]
    return {"tokens_per_s": result.tokens_per_second,
            "step_ms": 1e3 * statistics.median(t.total_s for t in timings),
            "draft_ms": 1e3 * statistics.median(t.draft_s for t in timings),
            "verify_ms": 1e3 * statistics.median(t.verify_s for t in timings)}


def decode_beside(engine, ids: list[int], max_new: int, place: str, duty: float) -> dict:
    """:func:`decode_once` with a busy neighbour in ``place`` ("alone", "thread" or "process")."""
    if place == "alone":
        return decode_once(engine, ids, max_new)
    stop = threading.Event() if place == "thread" else multiprocessing.Event()
    runner = (threading.Thread if place == "thread" else multiprocessing.Process)(
        target=busy_neighbour, args=(stop, duty), daemon=True)
    runner.start()
    try:
        return decode_once(engine, ids, max_new)
    finally:
        stop.set()
        runner.join()


def bench(rounds: int, duties: list[float], max_new: int, out_dir: Path) -> dict:
    from engine import SpeculativeEngine
    from engine.models.loading import load_default_pair, pair_name
    from engine.models.prompts import encode_chat, load_prompt_set
    from engine.tuning.optimizer import load_tuner

    sys.setswitchinterval(0.0005)  # as launch.py sets it for the app
    target, draft, tokenizer = load_default_pair()
    from engine.tuning.planner import TreePlanner

    pair = pair_name("default-target", "default-draft", draft, target)
    engine = SpeculativeEngine(target, draft, planner=TreePlanner(pair, load_tuner(pair, target)))
    ids = encode_chat(tokenizer, load_prompt_set("chat")[0]["messages"][-1:])
    engine.generate(ids, max_new_tokens=16, temperature=0.0, tree="auto", copies=False)  # warm-up
    runs = []
    for round_ in range(rounds):
        for duty in duties:
            for place in PLACES:
                run = {"round": round_, "duty": duty, "place": place, **decode_beside(engine, ids, max_new, place, duty)}
                runs.append(run)
                print(f"round {round_} duty {duty:.0%} {place:8s} {run['tokens_per_s']:6.2f} tokens/s · step "
                      f"{run['step_ms']:.0f} ms (draft {run['draft_ms']:.0f}, verify {run['verify_ms']:.0f})", flush=True)
    summary = {f"{place}@{duty:g}": statistics.median(r["tokens_per_s"] for r in runs
                                                      if r["place"] == place and r["duty"] == duty)
               for duty in duties for place in PLACES}
    print("median tokens/s:", json.dumps({k: round(v, 2) for k, v in summary.items()}))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"neighbour-{time.strftime('%Y%m%d-%H%M%S')}.json"
    report = {"runs": runs, "median_tokens_per_s": summary, "max_new_tokens": max_new}
    path.write_text(json.dumps(report, indent=2))
    _plot(summary, path.with_suffix(".html"))
    print(f"saved {path}")
    return report


def _plot(summary: dict, path: Path) -> None:
    import plotly.graph_objects as go

    labels = list(summary)
    figure = go.Figure(go.Bar(x=labels, y=[summary[k] for k in labels], text=[f"{summary[k]:.1f}" for k in labels]))
    figure.update_layout(title="Greedy decode rate beside a busy neighbour (median over rounds)",
                         yaxis_title="tokens/s", xaxis_title="neighbour @ duty")
    figure.write_html(path, include_plotlyjs="cdn")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duty", type=float, nargs="+", default=[0.1, 0.2],
                        help="the neighbour's busy share of each 100 ms")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args(argv)
    if args.rounds < 1 or not all(0.0 < d < 1.0 for d in args.duty):
        parser.error("--rounds must be >= 1 and each --duty within (0, 1)")
    bench(args.rounds, args.duty, args.max_new_tokens, args.out)


if __name__ == "__main__":
    main()
