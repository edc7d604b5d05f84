"""Pure functions from engine step records to plotly figures and summary lines: the per-step
chart, the stats line, Compare as a race, and what every figure shares (node statuses and their
colours, fonts, token text made visible). The token tree of a step is :mod:`app.views.tree_figures`.

Nothing here touches models or the UI: the inputs are :class:`engine.core.records.StepRecord` objects
and the text of their tokens, the outputs plotly figures or Markdown strings.
"""
from __future__ import annotations

import html
import re
import math
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go

from engine.core.records import StepRecord

ROOT, ACCEPTED, REJECTED, UNREACHED, UNUSED, BONUS = "root", "accepted", "rejected", "unreached", "unused", "bonus"

# Strong colour (marker border, legend, edges) and pale fill per status.
COLOURS = {
    ROOT: ("#334155", "#e2e8f0"),
    ACCEPTED: ("#15803d", "#dcfce7"),
    REJECTED: ("#dc2626", "#fee2e2"),
    UNREACHED: ("#9ca3af", "#f3f4f6"),
    UNUSED: ("#b45309", "#fef3c7"),
    BONUS: ("#7c3aed", "#ede9fe"),
}
STATUS_NAMES = {
    ROOT: "root (last committed token)",
    ACCEPTED: "accepted draft",
    REJECTED: "rejected draft",
    UNREACHED: "never reached",
    UNUSED: "accepted, not used (the answer ended first)",
    BONUS: "bonus token (from the target)",
}
EDGE_GREY = "#b6bcc6"
LABEL_BUDGET = 64  # characters of token labels across all levels of a tree drawn left to right
MIN_LABEL_CHARS = 8  # a label keeps at least this many characters (then an ellipsis; hover: the whole text)
FONT = "Inter, ui-sans-serif, system-ui, -apple-system, Segoe UI, sans-serif"
MONO = "JetBrains Mono, ui-monospace, SFMono-Regular, Menlo, Consolas, monospace"

_VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}


# ----- token text ------------------------------------------------------------------------------
def visible_token(text: str, max_chars: int = 14) -> str:
    """Token text with whitespace made visible (``␣ ↵ ⇥``), control characters as ``\\xNN``,
    shortened with an ellipsis. Not escaped: see :func:`token_label`."""
    out = []
    for ch in text:
        if ch in _VISIBLE:
            out.append(_VISIBLE[ch])
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    shown = "".join(out) or "∅"
    return shown if len(shown) <= max_chars else shown[: max_chars - 1] + "…"


def token_label(text: str, max_chars: int = 14) -> str:
    """:func:`visible_token`, HTML-escaped for plotly (which renders a subset of HTML in text)."""
    return html.escape(visible_token(text, max_chars), quote=False)


def token_text(token_texts, token: int) -> str:
    """The text of ``token`` in ``token_texts`` (a mapping or a function), else ``#<id>``."""
    if callable(token_texts) and not isinstance(token_texts, Mapping):
        return token_texts(token)
    text = token_texts.get(token) if token_texts is not None else None
    return f"#{token}" if text is None else text


def markdown_html(line: str) -> str:
    """HTML of a one-line Markdown text that uses only ``**bold**`` (the stats line)."""
    return re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", html.escape(line, quote=False))


def placeholder_figure(message: str, height: int = 300) -> go.Figure:
    """An empty figure with a centred message (before the first step)."""
    fig = go.Figure()
    fig.add_annotation(x=0.5, y=0.5, xref="paper", yref="paper", text=html.escape(message, quote=False),
                       showarrow=False, font=dict(family=FONT, size=14, color="#64748b"))
    fig.update_layout(height=height, margin=dict(l=20, r=20, t=20, b=20), plot_bgcolor="white",
                      paper_bgcolor="white", xaxis=dict(visible=False), yaxis=dict(visible=False))
    return fig


# ----- steps -----------------------------------------------------------------------------------
def running_speedup(steps: Sequence[StepRecord], baseline_tokens_per_s: float) -> list[float]:
    """Measured speedup after each step: cumulative tokens / cumulative step time, over the baseline."""
    out, tokens, seconds = [], 0, 0.0
    for step in steps:
        tokens += len(step.committed)
        seconds += step.timings.total_s
        out.append(tokens / seconds / baseline_tokens_per_s if seconds > 0 and baseline_tokens_per_s > 0 else 0.0)
    return out


