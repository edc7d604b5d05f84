"""The target's log-probabilities of the tokens a step commits (OpenAI's ``logprobs``).

They are what the model says, not what was sampled: the log_softmax of the target's raw logits
(temperature 1, no top-p), whatever the request's sampling settings, as llama-server and vLLM
report them by default. Each committed token is scored on the verification row that predicted
it: the root's row for the step's first token, the row of accepted node ``i`` for the token
after it (the next accepted node, or the bonus). Nothing here draws randomness or changes a
decision, so the tokens are the same with log-probabilities or without them.
"""
from __future__ import annotations

import torch

from engine.core.records import TokenLogprob
from engine.errors import InvalidParameterError

MAX_TOP_LOGPROBS = 20  # alternatives per token at most, as OpenAI's top_logprobs


def check_logprobs(value) -> int | None:
    """``value`` as the number of alternatives to report (0..20), or None (off); else
    :class:`InvalidParameterError`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise InvalidParameterError(f"logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives "
                                    f"per token), got {value!r}")
    return value


def committed_logprobs(logits: torch.Tensor, accepted: list[int], committed: list[int],
                       top: int) -> list[TokenLogprob]:
    """One :class:`TokenLogprob` per token of ``committed``: its log-probability under the target's
    logits ``[nodes, V]`` on the row of the accepted node before it (``accepted[j]`` predicts
    ``committed[j]``), and that row's ``top`` most likely tokens, computed in float32."""
    if not committed:
        return []
    rows = torch.tensor(accepted[:len(committed)], device=logits.device)
    scores = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)
    chosen = scores.gather(1, torch.tensor(committed, device=logits.device)[:, None])[:, 0].tolist()
    if top == 0:
        return [TokenLogprob(token, value) for token, value in zip(committed, chosen)]
    values, indices = torch.topk(scores, min(top, scores.shape[-1]), dim=-1)
    return [TokenLogprob(token, value, list(zip(ids, tops)))
            for token, value, ids, tops in zip(committed, chosen, indices.tolist(), values.tolist())]
