"""The decoding engine on tiny random models built in code (no downloads, a few seconds on CPU).

Greedy tree speculative decoding must be token-identical to the target's own greedy decoding,
whatever the draft and whatever the tree. The drafts used here:

* ``random``: an unrelated random model (same vocabulary): almost every draft token is rejected;
* ``close``: the target plus small weight noise: many acceptances, some through rank-2/3 children;
* ``clone``: an exact copy of the target: every first-choice draft token is accepted.

The reference prompts were checked for near ties (top-2 logit gap >= 1e-4 at every generated
position; see ``test_references_have_no_near_ties``), so a mismatch is an engine bug, not noise.
"""
from __future__ import annotations

import math

import pytest
import tiny_models as tm
import torch
from transformers import DynamicCache

from engine import SpeculativeEngine, Tree
from engine.core.sampling import logits_to_probs
from engine.core.settings import settings_from
from engine.core.step import Decoding
from engine.errors import (
    ContextOverflowError,
    EngineError,
    InvalidParameterError,
    InvalidTreeError,
    VocabularyMismatchError,
)

PROMPT = [5, 17, 3, 42, 9, 11]
SHORT_PROMPT = [7]
NEW_TOKENS = 24
QWEN_SEED = 2    # greedy continuation of PROMPT: 10 distinct tokens, min top-2 gap ~8e-3
LLAMA_SEED = 0   # greedy continuation of PROMPT: 15 distinct tokens, min top-2 gap ~9e-3

TREES = {
    "none": None,
    **{f"chain{d}": Tree.chain(d) for d in range(1, 5)},
    "2ary2": Tree.k_ary(2, 2),
    "3ary2": Tree.k_ary(3, 2),
    "2indep3": Tree.k_independent(2, 3),
    "irregular": Tree.from_parents([-1, 0, 1, 0, 2, 3, 0, 4, 1]),
    # Written with cousins out of parent order (node 3's parent is 2, node 4's is 1): Tree() refuses
    # that order (tests/test_tree.py), from_parents renumbers it canonically.
    "cousins_swapped": Tree.from_parents((-1, 0, 0, 2, 1)),
}


# ----- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """Tiny models run fastest on one thread, and several threads spin badly when the CPU is shared.
    Restored afterwards so that other test modules (real models) keep their parallelism."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def model_set(build, seed: int) -> dict:
    """A target, a random and a close draft, and the target's own greedy references."""
    target = build(seed=seed)
    return {
        "target": target,
        "random": build(seed=seed + 50, hidden_size=16, layers=1),
        "close": tm.perturbed(target, noise=0.003),
        "clone": tm.clone(target),
        "ref": tm.hf_greedy(target, PROMPT, NEW_TOKENS),
        "ref_short": tm.hf_greedy(target, SHORT_PROMPT, NEW_TOKENS),
        "ref_long": tm.hf_greedy(target, PROMPT, 40),  # 8 steps of a depth-3 tree commit <= 32
    }


@pytest.fixture(scope="module")
def qwen():
    return model_set(tm.qwen2, QWEN_SEED)


@pytest.fixture(scope="module")
def llama():
    return model_set(tm.llama, LLAMA_SEED)


def engine_for(models, draft_kind, **kwargs) -> SpeculativeEngine:
    draft = None if draft_kind is None else models[draft_kind]
    return SpeculativeEngine(models["target"], draft, stop_token_ids=kwargs.pop("stop_token_ids", []), **kwargs)


def single_line(exc: BaseException) -> bool:
    message = str(exc)
    return bool(message.strip()) and "\n" not in message


# ----- the reference itself ------------------------------------------------------------------
def test_references_have_no_near_ties(qwen, llama):
    assert qwen["ref_long"][:NEW_TOKENS] == qwen["ref"]
    for models, prompt, ref in ((qwen, PROMPT, qwen["ref_long"]), (qwen, SHORT_PROMPT, qwen["ref_short"]),
                                (llama, PROMPT, llama["ref"])):
        assert len(ref) >= NEW_TOKENS
        assert len(set(ref)) >= 5, "degenerate reference (a repeated token proves little)"
        assert tm.min_top2_gap(models["target"], prompt + ref, len(prompt)) > 1e-4


