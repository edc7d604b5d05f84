"""The greedy replay predicts the engine's own step count exactly (tiny models, several trees)."""
from __future__ import annotations

import pytest
import tiny_models as tm
import torch

from engine import SpeculativeEngine, Tree
from engine.tuning.replay import draft_ranks, greedy_acceptance, replay, tokens_per_step

PROMPT = [5, 17, 3, 42, 9, 11]


@pytest.fixture(scope="module")
def pair():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    target = tm.qwen2(seed=2)
    yield target, tm.perturbed(target, 0.003)
    torch.set_num_threads(before)


@pytest.mark.parametrize("tree", [Tree.chain(1), Tree.chain(4), Tree.k_ary(2, 2), Tree.k_ary(3, 2),
                                  Tree.k_independent(2, 3), Tree.optimal([0.6, 0.2, 0.1], 10, 4)])
def test_replay_matches_engine_steps(pair, tree):
    target, draft = pair
    result = SpeculativeEngine(target, draft, stop_token_ids=[]).generate(PROMPT, max_new_tokens=40, tree=tree, copies=False)
    ranks = draft_ranks(draft, PROMPT, result.tokens)
    assert replay(tree, ranks) == (len(result.tokens), len(result.steps))


def test_replay_walk_by_hand():
    ranks = [1, 2, 5, 1, 1, 1]
    # chain: accept rank 1, rank 2 has no node -> bonus | rank 5 -> bonus | 1, 1 -> bonus (past the end)
    assert replay(Tree.chain(2), ranks) == (6, 3)
    # binary: ranks 1 then 2 both exist (the bonus covers the rank-5 position) | 1, 1 -> bonus
    assert replay(Tree.k_ary(2, 2), ranks) == (6, 2)
    assert tokens_per_step(Tree.chain(0), [ranks]) == 1.0


def test_greedy_acceptance_counts_ranks():
    assert greedy_acceptance([[1, 1, 2], [3, 1]], k=3) == [0.6, 0.2, 0.2]
