"""End to end: ``SpeculativeEngine.generate`` at temperature > 0 samples the target's own law.

Tiny random models (vocabulary 16) built in code; the exact joint law of the first two new
tokens, ``p(x1 | prompt) * p(x2 | prompt, x1)``, is computed by enumerating the target. Thresholds
as in ``test_verify_stats``: chi-square p-value > 1e-3 and total variation under the bound that
exact sampling itself keeps with probability 0.9999 at the same count (``tv_bound``), 6,000 samples.
"""
from __future__ import annotations

import numpy as np
import pytest
import test_app_support as support
import tiny_models as tm
import torch
from test_verify_stats import P_MIN, assert_exact

from engine import SpeculativeEngine, Tree
from engine.core.sampling import logits_to_probs

VOCAB = 16
PROMPT = [3, 1, 4, 1, 5]
SAMPLES = 6_000


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    yield from support.one_torch_thread()


def sharpened(model: torch.nn.Module, factor: float) -> torch.nn.Module:
    """Scale the output head so the law has a few likely tokens. With 256 cells, a flat law's
    sampling noise alone would put the total variation near 0.03 at 20,000 samples; factor 30
    brings the expected noise to about 0.01 and 0.006 for the two cases below."""
    with torch.no_grad():
        model.lm_head.weight.mul_(factor)
    return model


@pytest.fixture(scope="module")
def pair():
    target = sharpened(tm.qwen2(seed=4, vocab_size=VOCAB, hidden_size=32, layers=1), 30.0)
    draft = tm.perturbed(target, 0.05, seed=1)
    return target, draft


def exact_joint(target: torch.nn.Module, temperature: float, top_p: float) -> np.ndarray:
    with torch.inference_mode():
        first = target(torch.tensor([PROMPT])).logits[0, -1]
        p1 = logits_to_probs(first, temperature, top_p).double()
        joint = np.zeros((VOCAB, VOCAB))
        for a in range(VOCAB):
            second = target(torch.tensor([PROMPT + [a]])).logits[0, -1]
            joint[a] = (p1[a] * logits_to_probs(second, temperature, top_p).double()).numpy()
    return joint


@pytest.mark.parametrize("method,tree,temperature,top_p", [
    ("sequoia", Tree.k_ary(2, 2), 0.7, 1.0),
    ("specinfer", Tree.k_independent(2, 2), 1.0, 0.8),
])
def test_generate_samples_the_targets_joint_law(pair, method, tree, temperature, top_p):
    target, draft = pair
    exact = exact_joint(target, temperature, top_p)
    assert (exact > 0.01).sum() >= 4, "degenerate target: the test would be vacuous"
    engine = SpeculativeEngine(target, draft, stop_token_ids=[])
    counts = np.zeros((VOCAB, VOCAB))
    accepted = 0
    for seed in range(SAMPLES):
        result = engine.generate(PROMPT, max_new_tokens=2, temperature=temperature, top_p=top_p, tree=tree,
                                 seed=seed, method=method)
        counts[result.tokens[0], result.tokens[1]] += 1
        accepted += result.steps[0].accepted_draft_tokens
    assert_exact(counts, exact)
    assert accepted > SAMPLES // 10, "the draft was almost never accepted: the test would not exercise the verifier"


def test_same_seed_same_sample(pair):
    target, draft = pair
    engine = SpeculativeEngine(target, draft, stop_token_ids=[])
    runs = [engine.generate(PROMPT, max_new_tokens=12, temperature=1.0, tree=Tree.k_ary(2, 2), seed=7).tokens
            for _ in range(2)]
    other = engine.generate(PROMPT, max_new_tokens=12, temperature=1.0, tree=Tree.k_ary(2, 2), seed=8).tokens
    assert runs[0] == runs[1]
    assert other != runs[0]


PIT_TOKENS, PIT_SAMPLES = 6, 600


def pit_values(target: torch.nn.Module, tokens: list[int], temperature: float, top_p: float,
               generator: torch.Generator) -> list[float]:
    """Randomised probability integral transform of each new token under the target's own law given
    everything before it: ``F(x - 1) + V p(x)`` with V uniform. For an exact sampler these are
    independent uniforms on [0, 1], whatever the step boundaries were."""
    with torch.inference_mode():
        logits = target(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1:-1]
    probs = logits_to_probs(logits, temperature, top_p).double()
    below = torch.cumsum(probs, dim=-1) - probs
    rows = torch.arange(len(tokens))
    chosen = torch.tensor(tokens)
    v = torch.rand(len(tokens), generator=generator, dtype=torch.float64)
    return (below[rows, chosen] + v * probs[rows, chosen]).tolist()


