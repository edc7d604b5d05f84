"""engine.core.sampling's top-p: the top-k shortcut gives the full sort's nucleus exactly."""
from __future__ import annotations

import pytest
import torch

from engine.core.sampling import _top_p_filter, logits_to_probs


def full_sort_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The textbook filter: sort everything, keep tokens whose preceding mass is below top_p."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(mass_before >= top_p, 0.0))
    return kept / kept.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])  # flat (full sort), middling, peaked (top-k)
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_top_p_matches_the_full_sort(scale, top_p):
    torch.manual_seed(int(scale * 100 + top_p * 10))
    probs = torch.softmax(torch.randn(5, 151936) * scale, dim=-1)
    assert torch.equal(_top_p_filter(probs, top_p), full_sort_nucleus(probs, top_p))


def test_top_p_rows_of_mixed_shapes_and_small_vocabularies():
    torch.manual_seed(3)
    peaked = torch.softmax(torch.randn(2, 5000) * 15, dim=-1)
    flat = torch.softmax(torch.randn(2, 5000) * 0.1, dim=-1)
    mixed = torch.cat([peaked, flat])  # one row needs the full sort: the whole batch takes it
    assert torch.equal(_top_p_filter(mixed, 0.9), full_sort_nucleus(mixed, 0.9))
    assert torch.equal(_top_p_filter(peaked, 0.9, candidates=64), full_sort_nucleus(peaked, 0.9))
    small = torch.softmax(torch.randn(3, 50), dim=-1)  # fewer tokens than candidates
    assert torch.equal(_top_p_filter(small, 0.8), full_sort_nucleus(small, 0.8))


def test_no_full_sort_when_the_candidates_hold_the_nucleus(monkeypatch):
    """The shortcut really runs: 4 candidates hold 0.97 of the mass, so nothing is sorted."""
    probs = torch.tensor([[0.5, 0.3, 0.12, 0.05, 0.03] + [0.0] * 2000])
    with monkeypatch.context() as patch:
        patch.setattr(torch, "sort", lambda *a, **k: pytest.fail("sorted the whole vocabulary"))
        out = _top_p_filter(probs, 0.9, candidates=4)
    assert torch.allclose(out[0, :3], torch.tensor([0.5, 0.3, 0.12]) / 0.92) and out[0, 3:].sum() == 0
    assert torch.equal(logits_to_probs(torch.log(probs.clamp(min=1e-30)), 1.0, 0.9), full_sort_nucleus(
        torch.softmax(torch.log(probs.clamp(min=1e-30)), -1), 0.9))


def test_sampling_keeps_only_what_the_engine_uses():
    """No dead entry points: the engine samples through sample_children / choose_children and the
    verifiers; top-k filtering of the target's law is not a parameter of this project."""
    import inspect

    import engine.core.sampling as sampling
    assert not hasattr(sampling, "sample")
    assert "top_k" not in inspect.signature(logits_to_probs).parameters
