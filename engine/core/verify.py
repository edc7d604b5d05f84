"""Acceptance rules: walk the drafted tree against the target's outputs.

Each verifier takes the tree, the node tokens and the target's per-node outputs and returns
``(accepted_nodes, bonus_token)``: a root-to-node path (root first) and the token the target
contributes after it. Pure functions, no model calls. They tell a :class:`WalkRecorder`, when
given one, every step of the walk, in order: what each child tried was judged on, the decision on
it, and the bonus. The base recorder (the default) records nothing; :class:`JudgedRecorder` keeps
``used[node] = (p, q)``, the target's (residual) and the draft's (renormalised) probability of
each tried child's token at that moment (q is None for top-k matching, where the child is kept
when the target's sample equals it, probability p); :class:`TraceRecorder` also keeps a
:class:`~engine.core.records.VerifierEvent` for every decision, in order. Recorders read the
distributions the walk already has and draw no randomness, so the walk is the same with any
recorder or none.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.core.records import VerifierEvent
from engine.core.sampling import sample_token
from engine.errors import InvalidDistributionError
from engine.trees.tree import Tree

TRACE_TOP = 8  # tokens of each distribution a trace event keeps

Used = dict[int, tuple[float, float | None]]  # node -> (p, q) it was judged on


def top_tokens(probs: torch.Tensor | None, k: int = TRACE_TOP) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens of ``probs [V]`` as ``[(token, prob)]``, zero-probability ones left out."""
    if probs is None:
        return []
    values, indices = torch.topk(probs, min(k, probs.shape[-1]))
    return [(int(t), float(v)) for t, v in zip(indices.tolist(), values.tolist()) if v > 0]


class WalkRecorder:
    """Told every decision of an acceptance walk, in order; records nothing (subclasses do).

    ``node`` is where the walk is (the node whose children are tried), ``child`` the child tried
    and ``token`` its token. Distributions ``[V]`` are the walk's own tensors, to read at once:
    the walk goes on changing some of them afterwards.
    """

    def judged(self, child: int, p_x: float, q_x: float | None) -> None:
        """``child`` was judged on the target's probability ``p_x`` of its token and the draft's
        ``q_x`` (1 for a copied child; None for top-k matching, kept with probability ``p_x``).
        Told before the decision on that child."""

    def sampled(self, node: int, child: int, token: int, u: float, p: torch.Tensor, q: torch.Tensor | None,
                residual: torch.Tensor | None) -> None:
        """A ``"sample"`` decision: the child was kept iff ``u * q[token] < p[token]``. ``p``, ``q``:
        the target's (residual) and the draft's (renormalised) distributions it was judged on (q
        None: a copied child, a point mass on ``token``). ``residual``: on rejection, the target's
        distribution after it; None when the child was kept."""

    def compared(self, rule: str, node: int, child: int, token: int, target_token: int,
                 p: torch.Tensor | None, q: torch.Tensor | None) -> None:
        """The child's token was compared with the target's token (``rule`` "argmax": its argmax,
        "match": its sample) and kept iff equal. ``p``: the target's distribution at ``node``,
        ``q`` the draft's (either None when the verifier was not given it)."""

    def bonus(self, rule: str, node: int, token: int, p: torch.Tensor | None) -> None:
        """No child of ``node`` was kept (or it is a leaf): the target contributes ``token`` under
        ``rule`` ("sample": drawn from the residual ``p``; "match": the sample from ``p`` no child
        matched; "argmax": its argmax, ``p`` its distribution or None)."""


class JudgedRecorder(WalkRecorder):
    """Keeps what each tried child was judged on: ``used[node] = (p, q)`` (see :meth:`WalkRecorder.judged`)."""

    def __init__(self) -> None:
        self.used: Used = {}

    def judged(self, child: int, p_x: float, q_x: float | None) -> None:
        self.used[child] = (p_x, q_x)


