"""Continuations copied from the context (engine/trees/copies.py, engine/core/copy_policy.py): the
index, the merged tree, the policy, and exactness: greedy output identical to the target's own
greedy decoding, and sampled output following the target's law on trees that mix copied
(point-mass) and sampled children. Thresholds as in ``test_verify_stats``: chi-square p-value
> 1e-3 and total variation under ``tv_bound`` (6,000 samples); KS p-value > 1e-3 for 6-token answers.
"""
from __future__ import annotations

import numpy as np
import pytest
import test_app_support as support
import tiny_models as tm
import torch
from test_engine_sampling import PIT_SAMPLES, PIT_TOKENS, PROMPT, SAMPLES, VOCAB, exact_joint, pit_values
from test_engine_sampling import pair  # noqa: F401  (fixture)
from test_verify_stats import P_MIN, assert_exact

import engine.core.copy_policy as copy_policy
from engine import SpeculativeEngine, Tree
from engine.core.copy_policy import CopyStats, StepPlan, plan_step
from engine.core.verify import accept_child
from engine.trees.copies import SOURCE_COPY, SOURCE_DRAFT, ContextIndex, CopyProposal, merge_copies


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    yield from support.one_torch_thread()


# ----- the index ----------------------------------------------------------------------------------
def test_lookup_prefers_the_longest_match_then_the_most_recent():
    index = ContextIndex(key_len=2)
    index.sync([1, 2, 3, 10, 11, 9, 2, 3, 20, 21, 8, 1, 2, 3])
    first, second = index.lookup(max_tokens=2, branches=2)
    assert (first.tokens, first.match_len, first.position) == ((10, 11), 3, 3)  # 1 2 3 matches 3 back
    assert (second.tokens, second.match_len, second.position) == ((20, 21), 2, 8)
    assert index.lookup(max_tokens=5, branches=1)[0].tokens == (10, 11, 9, 2, 3)


def test_lookup_keeps_one_branch_per_first_token_and_cuts_after_a_stop_token():
    index = ContextIndex(key_len=2)
    index.sync([4, 5, 6, 0, 7, 4, 5, 6, 1, 4, 5])
    proposals = index.lookup(max_tokens=4, branches=3, stop_tokens=frozenset({0}))
    assert [p.tokens for p in proposals] == [(6, 1, 4, 5), (6, 0)][:1]  # both continue with 6: one branch
    index.sync([4, 5, 6, 0, 7, 4, 5, 6, 1, 4, 5, 6, 0, 9, 4, 5])
    assert index.lookup(max_tokens=4, branches=1, stop_tokens=frozenset({0}))[0].tokens == (6, 0)


def test_a_copy_of_the_sequence_itself_stops_where_the_sequence_ends():
    index = ContextIndex(key_len=2)
    index.sync([7, 8, 7, 8, 7, 8])  # the suffix 7 8 occurs at 0 and 2: the newest continues 7 8
    assert index.lookup(max_tokens=10, branches=1)[0].tokens == (7, 8)


def test_an_expected_output_is_a_document_of_its_own():
    index = ContextIndex(key_len=3)
    index.sync([1, 2, 3])
    assert index.lookup(4) == []
    document = index.add_document([1, 2, 3, 40, 41, 42])
    proposal = index.lookup(4)[0]
    assert (proposal.tokens, proposal.document, proposal.position) == ((40, 41, 42), document, 3)


def test_the_indexed_sequence_only_grows():
    index = ContextIndex()
    index.sync([1, 2, 3, 4])
    with pytest.raises(ValueError):
        index.sync([1, 2, 9, 4, 5])
    with pytest.raises(ValueError):
        ContextIndex(key_len=0)


# ----- the merged tree ----------------------------------------------------------------------------
def test_copied_chains_come_first_on_every_level_and_the_models_order_is_kept():
    model = Tree.k_ary(2, 2)
    model_tokens = [100, 1, 2, 3, 4, 5, 6]
    merged = merge_copies(model, model_tokens, [CopyProposal((50, 51, 52), 4, 0, 10), CopyProposal((60,), 2, 0, 20)])
    tree = merged.tree
    assert list(tree.children[0][:2]) == [1, 2] and merged.sources[1:3] == [SOURCE_COPY, SOURCE_COPY]
    assert [merged.tokens[c] for c in tree.children[0]] == [50, 60, 1, 2]
    assert [merged.tokens[n] for n in range(tree.size) if merged.sources[n] == SOURCE_DRAFT] == model_tokens[1:]
    assert [merged.model_node[n] for n in range(tree.size) if merged.sources[n] == SOURCE_DRAFT] == list(range(1, 7))
    chain = [1]
    while tree.children[chain[-1]]:
        chain.append(tree.children[chain[-1]][0])
    assert [merged.tokens[n] for n in chain] == [50, 51, 52]
    assert [merged.origin[n] for n in chain] == [(0, 10), (0, 11), (0, 12)]
    for node in range(1, tree.size):  # model nodes keep their parents
        if merged.sources[node] == SOURCE_DRAFT:
            parent = tree.parents[node]
            assert merged.model_node[parent] == model.parents[merged.model_node[node]]
    assert merge_copies(model, model_tokens, []).tree == model