# ----- exactness -----------------------------------------------------------------------------
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("draft_kind", ["random", "close"])
@pytest.mark.parametrize("tree_name", list(TREES))
def test_greedy_matches_target_generate_qwen(qwen, tree_name, draft_kind, static):
    result = engine_for(qwen, draft_kind, static_cache=static).generate(PROMPT, max_new_tokens=NEW_TOKENS, temperature=0,
                                                   tree=TREES[tree_name], copies=False)
    assert result.tokens == qwen["ref"]
    assert result.finish_reason == "length"
    assert result.prompt_tokens == len(PROMPT)
    assert [t for s in result.steps for t in s.committed] == result.tokens


@pytest.mark.parametrize("tree_name", ["none", "chain1", "chain3", "3ary2", "irregular"])
def test_greedy_matches_target_generate_one_token_prompt(qwen, tree_name):
    """A one-token prompt: no prefill at all, the first verification starts from an empty cache."""
    result = engine_for(qwen, "close").generate(SHORT_PROMPT, max_new_tokens=NEW_TOKENS, tree=TREES[tree_name], copies=False)
    assert result.tokens == qwen["ref_short"]


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("draft_kind", ["random", "close"])
@pytest.mark.parametrize("tree_name", ["none", "chain3", "2ary2", "3ary2", "2indep3", "irregular"])
def test_greedy_matches_target_generate_llama(llama, tree_name, draft_kind, static):
    """Not Qwen-specific: a Llama pair (multi-head attention, different config class) works the same."""
    result = engine_for(llama, draft_kind, static_cache=static).generate(PROMPT, max_new_tokens=NEW_TOKENS, tree=TREES[tree_name], copies=False)
    assert result.tokens == llama["ref"]


def test_target_only_engine_matches_target_generate(qwen):
    engine = SpeculativeEngine(qwen["target"], None, stop_token_ids=[])
    result = engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, copies=False)  # the target alone, no free drafts
    assert result.tokens == qwen["ref"]
    assert len(result.steps) == NEW_TOKENS
    assert all(s.tokens == [s.tokens[0]] and s.accepted == [0] and len(s.committed) == 1 for s in result.steps)


def test_close_draft_accepts_through_lower_ranked_children(qwen):
    """The exactness tests are only meaningful if some steps accept draft tokens, including via
    children other than the draft's first choice (the branches that only a tree has)."""
    tree = TREES["3ary2"]
    result = engine_for(qwen, "close").generate(PROMPT, max_new_tokens=NEW_TOKENS, tree=tree, copies=False)
    assert result.tokens == qwen["ref"]
    assert sum(s.accepted_draft_tokens for s in result.steps) >= 6
    assert any(tree.ranks[a] > 1 for s in result.steps for a in s.accepted)


def test_engine_is_reusable_and_does_not_modify_the_prompt(qwen):
    engine = engine_for(qwen, "close")
    prompt = list(PROMPT)
    first = engine.generate(prompt, max_new_tokens=NEW_TOKENS, tree=TREES["2ary2"], copies=False).tokens
    second = engine.generate(tuple(prompt), max_new_tokens=NEW_TOKENS, tree=TREES["2ary2"], copies=False).tokens
    assert prompt == PROMPT
    assert first == second == qwen["ref"]


# ----- acceptance with a perfect draft -------------------------------------------------------
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_clone_draft_accepts_whole_chain(qwen, depth):
    """With draft == target, every draft token is the target's argmax: each step accepts the whole
    chain and commits depth + 1 tokens. A wrong tree mask or wrong positions would reject some."""
    result = engine_for(qwen, "clone").generate(PROMPT, max_new_tokens=NEW_TOKENS, tree=Tree.chain(depth), copies=False)
    assert result.tokens == qwen["ref"]
    assert result.tokens_per_step > depth
    assert all(s.accepted == list(range(depth + 1)) for s in result.steps[:-1])
    assert len(result.steps) == math.ceil(NEW_TOKENS / (depth + 1))


@pytest.mark.parametrize("tree_name", ["2ary2", "3ary2", "2indep3", "irregular"])
def test_clone_draft_accepts_first_choice_path(qwen, tree_name):
    tree = TREES[tree_name]
    result = engine_for(qwen, "clone").generate(PROMPT, max_new_tokens=NEW_TOKENS, tree=tree, copies=False)
    assert result.tokens == qwen["ref"]
    assert result.tokens_per_step > tree.depth
    for step in result.steps[:-1]:
        assert len(step.accepted) == tree.depth + 1
        assert all(tree.ranks[a] == 1 for a in step.accepted[1:])


