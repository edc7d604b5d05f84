"""Token log-probabilities: the engine's ``logprobs`` option (tiny models built in code).

Every logprob is checked against the log_softmax of the logits of a model no engine has touched,
at every position of the answer: what the target says, whatever the sampling settings. Asking
for them changes no token.
"""
from __future__ import annotations

import json

import pytest
import test_app_support as support
import tiny_models as tm
import torch

from engine import SpeculativeEngine, StepRecord, Tree
from engine.core.copy_policy import StepClock
from engine.core.records import TokenLogprob
from engine.errors import InvalidParameterError
from engine.tuning.tree_store import build_tree

TOLERANCE = 1e-4
PROMPT = [5, 17, 3, 42, 9, 11, 5, 17, 3, 42, 9]  # repeats itself: copies from the context get proposed


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    yield from support.one_torch_thread()


def reference_scores(model: torch.nn.Module, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """log_softmax of ``model``'s logits predicting each token of ``answer`` after ``prompt``
    (one plain forward, float32): ``[len(answer), V]``."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_same_ranking(got: list[tuple[object, float]], scores: torch.Tensor, name=lambda t: t) -> None:
    """``got`` [(token, logprob)] is the top of ``scores [V]`` in order (near ties may swap)."""
    values, ids = torch.topk(scores, len(got))
    assert [v for _, v in got] == pytest.approx(values.tolist(), abs=TOLERANCE)
    for rank, (token, _) in enumerate(got):
        tied = {ids[r].item() for r in range(len(got)) if abs(values[r] - values[rank]) < TOLERANCE}
        assert token == name(ids[rank].item()) or token in {name(t) for t in tied}, (rank, token)


# ----- the engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models():
    target = tm.qwen2(seed=2)
    return target, tm.perturbed(target, noise=0.003), tm.qwen2(seed=2)  # the last: never given to an engine


SETTINGS = {
    "target-alone-greedy": dict(tree=None),
    "target-alone-sampled": dict(tree=None, temperature=0.8, seed=3),
    "tree-greedy": dict(tree=Tree.k_ary(2, 2)),
    "tree-sampled": dict(tree=build_tree(8, 3), temperature=0.8, top_p=0.9, seed=5),
    "tree-sampled-static-cache": dict(tree=build_tree(8, 3), temperature=0.8, seed=6, static_cache=True),
    "specinfer": dict(tree=Tree.k_ary(2, 2), temperature=0.8, seed=1, method="specinfer"),
    "topk": dict(tree=Tree.k_ary(2, 2), temperature=0.8, seed=1, method="topk"),
    "chain": dict(tree=Tree.chain(3), temperature=0.8, seed=2, method="chain"),
    "copies-greedy": dict(tree=Tree.k_ary(2, 2), copies=True),
    "copies-sampled": dict(tree=Tree.k_ary(2, 2), temperature=0.8, seed=4, copies=True),
    "copies-alone": dict(tree=None, copies=True, prediction=[42, 9, 11, 5, 17]),
}


@pytest.mark.parametrize("setting", SETTINGS.values(), ids=SETTINGS.keys())
def test_engine_logprobs_are_the_targets_own_and_change_no_token(models, setting, monkeypatch):
    target, draft, fresh = models
    # copies are sized by measured step times: without them (the default costs) and on fresh
    # engines (no acceptance learnt before), both runs plan the same trees
    monkeypatch.setattr(StepClock, "observe", lambda *args, **kwargs: None)
    setting = dict(setting)
    options = {"stop_token_ids": [], "static_cache": setting.pop("static_cache", False)}
    plain = SpeculativeEngine(target, draft, **options).generate(PROMPT, max_new_tokens=24, **setting)
    scored = SpeculativeEngine(target, draft, **options).generate(PROMPT, max_new_tokens=24, logprobs=5, **setting)
    assert scored.tokens == plain.tokens and [s.accepted for s in scored.steps] == [s.accepted for s in plain.steps]
    assert all(s.token_logprobs == [] for s in plain.steps), "off: nothing is computed"
    entries = [e for step in scored.steps for e in step.token_logprobs]
    assert all(len(s.token_logprobs) == len(s.committed) for s in scored.steps)
    assert [e.token for e in entries] == scored.tokens
    if setting.get("copies") and not setting.get("temperature"):  # the copied branches were taken
        assert sum(s.accepted_by_source()["copy"] for s in scored.steps) > 0
    scores = reference_scores(fresh, PROMPT, scored.tokens)
    for position, entry in enumerate(entries):
        assert entry.logprob == pytest.approx(scores[position, entry.token].item(), abs=TOLERANCE), position
        assert len(entry.top) == 5
        assert_same_ranking(entry.top, scores[position])


def test_engine_logprobs_count_and_validation(models):
    target, draft, _ = models
    engine = SpeculativeEngine(target, draft, stop_token_ids=[])
    none = engine.generate(PROMPT, max_new_tokens=6, tree=Tree.chain(2), logprobs=0)
    assert all(e.top == [] for s in none.steps for e in s.token_logprobs)
    most = engine.generate(PROMPT, max_new_tokens=6, tree=Tree.chain(2), logprobs=20)
    assert all(len(e.top) == 20 for s in most.steps for e in s.token_logprobs)
    for bad in (-1, 21, 2.0, True, "5"):
        with pytest.raises(InvalidParameterError):
            engine.stream(PROMPT, max_new_tokens=4, logprobs=bad)


def test_a_record_with_logprobs_survives_json(models):
    target, draft, _ = models
    step = SpeculativeEngine(target, draft, stop_token_ids=[]).generate(
        PROMPT, max_new_tokens=4, tree=Tree.chain(2), logprobs=3).steps[0]
    raw = json.loads(json.dumps(step.to_dict()))
    raw.pop("timings")
    again = StepRecord(**raw)
    assert again.token_logprobs == step.token_logprobs and isinstance(again.token_logprobs[0], TokenLogprob)
