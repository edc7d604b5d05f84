"""The token tree of one step, drawn two ways from the same geometry: a plotly figure (laid out,
with hover text saying what the verifier did at each node) and a light SVG for the live view
while an answer streams. Pure functions of a :class:`engine.core.records.StepRecord` and the
text of its tokens, like :mod:`app.views.figures`, whose colours and token text they share.

Node statuses in a step's tree:

- ``root``: the last committed token the tree grows from;
- ``accepted``: on the path the target accepted;
- ``rejected``: drafted as a child of an accepted node (or of the root) but not accepted;
- ``unreached``: below a node that was not accepted, so verification never looked at it;
- ``unused``: accepted by the verifier but never committed: the answer ended (stop token or
  budget) earlier on the accepted path;
- ``bonus``: the token the target itself adds after the accepted path (not a tree node); in
  autoregressive mode (a root-only tree) it is simply the target's token.
"""
from __future__ import annotations

import html
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import plotly.graph_objects as go

from engine.core.records import StepRecord

from app.views.figures import (ACCEPTED, BONUS, COLOURS, EDGE_GREY, FONT, LABEL_BUDGET, MIN_LABEL_CHARS, MONO, REJECTED, ROOT,
                      STATUS_NAMES, UNREACHED, UNUSED, token_label, token_text, visible_token)

# ----- tree ------------------------------------------------------------------------------------
def node_statuses(step: StepRecord) -> list[str]:
    """Status of every tree node of ``step`` (see the module docstring)."""
    accepted = set(step.accepted)
    used = set(step.accepted[:step.accepted_draft_tokens + 1])
    statuses = []
    for node, parent in enumerate(step.parents):
        if node == 0:
            statuses.append(ROOT)
        elif node in used:
            statuses.append(ACCEPTED)
        elif node in accepted:
            statuses.append(UNUSED)
        elif parent in accepted:
            statuses.append(REJECTED)
        else:
            statuses.append(UNREACHED)
    return statuses


def bonus_token(step: StepRecord) -> int | None:
    """The target's own token after the accepted path, or None when a stop or the budget cut the step short."""
    return step.committed[-1] if step.used_bonus else None


def tree_layout(parents: Sequence[int], extra_child_of: int | None = None) -> tuple[list[float], list[float]]:
    """``(x, y)`` per node: x = depth (root left), leaves on consecutive rows in rank order, each
    parent centred on its children. ``extra_child_of`` reserves one more leaf row (last) under
    that node, returned as an extra final entry (used for the bonus token)."""
    n = len(parents)
    children: list[list[int]] = [[] for _ in range(n + 1)]
    for node in range(1, n):
        children[parents[node]].append(node)
    if extra_child_of is not None:
        children[extra_child_of].append(n)
    depth = [0] * (n + 1)
    for node in range(1, n):
        depth[node] = depth[parents[node]] + 1
    if extra_child_of is not None:
        depth[n] = depth[extra_child_of] + 1
    y = [0.0] * (n + 1)
    next_row = 0.0
    # iterative post-order: leaves take the next row, parents the middle of their children
    stack = [(0, False)]
    while stack:
        node, expanded = stack.pop()
        if children[node] and not expanded:
            stack.append((node, True))
            stack.extend((c, False) for c in reversed(children[node]))
        elif children[node]:
            y[node] = (y[children[node][0]] + y[children[node][-1]]) / 2
        else:
            y[node] = next_row
            next_row += 1
    count = n + (1 if extra_child_of is not None else 0)
    return [float(d) for d in depth[:count]], y[:count]


def format_prob(p: float) -> str:
    if p == 0:
        return "0"
    return f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"


def acceptance_probability(p: float, q: float) -> float:
    """min(1, p/q): the chance speculative sampling keeps a drafted token (1 when q == 0 and p > 0)."""
    if q <= 0:
        return 1.0 if p > 0 else 0.0
    return min(1.0, p / q)


def verifier_rule(step: StepRecord, node: int, status: str) -> str:
    """How the verifier judged ``node`` (not the root), with the probabilities it actually used."""
    if step.greedy:
        if status in (ACCEPTED, UNUSED):
            return "greedy (T = 0): argmax match, the target's most likely token" + (
                "<br>not used: the answer ended before it" if status == UNUSED else "")
        if status == REJECTED:
            return "greedy (T = 0): not the target's argmax"
        return "greedy (T = 0): never reached"
    p = step.verifier_p[node] if node < len(step.verifier_p) else None
    q = step.verifier_q[node] if node < len(step.verifier_q) else None
    if p is None:
        return "not tried: an earlier sibling was accepted, or the walk never got here"
    if step.method == "topk":
        return f"top-k: kept if the target's own sample is this token, p = {format_prob(p)}"
    first = step.ranks[node] == 1
    return (f"judged on {'p' if first else 'residual p'} = {format_prob(p)}, "
            f"{'q' if first or step.method == 'specinfer' else 'renormalised q'} = {format_prob(q)}"
            f"<br>accept prob min(1, p/q) = {acceptance_probability(p, q):.2f}")


