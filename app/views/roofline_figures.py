"""The roofline panel of "Why this tree": the machine's limits (:mod:`engine.tuning.roofline`) against
the measured profile and the steps of the last answer. Pure functions: records and a roofline in,
plotly figures and HTML out.

On one log-log chart, in ms against the rows a forward computes: the bandwidth floor of one target
forward (its weights streamed once), the compute roof for n rows, the roofline (the larger of the
two), the profile's t_T(n) and t_D(w) with the draft's own floor, each step of the last answer (its
verification at its tree's size, its draft per level at the level's mean width) and the pick.
"""
from __future__ import annotations

import html
from collections.abc import Sequence

import plotly.graph_objects as go

from engine.core.draft_gate import drafted_tree
from engine.core.records import StepRecord
from engine.tuning.roofline import Roofline, WhatIf, limits_sentence, one_sentence

from app.views.figures import FONT

FLOOR_COLOUR, COMPUTE_COLOUR, ROOF_COLOUR = "#0891b2", "#7c3aed", "#334155"
TARGET_COLOUR, DRAFT_COLOUR, PICK_COLOUR = "#2563eb", "#f97316", "#f59e0b"
STEP_COLOUR = "rgba(37, 99, 235, 0.35)"
STEP_DRAFT_COLOUR = "rgba(249, 115, 22, 0.4)"


def _rows_axis(roofline: Roofline, steps: Sequence[StepRecord]) -> list[int]:
    """Powers of two from 1 up to the largest size measured or verified (at least 64)."""
    top = max([64, *roofline.measured_target(), *roofline.measured_draft(), *(s.tree_size for s in steps)])
    xs, n = [], 1
    while n < top:
        xs.append(n)
        n *= 2
    return xs + [n]


def step_points(steps: Sequence[StepRecord]) -> tuple[list[tuple[int, float, int]], list[tuple[float, float, int]]]:
    """``(verify, draft)`` points of ``steps``: ``(rows verified, seconds, step number)`` for every step
    that timed its verification, and ``(mean level width, seconds per level, step number)`` for every
    step whose draft drafted (a level per depth of the draft's own tree: the levels with children)."""
    verify, draft = [], []
    for number, step in enumerate(steps, 1):
        if step.timings.verify_s > 0:
            verify.append((step.tree_size, step.timings.verify_s, number))
        drafted = drafted_tree(step)  # nodes copied from the context cost the draft nothing
        levels = drafted.depth
        if levels and step.timings.draft_s > 0:
            width = len(set(drafted.parents[1:])) / levels
            draft.append((width, step.timings.draft_s / levels, number))
    return verify, draft


def _limit_traces(roofline: Roofline, xs: list[int]) -> list[dict]:
    limits = roofline.limits
    floor = roofline.target_floor_s * 1e3
    line = dict(type="scatter", mode="lines", x=xs, hoverinfo="skip")
    return [
        {**line, "y": [floor] * len(xs), "name": f"bandwidth floor: {roofline.target_bytes / 1e9:.2f} GB at "
                                                 f"{limits.bandwidth_gbs:.0f} GB/s = {floor:.1f} ms",
         "line": dict(color=FLOOR_COLOUR, width=1.6, dash="dot"), "meta": {"kind": "floor"}},
        {**line, "y": [roofline.compute_s(n) * 1e3 for n in xs],
         "name": f"{limits.compute} compute for n rows at {limits.int8_gops:.0f} GOPS",
         "line": dict(color=COMPUTE_COLOUR, width=1.6, dash="dot"), "meta": {"kind": "compute"}},
        {**line, "y": [roofline.roof(n) * 1e3 for n in xs], "hoverinfo": None,
         "name": f"roofline: compute-bound from n = {roofline.compute_bound_from}",
         "hovertemplate": "n = %{x}: at least %{y:.1f} ms<extra>roofline</extra>",
         "line": dict(color=ROOF_COLOUR, width=3), "opacity": 0.35, "meta": {"kind": "roof"}},
    ]


def _measured_traces(roofline: Roofline) -> list[dict]:
    traces = []
    one = roofline.profile.target_time(1) if roofline.profile is not None else None
    for name, points, colour, kind in (("measured t_T(n): the target verifying n rows", roofline.measured_target(),
                                        TARGET_COLOUR, "target"),
                                       ("measured t_D(w): a draft level of width w", roofline.measured_draft(),
                                        DRAFT_COLOUR, "draft")):
        if not points:
            continue
        xs = list(points)
        floor = roofline.target_floor_s if kind == "target" else roofline.draft_floor_s
        traces.append(dict(type="scatter", mode="lines+markers", x=xs, y=[points[x] * 1e3 for x in xs], name=name,
                           line=dict(color=colour, width=2.2), marker=dict(size=7), meta={"kind": kind},
                           text=[f"{points[x] / floor:.2f}× its floor, {points[x] / one:.2f}× t_T(1)" if floor else ""
                                 for x in xs],
                           hovertemplate="%{x}: %{y:.1f} ms (%{text})<extra></extra>"))
    if roofline.draft_bytes and roofline.measured_draft():
        xs = list(roofline.measured_draft())
        floor = roofline.draft_floor_s * 1e3
        traces.append(dict(type="scatter", mode="lines", x=[xs[0], xs[-1]], y=[floor, floor], hoverinfo="skip",
                           name=f"draft's floor: {roofline.draft_bytes / 1e9:.2f} GB = {floor:.1f} ms",
                           line=dict(color=DRAFT_COLOUR, width=1.4, dash="dot"), meta={"kind": "draft_floor"}))
    return traces


