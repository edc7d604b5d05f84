"""Pure functions from logits to distributions and tokens (in the style of gpt-fast's generate.py)."""
from __future__ import annotations

import torch

from engine.errors import InvalidDistributionError


def logits_to_probs(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """Softmax of ``logits [..., V] / temperature`` restricted to the top-p nucleus.

    ``temperature == 0`` returns the plain softmax (greedy decisions use argmax, the softmax is
    only reported). Computed in float32; rows sum to 1. NaN or +inf logits (an overflowing dtype,
    broken weights) raise :class:`InvalidDistributionError` instead of sampling garbage.
    """
    logits = logits.float()
    if torch.isnan(logits).any() or torch.isposinf(logits).any():
        raise InvalidDistributionError("the model produced NaN/inf logits: load it in float32 (--dtype float32) "
                                       "or check its weights")
    if temperature > 0:  # shifted to max 0 first: a tiny temperature gives 0 or -inf, never inf - inf
        shifted = logits - logits.max(dim=-1, keepdim=True).values
        logits = torch.nan_to_num(shifted / temperature, nan=0.0, neginf=float("-inf"))  # 0 / tiny -> 0
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        probs = _top_p_filter(probs, top_p)
    return probs


TOP_P_CANDIDATES = 1024


def _top_p_filter(probs: torch.Tensor, top_p: float, candidates: int = TOP_P_CANDIDATES) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``; renormalise.

    The nucleus is looked for among the ``candidates`` most likely tokens first (a ``topk``, 10-20x
    cheaper than sorting 151,936 probabilities): when their mass reaches ``top_p`` every token
    outside them starts past the nucleus, so the result is the full sort's exactly (the same
    prefix sums in the same order). Rows whose nucleus may extend further are sorted in full.
    """
    if probs.shape[-1] > candidates:
        top_probs, top_order = torch.topk(probs, candidates, dim=-1)
        mass = torch.cumsum(top_probs, dim=-1)
        if bool((mass[..., -1] >= top_p).all()):
            return _keep_nucleus(probs, top_probs, top_order, mass, top_p)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    return _keep_nucleus(probs, sorted_probs, order, torch.cumsum(sorted_probs, dim=-1), top_p)


def _keep_nucleus(probs: torch.Tensor, sorted_probs: torch.Tensor, order: torch.Tensor, mass: torch.Tensor,
                  top_p: float) -> torch.Tensor:
    """``probs [..., V]`` zeroed outside the nucleus, renormalised, from its most likely entries
    ``sorted_probs [..., K]`` (descending) at vocabulary positions ``order [..., K]`` and their
    running mass ``mass [..., K]``."""
    mass_before = mass - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    filtered = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return filtered / filtered.sum(dim=-1, keepdim=True)


def sample_children(q: torch.Tensor, count: int, without_replacement: bool,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """``count`` tokens drawn from ``q [V]``: distinct (Sequoia) or i.i.d. (SpecInfer).

    Without replacement uses the exponential race: the top-``count`` of ``q / E`` with E ~ Exp(1)
    is an ordered sample without replacement (the first is a plain sample from q, the second a
    sample from q with the first removed, ...). Never more children than q has support.
    """
    if without_replacement:
        count = min(count, int((q > 0).sum()))
        noise = torch.empty_like(q).exponential_(1, generator=generator)
        return torch.topk(q / noise, count).indices
    return torch.multinomial(q, count, replacement=True, generator=generator)


def choose_children(q: torch.Tensor, count: int, method: str, greedy: bool,
                    generator: torch.Generator | None = None) -> list[int]:
    """Tokens for ``count`` children drawn from the draft distribution ``q [V]``, in rank order.

    Greedy decoding and ``topk`` take the draft's top-``count``; ``specinfer`` samples i.i.d.;
    the others sample without replacement. When the support runs out before ``count``, the last
    token repeats: such a surplus child is never accepted (its q was zeroed at removal).
    """
    if greedy or method == "topk":
        return torch.topk(q, count).indices.tolist()
    drawn = sample_children(q, count, without_replacement=method != "specinfer", generator=generator).tolist()
    return drawn + drawn[-1:] * (count - len(drawn))


def choose_level_children(probs: torch.Tensor, rows: list[int], counts: list[int], method: str, greedy: bool,
                          generator: torch.Generator | None = None) -> list[list[int]]:
    """:func:`choose_children` for several rows of one tree level ``probs [R, V]`` at once:
    ``counts[i]`` children for row ``rows[i]``. The top-k case is one batched ``topk`` (one
    host sync per level, not per node); sampling draws row by row, in order, from ``generator``."""
    if not rows:
        return []
    if greedy or method == "topk":
        top = torch.topk(probs[rows], max(counts), dim=-1).indices.tolist()
        return [row[:count] for row, count in zip(top, counts)]
    return [choose_children(probs[row], count, method, greedy, generator) for row, count in zip(rows, counts)]