COPY_COLOUR = "#0891b2"  # the border of a node copied from the context (a free draft)


def copied(step: StepRecord, node: int) -> bool:
    """Whether ``node`` was copied from the context rather than drafted by the draft model."""
    return bool(step.sources) and step.sources[node] == "copy"


def copy_origin(step: StepRecord, node: int) -> str:
    """Where a copied node's token was copied from, in words."""
    document, position = step.copy_origins[node]
    where = "the conversation (prompt and answer)" if document == 0 else "the expected output given with the request"
    return f"copied from {where}, token {position}: a free draft, no draft-model cost"


def _node_hover(step: StepRecord, node: int, status: str, text: str) -> str:
    shown = html.escape(visible_token(text, 40), quote=False)
    token = step.tokens[node]
    if node == 0:
        return f"<b>{shown}</b>  (id {token})<br>root: the last committed token"
    p, q = step.target_probs[node], step.draft_probs[node]
    if copied(step, node):
        return (f"<b>{shown}</b>  (id {token})<br>{STATUS_NAMES[status]} · {copy_origin(step, node)}"
                f"<br>target p = {format_prob(p)} · a copy is kept with probability p (T = 0: if it is the argmax)")
    depth = 0
    parent = step.parents[node]
    while parent != -1:
        depth += 1
        parent = step.parents[parent]
    return (f"<b>{shown}</b>  (id {token})<br>{STATUS_NAMES[status]} · depth {depth} · rank {step.ranks[node]}"
            f"<br>draft q = {format_prob(q)} · target p = {format_prob(p)}"
            f"<br>{verifier_rule(step, node, status)}")


def _edge_style(rank: int) -> tuple[str, float]:
    if rank <= 1:
        return "solid", 1.0
    if rank == 2:
        return "dash", 0.8
    return "dot", 0.7


def step_title(step: StepRecord) -> str:
    """The tree's heading: what the step drafted, accepted, used and committed, in words. A root-only
    step (autoregressive) is the target alone; a step cut short says how many accepted drafts it used."""
    drafted = step.tree_size - 1
    committed = len(step.committed)
    if drafted == 0:
        why = (" (timed: the answer's speed-up is measured against such steps)" if step.timed_alone else
               " (drafting paused: this answer's drafts were not paying)" if step.draft_paused else " (no draft)")
        return f"Step {step.index + 1}: the target alone wrote {committed} token{'' if committed == 1 else 's'}{why}"
    accepted = len(step.accepted) - 1
    used = step.accepted_draft_tokens
    copies = step.sources.count("copy") if step.sources else 0
    source = f" ({copies} copied from the context)" if copies else ""
    head = f"Step {step.index + 1}: accepted {accepted} of {drafted} drafted token{'' if drafted == 1 else 's'}{source}"
    if used < accepted or not step.used_bonus:
        why = "answer ended" if step.finish_reason == "stop" else "budget reached"
        return f"{head}, {used} used — {why}"
    return f"{head}, committed {committed}"


@dataclass
class TreeGeometry:
    """Where a step's tree is drawn, in character units (x) and rows (y): node ``i`` (the bonus
    token last, at index ``n``, when the step used it) at ``(xs[i], ys[i])`` with label ``labels[i]``
    (whitespace made visible, not escaped)."""

    statuses: list[str]
    bonus: int | None
    last: int
    n: int
    xs: list[float]
    ys: list[float]
    labels: list[str]
    width: float
    rows: int
    top_down: bool