def test_clone_draft_llama(llama):
    engine = SpeculativeEngine(llama["target"], tm.clone(llama["target"]), stop_token_ids=[])
    result = engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, tree=Tree.k_ary(2, 3), copies=False)
    assert result.tokens == llama["ref"]
    assert result.tokens_per_step > 3


# ----- KV-cache compaction -------------------------------------------------------------------
def fresh_cache(model, token_ids):
    cache = DynamicCache(config=model.config)
    if token_ids:
        with torch.inference_mode():
            model(input_ids=torch.tensor([token_ids]), past_key_values=cache, use_cache=True)
    return cache


def assert_caches_close(runner, length, expected, what):
    """The first ``length`` slots of ``runner``'s cache equal the ``expected`` DynamicCache."""
    assert expected.get_seq_length() == length, what
    if not runner.cache.layers[0].is_initialized:
        assert length == 0, what
        return
    if isinstance(runner.cache, DynamicCache):
        assert runner.cache.get_seq_length() == length, what
    assert len(runner.cache.layers) == len(expected.layers)
    for i, (a, e) in enumerate(zip(runner.cache.layers, expected.layers)):
        for name in ("keys", "values"):
            ta, te = getattr(a, name)[:, :, :length], getattr(e, name)
            assert ta.shape == te.shape, f"{what}: layer {i} {name} shape {tuple(ta.shape)} != {tuple(te.shape)}"
            assert torch.allclose(ta, te, atol=1e-5), \
                f"{what}: layer {i} {name} differs by {float((ta - te).abs().max()):.2e}"


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("tree_name", ["chain3", "2ary2", "3ary2", "2indep3", "irregular", "cousins_swapped"])
def test_kv_caches_equal_recomputed_caches_after_each_step(qwen, tree_name, static):
    """After every step the compacted caches hold exactly what a from-scratch forward of the committed
    sequence produces: the target all of ``seq`` but its last token, the draft ``seq[:draft_len]``
    (for the static cache: in its first slots; the rest is stale and masked)."""
    tree = TREES[tree_name]
    engine = engine_for(qwen, "close", static_cache=static)
    params = engine._prepare(list(PROMPT), settings_from(max_new_tokens=64, temperature=0.0, top_p=1.0,
        tree=tree, seed=0, stop_token_ids=[], copies=False))
    state = Decoding(engine, list(PROMPT), params)
    state.prefill()
    assert_caches_close(state.target_runner, len(PROMPT) - 1, fresh_cache(qwen["target"], PROMPT[:-1]),
                        "after prefill")
    gathered = 0
    for n in range(8):
        before = len(state.seq)
        record = state.step()
        assert not state.finished
        seq = state.seq
        assert seq == PROMPT + qwen["ref_long"][: len(seq) - len(PROMPT)]
        gathered += record.accepted != list(range(len(record.accepted)))
        assert_caches_close(state.target_runner, len(seq) - 1, fresh_cache(qwen["target"], seq[:-1]),
                            f"target after step {n}")
        # The draft keeps every accepted node it has already processed (all but a deepest-level one):
        # nothing it saw is recomputed in the next step's catch-up.
        if tree.depth:
            assert state.draft_len == before + sum(tree.depths[a] < tree.depth for a in record.accepted[1:])
        assert_caches_close(state.draft_runner, state.draft_len, fresh_cache(qwen["close"], seq[: state.draft_len]),
                            f"draft after step {n}")
    if tree_name != "chain3":
        assert gathered, "no step exercised the gather (non-contiguous) compaction path"


# ----- step records --------------------------------------------------------------------------
def path_probs(model, context, tokens, tree, node):
    """Softmax of ``model`` at parent(node) given ``context`` + the tree path down to parent(node)."""
    path = tree.path_to(tree.parents[node])
    ids = context[:-1] + [tokens[i] for i in path]  # tokens[0] == context[-1]
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1]
    return logits_to_probs(logits)


