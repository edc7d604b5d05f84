"""A prefill's progress in target-token units: what :class:`~engine.core.records.PrefillProgress`
reports after each chunk of a long prompt (the page's "reading your message" bar)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.core.records import PrefillProgress


@dataclass
class PrefillWork:
    """A prefill's work in target-token units, for :class:`PrefillProgress`: the roles in order,
    each with its tokens to read and a token's cost (``weights``)."""

    prompt_tokens: int
    start: float
    todo: dict[str, int]
    weights: dict[str, float]

    @property
    def reused(self) -> int:
        """Prompt tokens the target's cache already held."""
        return self.prompt_tokens - self.todo.get("target", self.prompt_tokens)

    def after(self, role: str, read: int) -> PrefillProgress:
        """The progress once ``role`` has read ``read`` of its tokens."""
        roles = list(self.todo)
        units = {r: self.todo[r] * self.weights[r] for r in roles}
        done = sum(units[r] for r in roles[:roles.index(role)]) + read * self.weights[role]
        total = sum(units.values())
        return PrefillProgress(done=self.reused + read if role == "target" else self.prompt_tokens,
                               total=self.prompt_tokens, fraction=min(1.0, done / total) if total else 1.0,
                               elapsed_s=time.perf_counter() - self.start)


def prefill_weight(engine, role: str) -> float:
    """A prompt token's prefill cost for ``role`` in target tokens: 1 for the target, the draft's
    share of the target's per-token weights (its layers' matrices) for the draft."""
    if role == "target" or engine.draft is None:
        return 1.0
    return _layer_weights(engine.draft) / max(1, _layer_weights(engine.target))


def _layer_weights(model: torch.nn.Module) -> int:
    """The weights a token meets in the decoder layers (what a prefill's time follows), from the
    config of a llama-style model; the parameter count otherwise."""
    config = getattr(model, "config", None)
    try:
        hidden, inner, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
        return int(layers * (4 * hidden * hidden + 3 * hidden * inner))
    except (AttributeError, TypeError):
        return sum(p.numel() for p in model.parameters())
