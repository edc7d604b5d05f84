"""engine/cli/fidelity.py: the pooled comparison of two models' next-token laws on the same answers."""
from __future__ import annotations

import math

import pytest
import torch

from engine.cli.fidelity import answer_log_probs, compare, shared_prefix
from tiny_models import llama


def test_a_model_against_itself_agrees_everywhere_with_zero_kl():
    torch.manual_seed(0)
    logp = [torch.log_softmax(torch.randn(5, 11), -1), torch.log_softmax(torch.randn(3, 11), -1)]
    answers = [[1, 2, 3, 4, 5], [0, 10, 7]]
    result = compare(logp, logp, answers)
    assert result.positions == 8 and result.top1_agreement == 1.0 and result.mean_kl == pytest.approx(0.0, abs=1e-7)
    nll = -sum(float(lp[range(len(a)), a].sum()) for lp, a in zip(logp, answers)) / 8
    assert result.reference_perplexity == pytest.approx(math.exp(nll)) == result.other_perplexity


def test_kl_agreement_and_perplexity_against_hand_computed_values():
    p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    q = torch.tensor([[0.2, 0.7, 0.1], [0.2, 0.2, 0.6]])
    result = compare([p.log()], [q.log()], [[0, 2]])
    kl = sum(float((p[i] * (p[i] / q[i]).log()).sum()) for i in range(2)) / 2
    assert result.top1_agreement == 0.5 and result.mean_kl == pytest.approx(kl)
    assert result.reference_perplexity == pytest.approx(math.exp(-(math.log(0.7) + math.log(0.8)) / 2))
    assert result.other_perplexity == pytest.approx(math.exp(-(math.log(0.2) + math.log(0.6)) / 2))


def test_teacher_forced_log_probs_are_the_models_next_token_laws():
    model = llama(seed=3)
    prompt, answer = [5, 9, 2], [7, 1, 4]
    logp = answer_log_probs(model, prompt, answer)
    assert logp.shape == (3, model.config.vocab_size)
    with torch.inference_mode():
        for j in range(3):
            step = torch.log_softmax(model(input_ids=torch.tensor([prompt + answer[:j]])).logits[0, -1].float(), -1)
            assert torch.allclose(logp[j], step, atol=1e-5)


def test_shared_prefix():
    assert shared_prefix([1, 2, 3], [1, 2, 4]) == 2 and shared_prefix([1], [1, 5]) == 1 and shared_prefix([], [2]) == 0