def tree_geometry(step: StepRecord, token_texts, max_label_chars: int | None = None) -> TreeGeometry:
    """The layout of :func:`tree_figure` and :func:`tree_svg`. A deep, narrow tree (the chains the
    optimizer picks on CPUs) is drawn top-down, one level a row, so every label keeps up to 14
    characters; a wide one left to right, its levels sharing about LABEL_BUDGET characters but never
    fewer than MIN_LABEL_CHARS. Either way each column is as wide as its longest label: chips never
    overlap, and a tree too wide for its panel grows rather than cutting its labels."""
    statuses = node_statuses(step)
    bonus = bonus_token(step)
    last = step.accepted[-1]
    depths, leaf_rows = tree_layout(step.parents, extra_child_of=last if bonus is not None else None)
    levels, rows = int(max(depths)) + 1, int(max(leaf_rows)) + 1
    top_down = levels > rows
    if max_label_chars is None:
        max_label_chars = 14 if top_down else max(MIN_LABEL_CHARS, min(14, LABEL_BUDGET // levels - 2))
    label_tokens = list(step.tokens) + ([bonus] if bonus is not None else [])
    labels = [visible_token(token_text(token_texts, t), max_label_chars) for t in label_tokens]
    if top_down:  # leaf rows become columns of one width (a parent sits between its children)
        column = max(len(label) for label in labels) + 2
        xs = [y * column + column / 2 for y in leaf_rows]
        ys, edge, rows = [float(d) for d in depths], rows * column, levels
    else:
        width = [1] * levels
        for depth, label in zip(depths, labels):
            width[int(depth)] = max(width[int(depth)], len(label))
        centre, edge = [], 0.0
        for w in width:
            centre.append(edge + w / 2 + 1)
            edge += w + 2
        xs, ys = [centre[int(d)] for d in depths], list(leaf_rows)
    return TreeGeometry(statuses, bonus, last, len(step.tokens), xs, ys, labels, edge, rows, top_down)


SVG_CHAR, SVG_ROW = 7.6, 40  # px a label character (12 px monospace) and a row


def tree_svg(step: StepRecord, token_texts, title: str | None = None, scale: float = 1.0) -> str:
    """The step's tree as inline SVG (a few kilobytes): what the chat sends while an answer streams,
    drawn by the browser itself rather than by plotly. The same layout, colours and edge styles as
    :func:`tree_figure`; each node's whole text, q, p and verdict show on hover (``<title>``)."""
    g = tree_geometry(step, token_texts)
    pad = 12
    px = lambda x: pad + x * SVG_CHAR * scale  # noqa: E731
    py = lambda y: pad + 14 * scale + y * SVG_ROW * scale  # noqa: E731
    width, height = px(g.width) + pad, py(g.rows - 1) + 14 * scale + pad
    on_path = set(step.accepted)
    parts = []
    for node in range(1, g.n):
        parent = step.parents[node]
        dash = {"solid": "", "dash": "6 4", "dot": "2 3"}.get(_edge_style(step.ranks[node])[0], "2 3")
        accepted = node in on_path and parent in on_path
        parts.append(f'<line x1="{px(g.xs[parent]):.1f}" y1="{py(g.ys[parent]):.1f}" x2="{px(g.xs[node]):.1f}" '
                     f'y2="{py(g.ys[node]):.1f}" stroke="{COLOURS[ACCEPTED][0] if accepted else EDGE_GREY}" '
                     f'stroke-width="{3.2 if accepted else 1.6}"' + (f' stroke-dasharray="{dash}"' if dash else "") + "/>")
    if g.bonus is not None:
        parts.append(f'<line x1="{px(g.xs[g.last]):.1f}" y1="{py(g.ys[g.last]):.1f}" x2="{px(g.xs[g.n]):.1f}" '
                     f'y2="{py(g.ys[g.n]):.1f}" stroke="{COLOURS[BONUS][0]}" stroke-width="2.4" stroke-dasharray="2 3"/>')
    chips = [(i, g.statuses[i]) for i in range(g.n)] + ([(g.n, BONUS)] if g.bonus is not None else [])
    for i, status in chips:
        strong, pale = COLOURS[status]
        label = g.labels[i]
        w, h = (len(label) * SVG_CHAR + 10) * scale, 22 * scale
        x, y = px(g.xs[i]), py(g.ys[i])
        token = g.bonus if i == g.n else step.tokens[i]
        hover = (f"{visible_token(token_text(token_texts, token), 60)} (id {token}): the target's own token"
                 if i == g.n else re.sub(r"<[^>]+>", " ", _node_hover(step, i, status, token_text(token_texts, token))))
        emphasised = status in (ROOT, ACCEPTED, BONUS)
        is_copy = i < g.n and copied(step, i)
        parts.append(f'<g class="sc-node sc-{status}{" sc-copy" if is_copy else ""}"><title>{html.escape(hover)}</title>'
                     f'<rect x="{x - w / 2:.1f}" y="{y - h / 2:.1f}" width="{w:.1f}" height="{h:.1f}" rx="4" '
                     f'fill="{pale}" stroke="{COPY_COLOUR if is_copy else strong}" '
                     f'stroke-width="{2.5 if is_copy else 2 if emphasised else 1}"/>'
                     f'<text x="{x:.1f}" y="{y + 4 * scale:.1f}" text-anchor="middle" font-family="{html.escape(MONO)}" '
                     f'font-size="{12 * scale:.0f}" fill="{"#0f172a" if emphasised else "#475569"}">'
                     f'{html.escape(label)}</text></g>')
    heading = html.escape(title if title is not None else step_title(step))
    return (f'<div class="sc-live-tree"><div class="sc-live-title">{heading}</div>'
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{heading}">{"".join(parts)}</svg></div>')


def live_placeholder(message: str, feed: str | None = None) -> str:
    """The live tree's place before the first step. With ``feed`` (a live feed's token), the box
    the page's live-feed script fills: the step's tree, then the stats line."""
    if feed is None:
        return f'<div class="sc-live-tree sc-live-empty">{html.escape(message)}</div>'
    return (f'<div class="sc-live-tree" data-sc-feed="{html.escape(feed)}"><div class="sc-feed-tree">'
            f'<div class="sc-live-empty">{html.escape(message)}</div></div><div class="sc-feed-stats"></div></div>')


def tree_figure(step: StepRecord, token_texts: Mapping[int, str] | Callable[[int], str] | None,
                title: str | None = None, max_label_chars: int | None = None, scale: float = 1.0,
                max_height: int = 540) -> go.Figure:
    """The token tree of one step, root on the left, depth growing to the right.

    Nodes are labelled with their (escaped, whitespace-visible) token text and coloured by
    status; edges are solid for rank-1 children, dashed for rank 2, dotted beyond, and green
    along the accepted path. Hover shows q, p, the rank and how the verifier judged the node
    (:func:`verifier_rule`: the residual p and renormalised q it used, or the argmax match). The node traces carry
    ``meta={"kind": "nodes", "status": ...}`` and ``customdata`` = node index.
    ``scale`` enlarges the fonts (presentation mode); the figure is at most ``max_height`` pixels
    (times ``scale``) tall, 700 for a large tree (24 nodes or more), which can also be zoomed (drag a
    box, double-click to reset).
    """
    g = tree_geometry(step, token_texts, max_label_chars)
    n, edge, rows = g.n, g.width, g.rows
    # plain dicts, validated once by go.Figure (per-call add_* is slow)
    traces = _edge_traces(step, g) + _node_traces(step, g, token_texts)
    annotations = _chips(step, g, scale)

    heading = title if title is not None else step_title(step)
    layout = dict(
        annotations=annotations,
        # the heading wraps after its first comma so that a phone-wide plot does not cut it
        title=dict(text=html.escape(heading, quote=False).replace(", ", ",<br>", 1) if len(heading) > 44 else
                   html.escape(heading, quote=False), x=0.01, xanchor="left", font=dict(size=round(15 * scale))),
        height=int(scale * min(max_height if n < 24 else max(max_height, 700), max(300, 34 * rows + 150))),
        margin=dict(l=20, r=20, t=round(64 * scale), b=20),
        plot_bgcolor="white", paper_bgcolor="white", font=dict(family=FONT, size=round(12 * scale), color="#1f2937"),
        hoverlabel=dict(bgcolor="white", font=dict(family=FONT, size=round(12 * scale), color="#0f172a"),
                        bordercolor="#94a3b8"),
        legend=dict(orientation="h", yanchor="top", y=-0.02, xanchor="left", x=0, font=dict(size=round(11 * scale))),
        # zoom: drag a box over part of a large tree; double-click resets
        xaxis=dict(visible=False, range=[0, max(edge, 8)], fixedrange=n < 24),
        yaxis=dict(visible=False, range=[rows - 0.4, -0.6], fixedrange=n < 24),
        showlegend=True, dragmode="zoom" if n >= 24 else False, transition=dict(duration=0),
    )
    return go.Figure(data=traces, layout=layout)


def _edge_traces(step: StepRecord, g) -> list[dict]:
    """The tree's edges, grouped by style (one trace a group: dash and whether on the accepted
    path), and the dotted edge to the bonus token."""
    xs, ys, on_path = g.xs, g.ys, set(step.accepted)
    groups: dict[tuple[str, bool], tuple[list, list]] = {}
    for node in range(1, g.n):
        parent = step.parents[node]
        key = (_edge_style(step.ranks[node])[0], node in on_path and parent in on_path)
        ex, ey = groups.setdefault(key, ([], []))
        ex += [xs[parent], xs[node], None]
        ey += [ys[parent], ys[node], None]
    traces = [dict(type="scatter", x=ex, y=ey, mode="lines", hoverinfo="skip", showlegend=False,
                   line=dict(color=COLOURS[ACCEPTED][0] if accepted else EDGE_GREY,
                             width=3.2 if accepted else 1.6, dash=dash),
                   meta={"kind": "edges", "dash": dash, "accepted": accepted})
              for (dash, accepted), (ex, ey) in sorted(groups.items(), key=lambda kv: kv[0][1])]
    if g.bonus is not None:
        traces.append(dict(type="scatter", x=[xs[g.last], xs[g.n]], y=[ys[g.last], ys[g.n]], mode="lines",
                           hoverinfo="skip", showlegend=False,
                           line=dict(color=COLOURS[BONUS][0], width=2.4, dash="dot"),
                           meta={"kind": "edges", "dash": "dot", "accepted": False, "bonus": True}))
    return traces


def _node_traces(step: StepRecord, g, token_texts) -> list[dict]:
    """Transparent hover markers, one trace per status (the chips are annotations: what shows), the
    bonus token's, and legend-only twins with visible swatches."""
    statuses, n, xs, ys = g.statuses, g.n, g.xs, g.ys
    hover_marker = dict(symbol="square", size=24, color="rgba(0,0,0,0)", line=dict(width=0))
    traces = []
    for status in (ROOT, ACCEPTED, UNUSED, REJECTED, UNREACHED):
        nodes = [i for i in range(n) if statuses[i] == status]
        if not nodes and status != ACCEPTED:
            continue
        traces.append(dict(
            type="scatter", x=[xs[i] for i in nodes], y=[ys[i] for i in nodes], mode="markers",
            name=STATUS_NAMES[status], customdata=nodes, showlegend=False,
            text=[_node_hover(step, i, status, token_text(token_texts, step.tokens[i])) for i in nodes],
            hovertemplate="%{text}<extra></extra>", marker=hover_marker,
            meta={"kind": "nodes", "status": status}))
    alone = n == 1  # autoregressive: no draft, the "bonus" is simply the target's token
    if g.bonus is not None:
        text = token_text(token_texts, g.bonus)
        traces.append(dict(
            type="scatter", x=[xs[n]], y=[ys[n]], mode="markers",
            name="the target's token" if alone else STATUS_NAMES[BONUS], customdata=[-1], showlegend=False,
            text=[f"<b>{html.escape(visible_token(text, 40), quote=False)}</b>  (id {g.bonus})<br>"
                  + ("the target's own token (no draft in this mode)" if alone else
                     "bonus token: the target's own choice after the accepted path")],
            hovertemplate="%{text}<extra></extra>", marker=hover_marker, meta={"kind": "bonus", "status": BONUS}))
    for trace in list(traces):
        strong, pale = COLOURS[trace["meta"]["status"]]
        traces.append(dict(type="scatter", x=[None], y=[None], mode="markers", name=trace["name"],
                           hoverinfo="skip", meta={"kind": "legend"},
                           marker=dict(symbol="square", size=11, color=pale, line=dict(color=strong, width=2))))
    if step.sources and "copy" in step.sources:
        traces.append(dict(type="scatter", x=[None], y=[None], mode="markers", name="copied from the context",
                           hoverinfo="skip", meta={"kind": "legend"},
                           marker=dict(symbol="square", size=11, color="white", line=dict(color=COPY_COLOUR, width=3))))
    return traces


def _chips(step: StepRecord, g, scale: float) -> list[dict]:
    """Each node's token in a box coloured by its status (copied nodes outlined in teal)."""
    labels = [html.escape(label, quote=False) for label in g.labels]
    chips = [(i, g.statuses[i]) for i in range(g.n)] + ([(g.n, BONUS)] if g.bonus is not None else [])
    annotations = []
    for i, status in chips:
        strong, pale = COLOURS[status]
        emphasised = status in (ROOT, ACCEPTED, BONUS)
        is_copy = i < g.n and copied(step, i)
        annotations.append(dict(
            x=g.xs[i], y=g.ys[i], text=labels[i], showarrow=False,
            font=dict(family=MONO, size=round(12 * scale), color="#0f172a" if emphasised else "#475569"),
            bgcolor=pale, bordercolor=COPY_COLOUR if is_copy else strong,
            borderwidth=3 if is_copy else 2 if emphasised else 1, borderpad=3,
            opacity=1.0 if status != UNREACHED else 0.75, captureevents=False))
    return annotations