class TraceRecorder(JudgedRecorder):
    """Also keeps ``events``: a :class:`VerifierEvent` per decision, in order, each child tried
    and the bonus, with the top :data:`TRACE_TOP` tokens of the distributions involved."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[VerifierEvent] = []

    def sampled(self, node: int, child: int, token: int, u: float, p: torch.Tensor, q: torch.Tensor | None,
                residual: torch.Tensor | None) -> None:
        q_x = 1.0 if q is None else q[token].item()
        self.events.append(VerifierEvent(node, child, token, residual is None, "sample", u, p[token].item(), q_x,
                                         top_p=top_tokens(p), top_q=top_tokens(q),
                                         residual=None if residual is None else top_tokens(residual)))

    def compared(self, rule: str, node: int, child: int, token: int, target_token: int,
                 p: torch.Tensor | None, q: torch.Tensor | None) -> None:
        self.events.append(VerifierEvent(node, child, token, token == target_token, rule,
                                         p_x=float(p[token]) if rule == "match" else None,
                                         target_token=target_token, top_p=top_tokens(p), top_q=top_tokens(q)))

    def bonus(self, rule: str, node: int, token: int, p: torch.Tensor | None) -> None:
        self.events.append(VerifierEvent(node, None, token, True, "bonus",
                                         p_x=float(p[token]) if rule != "argmax" else None,
                                         target_token=token if rule != "sample" else None, top_p=top_tokens(p)))


NO_RECORDER = WalkRecorder()  # what a verifier tells when given no recorder: nothing is kept


def verify_greedy(tree: Tree, tokens: list[int], target_argmax: torch.Tensor | list[int],
                  recorder: WalkRecorder | None = None, target_probs: torch.Tensor | None = None,
                  draft_probs: dict[int, torch.Tensor] | None = None) -> tuple[list[int], int]:
    """Greedy (temperature 0): follow the child whose token equals the target's argmax.

    ``target_argmax [size]`` (a tensor or a list) is the target's most likely next token after
    each node. The bonus token is the argmax after the last accepted node, so the committed
    sequence is exactly what the target's own greedy decoding produces. ``recorder`` is told
    each child compared (``"argmax"``, with ``target_probs [size, V]``'s row and
    ``draft_probs[node]``, when given) and the bonus; nothing is judged on probabilities.
    """
    recorder = NO_RECORDER if recorder is None else recorder
    argmax = target_argmax.tolist() if isinstance(target_argmax, torch.Tensor) else list(target_argmax)
    node = 0
    path = [0]
    while True:
        wanted = argmax[node]
        p = target_probs[node] if target_probs is not None else None
        q = draft_probs.get(node) if draft_probs is not None else None
        for child in tree.children[node]:
            recorder.compared("argmax", node, child, tokens[child], wanted, p, q)
            if tokens[child] == wanted:
                break
        else:
            recorder.bonus("argmax", node, wanted, p)
            return path, wanted
        node = child
        path.append(node)


def verify_stochastic(tree: Tree, tokens: list[int], target_probs: torch.Tensor,
                      draft_probs: dict[int, torch.Tensor], without_replacement: bool,
                      generator: torch.Generator | None = None, recorder: WalkRecorder | None = None,
                      copied: frozenset[int] = frozenset()) -> tuple[list[int], int]:
    """Multi-draft speculative sampling over a tree; the committed tokens follow the target exactly.

    ``target_probs [size, V]``: the target's distribution after each node (temperature/top-p
    applied). ``draft_probs[node] [V]``: the draft distribution the children of ``node`` were
    drawn from. At each node the children are tried in rank order: child x is accepted with
    probability ``min(1, p[x] / q[x])``; on rejection ``p <- normalize(relu(p - q))`` and, when the
    children were drawn without replacement (Sequoia), ``q[x] <- 0`` renormalised. If no child is
    accepted (or the node is a leaf) the bonus token is sampled from the residual ``p``.
    ``recorder`` is told each child tried (judged, then ``"sample"``) and the bonus.

    ``copied``: nodes copied from the context (:mod:`engine.trees.copies`). They come first among
    their siblings and are proposals with a point-mass q: kept with probability ``p[x]``, and on
    rejection ``p <- normalize(p with x removed)`` before the draft's children are tried.
    """
    check_distributions(target_probs)
    recorder = NO_RECORDER if recorder is None else recorder
    node, path = 0, [0]
    while True:
        kids = tree.children[node]
        point_masses = sum(1 for c in kids if c in copied)
        q = draft_probs[node] if len(kids) > point_masses else None
        choice, p = accept_child(target_probs[node], q, [tokens[c] for c in kids], without_replacement, generator,
                                 point_masses, recorder, (node, kids))
        if choice is None:
            bonus = sample_token(p, generator)
            recorder.bonus("sample", node, bonus, p)
            return path, bonus
        node = kids[choice]
        path.append(node)


def accept_child(p: torch.Tensor, q: torch.Tensor | None, child_tokens: list[int], without_replacement: bool,
                 generator: torch.Generator | None = None, point_masses: int = 0,
                 recorder: WalkRecorder | None = None,
                 where: tuple[int, Sequence[int]] | None = None) -> tuple[int | None, torch.Tensor]:
    """One node of :func:`verify_stochastic`: try the children (tokens in rank order) against the
    target distribution ``p [V]`` and the draft distribution ``q [V]`` they were drawn from.

    Returns ``(index of the accepted child, p)`` or ``(None, residual p)`` to draw the bonus from.
    ``recorder`` is told each child tried: what it was judged on, then the ``"sample"`` decision.
    ``where``: ``(node, children)``, the node and its children's node ids in the order of
    ``child_tokens``, which the recorder is told; without it the node is -1 and each child its
    index among ``child_tokens``.

    The first ``point_masses`` children are proposals with q = 1 on their token (copied from the
    context, independent of the draw): kept when ``u < p[x]``, else ``p[x] <- 0`` renormalised,
    which is ``normalize(relu(p - q))`` for that q. The draft's children then face the residual.
    """
    recorder = NO_RECORDER if recorder is None else recorder
    node, kids = (-1, range(len(child_tokens))) if where is None else where
    for index, x in enumerate(child_tokens[:point_masses]):
        u = torch.rand((), generator=generator, dtype=torch.float64, device=p.device).item()
        px = p[x].item()
        recorder.judged(kids[index], px, 1.0)
        if u < px:
            recorder.sampled(node, kids[index], x, u, p, None, None)
            return index, p
        residual = p.clone()
        residual[x] = 0.0
        residual = residual / residual.sum()
        recorder.sampled(node, kids[index], x, u, p, None, residual)
        p = residual
    if len(child_tokens) == point_masses:
        return None, p
    check_distributions(q)
    q = q.clone()
    for index, x in enumerate(child_tokens[point_masses:], start=point_masses):
        if q[x] <= 0:  # support of q exhausted: the remaining children carry no mass
            break
        u = torch.rand((), generator=generator, dtype=torch.float64, device=p.device).item()
        px, qx = p[x].item(), q[x].item()
        recorder.judged(kids[index], px, qx)
        if u * qx < px:  # u < p/q without dividing
            recorder.sampled(node, kids[index], x, u, p, q, None)
            return index, p
        residual = _residual(p, q)
        recorder.sampled(node, kids[index], x, u, p, q, residual)
        p = residual
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
                generator: torch.Generator | None = None, recorder: WalkRecorder | None = None,
                draft_probs: dict[int, torch.Tensor] | None = None) -> tuple[list[int], int]:
    """Top-k drafting baseline: the target samples its token; accept the child that matches it.
    ``recorder`` is told what every child was judged on (all are compared with the sample), each
    child compared up to the kept one (``"match"``, with the draft's ``draft_probs[node]``, when
    given) and the bonus when none matched."""
    check_distributions(target_probs)
    recorder = NO_RECORDER if recorder is None else recorder
    node, path = 0, [0]
    while True:
        kids, p = tree.children[node], target_probs[node]
        child_tokens = [tokens[c] for c in kids]
        choice, x = match_child(p, child_tokens, generator)
        for c, p_x in zip(kids, p[child_tokens].tolist()):
            recorder.judged(c, p_x, None)
        q = draft_probs.get(node) if draft_probs is not None else None
        for c in kids if choice is None else kids[:choice + 1]:
            recorder.compared("match", node, c, tokens[c], x, p, q)
        if choice is None:
            recorder.bonus("match", node, x, p)
            return path, x
        node = kids[choice]
        path.append(node)


def match_child(p: torch.Tensor, child_tokens: list[int],
                generator: torch.Generator | None = None) -> tuple[int | None, int]:
    """One node of :func:`verify_topk`: the target samples ``x ~ p [V]``; returns (index of the
    child whose token is x, or None, and x)."""
    x = sample_token(p, generator)
    return (child_tokens.index(x) if x in child_tokens else None), x
