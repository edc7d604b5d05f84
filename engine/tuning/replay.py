"""Exact greedy replay: tokens/step of any tree at temperature 0 from one pass over real text.

At T = 0 the committed text is the target's greedy continuation whatever the tree, and the
root's children are the draft's top-c tokens at the committed context. So if ``ranks[j]`` is the
draft's rank of the continuation's j-th token given everything before it, a step starting at
position j accepts the child of rank ``ranks[j]`` (if the node has that many children), then
``ranks[j + 1]`` one level down, and so on. Replaying that walk over the ranks gives exactly the
tokens/step the engine would measure (up to floating-point near-ties), for every tree shape, from
one causal draft forward per prompt.
"""
from __future__ import annotations

from collections import Counter

import torch

from engine.trees.tree import Tree


def draft_ranks(draft: torch.nn.Module, prompt: list[int], continuation: list[int]) -> list[int]:
    """1-based rank of ``continuation[j]`` under the draft at ``prompt + continuation[:j]``."""
    return _ranks(_continuation_logits(draft, prompt, continuation), continuation)


def draft_ranks_and_confidence(draft: torch.nn.Module, prompt: list[int],
                               continuation: list[int]) -> tuple[list[int], list[float]]:
    """:func:`draft_ranks`, and the draft's probability of its own first choice at each position
    (the confidence a greedy step's first draft token is grown on), from the same draft pass."""
    logits = _continuation_logits(draft, prompt, continuation)
    return _ranks(logits, continuation), torch.softmax(logits, dim=-1).amax(dim=-1).tolist()


def _continuation_logits(draft: torch.nn.Module, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Float logits ``[L, V]`` of the draft at ``prompt + continuation[:j]`` for every j (one causal pass)."""
    device = next(draft.parameters()).device
    ids = torch.tensor([prompt + continuation], device=device)
    with torch.inference_mode():
        return draft(input_ids=ids).logits[0, len(prompt) - 1: -1].float()


def _ranks(logits: torch.Tensor, continuation: list[int]) -> list[int]:
    chosen = logits.gather(1, torch.tensor(continuation, device=logits.device)[:, None])
    return ((logits > chosen).sum(dim=1) + 1).tolist()


def replay(tree: Tree, ranks: list[int]) -> tuple[int, int]:
    """``(tokens, steps)`` of greedy decoding with ``tree`` over a continuation with these ranks."""
    position, steps = 0, 0
    while position < len(ranks):
        node, accepted = 0, 0
        while position + accepted < len(ranks):
            kids = tree.children[node]
            rank = ranks[position + accepted]
            if rank > len(kids):
                break
            node = kids[rank - 1]
            accepted += 1
        position += accepted + 1  # accepted drafts + the bonus token
        steps += 1
    return len(ranks), steps


def tokens_per_step(tree: Tree, rank_lists: list[list[int]]) -> float:
    tokens = steps = 0
    for ranks in rank_lists:
        t, s = replay(tree, ranks)
        tokens, steps = tokens + t, steps + s
    return tokens / steps


def greedy_acceptance(rank_lists: list[list[int]], k: int = 32) -> list[float]:
    """Positional greedy acceptance: p_k = P(target's greedy token is the draft's k-th choice)."""
    counts = Counter(r for ranks in rank_lists for r in ranks)
    total = sum(len(r) for r in rank_lists)
    return [counts[rank] / total for rank in range(1, k + 1)]