# Each method with the static and the dynamic runner. The dynamic runner's whole 2-ary sequoia tree
# at 0.7 / 0.8, its whole 2-ary top-k tree at 1.0 and its chain at 0.7 / 0.8 run below, in the
# trees that growth cuts (whole trees must occur there too), and again in tests/test_copies.py and
# tests/test_draft_vocabulary.py, so they are not repeated here.
@pytest.mark.parametrize("method,tree,temperature,top_p,static", [
    ("sequoia", Tree.optimal([0.6, 0.2, 0.1], 8, 3), 1.0, 1.0, True),
    # written with cousins out of parent order, three levels deep: renumbered canonically
    ("sequoia", Tree.from_parents([-1, 0, 0, 2, 1, 3, 4]), 1.0, 1.0, False),
    ("specinfer", Tree.k_independent(2, 2), 0.7, 0.8, True),
    ("specinfer", Tree.k_ary(2, 2), 1.0, 1.0, False),
    ("chain", Tree.chain(2), 1.0, 1.0, True),
    ("topk", Tree.k_ary(3, 2), 0.7, 0.8, True),
    ("autoregressive", None, 0.7, 0.8, True),
], ids=lambda v: "static" if v is True else "dynamic" if v is False else None)
def test_six_token_answers_follow_the_targets_law(pair, method, tree, temperature, top_p, static):
    """Every method, top-p < 1 and 1, the dynamic and the static runner: 600 answers of 6 tokens
    (so tokens after a sampled step, and steps after a rejection, count). Kolmogorov-Smirnov test
    of the 3,600 transformed values against the uniform law: p-value > 1e-3."""
    from scipy.stats import kstest

    target, draft = pair
    engine = SpeculativeEngine(target, draft, stop_token_ids=[], static_cache=static)
    generator = torch.Generator().manual_seed(123)
    values, steps, accepted = [], 0, 0
    for seed in range(PIT_SAMPLES):
        result = engine.generate(PROMPT, max_new_tokens=PIT_TOKENS, temperature=temperature, top_p=top_p,
                                 tree=tree, seed=seed, method=method)
        assert len(result.tokens) == PIT_TOKENS
        values += pit_values(target, result.tokens, temperature, top_p, generator)
        steps += len(result.steps)
        accepted += sum(step.accepted_draft_tokens for step in result.steps)
    p_value = kstest(values, "uniform").pvalue
    assert p_value > P_MIN, f"KS p-value {p_value:.2e}"
    if method != "autoregressive":
        assert accepted > PIT_SAMPLES // 2 and steps < PIT_SAMPLES * PIT_TOKENS, "the verifier was barely exercised"


@pytest.mark.parametrize("method,tree,temperature,top_p,confidence", [
    ("sequoia", Tree.k_ary(2, 2), 0.7, 0.8, 0.5),
    ("sequoia", Tree.optimal([0.6, 0.2, 0.1], 8, 3), 1.0, 1.0, 0.3),
    ("specinfer", Tree.k_independent(2, 3), 1.0, 1.0, 0.4),
    ("chain", Tree.chain(4), 0.7, 0.8, 0.6),
    ("topk", Tree.k_ary(2, 2), 1.0, 1.0, 0.2),
])
def test_six_token_answers_follow_the_targets_law_when_growth_stops_early(pair, method, tree, temperature, top_p,
                                                                          confidence):
    """Trees cut below nodes whose draft path confidence is under ``confidence``: the cut depends on
    the draft alone, so the law stays the target's. Same KS test and threshold as above, and both
    whole and cut trees must occur."""
    from scipy.stats import kstest

    target, draft = pair
    engine = SpeculativeEngine(target, draft, stop_token_ids=[])
    generator = torch.Generator().manual_seed(77)
    values, sizes = [], set()
    for seed in range(PIT_SAMPLES):
        result = engine.generate(PROMPT, max_new_tokens=PIT_TOKENS, temperature=temperature, top_p=top_p,
                                 tree=tree, seed=seed, method=method, confidence=confidence)
        values += pit_values(target, result.tokens, temperature, top_p, generator)
        sizes.update(len(step.tokens) for step in result.steps)
    assert kstest(values, "uniform").pvalue > P_MIN
    assert tree.size in sizes and min(sizes) < tree.size, sorted(sizes)


def test_the_six_token_test_catches_a_biased_sampler(pair):
    """The same transform on answers drawn at the wrong temperature fails the same threshold."""
    from scipy.stats import kstest

    target, draft = pair
    engine = SpeculativeEngine(target, draft, stop_token_ids=[])
    generator = torch.Generator().manual_seed(5)
    values = []
    for seed in range(PIT_SAMPLES):
        tokens = engine.generate(PROMPT, max_new_tokens=PIT_TOKENS, temperature=0.9, tree=Tree.k_ary(2, 2),
                                 seed=seed).tokens
        values += pit_values(target, tokens, 0.7, 1.0, generator)
    assert kstest(values, "uniform").pvalue < P_MIN


@pytest.fixture(scope="module")
def q4k_pair():
    """A tiny target in the k-quant format (its layers quantised to Q4_K, batch-invariant kernels)
    and a float draft near it: the int4 target's own law is what sampling must follow."""
    from engine.backends.kquant_model import kquant_model

    float_target = sharpened(tm.qwen2(seed=4, vocab_size=VOCAB, hidden_size=256, layers=1), 30.0)
    return kquant_model(float_target), tm.perturbed(float_target, 0.05, seed=1)


@pytest.mark.parametrize("method,tree,temperature,top_p", [
    ("sequoia", Tree.k_ary(2, 2), 0.7, 0.8),
    ("chain", Tree.chain(3), 1.0, 1.0),
])
def test_six_token_answers_of_the_int4_target_follow_its_law(q4k_pair, method, tree, temperature, top_p):
    """The k-quant target format, same KS test and threshold as above."""
    from scipy.stats import kstest

    target, draft = q4k_pair
    engine = SpeculativeEngine(target, draft, stop_token_ids=[])
    generator = torch.Generator().manual_seed(321)
    values = []
    for seed in range(PIT_SAMPLES):
        tokens = engine.generate(PROMPT, max_new_tokens=PIT_TOKENS, temperature=temperature, top_p=top_p,
                                 tree=tree, seed=seed, method=method).tokens
        values += pit_values(target, tokens, temperature, top_p, generator)
    assert kstest(values, "uniform").pvalue > P_MIN
