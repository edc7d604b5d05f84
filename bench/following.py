"""``python -m bench.following``: does the tree follow the conversation, and does it pay?

Conversations of three turns (a bundled prompt or one of two made up here, then two follow-ups),
prose and code, through the app's worker as the page sends them (the embedded pair, the app's
defaults: ``tree="auto"``, T = 0, free drafts, 256 tokens, every 10th step timed on the target
alone). Each conversation runs twice, one after the other: ``follow`` keeps the session's
conversation cache, so each answer's tree is priced by the conversation's earlier steps;
``calibrated`` decodes every turn from a fresh cache, priced by the calibration alone (the
turns' text is the same: greedy). Per answer it records the stats line's figures: predicted and
measured tokens/step (over all steps, and over the steps that drafted), which acceptance priced
the pick, tokens/s and the speedup over the target alone timed in the same answer. JSON and a plot go to ``results/``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLLOW_UPS = {"prose": ["Tell me more about that, in one paragraph.", "Now explain it to a ten-year-old."],
              "code": ["Now add type hints and a docstring.", "Write three unit tests for it."]}
MADE_UP = ["Plan a three-day trip to Lisbon for a couple who like food and long walks.",
           "Write a short, friendly letter to a neighbour apologising for last night's noisy party."]
PROSE_KINDS = ("explanation", "list", "dialogue")


def conversations(prose: int, code: int) -> list[tuple[str, str]]:
    """``(kind, first message)``: the bundled prose prompts (then the two made up here), the bundled code ones."""
    from engine.models.prompts import load_prompt_set

    bundled = load_prompt_set("chat")
    firsts = [p["messages"][-1]["content"] for p in bundled if p["kind"] in PROSE_KINDS]
    coding = [p["messages"][-1]["content"] for p in bundled if p["kind"] == "code"]
    return [("prose", m) for m in (firsts + MADE_UP)[-prose:]] + [("code", m) for m in coding[:code]]


def run_conversation(worker, kind: str, first: str, follow: bool, session: str) -> list[dict]:
    """The three answers of one conversation; the stats line's figures for each."""
    from app.page.controls import DEFAULTS
    from app.serving.jobs import GenerationRequest
    from app.views import figures
    from engine.core.settings import settings_from

    history, out = [], []
    settings = settings_from(max_new_tokens=256)  # the page's defaults: auto, T = 0, free drafts
    for turn, message in enumerate([first] + FOLLOW_UPS[kind]):
        history.append({"role": "user", "content": message})
        job = worker.submit(GenerationRequest(settings=settings, messages=list(history), keep_cache=follow,
                                              time_alone_every=int(DEFAULTS["time_alone_every"])), session=session)
        steps, decision, text = [], None, []
        for event in job.iter_events():
            if event.kind == "started" and event.phase == "main":
                decision = event.data["decision"]
            elif event.kind == "step" and event.phase == "main":
                steps.append(event.data)
            elif event.kind == "error":
                raise RuntimeError(event.data)
        tokens = [t for s in steps for t in s.committed]
        history.append({"role": "assistant", "content": worker.tokenizer.decode(tokens, skip_special_tokens=True)})
        s = figures.summarise(steps)
        alone, source = figures.answer_baseline(steps, None, "")
        out.append({"kind": kind, "first": first, "turn": turn + 1, "mode": "follow" if follow else "calibrated",
                    "acceptance": decision.priced_by.label() if decision.priced_by else "",
                    "tree": [decision.tree.size, decision.tree.depth],
                    "predicted_tokens_per_step": decision.choice.expected_tokens if decision.choice else None,
                    "tokens_per_step": s["tokens_per_step"], "drafting_tokens_per_step": s["drafting_tokens_per_step"],
                    "tokens": s["tokens"], "tokens_per_s": s["tokens_per_s"],
                    "alone_tokens_per_s": alone if source == figures.IN_ANSWER else None,
                    "speedup_in_answer": s["tokens_per_s"] / alone if alone and source == figures.IN_ANSWER else None,
                    "paused_steps": s["paused"]})
        row = out[-1]
        print(f"{kind:5} {row['mode']:10} turn {row['turn']}: tree {row['tree'][0]}/{row['tree'][1]} "
              f"predicted {row['predicted_tokens_per_step'] or 0:.2f} measured {row['tokens_per_step']:.2f} tokens/step "
              f"({row['drafting_tokens_per_step'] or 0:.2f} drafting) "
              f"({row['acceptance']}); {row['tokens_per_s']:.1f} tokens/s, "
              f"{row['speedup_in_answer'] or float('nan'):.2f}x the target alone in the answer; {first[:40]!r}",
              flush=True)
    return out