MEASURED = "measured"                    # the target alone, measured while the page drew (Compare, Measure)
MEASURED_AT_START = "measured at launch"  # measured before any page drew on the cores: a page's own
                                          # drawing slows an answer, so a ratio to it reads low
IN_ANSWER = "timed in this answer"     # the answer's own steps of the target alone, under its load
BASELINE_WORDS = {MEASURED: "measured", MEASURED_AT_START: "measured at launch, before any page drew",
                  IN_ANSWER: "timed in this answer", "estimated": "estimated from the device profile"}
MIN_ALONE_STEPS = 3  # an answer's own target-alone steps make its baseline from this many on


def is_measured(baseline_source: str) -> bool:
    """Whether a target-alone rate from ``baseline_source`` was timed on this machine (at launch,
    in the page or in the answer), not estimated from the device profile."""
    return baseline_source in (MEASURED, MEASURED_AT_START, IN_ANSWER)


def alone_steps(steps: Sequence[StepRecord]) -> list[StepRecord]:
    """The steps of a speculative answer that the target decoded alone: those given to it to be
    timed (``timed_alone``), those the draft gate paused and those taken while the draft read a long
    prompt (its reading is not in their time). The first step is left out (it pays what is first)."""
    return [s for s in steps if s.tree_size == 1 and s.index > 0]


def answer_baseline(steps: Sequence[StepRecord], rate: float | None,
                    source: str) -> tuple[float | None, str]:
    """The target-alone rate to measure ``steps`` against: the answer's own target-alone steps'
    (``IN_ANSWER``) when it has ``MIN_ALONE_STEPS`` of them, timed under the same load as its other
    steps; else ``(rate, source)``."""
    alone = alone_steps(steps)
    seconds = sum(s.timings.total_s for s in alone)
    if len(alone) < MIN_ALONE_STEPS or seconds <= 0:
        return rate, source
    return sum(len(s.committed) for s in alone) / seconds, IN_ANSWER