@pytest.mark.parametrize("tree_name", ["chain3", "3ary2", "2indep3", "irregular"])
def test_step_records(qwen, tree_name):
    tree = TREES[tree_name]
    result = engine_for(qwen, "close").generate(PROMPT, max_new_tokens=NEW_TOKENS, tree=tree, copies=False)
    assert result.tokens == qwen["ref"]
    context = list(PROMPT)
    for k, step in enumerate(result.steps):
        n = tree.size
        assert step.index == k
        assert len(step.tokens) == len(step.parents) == len(step.ranks) == len(step.draft_probs) \
            == len(step.target_probs) == n == step.tree_size
        assert step.parents == list(tree.parents) and step.ranks == list(tree.ranks)
        assert step.tokens[0] == context[-1]
        assert all(0 <= t < tm.VOCAB for t in step.tokens)
        assert step.draft_probs[0] == 1.0 and step.target_probs[0] == 1.0
        assert all(0.0 <= p <= 1.0 for p in step.draft_probs + step.target_probs)
        # Siblings are the draft's distinct top choices, in rank order.
        for node in range(n):
            kids = tree.children[node]
            assert len({step.tokens[c] for c in kids}) == len(kids)
            probs = [step.draft_probs[c] for c in kids]
            assert probs == sorted(probs, reverse=True)
        # accepted is a root-to-node path.
        assert step.accepted[0] == 0
        assert all(step.parents[b] == a for a, b in zip(step.accepted, step.accepted[1:]))
        assert step.accepted_draft_tokens == min(len(step.accepted) - 1, len(step.committed))  # committed ones only
        # committed = accepted draft tokens + bonus (the target's choice, which no child of the last node matched).
        expected_prefix = [step.tokens[a] for a in step.accepted[1:]]
        last = step is result.steps[-1]
        if not last:
            assert len(step.committed) == len(step.accepted)
            assert step.committed[:-1] == expected_prefix
            bonus = step.committed[-1]
            assert bonus not in [step.tokens[c] for c in tree.children[step.accepted[-1]]]
            assert step.finish_reason is None
        else:
            m = len(step.committed)  # truncated by the budget: a prefix of accepted tokens + bonus
            assert 1 <= m <= len(step.accepted)
            assert step.committed[: min(m, len(expected_prefix))] == expected_prefix[:m]
            assert step.finish_reason == "length"
        assert step.timings.draft_s >= 0 and step.timings.verify_s >= 0 and step.timings.bookkeeping_s >= 0
        assert step.timings.total_s >= 0
        # Reported probabilities are those of a plain forward over the context + path (first steps only).
        if k < 3:
            for node in range(1, n):
                q = path_probs(qwen["close"], context, step.tokens, tree, node)
                p = path_probs(qwen["target"], context, step.tokens, tree, node)
                assert step.draft_probs[node] == pytest.approx(float(q[step.tokens[node]]), abs=1e-5)
                assert step.target_probs[node] == pytest.approx(float(p[step.tokens[node]]), abs=1e-5)
                # Children are the draft's top-ranked tokens at their parent.
                rank = tree.ranks[node]
                assert step.tokens[node] == int(torch.topk(q, rank).indices[rank - 1])
        context += step.committed
    assert result.prefill_s >= 0 and result.decode_s >= 0
    assert result.tokens_per_step == pytest.approx(len(result.tokens) / len(result.steps))
    record = result.steps[0].to_dict()
    assert set(record) >= {"tokens", "parents", "ranks", "draft_probs", "target_probs", "accepted", "committed"}


# ----- growth by confidence ------------------------------------------------------------------
def drafted_tree(step) -> Tree:
    return Tree(tuple(step.parents))


def path_confidence(step, node: int) -> float:
    tree, confidence = drafted_tree(step), 1.0
    for n in tree.path_to(node)[1:]:
        confidence *= step.draft_probs[n]
    return confidence


def assert_cut_of(step, full: Tree, threshold: float, stops=frozenset()) -> None:
    """The drafted tree is ``full`` cut below the nodes whose path confidence is under ``threshold``
    (or whose token is a stop token): every node keeps all of its children in ``full`` or none."""
    drafted = drafted_tree(step)
    full_id = [0]  # drafted node -> node of the full tree, breadth-first in both
    for node in range(1, drafted.size):
        parent = full_id[drafted.parents[node]]
        full_id.append(full.children[parent][drafted.ranks[node] - 1])
    for node in range(drafted.size):
        kids, full_kids = drafted.children[node], full.children[full_id[node]]
        grows = bool(full_kids) and path_confidence(step, node) >= threshold and \
            (node == 0 or step.tokens[node] not in stops)
        assert len(kids) == (len(full_kids) if grows else 0), f"node {node} of {drafted.parents}"


# The tiny draft's laws are nearly flat (q ~ 0.02 a token): these cut at depth 1, 2 or 3, or never.
THRESHOLDS = [1e-7, 4e-4, 0.0201, 0.5]


