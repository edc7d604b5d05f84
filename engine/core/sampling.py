"""Pure functions from logits to distributions and tokens (in the style of gpt-fast's generate.py)."""
from __future__ import annotations

import functools

import torch

from engine.errors import InvalidDistributionError
from engine.kernels.build import compiled_kernels


def logits_to_probs(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """Softmax of ``logits [..., V] / temperature`` restricted to the top-p nucleus.

    ``temperature == 0`` returns the plain softmax (greedy decisions use argmax, the softmax is
    only reported). Computed in float32; rows sum to 1. NaN or +inf logits (an overflowing dtype,
    broken weights) raise :class:`InvalidDistributionError` instead of sampling garbage.

    With top-p on CPU float32 logits, the compiled kernels compute it in one call
    (``nucleus_probs``, engine/kernels/csrc/nucleus.cpp: the same bits on every machine and ISA
    with the kernels; about 0.2 ms a row of 151,936 tokens where torch's dozen operations take 1
    to 2 ms). Without the kernels (or on a GPU), torch does, choosing the nucleus in float64.
    Both keep the exact nucleus of ``softmax(z)``, ``z = (x - max) / temperature`` in float32, but
    for tokens whose exact preceding mass lies within :data:`NUCLEUS_TIE_BAND` of ``top_p`` (the
    tie rule: there a float rounding decides), and their probabilities agree to a few roundings.
    Tokens of exactly equal probability (equal logits) are ranked by index on both: where the
    nucleus ends among them, the lower indices are kept.
    """
    fused = compiled("nucleus_probs") if top_p < 1.0 and logits.dtype == torch.float32 and logits.device.type == "cpu" else None
    if fused is not None:
        probs, finite = fused(logits, float(temperature), float(top_p))
        if not finite:
            raise InvalidDistributionError(NON_FINITE)
        return probs
    return torch_logits_to_probs(logits, temperature, top_p)


NUCLEUS_TIE_BAND = 1e-6  # tokens this close (in preceding mass) to top_p may fall either side
NO_MASS = "cannot draw a token from a distribution whose mass is zero or not finite"
NON_FINITE = "the model produced NaN/inf logits: load it in float32 (--dtype float32) or check its weights"


COMPILED: dict[str, object] = {}  # name -> compiled function, once sampling has looked the kernels up


def use_compiled_kernels(extension) -> None:
    """Sample and rank through ``extension``'s ``nucleus_probs``, ``draw_index`` and ``top_indices``
    from now on (:func:`_look_up_kernels` calls this with the kernels it finds)."""
    COMPILED.update(nucleus_probs=extension.nucleus_probs, draw_index=extension.draw_index,
                    top_indices=extension.top_indices)


@functools.cache
def _look_up_kernels() -> None:
    """Load the compiled kernels once, before the first draw, and sample through them from then on
    (:func:`engine.kernels.build.compiled_kernels`; they are built once into the user cache, and
    none where no compiler is found). Looked up on first use rather than when an int4 model happens
    to load them, so a process samples through the same functions from its first token on: the
    same seed gives the same draws all along."""
    extension = compiled_kernels()
    if extension is not None:
        use_compiled_kernels(extension)


def compiled(name: str):
    """The compiled function ``name`` (see :data:`COMPILED`), or None without the kernels."""
    if not COMPILED:
        _look_up_kernels()
    return COMPILED.get(name)


def top_indices(x: torch.Tensor, k: int) -> list[list[int]]:
    """The indices of the ``k`` largest values of each row of ``x [R, V]``, largest first: with
    ``k = 1``, ``torch.argmax``'s. On CPU float32 the compiled ``top_indices`` takes one pass a row
    (about 25 us over 151,936 tokens, where ``topk`` and ``argmax`` take 250-350 us); otherwise
    torch does (:func:`torch_top_indices`). Both order equal values by index, lower first; a row
    holding a NaN is ranked by ``torch.topk``, which takes NaN as the largest value."""
    top = compiled("top_indices") if x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 \
        and 1 <= k <= min(64, x.shape[-1]) else None
    if top is not None:
        indices = top(x, k)
        if not bool((indices[:, 0] < 0).any()):
            return indices.tolist()
    return torch_top_indices(x, k)


def torch_top_indices(x: torch.Tensor, k: int) -> list[list[int]]:
    """:func:`top_indices` in torch operations (any device and dtype, rows ``x [..., V]``): equal
    values in index order, lower first, as the compiled ``top_indices`` orders them. ``k = 1`` is
    ``argmax``'s first maximum. ``topk`` alone promises no order among equal values, neither which
    of them it picks when they straddle the k-th place nor how it ranks those it picks: its
    values are kept, and its indices re-ranked by (value descending, index ascending); where the
    k-th value ties with a token ``topk`` left out, that row's ties are listed and ranked whole."""
    if k == 1:
        return x.argmax(dim=-1, keepdim=True).tolist()
    rows = x.reshape(-1, x.shape[-1])
    values, indices = torch.topk(rows, k, dim=-1)
    nan = torch.isnan(values[:, 0])  # topk ranks NaN first; such rows keep its order
    past = ((rows >= values[:, -1:]).sum(dim=-1) > k) & ~nan  # the k-th value ties with a token left out
    for r in past.nonzero().flatten().tolist():
        within = (rows[r] >= values[r, -1]).nonzero().squeeze(1)  # increasing: a stable sort keeps index order
        indices[r] = within[torch.sort(rows[r, within], descending=True, stable=True).indices[:k]]
    ascending = indices.sort(dim=-1).values
    ranked = ascending.gather(-1, torch.sort(rows.gather(-1, ascending), dim=-1, descending=True, stable=True).indices)
    return torch.where(nan[:, None], indices, ranked).reshape(*x.shape[:-1], k).tolist()


def torch_logits_to_probs(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """:func:`logits_to_probs` in torch operations (any device and dtype)."""
    logits = logits.float()
    row_max = logits.amax(dim=-1, keepdim=True)  # NaN and +inf propagate to the max: one check per row
    if torch.isnan(row_max).any() or torch.isposinf(row_max).any():
        raise InvalidDistributionError(NON_FINITE)
    if temperature > 0:  # shifted to max 0 first: a tiny temperature gives 0 or -inf, never inf - inf
        logits = (logits - row_max).div_(temperature)
        # NaN only from 0 / 0 (a temperature below float32's range) or -inf - -inf (a row of -inf
        # only): taken as 0, as a pass over every row would
        if temperature < torch.finfo(torch.float32).tiny or bool(torch.isneginf(row_max).any()):
            logits = torch.nan_to_num(logits, nan=0.0, neginf=float("-inf"))
    if top_p < 1.0:  # in float64: a float32 softmax's sum drifts enough to move a wide nucleus's edge
        return _top_p_filter(torch.softmax(logits.double(), dim=-1), top_p).float()
    return torch.softmax(logits, dim=-1)


TOP_P_CANDIDATES = 1024
LIKELY = 1e-3  # tokens at least this likely are the first candidates for the nucleus


def _top_p_filter(probs: torch.Tensor, top_p: float, candidates: int = TOP_P_CANDIDATES) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``; renormalise.

    Each row's nucleus is looked for among a few most likely tokens first: those at least
    :data:`LIKELY` probable (one comparison pass and a sort of the few found), then the top
    ``candidates`` (a ``topk``). When their mass reaches ``top_p``, every other token starts past
    the nucleus, so the result is the full sort's exactly (the same prefix sums in the same order).
    Rows whose nucleus may extend further are sorted in full. On 151,936 tokens the first try is
    2 to 5 times cheaper than a ``topk`` of the same few tokens and about 50 times cheaper than
    the full sort.

    Tokens of equal probability are ranked by index, lower first, as the compiled
    ``nucleus_probs`` ranks them: where the nucleus ends inside a run of exactly equal
    probabilities, the lower indices are kept. Every sort here is stable over indices listed in
    increasing order, and the ``topk`` only finds the value the candidates reach down to: every
    token at least that likely is a candidate, so ties at the edge come in whole.
    """
    rows = probs.reshape(-1, probs.shape[-1])
    filtered = torch.zeros_like(rows)
    for row, out in zip(rows, filtered):
        _keep_row_nucleus(row, out, top_p, candidates)
    return (filtered / filtered.sum(dim=-1, keepdim=True)).reshape(probs.shape)


def _keep_row_nucleus(row: torch.Tensor, out: torch.Tensor, top_p: float, candidates: int) -> None:
    """Write the nucleus of ``row [V]`` (unnormalised) into ``out [V]``, zero elsewhere."""
    likely = (row >= LIKELY).nonzero().squeeze(1)
    if 0 < likely.numel() < row.shape[0] and _write_nucleus(out, *_ranked(row, likely), top_p):
        return
    if candidates < row.shape[0]:
        bar = torch.topk(row, candidates, sorted=False).values.min()  # the candidates-th largest probability
        within = (row >= bar).nonzero().squeeze(1)
        if within.numel() < row.shape[0] and _write_nucleus(out, *_ranked(row, within), top_p):
            return
    top_probs, order = torch.sort(row, descending=True, stable=True)
    _write_nucleus(out, top_probs, order, top_p, whole=True)


def _ranked(row: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``row``'s entries at ``indices`` (increasing), most likely first and equal ones in index
    order (a stable sort), with their vocabulary positions."""
    top_probs, order = torch.sort(row[indices], descending=True, stable=True)
    return top_probs, indices[order]


def _write_nucleus(out: torch.Tensor, top_probs: torch.Tensor, order: torch.Tensor, top_p: float,
                   whole: bool = False) -> bool:
    """From a row's most likely entries ``top_probs [K]`` (descending) at vocabulary positions
    ``order [K]``: when their mass reaches ``top_p`` (or they are the ``whole`` row), write those
    inside the nucleus into ``out [V]`` and return True; else write nothing and return False."""
    mass = torch.cumsum(top_probs, dim=-1)
    if not whole and not bool(mass[-1] >= top_p):
        return False
    out.scatter_(-1, order, top_probs.masked_fill(mass - top_probs >= top_p, 0.0))
    return True


REJECTIONS = 8  # redraws of an already drawn child before its mass is removed outright


def sample_token(probs: torch.Tensor, generator: torch.Generator | None = None,
                 cdf: torch.Tensor | None = None) -> int:
    """One token drawn from ``probs [V]`` by inverting its CDF (float64 prefix sums, one uniform).

    A token of zero probability is never drawn: the first index whose prefix sum exceeds ``u``
    has a prefix sum larger than its predecessor's. ``cdf``: ``probs``' prefix sums when the
    caller has them. About 20x cheaper than ``torch.multinomial`` over 151,936 tokens; on CPU
    float32 without ``cdf`` the compiled ``draw_index`` does the same sums and comparison in one
    pass (the same token for the same generator state).
    """
    draw = compiled("draw_index") if cdf is None and probs.dtype == torch.float32 and probs.device.type == "cpu" else None
    if draw is not None:  # the same prefix sums and comparison in one compiled pass, skipping zeros
        while True:
            index = draw(probs, float(torch.rand(1, generator=generator, dtype=torch.float64)))
            if index >= 0:
                return index
            if index == -2:
                raise InvalidDistributionError(NO_MASS)
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64) if cdf is None else cdf
    total = float(cdf[-1])
    if not 0.0 < total < float("inf"):
        raise InvalidDistributionError(NO_MASS)
    while True:
        u = torch.rand(1, generator=generator, dtype=torch.float64, device=cdf.device) * cdf[-1]
        index = int(torch.searchsorted(cdf, u, right=True))
        if index < cdf.shape[-1]:  # u rounded up to the total mass: draw again (about 1e-16 of draws)
            return index


def sample_children(q: torch.Tensor, count: int, without_replacement: bool,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """``count`` tokens drawn from ``q [V]``: distinct (Sequoia) or i.i.d. (SpecInfer).

    Without replacement, the i-th token is a sample from q with the first i - 1 removed: a draw
    that repeats one is drawn again (rejection: exactly the renormalised law), and after
    :data:`REJECTIONS` repeats the drawn tokens' mass is removed from the CDF instead, which keeps
    the law exact and the cost bounded when one token holds nearly all of q. Never more
    children than q has support.
    """
    if without_replacement:
        count = min(count, int((q > 0).sum()))
    cdf = torch.cumsum(q, dim=-1, dtype=torch.float64) if count > 1 else None  # one draw: sample_token sums
    drawn: list[int] = []
    while len(drawn) < count:
        for _ in range(REJECTIONS):
            token = sample_token(q, generator, cdf)
            if not without_replacement or token not in drawn:
                drawn.append(token)
                break
        else:
            remaining = q.clone()
            remaining[drawn] = 0
            cdf = torch.cumsum(remaining, dim=-1, dtype=torch.float64)
    return torch.tensor(drawn, dtype=torch.long)


def choose_children(q: torch.Tensor, count: int, method: str, greedy: bool,
                    generator: torch.Generator | None = None) -> list[int]:
    """Tokens for ``count`` children drawn from the draft distribution ``q [V]``, in rank order.

    Greedy decoding and ``topk`` take the draft's top-``count``; ``specinfer`` samples i.i.d.;
    the others sample without replacement. When the support runs out before ``count``, the last
    token repeats: such a surplus child is never accepted (its q was zeroed at removal).
    """
    if greedy or method == "topk":
        return top_indices(q[None], count)[0]
    drawn = sample_children(q, count, without_replacement=method != "specinfer", generator=generator).tolist()
    return drawn + drawn[-1:] * (count - len(drawn))


def choose_level_children(probs: torch.Tensor, rows: list[int], counts: list[int], method: str, greedy: bool,
                          generator: torch.Generator | None = None) -> list[list[int]]:
    """:func:`choose_children` for several rows of one tree level ``probs [R, V]`` at once:
    ``counts[i]`` children for row ``rows[i]``. The top-k case is one batched :func:`top_indices`
    (one call per level, not per node); sampling draws row by row, in order, from ``generator``."""
    if not rows:
        return []
    if greedy or method == "topk":
        top = top_indices(probs[rows], max(counts))
        return [row[:count] for row, count in zip(top, counts)]
    return [choose_children(probs[row], count, method, greedy, generator) for row, count in zip(rows, counts)]