def steps_figure(steps: Sequence[StepRecord], baseline_tokens_per_s: float | None = None,
                 expected_tokens: float | None = None, predicted_speedup: float | None = None,
                 highlight: int | None = None, baseline_source: str = "measured") -> go.Figure:
    """Tokens committed per step as stacked bars (accepted drafts + bonus), with the running
    measured speedup over the target-only rate (when ``baseline_tokens_per_s`` is known) and
    the predicted values (expected tokens per step, predicted speedup) as dashed lines.
    ``highlight``: step index to outline (the one the tree shows). ``baseline_source``: whether the
    target-alone rate was ``"measured"`` or ``"estimated"`` (from the device profile); the legend says which."""
    baseline_tokens_per_s, baseline_source = answer_baseline(steps, baseline_tokens_per_s, baseline_source)
    fig = go.Figure()
    xs = [s.index + 1 for s in steps]
    accepted = [s.accepted_draft_tokens for s in steps]
    bonus = [len(s.committed) - a for s, a in zip(steps, accepted)]
    alone = bool(steps) and all(s.tree_size == 1 for s in steps)  # autoregressive: no drafts, no bonus
    bonus_name = "the target's token" if alone else "bonus token"
    hover = [f"step {x}: {a} accepted + {b} {'from the target' if alone else 'bonus'} = {a + b} tokens<br>draft {s.timings.draft_s * 1e3:.0f} ms · "
             f"verify {s.timings.verify_s * 1e3:.0f} ms" for x, a, b, s in zip(xs, accepted, bonus, steps)]
    line_width = [2.5 if highlight is not None and s.index == highlight else 0 for s in steps]
    fig.add_trace(go.Bar(x=xs, y=accepted, name="accepted drafts", marker=dict(
        color=COLOURS[ACCEPTED][0], line=dict(color="#0f172a", width=line_width)),
        text=hover, hovertemplate="%{text}<extra></extra>", meta={"kind": "accepted"}))
    fig.add_trace(go.Bar(x=xs, y=bonus, name=bonus_name, marker=dict(
        color=COLOURS[BONUS][0], line=dict(color="#0f172a", width=line_width)),
        text=hover, hovertemplate="%{text}<extra></extra>", textposition="none", meta={"kind": "bonus"}))
    fig.update_traces(textposition="none", selector=dict(type="bar"))
    if expected_tokens is not None and steps:
        fig.add_trace(go.Scatter(x=[xs[0] - 0.5, xs[-1] + 0.5], y=[expected_tokens] * 2, mode="lines",
                                 name=f"predicted tokens/step ({expected_tokens:.2f})", hoverinfo="skip",
                                 line=dict(color="#64748b", dash="dash", width=1.5), meta={"kind": "expected"}))
    has_speedup = baseline_tokens_per_s is not None and baseline_tokens_per_s > 0 and steps
    if has_speedup:
        speed = running_speedup(steps, baseline_tokens_per_s)
        name = ("measured speedup (running)" if is_measured(baseline_source) else
                "speedup over an estimated target-alone rate (running)")
        fig.add_trace(go.Scatter(x=xs, y=speed, mode="lines+markers", name=name,
                                 yaxis="y2", line=dict(color="#ea580c", width=2.2), marker=dict(size=4),
                                 hovertemplate="after step %{x}: %{y:.2f}× the target alone ("
                                               + BASELINE_WORDS.get(baseline_source, baseline_source)
                                               + f", {baseline_tokens_per_s:.1f} tokens/s)<extra></extra>",
                                 meta={"kind": "speedup"}))
    if predicted_speedup is not None and steps:
        fig.add_trace(go.Scatter(x=[xs[0] - 0.5, xs[-1] + 0.5], y=[predicted_speedup] * 2, mode="lines",
                                 yaxis="y2", name=f"predicted speedup ({predicted_speedup:.2f}×)", hoverinfo="skip",
                                 line=dict(color="#ea580c", dash="dash", width=1.5), meta={"kind": "predicted"}))
    most = max([a + b for a, b in zip(accepted, bonus)] + [expected_tokens or 0, 1])
    layout = dict(
        barmode="stack", height=290, margin=dict(l=50, r=50 if has_speedup or predicted_speedup else 20, t=36, b=70),
        title=dict(text="Tokens per step" + (" and speedup" if has_speedup else ""), x=0.01, xanchor="left",
                   font=dict(size=14)),
        plot_bgcolor="white", paper_bgcolor="white", font=dict(family=FONT, size=12, color="#1f2937"),
        legend=dict(orientation="h", yanchor="top", y=-0.22, xanchor="left", x=0, font=dict(size=11),
                    traceorder="normal"),
        hoverlabel=dict(bgcolor="white", font=dict(family=FONT, size=12, color="#0f172a"), bordercolor="#94a3b8"),
        xaxis=dict(title=dict(text="step", standoff=2), gridcolor="#f1f5f9", zeroline=False,
                   range=[0.4, max(xs[-1] if xs else 1, 1) + 0.6], fixedrange=True),
        yaxis=dict(title=dict(text="tokens"), gridcolor="#eef2f7", rangemode="tozero", dtick=1 if most <= 8 else None,
                   range=[0, most * 1.15], fixedrange=True),
        bargap=0.25 if len(steps) < 60 else 0.05, hovermode="closest", dragmode=False,
    )
    if has_speedup or predicted_speedup is not None:
        top = max((running_speedup(steps, baseline_tokens_per_s) if has_speedup else []) + [predicted_speedup or 0, 1.0])
        layout["yaxis2"] = dict(title=dict(text="speedup ×"), overlaying="y", side="right", rangemode="tozero",
                                range=[0, top * 1.2], showgrid=False, fixedrange=True)
    fig.update_layout(**layout)
    return fig