# ----- the policy ---------------------------------------------------------------------------------
def test_the_policy_stops_copying_what_the_target_rejects_and_copies_alone_what_it_keeps():
    model_tree = Tree.chain(3)
    sure, never = CopyStats(), CopyStats()
    for _ in range(50):
        sure.observe(match_len=20, length=16, accepted=16)
        never.observe(match_len=20, length=8, accepted=0)
    kept = plan_step(sure, 20, 32, model_tree, 2.0, None)
    assert kept.copy_len >= 16 and not kept.draft
    assert plan_step(never, 20, 32, model_tree, 2.0, None).copy_len == 0
    assert plan_step(CopyStats(), 20, 0, model_tree, 2.0, None) == \
        StepPlan(0, True, 2.0, plan_step(CopyStats(), 20, 0, model_tree, 2.0, None).step_cost)


def test_deep_copied_tokens_count_at_the_deepest_depth_the_policy_reads():
    """Tokens at depth 8 and below share one count, the one the estimate of any depth >= 8 reads:
    nothing is counted where nothing reads it."""
    from engine.core.copy_policy import DEEPEST, PRIOR_WEIGHT

    stats = CopyStats()
    stats.observe(match_len=20, length=20, accepted=20)
    stats.observe(match_len=20, length=20, accepted=10)  # tokens 1..10 kept, the 11th rejected
    assert max(depth for _, depth in stats.tried) == DEEPEST
    bucket = next(iter(stats.tried))[0]
    assert stats.tried[bucket, DEEPEST] == 13 + 4 and stats.kept[bucket, DEEPEST] == 13 + 3
    assert stats.acceptance(20, 30) == stats.acceptance(20, DEEPEST) == \
        pytest.approx((16 + PRIOR_WEIGHT * stats.acceptance(20, 7)) / (17 + PRIOR_WEIGHT))


# ----- exactness ----------------------------------------------------------------------------------
LOOPING_PROMPT = [5, 17, 3, 42, 9, 11] * 3 + [5, 17, 3]
QWEN_SEED = 2  # its greedy answer to LOOPING_PROMPT repeats with period 11: copies get accepted


@pytest.fixture(scope="module")
def greedy_pair():
    target = tm.qwen2(seed=QWEN_SEED)
    return target, tm.perturbed(target, 0.01), tm.hf_greedy(target, LOOPING_PROMPT, 40)


@pytest.mark.parametrize("tree", [None, Tree.chain(3), Tree.k_ary(2, 2)], ids=["target-only", "chain3", "2ary2"])
def test_greedy_with_copies_is_the_targets_greedy_decoding(greedy_pair, tree):
    target, draft, reference = greedy_pair
    engine = SpeculativeEngine(target, draft, stop_token_ids=[])
    result = engine.generate(LOOPING_PROMPT, max_new_tokens=40, tree=tree, copies=True)
    assert result.tokens == reference
    copied = sum(step.accepted_by_source()["copy"] for step in result.steps)
    assert copied >= 10 and len(result.steps) < 30, "copies were not used: the test would be vacuous"
    wrong = reference[:15] + [(t + 1) % 64 for t in reference[15:20]] + reference[20:]
    predicted = engine.generate(LOOPING_PROMPT, max_new_tokens=40, tree=tree, prediction=wrong)
    assert predicted.tokens == reference
    assert any(step.sources and SOURCE_COPY in step.sources and step.copy_origins[1][0] == 1
               for step in predicted.steps), "the prediction was never copied from"