def summary(rows: list[dict]) -> dict:
    """Per kind and mode: median speedup in the answer, and the third answers' |predicted/measured - 1|."""
    out = {}
    for kind in ("prose", "code"):
        for mode in ("follow", "calibrated"):
            mine = [r for r in rows if r["kind"] == kind and r["mode"] == mode]
            if not mine:
                continue
            third = [r for r in mine if r["turn"] == 3 and r["predicted_tokens_per_step"]]
            errors = [abs(r["predicted_tokens_per_step"] / r["tokens_per_step"] - 1) for r in third]
            drafting = [abs(r["predicted_tokens_per_step"] / r["drafting_tokens_per_step"] - 1) for r in third
                        if r["drafting_tokens_per_step"]]
            speedups = [r["speedup_in_answer"] for r in mine if r["speedup_in_answer"]]
            out[f"{kind}/{mode}"] = {
                "answers": len(mine), "median_speedup_in_answer": statistics.median(speedups) if speedups else None,
                "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                "third_answer_prediction_error": errors, "third_answers_within_25pct": sum(e <= 0.25 for e in errors),
                "third_answer_error_on_drafting_steps": drafting,
                "third_answers_within_25pct_on_drafting_steps": sum(e <= 0.25 for e in drafting)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.following", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prose", type=int, default=5, help="prose conversations (the last N of the bundled + made up)")
    parser.add_argument("--code", type=int, default=2, help="code conversations (the first N bundled)")
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    import launch

    worker = launch.build_worker(launch.parse_args(["--no-measure"]))
    rows = []
    try:
        for i, (kind, first) in enumerate(conversations(args.prose, args.code)):
            for follow in (True, False):
                rows += run_conversation(worker, kind, first, follow, session=f"bench-{i}-{follow}")
    finally:
        worker.close()
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "answers": rows, "summary": summary(rows)}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"following-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2))
    _plot(rows, path.with_suffix(".html"))
    print(json.dumps(report["summary"], indent=2))
    print(f"saved {path}")
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    """Predicted against measured tokens/step per answer, by kind and mode."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for kind, symbol in (("prose", "circle"), ("code", "square")):
        for mode, colour in (("follow", "#16a34a"), ("calibrated", "#9ca3af")):
            mine = [r for r in rows if r["kind"] == kind and r["mode"] == mode and r["predicted_tokens_per_step"]]
            fig.add_trace(go.Scatter(x=[r["tokens_per_step"] for r in mine],
                                     y=[r["predicted_tokens_per_step"] for r in mine], mode="markers",
                                     name=f"{kind}, {mode}", marker=dict(symbol=symbol, color=colour, size=9),
                                     text=[f"turn {r['turn']}: {r['first'][:40]}" for r in mine]))
    top = max([r["tokens_per_step"] for r in rows] + [r["predicted_tokens_per_step"] or 0 for r in rows] + [1])
    fig.add_trace(go.Scatter(x=[1, top], y=[1, top], mode="lines", name="predicted = measured",
                             line=dict(dash="dot", color="#64748b")))
    fig.update_layout(title="Predicted against measured tokens/step (each answer)",
                      xaxis_title="measured tokens/step", yaxis_title="predicted tokens/step")
    fig.write_html(str(path))


if __name__ == "__main__":
    raise SystemExit(main())