@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("tree_name", ["chain4", "3ary2", "2indep3", "irregular"])
def test_growth_by_confidence_stays_exact_and_cuts_where_it_should(qwen, tree_name, threshold):
    tree = TREES[tree_name]
    result = engine_for(qwen, "close").generate(PROMPT, max_new_tokens=NEW_TOKENS, tree=tree, confidence=threshold, copies=False)
    assert result.tokens == qwen["ref"]
    for step in result.steps:
        assert_cut_of(step, tree, threshold)
        assert len(step.tokens) == len(step.parents) == len(step.draft_probs) == len(step.target_probs)


def test_growth_by_confidence_cuts_some_steps_and_not_others(qwen):
    """A threshold at the median path confidence of the uncut chain's second level leaves some steps
    deeper than two and cuts others there: the test above checks both kinds of step."""
    tree = TREES["chain4"]
    uncut = engine_for(qwen, "close").generate(PROMPT, max_new_tokens=NEW_TOKENS, tree=tree, copies=False)
    threshold = sorted(path_confidence(step, 2) for step in uncut.steps)[len(uncut.steps) // 2]
    result = engine_for(qwen, "close").generate(PROMPT, max_new_tokens=NEW_TOKENS, tree=tree, confidence=threshold, copies=False)
    depths = {drafted_tree(step).depth for step in result.steps}
    assert result.tokens == qwen["ref"]
    assert min(depths) <= 2 < max(depths), depths


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("tree_name", ["chain4", "3ary2", "irregular"])
def test_kv_caches_stay_exact_when_growth_stops_early(qwen, tree_name, static):
    """As test_kv_caches_equal_recomputed_caches_after_each_step, for trees cut by confidence: the
    draft keeps the accepted nodes of every level it drafted."""
    engine = engine_for(qwen, "close", static_cache=static)
    params = engine._prepare(list(PROMPT), settings_from(max_new_tokens=64, temperature=0.0, top_p=1.0,
        tree=TREES[tree_name], seed=0, stop_token_ids=[], copies=False, confidence=0.0201))
    state = Decoding(engine, list(PROMPT), params)
    state.prefill()
    cut = 0
    for n in range(8):
        before = len(state.seq)
        record = state.step()
        drafted = drafted_tree(record)
        cut += drafted.size < TREES[tree_name].size
        seq = state.seq
        assert seq == PROMPT + qwen["ref_long"][: len(seq) - len(PROMPT)]
        assert_caches_close(state.target_runner, len(seq) - 1, fresh_cache(qwen["target"], seq[:-1]),
                            f"target after step {n}")
        assert state.draft_len == before + sum(drafted.depths[a] < drafted.depth for a in record.accepted[1:])
        assert_caches_close(state.draft_runner, state.draft_len, fresh_cache(qwen["close"], seq[: state.draft_len]),
                            f"draft after step {n}")
    assert cut, "no step was cut: the test would not exercise the early stop"


def test_nothing_grows_below_a_stop_token(qwen):
    """With the target's own copy as the draft, a chain stops right after the drafted stop token."""
    ref = qwen["ref"]
    stop = ref[1]
    result = engine_for(qwen, "clone", stop_token_ids=[stop]).generate(PROMPT, max_new_tokens=NEW_TOKENS,
                                                                       tree=Tree.chain(4), copies=False)
    first = result.steps[0]
    assert first.tokens == [PROMPT[-1], ref[0], stop] and first.parents == [-1, 0, 1]
    assert result.tokens == ref[:2] and result.finish_reason == "stop"


# ----- stopping ------------------------------------------------------------------------------
def mid_step_stop(result, ref):
    """A (global index, token) that is its first occurrence in ``ref`` and lies strictly inside a
    step's committed tokens (not the last one), so stopping there truncates that step."""
    offset = 0
    for step in result.steps:
        for j in range(len(step.committed) - 1):
            k = offset + j
            if k > 0 and ref[k] not in ref[:k]:
                return k, ref[k]
        offset += len(step.committed)
    raise AssertionError("no suitable stop position")


def test_stop_token_ends_generation_mid_step(qwen):
    ref, tree = qwen["ref"], Tree.chain(4)
    engine = engine_for(qwen, "clone")
    k, stop = mid_step_stop(engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, tree=tree, copies=False), ref)
    result = engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, tree=tree, stop_token_ids=[stop], copies=False)
    assert result.tokens == ref[: k + 1]
    assert result.tokens[-1] == stop
    assert result.finish_reason == "stop"
    last = result.steps[-1]
    assert last.finish_reason == "stop"
    assert len(last.committed) < len(last.accepted)  # the step accepted more than it committed
    assert all(s.finish_reason is None for s in result.steps[:-1])


