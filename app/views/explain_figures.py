"""Pure functions behind the three teaching views: why this tree, the verifier step by step, and
acceptance per position. Inputs are engine records and tables, outputs plotly figures or HTML.

- **Why this tree**: the DP table G(n, d) and the predicted speedup S(n, d) as heatmaps
  (:mod:`engine.tuning.explain`), with the optimizer's pick and the user's setting marked, and the
  hardware profile t_T(n), t_D(w) it was computed from.
- **Step-through**: one decision of the acceptance walk (:class:`engine.core.records.VerifierEvent`)
  in a sentence, its p and q (and the residual after a rejection) as bars, and the tree with the
  node being judged outlined.
- **Acceptance per position**: per depth, how often the verifier accepted a child among the
  steps that reached that depth, against what the calibration predicts for the same nodes.
"""
from __future__ import annotations

import html
from collections.abc import Callable, Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.core.records import StepRecord, VerifierEvent
from engine.tuning.explain import Tables
from engine.tuning.profile import HardwareProfile

from app.views import figures

from app.views import tree_figures
from app.views.figures import FONT, MONO, visible_token

PICK_COLOUR = "#f59e0b"   # the optimizer's pick
YOURS_COLOUR = "#0f172a"  # the user's setting
P_COLOUR, Q_COLOUR, RESIDUAL_COLOUR = "#2563eb", "#f97316", "#7c3aed"

TokenTexts = Mapping[int, str] | Callable[[int], str] | None


def _text(texts: TokenTexts, token: int) -> str:
    return figures.token_text(texts, token)


def _quoted(texts: TokenTexts, token: int, limit: int = 24) -> str:
    """A token as the sentences show it: quoted, whitespace visible, HTML-escaped."""
    return "‘" + html.escape(visible_token(_text(texts, token), limit), quote=False) + "’"


def _base_layout(title: str, height: int) -> dict:
    return dict(title=dict(text=title, x=0.01, xanchor="left", font=dict(size=14)), height=height,
                plot_bgcolor="white", paper_bgcolor="white", font=dict(family=FONT, size=12, color="#1f2937"),
                hoverlabel=dict(bgcolor="white", font=dict(family=FONT, size=12, color="#0f172a"),
                                bordercolor="#94a3b8"), dragmode=False)


# ----- why this tree ---------------------------------------------------------------------------
def _marker(size: int, depth: int, name: str, colour: str, symbol: str, label: str, kind: str) -> dict:
    """A marked cell: a star (the pick) or a white disc ringed in ``colour`` (the user's setting)."""
    star = symbol == "star"
    return dict(type="scatter", x=[size], y=[max(depth, 1)], mode="markers", name=name, text=[label],
                marker=dict(symbol=symbol, size=20 if star else 13, color=colour if star else "white",
                            line=dict(color="white" if star else colour, width=1.5 if star else 3)),
                hovertemplate=f"{html.escape(name)}: n = {size}, d = {depth}<extra></extra>", meta={"kind": kind},
                cliponaxis=False)


def _label(size: int, depth: int, text: str, colour: str, below: bool) -> dict:
    """The marker's name in a white box, just above (or below) it: readable on any cell colour."""
    return dict(x=size, y=max(depth, 1), text=f"<b>{html.escape(text)}</b>", showarrow=True, arrowhead=0,
                arrowwidth=1.2, arrowcolor=colour, ax=0, ay=26 if below else -26, font=dict(size=12, color=colour),
                bgcolor="rgba(255,255,255,0.92)", bordercolor=colour, borderwidth=1, borderpad=2)