def test_copies_never_exceed_the_context(greedy_pair):
    target, draft, reference = greedy_pair
    engine = SpeculativeEngine(target, draft, stop_token_ids=[])
    limit = engine.max_context
    prompt = (LOOPING_PROMPT * (limit // len(LOOPING_PROMPT)))[:limit - 12]
    result = engine.generate(prompt, max_new_tokens=8, tree=Tree.chain(2), copies=True)
    assert len(result.tokens) == 8


def forced_copies(monkeypatch, length: int = 2) -> None:
    """Every step verifies ``length`` copied tokens beside the draft's tree, whatever the stats say
    (the plan depends on the past only, so any plan keeps the law: this one exercises mixed trees)."""
    monkeypatch.setattr(copy_policy, "plan_step", lambda *a, **k: StepPlan(length, True, 1.0, 1.0))
    monkeypatch.setattr(SpeculativeEngine, "copy_branches", 2)


def two_branch_prediction(target, temperature: float, top_p: float) -> list[int]:
    """An expected output in which the prompt's last tokens occur twice, followed by the target's two
    most likely first tokens: two copied branches at the root, one often kept, one often not."""
    with torch.inference_mode():
        first = target(torch.tensor([PROMPT])).logits[0, -1]
    likely = torch.argsort(first, descending=True)[:2].tolist()
    return [likely[0], likely[1], *PROMPT[-3:], likely[1], likely[0]]


def test_mixed_trees_sample_the_targets_joint_law(pair, monkeypatch):  # noqa: F811
    """6,000 two-token answers from a 2-ary tree with two copied branches beside it at every step."""
    method, tree, temperature, top_p = "sequoia", Tree.k_ary(2, 2), 0.7, 1.0
    target, draft = pair
    forced_copies(monkeypatch)
    exact = exact_joint(target, temperature, top_p)
    prediction = two_branch_prediction(target, temperature, top_p)
    engine = SpeculativeEngine(target, draft, stop_token_ids=[])
    counts = np.zeros((VOCAB, VOCAB))
    by_source = {"copy": 0, "draft": 0}
    branches = 0
    for seed in range(SAMPLES):
        result = engine.generate(PROMPT, max_new_tokens=2, temperature=temperature, top_p=top_p, tree=tree,
                                 seed=seed, method=method, prediction=prediction)
        counts[result.tokens[0], result.tokens[1]] += 1
        step = result.steps[0]
        branches += step.sources.count(SOURCE_COPY) >= 3
        for source, n in step.accepted_by_source().items():
            by_source[source] += n
    assert_exact(counts, exact)
    assert branches == SAMPLES, "every step should carry two copied branches"
    assert by_source["copy"] > SAMPLES // 10 and by_source["draft"] > SAMPLES // 20, by_source


@pytest.mark.parametrize("method,temperature,top_p", [("sequoia", 1.0, 1.0), ("specinfer", 0.7, 0.8),
                                                     ("topk", 0.7, 0.9)])
def test_six_token_answers_with_copies_follow_the_targets_law(pair, monkeypatch, method, temperature, top_p):  # noqa: F811
    """600 answers of 6 tokens, copies forced beside a 2-ary tree at every step (copies of the
    prompt and of the answer so far, as they come): KS test of the transformed values, p > 1e-3."""
    from scipy.stats import kstest

    target, draft = pair
    forced_copies(monkeypatch, length=3)
    engine = SpeculativeEngine(target, draft, stop_token_ids=[])
    prediction = two_branch_prediction(target, temperature, top_p) * 2
    generator = torch.Generator().manual_seed(7)
    values, copied = [], 0
    for seed in range(PIT_SAMPLES):
        result = engine.generate(PROMPT, max_new_tokens=PIT_TOKENS, temperature=temperature, top_p=top_p,
                                 tree=Tree.k_ary(2, 2), seed=seed, method=method, prediction=prediction)
        values += pit_values(target, result.tokens, temperature, top_p, generator)
        copied += sum(step.accepted_by_source()["copy"] for step in result.steps)
    assert kstest(values, "uniform").pvalue > P_MIN
    assert copied > PIT_SAMPLES // 4, "copies were barely kept: the test would not exercise them"


def test_point_mass_children_leave_the_residual_law():
    """At one node, copied children tried first then the draft's without replacement: the kept
    token (or the bonus from the residual) is distributed as p, exactly enumerated against 40,000 draws."""
    p = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05], dtype=torch.float64)
    q = torch.tensor([0.1, 0.1, 0.5, 0.2, 0.1], dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    counts = np.zeros(5)
    draws = 40_000
    for _ in range(draws):
        children = [3, 0]  # copied: tokens 3 then 0
        drafted = torch.multinomial(q, 2, replacement=False, generator=generator).tolist()
        choice, residual = accept_child(p, q, children + drafted, True, generator, point_masses=2)
        token = (children + drafted)[choice] if choice is not None else \
            int(torch.multinomial(residual, 1, generator=generator))
        counts[token] += 1
    from scipy.stats import chisquare
    assert chisquare(counts, p.numpy() * draws).pvalue > P_MIN