def _step_traces(steps: Sequence[StepRecord]) -> list[dict]:
    verify, draft = step_points(steps)
    traces = []
    for name, points, colour, kind, what in (("last answer: each step's verification", verify, STEP_COLOUR,
                                              "steps_verify", "rows verified in"),
                                             ("last answer: each step's draft, per level", draft, STEP_DRAFT_COLOUR,
                                              "steps_draft", "wide levels, each")):
        if points:
            traces.append(dict(type="scatter", mode="markers", x=[p[0] for p in points],
                               y=[p[1] * 1e3 for p in points], name=name, meta={"kind": kind},
                               marker=dict(color=colour, size=8, symbol="circle-open", line=dict(width=1.6)),
                               text=[f"step {p[2]}" for p in points],
                               hovertemplate=f"%{{text}}: %{{x:.3g}} {what} %{{y:.1f}} ms<extra></extra>"))
    return traces


def roofline_figure(roofline: Roofline, pick: tuple[int, float] | None = None,
                    steps: Sequence[StepRecord] = (), title: str = "This machine's limits") -> go.Figure:
    """The roofline chart (see the module docstring); ``pick``: ``(tree size, its t_T seconds)`` to
    star, ``steps``: the last answer's steps."""
    xs = _rows_axis(roofline, steps)
    traces = _limit_traces(roofline, xs) + _measured_traces(roofline) + _step_traces(steps)
    if pick is not None:
        traces.append(dict(type="scatter", mode="markers+text", x=[pick[0]], y=[pick[1] * 1e3], name="the pick",
                           text=["pick"], textposition="top center", textfont=dict(color="#b45309", size=12),
                           marker=dict(symbol="star", size=18, color=PICK_COLOUR, line=dict(color="white", width=1.2)),
                           hovertemplate=f"the pick: n = {pick[0]} rows, t_T = %{{y:.1f}} ms<extra></extra>",
                           meta={"kind": "pick"}, cliponaxis=False))
    layout = dict(title=dict(text=title, x=0.01, xanchor="left", font=dict(size=14)), height=400,
                  plot_bgcolor="white", paper_bgcolor="white", font=dict(family=FONT, size=12, color="#1f2937"),
                  dragmode=False, showlegend=True, margin=dict(l=56, r=16, t=44, b=130),
                  legend=dict(orientation="h", yanchor="top", y=-0.2, x=0, font=dict(size=11)),
                  xaxis=dict(type="log", tickvals=xs, fixedrange=True, gridcolor="#eef2f7",
                             title=dict(text="rows n a forward computes (target: tree size; draft: level width)",
                                        standoff=2)),
                  yaxis=dict(type="log", title=dict(text="ms (log)"), fixedrange=True, gridcolor="#eef2f7"))
    return go.Figure(data=traces, layout=layout)


def roofline_html(what: WhatIf | None, roofline: Roofline, scales: tuple[float, float] = (1.0, 1.0)) -> str:
    """The sentence under the chart: the limits, then (with a profile) why a bigger tree would not pay
    and what would make it pay; ``scales``: the what-if's (draft cost, target size) factors, named
    when either is not 1."""
    draft, target = scales
    head = "" if (draft, target) == (1.0, 1.0) else (
        f"<div class='sc-why-note'>What if: every draft level ×{draft:g}, the target ×{target:g} "
        f"(its bytes, its arithmetic and its measured times).</div>")
    text = one_sentence(what) if what is not None else limits_sentence(roofline)
    limits = roofline.limits
    when = limits.measured_at.replace("T", " ").removesuffix("Z")[:16]
    threads = f"{limits.threads} thread{'s' if limits.threads != 1 else ''}"
    source = (f"<div class='sc-why-note'>Limits measured on this machine {html.escape(when)} UTC ({threads}): "
              f"{'an' if limits.compute[:1] in 'aeiou' else 'a'} {html.escape(limits.compute)} matrix product and a 512 MB tensor streamed, the best of a few runs.</div>")
    return f"<div class='sc-roof-text'>{head}<div class='sc-why-line'>{html.escape(text)}</div>{source}</div>"
