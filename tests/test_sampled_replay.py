"""The sampled replay simulates engine steps with the engine's own law (tiny models, vocab 16).

Two-sample chi-square on the tokens committed by the first step: the engine's
``SpeculativeEngine.stream`` against ``sampled_tokens_per_step`` from the same context, 3,000
seeds each; p-value > 1e-3. A walk that ignored rejections of lower-ranked children (accepting
only first children) must fail the same comparison.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

import tests.tiny_models as tm
from engine import SpeculativeEngine, Tree
from engine.core.speculative import forward
from engine.tuning.sampled_replay import ContextOracle, Setting, replay_sequence
from tests.test_engine_sampling import sharpened

VOCAB = 16
PROMPT = [3, 1, 4, 1, 5, 9, 2]
SEEDS = 3000
# one worker for the module under xdist: the engine's counts are memoised for the test that reuses them
pytestmark = pytest.mark.xdist_group("sampled-replay")


@pytest.fixture(scope="module")
def pair():
    target = sharpened(tm.qwen2(seed=7, vocab_size=VOCAB, hidden_size=32, layers=1), 6.0)
    draft = tm.perturbed(target, 0.08, seed=3)
    return target, draft


_ENGINE_COUNTS: dict[int, np.ndarray] = {}


def engine_counts(pair, setting: Setting) -> np.ndarray:
    """Tokens committed by the engine's first step, histogram over ``SEEDS`` seeds (memoised)."""
    if id(setting) in _ENGINE_COUNTS:
        return _ENGINE_COUNTS[id(setting)]
    engine = SpeculativeEngine(*pair, stop_token_ids=[])
    counts = np.zeros(setting.tree.depth + 2, dtype=int)
    for seed in range(SEEDS):
        step = next(engine.stream(PROMPT, max_new_tokens=setting.tree.depth + 1, temperature=setting.temperature,
                                  top_p=setting.top_p, tree=setting.tree, seed=seed, method=setting.method, copies=False))
        counts[len(step.committed)] += 1
    _ENGINE_COUNTS[id(setting)] = counts
    return counts


def chi2_p_value(a: np.ndarray, b: np.ndarray) -> float:
    table = np.stack([a, b])
    table = table[:, table.sum(axis=0) > 0]
    assert table.shape[1] >= 2, f"degenerate step law {table}: the test models accept too much or too little"
    return chi2_contingency(table)[1]


def replay_counts(pair, settings: list[Setting]) -> list[np.ndarray]:
    per_setting = replay_sequence(*pair, PROMPT, [len(PROMPT) - 1], settings, range(SEEDS))
    return [np.bincount([len(w) + 1 for w in walks], minlength=s.tree.depth + 2)
            for walks, s in zip(per_setting, settings)]


SETTINGS = [
    Setting(Tree.from_parents([-1, 0, 0, 0, 1, 1, 2, 4]), "sequoia", 0.8, 1.0),
    Setting(Tree.k_independent(3, 2), "specinfer", 1.0, 0.9),
    Setting(Tree.k_ary(3, 2), "topk", 0.6, 1.0),
    Setting(Tree.chain(3), "chain", 0.7, 0.8),
]


@pytest.fixture(scope="module")
def replayed(pair):
    return replay_counts(pair, SETTINGS)


@pytest.mark.parametrize("index", range(len(SETTINGS)), ids=[s.method for s in SETTINGS])
def test_replay_matches_engine_step_law(pair, replayed, index):
    engine = engine_counts(pair, SETTINGS[index])
    p_value = chi2_p_value(engine, replayed[index])
    assert p_value > 1e-3, f"engine {engine} vs replay {replayed[index]}: p = {p_value:.2g}"


def test_wrong_walk_is_detected(pair):
    """Replaying the sequoia tree as a chain (first children only) shifts the law detectably."""
    setting = SETTINGS[0]
    wrong = replay_counts(pair, [Setting(Tree.chain(setting.tree.depth), "sequoia", setting.temperature)])[0]
    engine = engine_counts(pair, setting)
    assert chi2_p_value(engine, wrong) < 1e-3, f"engine {engine} vs first-children walk {wrong}"


def test_oracle_logits_equal_causal_forward(pair):
    target, draft = pair
    from transformers import DynamicCache
    root = len(PROMPT) - 1
    caches = []
    for model in pair:
        cache = DynamicCache(config=model.config)
        forward(model, cache, PROMPT[:root], start=0)
        caches.append(cache)
    oracle = ContextOracle(target, draft, *caches, root_pos=root, root_token=PROMPT[root])
    paths = [(), (2,), (7,), (2, 5), (7, 1), (2, 5, 11)]
    oracle.evaluate(paths[:3])
    oracle.evaluate(paths[3:])  # second round: parents already in the caches
    with torch.inference_mode():
        for path in paths:
            ids = torch.tensor([PROMPT + list(path)])
            for model, got in zip(pair, oracle.logits[path]):
                want = model(ids).logits[0, -1].float()
                assert torch.allclose(got, want, atol=1e-4), (path, (got - want).abs().max())


def test_bench_trees_sampled_report_runs_end_to_end(pair, tmp_path):
    """The benchmark's sampled part on tiny models: every row present, tokens/step in range, plot written."""
    from bench.trees import SampledPlan, plot, sampled_measurements
    sequences = [(len(PROMPT), PROMPT + [2, 6, 5, 3, 5, 8, 9, 7])] * 2
    sampled = sampled_measurements(*pair, sequences[:1], sequences[1:],
                                   SampledPlan(sizes=(2, 4, 8), scalability_setting=(0.6, 1.0),
                                               grid=[(0.6, 1.0), (1.0, 0.8)], robust_size=6, roots=3, seeds=2, k=8))
    assert [r["size"] for r in sampled["scalability"]] == [2, 4, 8]
    assert len(sampled["robustness"]) == 2 and sampled["steps_per_point"] == 3 * 2
    for row in sampled["scalability"]:
        assert 1.0 <= row["sequoia"] <= row["sequoia_depth"] + 1 and row["k_chains_k"] in (1, 2, 4, 8)
    assert all(0 < sum(v) <= 1 + 1e-9 and min(v) >= 0 for v in sampled["acceptance"].values())
    greedy = [{"size": n, "sequoia": 1.5, "sequoia_predicted": 1.6, "k_chains": 1.4, "binary": 1.3} for n in (2, 4)]
    plot({"greedy": greedy, "sampled": sampled}, tmp_path / "trees.html")
    assert "specinfer" in (tmp_path / "trees.html").read_text()