@pytest.mark.parametrize("tree_name", ["none", "chain2", "3ary2"])
def test_stop_tokens_from_constructor_and_override(qwen, tree_name):
    ref, tree = qwen["ref"], TREES[tree_name]
    k = next(i for i in range(3, NEW_TOKENS) if ref[i] not in ref[:i])
    unused = next(t for t in range(tm.VOCAB) if t not in ref)
    engine = SpeculativeEngine(qwen["target"], qwen["close"], stop_token_ids=[unused, ref[k]])
    stopped = engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, tree=tree, copies=False)
    assert stopped.tokens == ref[: k + 1] and stopped.finish_reason == "stop"
    # A per-call list replaces the engine's: [] means only the budget stops.
    full = engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, tree=tree, stop_token_ids=[], copies=False)
    assert full.tokens == ref and full.finish_reason == "length"


def test_default_stop_tokens_come_from_generation_config(qwen):
    """With no stop_token_ids the engine uses the model's eos, exactly like HF generate()."""
    ref = qwen["ref"]
    k = next(i for i in range(2, NEW_TOKENS) if ref[i] not in ref[:i])
    target = tm.clone(qwen["target"])
    target.generation_config.eos_token_id = ref[k]
    with torch.inference_mode():
        hf = target.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert hf == ref[: k + 1]
    result = SpeculativeEngine(target, qwen["close"]).generate(PROMPT, max_new_tokens=NEW_TOKENS,
                                                              tree=Tree.k_ary(2, 2), copies=False)
    assert result.tokens == hf and result.finish_reason == "stop"


@pytest.mark.parametrize("budget", list(range(1, 12)) + [NEW_TOKENS])
def test_max_new_tokens_is_exact(qwen, budget):
    """The budget is met exactly even when the last step accepts more tokens than remain."""
    result = engine_for(qwen, "clone").generate(PROMPT, max_new_tokens=budget, tree=Tree.chain(4), copies=False)
    assert result.tokens == qwen["ref"][:budget]
    assert len(result.tokens) == budget
    assert result.finish_reason == "length" and result.steps[-1].finish_reason == "length"
    if budget % 5:
        last = result.steps[-1]
        assert len(last.committed) == budget % 5 < len(last.accepted)


def test_max_new_tokens_one_without_draft(qwen):
    result = SpeculativeEngine(qwen["target"], stop_token_ids=[]).generate(PROMPT, max_new_tokens=1, copies=False)
    assert result.tokens == qwen["ref"][:1] and len(result.steps) == 1 and result.finish_reason == "length"


def test_stream_yields_steps_incrementally(qwen):
    engine = engine_for(qwen, "close")
    stream = engine.stream(PROMPT, max_new_tokens=NEW_TOKENS, tree=Tree.k_ary(2, 2), copies=False)
    first = next(stream)
    assert first.index == 0 and first.committed == qwen["ref"][: len(first.committed)]
    rest = list(stream)
    assert [t for s in [first] + rest for t in s.committed] == qwen["ref"]