# ----- stats -----------------------------------------------------------------------------------
def summarise(steps: Sequence[StepRecord]) -> dict:
    """Totals over steps: tokens, seconds (decode), tokens/s, tokens/step, acceptance, time split."""
    tokens = sum(len(s.committed) for s in steps)
    drafted = sum(s.tree_size - 1 for s in steps)
    accepted = sum(s.accepted_draft_tokens for s in steps)
    copied = sum(s.accepted_by_source()["copy"] for s in steps)
    draft_s = sum(s.timings.draft_s for s in steps)
    verify_s = sum(s.timings.verify_s for s in steps)
    total_s = sum(s.timings.total_s for s in steps)
    # what the draft's own trees wrote a step (what G predicts): the target alone's steps (timed,
    # paused, reading) and the tokens copied from the context aside
    drafting = [s for s in steps if s.tree_size > 1 and (not s.sources or "draft" in s.sources)]
    drafted_tokens = sum(len(s.committed) - s.accepted_by_source()["copy"] for s in drafting)
    return {
        "steps": len(steps), "tokens": tokens, "seconds": total_s,
        "drafting_steps": len(drafting),
        "drafting_tokens_per_step": drafted_tokens / len(drafting) if drafting else None,
        "reading_s": sum(s.timings.reading_s for s in steps),
        "paused": sum(1 for s in steps if s.draft_paused),
        "tokens_per_s": tokens / total_s if total_s > 0 else 0.0,
        "tokens_per_step": tokens / len(steps) if steps else 0.0,
        "accepted_per_step": accepted / len(steps) if steps else 0.0,
        "drafted": drafted, "accepted": accepted, "accepted_copies": copied,
        "acceptance_rate": accepted / drafted if drafted else None,
        "draft_share": draft_s / total_s if total_s > 0 else 0.0,
        "verify_share": verify_s / total_s if total_s > 0 else 0.0,
    }


def stats_line(steps: Sequence[StepRecord], baseline_tokens_per_s: float | None = None,
               baseline_source: str = "measured", expected_tokens: float | None = None,
               priced_speedup: float | None = None, acceptance: str = "") -> str:
    """One Markdown line: tokens/s, tokens/step, acceptance, draft/verify time split, speedup.

    Every figure says what it is: *measured* (this answer's steps, or a run of the target alone),
    *estimated* (the target-alone rate from the device profile, ``baseline_source="estimated"``)
    or *predicted* (``expected_tokens``, from the acceptance vector ``acceptance`` names:
    "calibrated", or "this conversation's after N steps"). ``priced_speedup``
    (:func:`engine.core.draft_gate.priced_speedup`) explains a measured ratio below 1."""
    if not steps:
        return "No steps yet."
    baseline_tokens_per_s, baseline_source = answer_baseline(steps, baseline_tokens_per_s, baseline_source)
    s = summarise(steps)
    parts = [f"measured **{s['tokens_per_s']:.1f} tokens/s**",
             f"{s['tokens']} tokens in {s['steps']} step{'s' if s['steps'] != 1 else ''}",
             f"**{s['tokens_per_step']:.2f} tokens/step**"]
    if s["acceptance_rate"] is not None:
        copies = f", {s['accepted_copies']} of them copied from the context" if s["accepted_copies"] else ""
        parts.append(f"accepted {s['accepted_per_step']:.2f} drafts/step "
                     f"({_percent(s['acceptance_rate'])} of {s['drafted']} drafted{copies})")
    else:
        parts.append("no drafts (target alone)")
    if expected_tokens is not None and s["acceptance_rate"] is not None:
        notes = [f"acceptance {acceptance}"] if acceptance else []
        if s["drafting_steps"]:
            notes.append(f"measured {s['drafting_tokens_per_step']:.2f} on the {s['drafting_steps']} steps the draft "
                         "drafted, copies aside")
        parts.append(f"predicted {expected_tokens:.2f} tokens/step" + (f" ({'; '.join(notes)})" if notes else ""))
    parts.append(f"time: draft {_percent(s['draft_share'])} · verify {_percent(s['verify_share'])}")
    if s["paused"]:
        parts.append(f"drafting paused on {s['paused']} of {s['steps']} steps (this answer kept too few drafts "
                     "for them to pay, so the target wrote alone there)")
    if s["reading_s"] > 0:
        parts.append(f"besides, {s['reading_s']:.1f} s of the draft reading your message between the first steps "
                     "(prompt reading, as the prefill, so not in tokens/s)")
    if baseline_tokens_per_s and baseline_tokens_per_s > 0 and s["tokens_per_s"] > 0 and s["drafted"]:
        ratio = s["tokens_per_s"] / baseline_tokens_per_s
        if baseline_source == IN_ANSWER:
            parts.append(f"**{ratio:.2f}× the target alone** (target alone timed in this answer, under the same "
                         f"load: {baseline_tokens_per_s:.1f} tokens/s on {len(alone_steps(steps))} of its steps)")
        elif is_measured(baseline_source):
            why = ("; this page's drawing slows the answer too, so Compare races both here"
                   if baseline_source == MEASURED_AT_START else "")
            parts.append(f"**{ratio:.2f}× the target alone** (target alone {BASELINE_WORDS[baseline_source]}: "
                         f"{baseline_tokens_per_s:.1f} tokens/s{why})")
        else:
            parts.append(f"≈{ratio:.2f}× the target alone (target alone estimated from the device profile: "
                         f"{baseline_tokens_per_s:.1f} tokens/s; Compare or “Measure” measures it)")
        if ratio < 1.0:
            parts.append(why_slower(s["tokens_per_step"], expected_tokens, priced_speedup,
                                    same_load=baseline_source == IN_ANSWER))
    return " · ".join(parts)


