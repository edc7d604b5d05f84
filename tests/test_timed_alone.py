"""Steps the target decodes alone to time itself (``stream(..., timed_alone=TimedAlone(n))``).

An answer that gives its second step and every n-th after it to the target alone carries its own
measurement of the target alone, taken under the load it decoded under. Those steps must be exactly the scheduled
ones, verify the root alone and leave the output's law as it was: greedy token for token (tiny
models, against an HF reference no engine touched), sampled by a KS test of the probability
integral transform (p > 1e-3, as tests/test_engine_sampling.py).
"""
from __future__ import annotations

import pytest
import tiny_models as tm
import torch
from test_draft_gate import single_thread, target, tuned_engine  # noqa: F401 (the fixtures: one thread, the tiny target)
from test_engine_sampling import PIT_SAMPLES, PROMPT, pit_values
from test_verify_stats import P_MIN

from engine import SpeculativeEngine
from engine.core.timed_alone import TimedAlone
from engine.errors import InvalidParameterError
from engine.trees.tree import Tree


@pytest.mark.parametrize("every", [2, 3, 5])
@pytest.mark.parametrize("tree", ["auto", "k-ary", "copies"])
def test_the_scheduled_steps_verify_the_root_alone_and_greedy_output_is_the_targets(target, every, tree):
    engine = tuned_engine(target, tm.clone(target))  # a draft always kept: every other step drafts
    kwargs = {"tree": "auto", "copies": False} if tree == "auto" else {"tree": Tree.k_ary(2, 3), "copies": tree == "copies"}
    result = engine.generate(PROMPT, max_new_tokens=40, timed_alone=TimedAlone(every), **kwargs)
    timed = [step.index for step in result.steps if step.timed_alone]
    assert timed == [i for i in range(len(result.steps)) if i % every == 1] and timed
    assert all(step.tree_size == 1 and len(step.committed) == 1 for step in result.steps if step.timed_alone)
    assert all(step.tree_size > 1 for step in result.steps if not step.timed_alone)
    assert result.tokens == tm.hf_greedy(target, PROMPT, 40)
    assert not any(step.timed_alone for step in engine.generate(PROMPT, max_new_tokens=12, **kwargs).steps)


@pytest.mark.parametrize("every", [1, -1, 2.5, True, "4"])
def test_a_schedule_that_is_not_0_or_2_and_more_is_refused(target, every):
    engine = SpeculativeEngine(target, tm.clone(target), stop_token_ids=[])
    with pytest.raises(InvalidParameterError, match="TimedAlone.every"):
        engine.stream(PROMPT, max_new_tokens=4, tree=Tree.chain(2), timed_alone=TimedAlone(every))


def test_answers_with_steps_timed_alone_follow_the_targets_law(target):
    """600 answers of 8 tokens at T = 0.7, every other step the target alone: KS test of the
    transformed values against the uniform law, p-value > 1e-3."""
    from scipy.stats import kstest

    engine = SpeculativeEngine(target, tm.perturbed(target, 0.05, seed=1), stop_token_ids=[])
    generator = torch.Generator().manual_seed(37)
    values, timed = [], 0
    for seed in range(PIT_SAMPLES):
        result = engine.generate(PROMPT, max_new_tokens=8, temperature=0.7, tree=Tree.chain(3), seed=seed,
                                 timed_alone=TimedAlone(2))
        values += pit_values(target, result.tokens, 0.7, 1.0, generator)
        timed += sum(step.timed_alone for step in result.steps)
    assert timed > PIT_SAMPLES, timed
    assert kstest(values, "uniform").pvalue > P_MIN