def _heatmap_figure(tables: Tables, grid, title: str, colourbar: str, marks: tuple, kind: str,
                    pick_text: str | None = None, **scale) -> go.Figure:
    """A heatmap of ``grid`` over the tables' sizes and depths; ``marks``: (pick, yours), each an
    (n, d) to mark or None; ``pick_text``: the pick's label (default "pick", or "pick = you"
    without ``yours``)."""
    pick, yours = marks
    hover = _hover_cells(tables)
    traces = [dict(type="heatmap", x=list(tables.sizes), y=list(tables.depths), z=[list(r) for r in grid],
                   text=hover, hovertemplate="%{text}<extra></extra>", xgap=0.5, ygap=0.5,
                   colorbar=dict(title=dict(text=colourbar, side="right"), thickness=12, len=0.9), meta={"kind": kind},
                   **scale)]
    labels = []
    if yours is not None:
        traces.append(_marker(*yours, "your setting", YOURS_COLOUR, "circle", "you", "yours"))
        labels.append(_label(*yours, "you", YOURS_COLOUR, below=True))
    if pick is not None:
        text = pick_text or ("pick" if yours is not None else "pick = you")
        traces.append(_marker(*pick, "optimizer's pick", PICK_COLOUR, "star", text, "pick"))
        labels.append(_label(*pick, text, "#b45309", below=False))
    layout = _base_layout(title, 340)
    layout.update(margin=dict(l=50, r=10, t=44, b=46), showlegend=False, annotations=labels,
                  xaxis=dict(title=dict(text="tree size n (nodes, root included)", standoff=4), fixedrange=True,
                             range=[0.5, tables.sizes[-1] + 0.5], ticks="outside"),
                  yaxis=dict(title=dict(text="depth d", standoff=2), fixedrange=True,
                             range=[0.5, tables.depths[-1] + 0.9], dtick=2 if len(tables.depths) > 8 else 1))
    return go.Figure(data=traces, layout=layout)


def _hover_cells(tables: Tables) -> list[list[str]]:
    rows = []
    for i, d in enumerate(tables.depths):
        row = []
        for j, n in enumerate(tables.sizes):
            g = tables.expected[i][j]
            if g is None:
                row.append(f"n = {n}, d ≤ {d}: no tree")
                continue
            head = "target alone (no draft)" if n == 1 else f"n = {n}, depth ≤ {d}"
            text = f"{head}<br>G = {g:.2f} tokens/step"
            if tables.speedup is not None:
                text += (f"<br>verify {tables.verify_s[i][j] * 1e3:.0f} ms + draft {tables.draft_s[i][j] * 1e3:.0f} ms"
                         f"<br>predicted speedup S = {tables.speedup[i][j]:.2f}×")
            row.append(text)
        rows.append(row)
    return rows


def expected_heatmap(tables: Tables, pick: tuple[int, int] | None = None, yours: tuple[int, int] | None = None,
                     calibration: str = "") -> go.Figure:
    """G(n, d), expected tokens per step (bonus included) of the DP tree of n nodes and depth <= d,
    under the acceptance vector in use; ``pick`` and ``yours`` are (n, d) marked on it."""
    title = "G(n, d): expected tokens per step" + (f" <span style='font-size:11px;color:#64748b'>"
                                                   f"({html.escape(calibration)})</span>" if calibration else "")
    return _heatmap_figure(tables, tables.expected, title, "tokens/step", (pick, yours), "expected",
                           colorscale="Viridis")


def speedup_heatmap(tables: Tables, pick: tuple[int, int] | None = None,
                    yours: tuple[int, int] | None = None,
                    title: str = "S(n, d): predicted speedup over the target alone",
                    pick_text: str | None = None) -> go.Figure:
    """S(n, d) = G(n, d)·t_T(1) / (t_T(n) + draft cost), predicted speedup over the target alone;
    diverging around 1 (red: slower than the target alone, green: faster); ``title`` and
    ``pick_text`` (the pick's label) for a what-if's table."""
    if tables.speedup is None:
        return figures.placeholder_figure("No hardware profile for this pair and device: no speedup to predict "
                                          "(python -m engine.cli.profile measures one).", 340)
    values = [s for row in tables.speedup for s in row if s is not None]
    low, high = min(values + [0.95]), max(values + [1.05])
    middle = (1.0 - low) / (high - low)  # where 1× (the target alone) falls on the scale: pale yellow
    scale = [[0.0, "#b91c1c"], [middle / 2, "#f87171"], [middle, "#fef9c3"],
             [middle + (1 - middle) / 2, "#4ade80"], [1.0, "#166534"]]
    return _heatmap_figure(tables, tables.speedup, title, "speedup ×",
                           (pick, yours), "speedup", pick_text, colorscale=scale, zmin=low, zmax=high)