def why_slower(tokens_per_step: float, expected_tokens: float | None, priced_speedup: float | None = None,
               same_load: bool = False) -> str:
    """Why an answer came out slower than the target alone: its drafts were kept less than the
    calibration predicts (the tree was sized for more), or each step cost more than measured; and,
    with ``priced_speedup``, whether its steps beat the target alone as this machine's profile
    prices them (then the page and the host took a margin that was there). ``same_load``: the
    target alone was timed in the answer itself, so the page's drawing weighed on both sides."""
    kept_less = expected_tokens is not None and tokens_per_step < 0.85 * expected_tokens
    if kept_less:
        head = (f"slower than the target alone on this answer: its drafts were kept less than predicted "
                f"({tokens_per_step:.2f} tokens/step, against {expected_tokens:.2f})")
    elif same_load:
        head = ("slower than the target alone on this answer: against the target alone's steps timed beside "
                "them, its drafting steps cost more than this machine's profile prices them")
    else:
        head = ("slower than the target alone on this answer: its steps cost more than when the target alone was "
                "timed (this page's drawing, or another program, shared the cores)")
    if priced_speedup is not None and priced_speedup >= 1.0:
        taker = "this page's drawing and the host took that thin a margin" if kept_less else "the difference is theirs"
        return (f"{head}; priced by this machine's profile its steps are {priced_speedup:.2f}× the target alone, "
                f"so {taker} (Compare races both in this page)")
    if kept_less:
        return f"{head}; a longer answer, or one that repeats the conversation, keeps more"
    return head


def _percent(x: float) -> str:
    return "–" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


# ----- compare as a race -----------------------------------------------------------------------
def race_html(speculative: Sequence[StepRecord], alone: Sequence[StepRecord], total_tokens: int) -> str:
    """Compare as a race, on the decoding clock (prefill excluded): how far the target alone has
    got after ``alone``'s steps, and how far the speculative answer had got in the same time (from
    its own step timings), as two bars out of ``total_tokens``. HTML (no user text in it)."""
    elapsed = sum(s.timings.total_s for s in alone)
    alone_tokens = sum(len(s.committed) for s in alone)
    spec_tokens, clock = 0, 0.0
    for step in speculative:
        if clock + step.timings.total_s > elapsed:
            break
        clock += step.timings.total_s
        spec_tokens += len(step.committed)
    spec_done = spec_tokens >= total_tokens
    spec_time = sum(s.timings.total_s for s in speculative)
    total = max(total_tokens, 1)

    def bar(label, tokens, colour, note):
        pct = min(100.0, 100.0 * tokens / total)
        return (f"<div class='sc-race-row'><span class='sc-race-label'>{label}</span>"
                f"<span class='sc-race-track'><span class='sc-race-bar' style='width:{pct:.1f}%;background:{colour}'>"
                f"</span></span><span class='sc-race-note'>{note}</span></div>")

    spec_note = (f"done in {spec_time:.2f} s" if spec_done else f"{spec_tokens} tokens")
    return (f"<div class='sc-race'><div class='sc-race-head'>Race, measured live: {elapsed:.2f} s of decoding</div>"
            + bar("speculative", spec_tokens, COLOURS[ACCEPTED][0], spec_note)
            + bar("target alone", alone_tokens, "#ea580c", f"{alone_tokens} tokens")
            + "</div>")
