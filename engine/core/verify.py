"""Acceptance rules: walk the drafted tree against the target's outputs.

Each verifier takes the tree, the node tokens and the target's per-node outputs and returns
``(accepted_nodes, bonus_token)``: a root-to-node path (root first) and the token the target
contributes after it. Pure functions, no model calls. The sampling verifiers also fill ``used``,
when given, with what each child they tried was judged on: ``used[node] = (p, q)``, the target's
(residual) and the draft's (renormalised) probability of its token at that moment (q is None for
top-k matching, where the child is kept when the target's sample equals it, probability p).
With ``trace`` (a list) they append a :class:`~engine.core.records.VerifierEvent` for every decision,
in order: each child tried and the bonus. Tracing reads the distributions the walk already has and
draws no randomness, so the walk is the same with it or without it.
"""
from __future__ import annotations

import torch

from engine.core.records import VerifierEvent
from engine.core.sampling import sample_token
from engine.errors import InvalidDistributionError
from engine.trees.tree import Tree

TRACE_TOP = 8  # tokens of each distribution a trace event keeps


def top_tokens(probs: torch.Tensor | None, k: int = TRACE_TOP) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens of ``probs [V]`` as ``[(token, prob)]``, zero-probability ones left out."""
    if probs is None:
        return []
    values, indices = torch.topk(probs, min(k, probs.shape[-1]))
    return [(int(t), float(v)) for t, v in zip(indices.tolist(), values.tolist()) if v > 0]


def verify_greedy(tree: Tree, tokens: list[int], target_argmax: torch.Tensor | list[int],
                  trace: list[VerifierEvent] | None = None, target_probs: torch.Tensor | None = None,
                  draft_probs: dict[int, torch.Tensor] | None = None) -> tuple[list[int], int]:
    """Greedy (temperature 0): follow the child whose token equals the target's argmax.

    ``target_argmax [size]`` (a tensor or a list) is the target's most likely next token after
    each node. The bonus token is the argmax after the last accepted node, so the committed
    sequence is exactly what the target's own greedy decoding produces. ``trace`` gets an
    ``"argmax"`` event per child compared (with the top tokens of ``target_probs [size, V]`` and
    ``draft_probs[node]``, when given) and a ``"bonus"`` event.
    """
    argmax = target_argmax.tolist() if isinstance(target_argmax, torch.Tensor) else list(target_argmax)
    node = 0
    path = [0]
    while True:
        wanted = argmax[node]
        match = next((c for c in tree.children[node] if tokens[c] == wanted), None)
        if trace is not None:
            _trace_comparisons(trace, "argmax", node, tree.children[node], tokens, match, wanted,
                               target_probs[node] if target_probs is not None else None, draft_probs)
        if match is None:
            return path, wanted
        node = match
        path.append(node)


Used = dict[int, tuple[float, float | None]]  # node -> (p, q) it was judged on


def verify_stochastic(tree: Tree, tokens: list[int], target_probs: torch.Tensor,
                      draft_probs: dict[int, torch.Tensor], without_replacement: bool,
                      generator: torch.Generator | None = None, used: Used | None = None,
                      trace: list[VerifierEvent] | None = None,
                      copied: frozenset[int] = frozenset()) -> tuple[list[int], int]:
    """Multi-draft speculative sampling over a tree; the committed tokens follow the target exactly.

    ``target_probs [size, V]``: the target's distribution after each node (temperature/top-p
    applied). ``draft_probs[node] [V]``: the draft distribution the children of ``node`` were
    drawn from. At each node the children are tried in rank order: child x is accepted with
    probability ``min(1, p[x] / q[x])``; on rejection ``p <- normalize(relu(p - q))`` and, when the
    children were drawn without replacement (Sequoia), ``q[x] <- 0`` renormalised. If no child is
    accepted (or the node is a leaf) the bonus token is sampled from the residual ``p``.

    ``copied``: nodes copied from the context (:mod:`engine.trees.copies`). They come first among
    their siblings and are proposals with a point-mass q: kept with probability ``p[x]``, and on
    rejection ``p <- normalize(p with x removed)`` before the draft's children are tried.
    """
    check_distributions(target_probs)
    node, path = 0, [0]
    while True:
        kids = tree.children[node]
        point_masses = sum(1 for c in kids if c in copied)
        q = draft_probs[node] if len(kids) > point_masses else None
        tried: list[tuple[float, float]] = []
        events: list[VerifierEvent] | None = [] if trace is not None else None
        choice, p = accept_child(target_probs[node], q, [tokens[c] for c in kids], without_replacement, generator,
                                 tried, events, point_masses)
        if used is not None:
            used.update(zip(kids, tried))
        if trace is not None:
            for event in events:  # accept_child numbers the children it tried 0, 1, ...
                event.node, event.child = node, kids[event.child]
            trace.extend(events)
        if choice is None:
            bonus = sample_token(p, generator)
            if trace is not None:
                trace.append(VerifierEvent(node, None, bonus, True, "bonus", p_x=float(p[bonus]), top_p=top_tokens(p)))
            return path, bonus
        node = kids[choice]
        path.append(node)


def accept_child(p: torch.Tensor, q: torch.Tensor | None, child_tokens: list[int], without_replacement: bool,
                 generator: torch.Generator | None = None,
                 tried: list[tuple[float, float]] | None = None,
                 trace: list[VerifierEvent] | None = None, point_masses: int = 0) -> tuple[int | None, torch.Tensor]:
    """One node of :func:`verify_stochastic`: try the children (tokens in rank order) against the
    target distribution ``p [V]`` and the draft distribution ``q [V]`` they were drawn from.

    Returns ``(index of the accepted child, p)`` or ``(None, residual p)`` to draw the bonus from.
    ``tried`` gets ``(p[x], q[x])`` of each child tried, as the acceptance test used them;
    ``trace`` a ``"sample"`` :class:`VerifierEvent` per child tried (``node`` -1, ``child`` = its
    index among ``child_tokens``: :func:`verify_stochastic` renumbers them).

    The first ``point_masses`` children are proposals with q = 1 on their token (copied from the
    context, independent of the draw): kept when ``u < p[x]``, else ``p[x] <- 0`` renormalised,
    which is ``normalize(relu(p - q))`` for that q. The draft's children then face the residual.
    """
    for index, x in enumerate(child_tokens[:point_masses]):
        u = torch.rand((), generator=generator, dtype=torch.float64, device=p.device).item()
        px = p[x].item()
        if tried is not None:
            tried.append((px, 1.0))
        event = VerifierEvent(-1, index, x, u < px, "sample", u, px, 1.0, top_p=top_tokens(p)) \
            if trace is not None else None
        if u < px:
            if trace is not None:
                trace.append(event)
            return index, p
        p = p.clone()
        p[x] = 0.0
        p = p / p.sum()
        if trace is not None:
            event.residual = top_tokens(p)
            trace.append(event)
    if len(child_tokens) == point_masses:
        return None, p
    check_distributions(q)
    q = q.clone()
    for index, x in enumerate(child_tokens[point_masses:], start=point_masses):
        if q[x] <= 0:  # support of q exhausted: the remaining children carry no mass
            break
        u = torch.rand((), generator=generator, dtype=torch.float64, device=p.device).item()
        px, qx = p[x].item(), q[x].item()
        if tried is not None:
            tried.append((px, qx))
        if u * qx < px:  # u < p/q without dividing
            if trace is not None:
                trace.append(VerifierEvent(-1, index, x, True, "sample", u, px, qx, top_p=top_tokens(p),
                                           top_q=top_tokens(q)))
            return index, p
        if trace is not None:
            event = VerifierEvent(-1, index, x, False, "sample", u, px, qx, top_p=top_tokens(p), top_q=top_tokens(q))
        p = _residual(p, q)
        if trace is not None:
            event.residual = top_tokens(p)
            trace.append(event)
        if without_replacement:
            q[x] = 0.0
            total = q.sum()
            if total <= 0:
                break
            q = q / total
    return None, p


def check_distributions(probs: torch.Tensor) -> None:
    """Rows of ``probs [..., V]`` must be finite, non-negative and carry mass. Two passes over the
    vocabulary: a NaN entry makes the minimum NaN (not >= 0), and an infinite one (non-negative
    entries) makes its row's sum infinite."""
    lowest, totals = probs.amin(), probs.sum(dim=-1)
    if not bool(lowest >= 0) or not bool(torch.isfinite(totals).all()) or bool((totals <= 0).any()):
        raise InvalidDistributionError("a verifier distribution has NaN/inf, negative entries or no mass")


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``normalize(relu(p - q))``; if rounding leaves no mass, ``p`` itself (impossible exactly)."""
    residual = torch.clamp(p - q, min=0.0)
    total = residual.sum()
    return residual / total if total > 0 else p


def verify_topk(tree: Tree, tokens: list[int], target_probs: torch.Tensor,
                generator: torch.Generator | None = None, used: Used | None = None,
                trace: list[VerifierEvent] | None = None,
                draft_probs: dict[int, torch.Tensor] | None = None) -> tuple[list[int], int]:
    """Top-k drafting baseline: the target samples its token; accept the child that matches it.
    ``trace`` gets a ``"match"`` event per child compared with the sample (the draft's top tokens
    from ``draft_probs[node]``, when given) and a ``"bonus"`` event when none matched."""
    check_distributions(target_probs)
    node, path = 0, [0]
    while True:
        kids = tree.children[node]
        choice, x = match_child(target_probs[node], [tokens[c] for c in kids], generator)
        if used is not None:
            used.update((c, (target_probs[node, tokens[c]].item(), None)) for c in kids)
        if trace is not None:
            _trace_comparisons(trace, "match", node, kids, tokens, None if choice is None else kids[choice], x,
                               target_probs[node], draft_probs, with_p=True)
        if choice is None:
            return path, x
        node = kids[choice]
        path.append(node)


def _trace_comparisons(trace: list[VerifierEvent], rule: str, node: int, kids: list[int], tokens: list[int],
                       kept: int | None, target_token: int, p: torch.Tensor | None,
                       draft_probs: dict[int, torch.Tensor] | None, with_p: bool = False) -> None:
    """The events of a node whose children are compared with one target token (``rule`` "argmax":
    its argmax, "match": its sample): one per child up to the ``kept`` one, then the bonus when
    none was kept. ``p [V]``: the target's distribution there (top tokens shown; with ``with_p``
    each event also carries the probability of its token)."""
    top_p = top_tokens(p) if p is not None else []
    top_q = top_tokens((draft_probs or {}).get(node)) if kids else []
    for c in kids:
        trace.append(VerifierEvent(node, c, tokens[c], c == kept, rule, p_x=float(p[tokens[c]]) if with_p else None,
                                   target_token=target_token, top_p=top_p, top_q=top_q))
        if c == kept:
            return
    trace.append(VerifierEvent(node, None, target_token, True, "bonus",
                               p_x=float(p[target_token]) if with_p else None, target_token=target_token, top_p=top_p))


def match_child(p: torch.Tensor, child_tokens: list[int],
                generator: torch.Generator | None = None) -> tuple[int | None, int]:
    """One node of :func:`verify_topk`: the target samples ``x ~ p [V]``; returns (index of the
    child whose token is x, or None, and x)."""
    x = sample_token(p, generator)
    return (child_tokens.index(x) if x in child_tokens else None), x