def profile_figure(profile: HardwareProfile) -> go.Figure:
    """The measured latencies the optimizer uses: t_T(n) (the target verifying n tokens) and t_D(w)
    (one draft forward over a level of w nodes), in ms, n and w on a log2 axis."""
    one = profile.target_time(1)
    traces = []
    for name, points, colour, kind in (("target t_T(n): verify n tokens", profile.target, P_COLOUR, "target"),
                                       ("draft t_D(w): one level of w nodes", profile.draft, Q_COLOUR, "draft")):
        xs = sorted(points)
        traces.append(dict(type="scatter", x=xs, y=[points[x] * 1e3 for x in xs], mode="lines+markers", name=name,
                           line=dict(color=colour, width=2.2), marker=dict(size=7),
                           text=[f"{points[x] / one:.2f}× one target token" for x in xs],
                           hovertemplate="%{x}: %{y:.0f} ms (%{text})<extra></extra>", meta={"kind": kind}))
    layout = _base_layout("Measured forward latencies (the hardware profile)", 300)
    layout.update(margin=dict(l=56, r=16, t=44, b=80), showlegend=True,
                  legend=dict(orientation="h", yanchor="top", y=-0.25, x=0, font=dict(size=11)),
                  xaxis=dict(type="log", title=dict(text="tokens n (target) / level width w (draft)", standoff=2),
                             tickvals=sorted(set(profile.target) | set(profile.draft)), fixedrange=True),
                  yaxis=dict(title=dict(text="ms"), rangemode="tozero", fixedrange=True, gridcolor="#eef2f7"))
    return go.Figure(data=traces, layout=layout)


def profile_caption(profile: HardwareProfile, source: str) -> str:
    """Where the profile comes from and what it measured (HTML)."""
    return (f"<div class='sc-why-profile'>Profile <b>{html.escape(profile.device)}</b> · pair "
            f"<code>{html.escape(profile.pair)}</code> · {html.escape(profile.dtype)} · after a "
            f"{profile.prefix_len}-token prefix{_overhead_note(profile)}{_measured_note(profile)} · "
            f"{html.escape(source)}</div>")


def _measured_note(profile: HardwareProfile) -> str:
    """When the profile was measured and how much its repeats disagreed (older profiles kept neither)."""
    when = (f"measured {html.escape(profile.measured_at.replace('T', ' ').removesuffix('Z')[:16])} UTC"
            if profile.measured_at else "date of measurement not kept")
    if not profile.repeats:
        return f" · {when}"
    return f" · {when}, medians of {profile.repeats} repeats that varied ≤ {profile.max_spread():.0%}"


def _overhead_note(profile: HardwareProfile) -> str:
    if profile.step_overhead <= 0:
        return ""
    return f" · every step also costs {profile.step_overhead * 1e3:.0f} ms beyond its forwards"


# ----- step-through ----------------------------------------------------------------------------
def _has_children(step: StepRecord, node: int) -> bool:
    return any(p == node for p in step.parents[1:])