# ----- bad input -----------------------------------------------------------------------------
BAD_CALLS = {
    "empty prompt": (dict(input_ids=[]), InvalidParameterError),
    "prompt not a list": (dict(input_ids="5 17"), InvalidParameterError),
    "token = vocab size": (dict(input_ids=[5, tm.VOCAB]), InvalidParameterError),
    "negative token": (dict(input_ids=[5, -1]), InvalidParameterError),
    "float token": (dict(input_ids=[5, 1.0]), InvalidParameterError),
    "bool token": (dict(input_ids=[True]), InvalidParameterError),
    "max_new_tokens 0": (dict(max_new_tokens=0), InvalidParameterError),
    "max_new_tokens -1": (dict(max_new_tokens=-1), InvalidParameterError),
    "max_new_tokens 2.5": (dict(max_new_tokens=2.5), InvalidParameterError),
    "max_new_tokens True": (dict(max_new_tokens=True), InvalidParameterError),
    "max_new_tokens str": (dict(max_new_tokens="8"), InvalidParameterError),
    "temperature -1": (dict(temperature=-1), InvalidParameterError),
    "temperature nan": (dict(temperature=float("nan")), InvalidParameterError),
    "temperature inf": (dict(temperature=float("inf")), InvalidParameterError),
    "temperature str": (dict(temperature="0"), InvalidParameterError),
    "top_p 0": (dict(top_p=0), InvalidParameterError),
    "top_p 1.5": (dict(top_p=1.5), InvalidParameterError),
    "top_p -0.5": (dict(top_p=-0.5), InvalidParameterError),
    "top_p nan": (dict(top_p=float("nan")), InvalidParameterError),
    "seed 1.5": (dict(seed=1.5), InvalidParameterError),
    "seed str": (dict(seed="0"), InvalidParameterError),
    "seed True": (dict(seed=True), InvalidParameterError),
    "seed None": (dict(seed=None), InvalidParameterError),
    "tree as list": (dict(tree=[-1, 0]), InvalidParameterError),
    "temperature True": (dict(temperature=True), InvalidParameterError),
    "top_p True": (dict(top_p=True), InvalidParameterError),
    "stop ids int": (dict(stop_token_ids=5), InvalidParameterError),
    "stop ids str": (dict(stop_token_ids="5"), InvalidParameterError),
    "unknown method": (dict(method="beam"), InvalidParameterError),
    "chain method, branching tree": (dict(method="chain", tree=Tree.k_ary(2, 2)), InvalidParameterError),
    "auto tree without tuner": (dict(tree="auto"), InvalidParameterError),
    "unknown tree name": (dict(tree="big"), InvalidParameterError),
    "confidence -0.1": (dict(confidence=-0.1), InvalidParameterError),
    "confidence 1.5": (dict(confidence=1.5), InvalidParameterError),
    "confidence nan": (dict(confidence=float("nan")), InvalidParameterError),
    "confidence str": (dict(confidence="0.5"), InvalidParameterError),
    "confidence True": (dict(confidence=True), InvalidParameterError),
    "over context": (dict(max_new_tokens=tm.MAX_POSITIONS), ContextOverflowError),
    "prompt over context": (dict(input_ids=[1] * (tm.MAX_POSITIONS + 1), max_new_tokens=1), ContextOverflowError),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
@pytest.mark.parametrize("api", ["generate", "stream"])
def test_bad_input_raises_documented_error(qwen, case, api):
    kwargs, error = BAD_CALLS[case]
    kwargs = {"input_ids": list(PROMPT), "max_new_tokens": 8, "tree": Tree.chain(2), **kwargs}
    engine = engine_for(qwen, "random")
    with pytest.raises(error) as info:
        if api == "generate":
            engine.generate(**kwargs)
        else:
            engine.stream(**kwargs)  # validated at call time, before the first step
    assert isinstance(info.value, EngineError)
    assert single_line(info.value)


def test_tree_with_draft_tokens_needs_a_draft(qwen):
    engine = SpeculativeEngine(qwen["target"], None, stop_token_ids=[])
    with pytest.raises(InvalidParameterError) as info:
        engine.generate(PROMPT, max_new_tokens=4, tree=Tree.chain(1), copies=False)
    assert single_line(info.value)
    # A root-only tree is plain decoding and needs no draft.
    assert engine.generate(PROMPT, max_new_tokens=4, tree=Tree.chain(0), copies=False).tokens == qwen["ref"][:4]


def test_invalid_tree_errors_are_engine_errors():
    with pytest.raises(EngineError) as info:
        Tree.from_parents([-1, 2, 0])
    assert isinstance(info.value, InvalidTreeError) and single_line(info.value)


@pytest.mark.parametrize("draft_vocab", [tm.VOCAB - 1, tm.VOCAB + 1])
def test_draft_with_other_vocabulary_is_rejected(qwen, draft_vocab):
    draft = tm.qwen2(seed=9, vocab_size=draft_vocab, hidden_size=16, layers=1)
    with pytest.raises(VocabularyMismatchError) as info:
        SpeculativeEngine(qwen["target"], draft)
    assert isinstance(info.value, EngineError) and single_line(info.value)


def test_context_limit_counts_prompt_budget_and_tree():
    """prompt + max_new_tokens + tree size may reach the context exactly; clear overflows are refused."""
    context = 32
    target = tm.qwen2(seed=QWEN_SEED, max_positions=context)
    engine = SpeculativeEngine(target, tm.perturbed(target, 0.003), stop_token_ids=[])
    prompt = PROMPT  # 6 tokens
    ref = tm.hf_greedy(target, prompt, context - len(prompt) - 1)
    fits = engine.generate(prompt, max_new_tokens=context - len(prompt) - 1, tree=None, copies=False)  # + root = 32
    assert fits.tokens == ref
    tree = Tree.chain(3)
    assert engine.generate(prompt, max_new_tokens=context - len(prompt) - tree.size, tree=tree, copies=False).tokens == \
        ref[: context - len(prompt) - tree.size]
    # Overflows whatever the exact accounting: the deepest draft position would be past the context.
    for budget, t in ((context - len(prompt) + 2, None), (context - len(prompt) + 2 - tree.depth, tree)):
        with pytest.raises(ContextOverflowError) as info:
            engine.generate(prompt, max_new_tokens=budget, tree=t, copies=False)
        assert single_line(info.value)


def test_constructor_stop_ids_must_be_a_list(qwen):
    with pytest.raises(InvalidParameterError):
        SpeculativeEngine(qwen["target"], None, stop_token_ids=5)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_sliding_window_models_decode_exactly_past_their_window(static):
    """A model whose layers slide over a window of 8 positions (half of them, as Gemma 3 mixes
    windowed and global layers): the engine keeps every position and applies the window by the mask;
    greedy trees give Hugging Face's own greedy tokens (its sliding cache drops what falls out) over
    a prompt and an answer far longer than the window."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def build(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        config = Qwen2Config(vocab_size=tm.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                             sliding_window=8, max_window_layers=1, max_position_embeddings=256)
        model = Qwen2ForCausalLM(config).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(8)  # peaked logits: no near-ties between the two caches' sums
        return model

    target = build(5)
    assert target.config.layer_types == ["full_attention", "sliding_attention"]
    reference = tm.hf_greedy(target, PROMPT, 24)
    draft = tm.perturbed(target, noise=0.003)
    engine = SpeculativeEngine(target, draft, static_cache=static)
    for tree in (Tree.chain(3), Tree.k_ary(2, 2)):
        assert engine.generate(PROMPT, max_new_tokens=24, temperature=0, tree=tree, copies=False).tokens == reference


# ----- static cache: the attention window grows with the context --------------------------------
def test_window_bucket():
    from engine.core.runner import window_bucket
    assert [window_bucket(n, 4096) for n in (1, 256, 257, 600, 4000, 5000)] == [256, 256, 512, 1024, 4096, 4096]


def test_static_cache_crossing_a_window_boundary_stays_exact():
    """A long prompt whose answer crosses slot 256: attention switches from a 256- to a 512-slot window
    mid-generation, and every step still equals the target's own greedy decoding."""
    target = tm.qwen2(seed=QWEN_SEED, max_positions=1024)
    draft = tm.perturbed(target, noise=0.003)
    prompt = [(7 * i + 3) % tm.VOCAB for i in range(240)]
    ref = tm.hf_greedy(target, prompt, 40)
    assert tm.min_top2_gap(target, prompt + ref, len(prompt)) > 1e-4
    engine = SpeculativeEngine(target, draft, stop_token_ids=[], static_cache=True)
    assert engine.generate(prompt, max_new_tokens=40, tree=Tree.k_ary(2, 3), copies=False).tokens == ref
    assert engine._static_runners["target"].window.slots == 512


@pytest.mark.parametrize("method", ["sequoia", "specinfer", "topk"])
def test_step_records_say_what_the_verifier_judged_each_node_on(qwen, method):
    engine = engine_for(qwen, "close")
    tried = 0
    for step in engine.stream(PROMPT, max_new_tokens=24, temperature=0.8, tree=Tree.k_ary(2, 2), seed=3,
                              method=method, copies=False):
        assert step.method == method and not step.greedy
        assert len(step.verifier_p) == len(step.verifier_q) == step.tree_size
        for node in step.accepted[1:]:
            assert step.verifier_p[node] is not None, "an accepted node was never judged"
        first = 1  # the root's rank-1 child (breadth-first order), always tried first
        assert step.verifier_p[first] == pytest.approx(step.target_probs[first], rel=1e-6)
        if method != "topk":
            assert step.verifier_q[first] == pytest.approx(step.draft_probs[first], rel=1e-6)
        else:
            assert step.verifier_q[first] is None
        tried += sum(p is not None for p in step.verifier_p)
    assert tried > 0
    greedy = engine.generate(PROMPT, max_new_tokens=8, tree=Tree.k_ary(2, 2), copies=False).steps[0]
    assert greedy.greedy and all(p is None for p in greedy.verifier_p)