def event_sentence(step: StepRecord, event: VerifierEvent, texts: TokenTexts) -> str:
    """One sentence (HTML) that explains the decision ``event`` of ``step``'s walk."""
    token = _quoted(texts, event.token)
    where = _quoted(texts, step.tokens[event.node])
    events = step.trace or []
    later = events[events.index(event) + 1:] if event in events else []
    next_sibling = next((e for e in later if e.node == event.node and e.rule != "bonus"), None)
    if event.rule == "bonus":
        rejected_here = any(e.node == event.node and e.rule != "bonus" and not e.accepted for e in events)
        unused = "" if step.used_bonus else " (not committed: the answer had already ended)"
        if step.tree_size == 1:
            return f"No draft: the target writes {token} itself{unused}."
        if step.greedy:
            why = "no child matched" if rejected_here else "it is a leaf" if event.node else "nothing was drafted"
            return (f"After {where} {why}: the bonus token is the target's argmax {token}, so every step "
                    f"commits at least one token{unused}.")
        if event.node and not _has_children(step, event.node):
            return f"{where} is a leaf: the bonus token {token} is drawn from the target's p there{unused}."
        if step.method == "topk":
            return f"No child of {where} matched: the target's own sample {token} is the bonus token{unused}."
        return (f"Every child of {where} was rejected: the bonus token {token} is drawn from the residual p "
                f"(what is left of the target's distribution once the drafts' share is taken out){unused}.")
    if event.rule == "argmax":
        argmax = _quoted(texts, event.target_token)
        if event.accepted:
            return (f"Greedy (T = 0): the target's most likely token after {where} is {argmax}; the draft's "
                    f"child {token} matches it: accepted, the walk moves to its children.")
        return (f"Greedy (T = 0): the target's most likely token after {where} is {argmax}; the child {token} "
                f"is not it: rejected, " + ("the next sibling is tried." if next_sibling else
                                            "no sibling left, so the argmax itself is the bonus token."))
    if event.rule == "match":
        sample = _quoted(texts, event.target_token)
        if event.accepted:
            return (f"Top-k: the target sampled {sample} after {where}; the child {token} is that token: accepted, "
                    f"the walk moves to its children.")
        return (f"Top-k: the target sampled {sample} after {where}; the child {token} is not it: rejected, "
                + ("the next sibling is compared." if next_sibling else "no sibling left, the sample is the bonus token."))
    accept = event.acceptance
    p_name = "p" if event.residual is None and not _earlier_rejections(events, event) else "residual p"
    q_name = "q" if step.method == "specinfer" or not _earlier_rejections(events, event) else "renormalised q"
    fmt = tree_figures.format_prob
    numbers = f"{p_name}({token}) = {fmt(event.p_x)}, {q_name}({token}) = {fmt(event.q_x)}"
    if event.accepted:
        moves = ("the walk moves to its children." if _has_children(step, event.child) else
                 "it is a leaf, so the bonus token comes next.")
        return f"r = {event.r:.2f} &lt; min(1, p/q) = {accept:.2f} ({numbers}): {token} is accepted, {moves}"
    then = (f"the next sibling {_quoted(texts, next_sibling.token)} is judged on it" if next_sibling else
            "the bonus token is drawn from it")
    renorm = (f" and q is renormalised without {token}" if step.method != "specinfer" and next_sibling else "")
    return (f"r = {event.r:.2f} ≥ min(1, p/q) = {accept:.2f} ({numbers}): {token} is rejected; p becomes the "
            f"residual norm(relu(p − q)){renorm}, and {then}.")


def _earlier_rejections(events: Sequence[VerifierEvent], event: VerifierEvent) -> bool:
    if event not in events:
        return False
    before = events[:events.index(event)]
    return any(e.node == event.node and e.rule == "sample" and not e.accepted for e in before)


def acceptance_gauge(event: VerifierEvent) -> str:
    """r against min(1, p/q) on a 0..1 track (HTML): r left of the boundary is an acceptance."""
    if event.rule != "sample" or event.r is None:
        return ""
    accept = event.acceptance
    verdict = "accepted" if event.accepted else "rejected"
    return (f"<div class='sc-gauge' title='a uniform r is drawn; the child is kept when r &lt; min(1, p/q)'>"
            f"<div class='sc-gauge-track'><div class='sc-gauge-accept' style='width:{100 * accept:.1f}%'></div>"
            f"<div class='sc-gauge-r sc-gauge-{verdict}' style='left:{100 * event.r:.1f}%'></div></div>"
            f"<div class='sc-gauge-legend'><span>0</span><span class='sc-gauge-label'>green: "
            f"r &lt; min(1, p/q) = {accept:.2f} keeps the child · marker: r = {event.r:.2f} → <b>{verdict}</b></span>"
            f"<span>1</span></div></div>")


def _labels(tokens: Sequence[int], texts: TokenTexts) -> list[str]:
    """Bar labels: visible token text, made unique (plotly merges equal categories)."""
    out, seen = [], set()
    for t in tokens:
        label = html.escape(visible_token(_text(texts, t), 10), quote=False)
        if label in seen:
            label = f"{label} #{t}"
        seen.add(label)
        out.append(label)
    return out


def event_figure(event: VerifierEvent, texts: TokenTexts, top: int = 8, after_rejection: bool = False,
                 renormalised_q: bool | None = None) -> go.Figure:
    """The target's p and the draft's q over their top tokens, side by side (the token judged
    outlined); after a rejection, the residual norm(relu(p − q)) in a second panel.
    ``after_rejection``: an earlier sibling was rejected, so p is already a residual (and q
    renormalised, unless ``renormalised_q`` is False: SpecInfer keeps q)."""
    p, q = dict(event.top_p[:top]), dict(event.top_q[:top])
    order = list(p) + [t for t in q if t not in p]
    if event.token not in order and event.rule != "bonus":
        order.append(event.token)
    labels = _labels(order, texts)
    residual = dict((event.residual or [])[:top])
    panels = 2 if residual else 1
    p_name = "target p (residual)" if after_rejection else "target p"
    fig = make_subplots(rows=1, cols=panels, column_widths=[0.62, 0.38] if panels == 2 else None,
                        horizontal_spacing=0.08,
                        subplot_titles=("p and q, their top tokens", "residual norm(relu(p − q))") if panels == 2
                        else None)
    outline = [3 if t == event.token else 0 for t in order]
    hover = "%{x}: %{y:.3f}<extra>%{fullData.name}</extra>"
    fig.add_trace(go.Bar(x=labels, y=[p.get(t) for t in order], name=p_name, marker=dict(
        color=P_COLOUR, line=dict(color="#0f172a", width=outline)), hovertemplate=hover, meta={"kind": "p"}), 1, 1)
    if q:
        fig.add_trace(go.Bar(x=labels, y=[q.get(t) for t in order], name="draft q" + (" (renormalised)" if
                             (after_rejection if renormalised_q is None else renormalised_q) else ""), marker=dict(
            color=Q_COLOUR, line=dict(color="#0f172a", width=outline)), hovertemplate=hover, meta={"kind": "q"}), 1, 1)
    if residual:
        r_order = list(residual)
        fig.add_trace(go.Bar(x=_labels(r_order, texts), y=[residual[t] for t in r_order], name="residual",
                             marker=dict(color=RESIDUAL_COLOUR), hovertemplate=hover, meta={"kind": "residual"}), 1, 2)
    layout = _base_layout("" if panels == 2 else "p (target) and q (draft) over their top tokens", 320)
    layout.update(barmode="group", bargap=0.25, margin=dict(l=52, r=12, t=40, b=110), showlegend=True,
                  legend=dict(orientation="h", yanchor="top", y=-0.36, x=0, font=dict(size=11)))
    fig.update_layout(**layout)
    fig.update_xaxes(tickangle=-35, tickfont=dict(family=MONO, size=11), fixedrange=True)
    fig.update_yaxes(rangemode="tozero", fixedrange=True, gridcolor="#eef2f7", title_text="probability", row=1, col=1)
    fig.update_annotations(font=dict(size=12))
    return fig


def focus_tree(step: StepRecord, texts: TokenTexts, event: VerifierEvent | None, scale: float = 1.0) -> go.Figure:
    """The step's tree (:func:`app.views.tree_figures.tree_figure`) with the chip of the node being judged outlined
    in amber (the bonus chip for a bonus event) and the node the walk stands on outlined in black."""
    fig = tree_figures.tree_figure(step, texts, scale=scale, max_height=420)
    if event is None:
        return fig
    where = {int(node) for trace in fig.data if trace.meta and trace.meta.get("kind") in ("nodes", "bonus")
             for node in trace.customdata}
    focus = -1 if event.child is None else event.child
    chips = list(fig.layout.annotations)  # one per node in order, then the bonus
    for node, colour, name, kind in ((event.node, YOURS_COLOUR, "the walk is here", "at"),
                                     (focus, PICK_COLOUR, "being judged", "focus")):
        if node not in where:
            continue
        index = node if node >= 0 else len(step.tokens)
        if index < len(chips):
            chips[index].update(bordercolor=colour, borderwidth=4)
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name, hoverinfo="skip", showlegend=True,
                                 marker=dict(symbol="square-open", size=12, color=colour, line=dict(width=3)),
                                 meta={"kind": kind, "node": node}))  # legend only
    fig.update_layout(annotations=chips)
    return fig


# ----- acceptance per position -----------------------------------------------------------------
def acceptance_by_depth(steps: Sequence[StepRecord], acceptance: Sequence[float] | None = None) -> list[dict]:
    """Per depth d = 1, 2, ...: ``reached`` (steps whose walk got to try a child at depth d: the
    accepted node at depth d − 1 has children), ``accepted`` (of those, steps that accepted one),
    ``rate`` = accepted / reached and, given the calibration's vector p_1..p_K, ``predicted``: the
    mean over the same steps of p_1 + … + p_c, c the number of children tried from (the chance
    that one of c ranked children is accepted). The bonus token is not counted anywhere here."""
    rows: dict[int, dict] = {}
    for step in steps:
        children: dict[int, int] = {}
        for node, parent in enumerate(step.parents[1:], start=1):
            children[parent] = children.get(parent, 0) + 1
        kept = len(step.accepted) - 1
        for depth, node in enumerate(step.accepted, start=1):
            c = children.get(node, 0)
            if not c:
                break
            row = rows.setdefault(depth, {"depth": depth, "reached": 0, "accepted": 0, "predicted_sum": 0.0})
            row["reached"] += 1
            row["accepted"] += int(kept >= depth)
            if acceptance is not None:
                row["predicted_sum"] += float(sum(acceptance[:c]))
    out = []
    for depth in sorted(rows):
        row = rows[depth]
        out.append({"depth": depth, "reached": row["reached"], "accepted": row["accepted"],
                    "rate": row["accepted"] / row["reached"],
                    "predicted": row["predicted_sum"] / row["reached"] if acceptance is not None else None})
    return out


ACCEPTANCE_DEFINITIONS = (
    "<b>Acceptance at depth d</b> = accepted / reached: among this conversation's steps whose walk got to try a "
    "child at depth d (the accepted path reached depth d − 1 and that node has children), the share that "
    "accepted one. It excludes the bonus token. <b>Predicted</b>: what the calibration's vector p₁…p_K says for "
    "the same nodes, p₁ + … + p_c for a node with c children, averaged. <b>Tokens/step</b> (the per-step "
    "chart) counts the accepted drafts plus the bonus token, so it is at least 1 even when nothing is accepted.")


def acceptance_figure(rows: Sequence[dict], calibration: str = "", tokens_per_step: float | None = None) -> go.Figure:
    """Measured acceptance per depth (bars, with accepted/reached on them) against the calibration's
    prediction for the same nodes (markers)."""
    if not rows:
        return figures.placeholder_figure("No drafted tokens were verified yet: send a message (a method other "
                                          "than autoregressive).", 300)
    xs = [r["depth"] for r in rows]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=xs, y=[r["rate"] for r in rows], name="measured: accepted / reached",
                         marker=dict(color=figures.COLOURS[figures.ACCEPTED][0]),
                         text=[f"{r['accepted']}/{r['reached']}" for r in rows], textposition="outside",
                         cliponaxis=False, hovertemplate="depth %{x}: %{text} = %{y:.2f}<extra></extra>",
                         meta={"kind": "measured"}))
    if rows[0]["predicted"] is not None:
        fig.add_trace(go.Scatter(x=xs, y=[r["predicted"] for r in rows], mode="markers+lines",
                                 name="predicted by the calibration" + (f" ({calibration})" if calibration else ""),
                                 line=dict(color="#64748b", dash="dash", width=1.5),
                                 marker=dict(symbol="diamond", size=10, color="#334155"),
                                 hovertemplate="depth %{x}: predicted %{y:.2f}<extra></extra>", meta={"kind": "predicted"}))
    title = "Acceptance per position (depth in the tree), this conversation"
    if tokens_per_step is not None:
        title += f" · {tokens_per_step:.2f} tokens/step"
    layout = _base_layout(title, 320)
    layout.update(margin=dict(l=50, r=16, t=44, b=70), showlegend=True, bargap=0.35,
                  legend=dict(orientation="h", yanchor="top", y=-0.2, x=0, font=dict(size=11)),
                  xaxis=dict(title=dict(text="depth d", standoff=2), dtick=1, fixedrange=True),
                  yaxis=dict(title=dict(text="acceptance"), range=[0, 1.12], fixedrange=True, gridcolor="#eef2f7"))
    fig.update_layout(**layout)
    return fig
