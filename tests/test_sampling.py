"""engine.core.sampling's top-p: the top-k shortcut gives the full sort's nucleus exactly."""
from __future__ import annotations

import math

import pytest
import torch

from engine.core.sampling import (NUCLEUS_TIE_BAND, _top_p_filter, compiled, logits_to_probs, top_indices,
                                  torch_logits_to_probs, torch_top_indices)


def full_sort_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The textbook filter: sort everything (equal probabilities in index order: a stable sort),
    keep tokens whose preceding mass is below top_p."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
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
        sort = torch.sort

        def small_sorts_only(values, *args, **kwargs):
            if values.shape[-1] > 64:
                pytest.fail("sorted the whole vocabulary")
            return sort(values, *args, **kwargs)

        patch.setattr(torch, "sort", small_sorts_only)
        out = _top_p_filter(probs, 0.9, candidates=4)
    assert torch.allclose(out[0, :3], torch.tensor([0.5, 0.3, 0.12]) / 0.92) and out[0, 3:].sum() == 0
    assert torch.equal(torch_logits_to_probs(torch.log(probs.clamp(min=1e-30)), 1.0, 0.9), full_sort_nucleus(
        torch.softmax(torch.log(probs.clamp(min=1e-30)), -1), 0.9))


def exact_law(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The softmax both implementations approximate, in float64, of the float32 shifted logits
    ``(x - max) / temperature`` they both compute (the one rounding they share by contract)."""
    z = logits - logits.amax(-1, keepdim=True)
    if temperature > 0:
        z = z / temperature
    return torch.softmax(torch.nan_to_num(z, nan=0.0, neginf=float("-inf")).double(), dim=-1)


def assert_the_nucleus_up_to_the_tie_band(kept: torch.Tensor, exact: torch.Tensor, top_p: float) -> None:
    """``kept [V]`` (bool) is the top-p nucleus of ``exact [V]`` (float64), except for tokens whose
    exact preceding mass lies within :data:`NUCLEUS_TIE_BAND` of top_p (either side is right to a
    float rounding). Ties in probability are broken by index, as both implementations do."""
    values, order = torch.sort(exact, descending=True, stable=True)
    before = torch.empty_like(exact).scatter_(0, order, torch.cumsum(values, 0) - values)
    sure_in, sure_out = before < top_p - NUCLEUS_TIE_BAND, before >= top_p + NUCLEUS_TIE_BAND
    assert bool(kept[sure_in].all()), f"{int((~kept[sure_in]).sum())} tokens of the nucleus dropped"
    assert not bool(kept[sure_out & (exact > 0)].any()), f"{int(kept[sure_out].sum())} tokens past the nucleus kept"


@pytest.mark.parametrize("temperature", [0.0, 0.3, 0.6, 1.0, 1.7])
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_the_compiled_nucleus_and_torchs_are_the_exact_nucleus_to_a_rounding(temperature, top_p):
    """The kernels' one-call softmax and top-p (what the engine runs on CPU) and the torch
    operations (without kernels, and on GPUs) against the exact float64 nucleus: the same tokens
    kept but for the tie band, the same probabilities to a few float roundings, and rows that
    sum to 1. Peaked, middling and flat rows (a flat one at top-p 0.99 keeps 140,000 tokens of
    1e-6 each: a float32 sum of the softmax drifts by tens of them, on some ISAs), a vocabulary
    that is not a multiple of 16, -inf entries."""
    from engine.kernels.build import compiled_kernels

    if compiled_kernels() is None:
        pytest.fail("the kernels did not build: a C++ compiler and ninja are part of the install")
    generator = torch.Generator().manual_seed(int(temperature * 10 + top_p * 100))
    logits = torch.randn(6, 151_933, generator=generator) * torch.tensor([[0.3], [1.0], [3.0], [6.0], [12.0], [2.0]])
    logits[5, ::7] = float("-inf")
    fused = logits_to_probs(logits, temperature, top_p)
    reference = torch_logits_to_probs(logits, temperature, top_p)
    exact = exact_law(logits, temperature)
    for row in range(6):
        for probs in (fused[row], reference[row]):
            assert_the_nucleus_up_to_the_tie_band(probs > 0, exact[row], top_p)
            assert float(probs.double().sum()) == pytest.approx(1.0, abs=1e-6)
        both = (fused[row] > 0) & (reference[row] > 0)
        torch.testing.assert_close(fused[row][both], reference[row][both], rtol=2e-6, atol=1e-12)
        kept_mass = float(exact[row][fused[row] > 0].sum())
        torch.testing.assert_close(fused[row][both].double(), exact[row][both] / kept_mass, rtol=2e-6, atol=1e-12)


# ---- exact ties at the edge of the nucleus: ranked by index, lower first, on every path ----------

def reference_nucleus(logits: list[float], temperature: float, top_p: float) -> list[int]:
    """The rule, in plain float64 Python: the softmax of ``(x - max) / temperature``; tokens ranked
    by probability, descending, and tokens of equal probability by index, ascending; a token is
    kept when the mass ranked before it is below ``top_p``. Returns the kept indices, increasing."""
    top = max(logits)
    weights = [math.exp((x - top) / temperature) for x in logits]
    total = math.fsum(weights)
    probs = [w / total for w in weights]
    kept, before = [], 0.0
    for index in sorted(range(len(probs)), key=lambda i: (-probs[i], i)):
        if before >= top_p:
            break
        kept.append(index)
        before += probs[index]
    return sorted(kept)


# name: (vocabulary, head, tie, tied tokens, rest, tied tokens kept but the first), logits as
# multiples of the temperature: the distinct ``head`` logits and a run of bit-identical ``tie``
# logits at random places, every other token at ``rest`` (bit-identical too); the nucleus ends
# inside the run of ties. Each row is found by another path of the torch filter and the kernel.
TIED_ROWS = {
    "likely": (151_936, [4.0, 3.0, 2.0], 1.0, 12, -30.0, 5),         # ties at p ~ 0.02: among the likely tokens
    "candidates": (151_936, [6.0], -1.6, 2_000, -40.0, 300),         # p ~ 2.5e-4: 2,000 straddle the 1,024th place
    "small-vocabulary": (600, [1.5, 1.0], 0.0, 400, -0.5, 250),      # every token likely: the full sort
    "flat": (151_936, [2.0], 0.0, 120_000, 0.25, 50_000),            # past the candidates: the full sort
}


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("case", list(TIED_ROWS))
def test_exact_ties_at_the_edge_of_the_nucleus_keep_the_lower_indices_on_every_path(case, temperature):
    """Rows where many tokens have bit-identical logits and the nucleus ends half a tied token's
    mass inside their run (outside the tie band, so the kept set is determined): the plain float64
    rule keeps the lower indices of the run; torch's filter (no kernels, GPUs) keeps exactly those,
    bit for bit what a full stable sort keeps; the compiled kernel (when built) keeps the same
    tokens, with torch's probabilities to a few float roundings. Torch's unstable sort and its
    top-k used to keep others (3 rows in 3,005 random ones, all with equal logits at the edge)."""
    vocabulary, head, tie, ties, rest, kept_ties = TIED_ROWS[case]
    places = torch.randperm(vocabulary, generator=torch.Generator().manual_seed(len(case)))
    logits = torch.full((vocabulary,), rest * temperature)
    logits[places[:len(head)]] = torch.tensor(head) * temperature
    tied = places[len(head):len(head) + ties].sort().values.tolist()
    logits[tied] = tie * temperature

    values = logits.tolist()
    top = max(values)
    weights = [math.exp((x - top) / temperature) for x in values]
    total = math.fsum(weights)
    q = weights[tied[0]] / total  # each tied token's probability
    top_p = math.fsum(w for w in weights if w > weights[tied[0]]) / total + (kept_ties + 0.5) * q
    assert q / 2 > NUCLEUS_TIE_BAND and top_p < 1.0

    expected = reference_nucleus(values, temperature, top_p)
    assert sorted(set(expected) & set(tied)) == tied[:kept_ties + 1]  # the rule: the run's lower indices

    torchs = torch_logits_to_probs(logits[None], temperature, top_p)[0]
    assert (torchs > 0).nonzero().flatten().tolist() == expected
    probs = torch.softmax(((logits - logits.max()) / temperature).double(), dim=-1)
    assert torch.equal(_top_p_filter(probs[None], top_p)[0], full_sort_nucleus(probs, top_p))

    fused = compiled("nucleus_probs")
    if fused is not None:
        kernels, finite = fused(logits[None], temperature, top_p)
        assert finite and (kernels[0] > 0).nonzero().flatten().tolist() == expected
        torch.testing.assert_close(kernels[0], torchs, rtol=2e-6, atol=1e-12)


def test_exact_ties_across_the_kth_place_rank_by_index_on_every_path():
    """``top_indices``' torch path (no kernels, GPUs) and the compiled one against the rule: the
    k largest values, equal ones in index order, lower first, also where a run of equal values
    straddles the k-th place (``topk`` alone picks among them and orders them as it likes)."""
    generator = torch.Generator().manual_seed(7)
    rows = torch.randn(4, 151_936, generator=generator)
    for row, (top, ties) in zip(rows, [(30.0, 40), (20.0, 3), (30.0, 151_936), (30.0, 40)]):
        row[torch.randperm(151_936, generator=generator)[:ties]] = top
    rows[1, 9] = 25.0  # one larger value before the run
    rows[3, 0] = float("nan")  # a row with a NaN is torch.topk's (NaN the largest) on every path
    ranked = [sorted(range(151_936), key=lambda i: (-row[i], i))[:64] for row in rows[:3].tolist()]
    for k in (1, 2, 3, 8, 40, 64):
        expected = [row[:k] for row in ranked]
        assert torch_top_indices(rows[:3], k) == expected
        assert top_indices(rows[:3], k) == expected  # compiled where the kernels are built
        nan_row = [0] if k == 1 else torch.topk(rows[3], k).indices.tolist()
        assert torch_top_indices(rows, k)[3] == top_indices(rows, k)[3] == nan_row


def test_a_temperature_below_floats_range_puts_all_mass_on_the_top_logits():
    """1e-50 (the API takes it) is a float32 zero: the kernels must not read it as temperature 1."""
    logits = torch.tensor([[0.5, 2.0, 1.0, 2.0, -1.0], [3.0, 1.0, 0.0, 0.0, 0.0]])
    for top_p in (0.9, 0.999):
        for temperature in (1e-50, 1e-46, 1e-40):
            for probs in (logits_to_probs(logits, temperature, top_p), torch_logits_to_probs(logits, temperature, top_p)):
                assert torch.equal(probs[1], torch.tensor([1.0, 0, 0, 0, 0]))
                assert probs[0, 1] > 0 and probs[0, [0, 2, 4]].sum() == 0


def test_a_row_without_mass_cannot_be_drawn_from():
    """An all-zero (or NaN) row used to loop forever in sample_token; now it raises."""
    from engine.core.sampling import sample_token
    from engine.errors import InvalidDistributionError

    for bad in (torch.zeros(50), torch.full((50,), float("nan"))):
        with pytest.raises(InvalidDistributionError, match="mass"):
            sample_token(bad, torch.Generator().manual_seed(0))
        with pytest.raises(InvalidDistributionError, match="mass"):
            sample_token(bad, torch.Generator().manual_seed(0), cdf=torch.cumsum(bad, 0, dtype=torch.float64))


def test_the_compiled_nucleus_refuses_non_finite_logits():
    from engine.kernels.build import compiled_kernels
    from engine.core.sampling import compiled
    from engine.errors import InvalidDistributionError

    assert compiled_kernels() is not None and compiled("nucleus_probs") is compiled_kernels().nucleus_probs  # sampling looks them up
    for bad in (float("nan"), float("inf")):
        logits = torch.zeros(2, 100)
        logits[1, 17] = bad
        with pytest.raises(InvalidDistributionError):
            logits_to_probs(logits, 0.6, 0.9)


def test_sampling_keeps_only_what_the_engine_uses():
    """No dead entry points: the engine samples through sample_children / choose_children and the
    verifiers; top-k filtering of the target's law is not a parameter of this project."""
    import inspect

    import engine.core.sampling as sampling
    assert not hasattr(sampling, "sample")  # tokens are drawn by sample_token and sample_children
    assert "top_k" not in inspect.signature(logits_to_probs).parameters


# ---- drawing tokens: the CDF inversion and the rejection draws without replacement -------------------

DRAWS = 40_000


def _ordered_law(q: list[float], count: int) -> dict[tuple[int, ...], float]:
    """Exact law of ``count`` ordered draws without replacement from ``q``."""
    import itertools

    law = {}
    for seq in itertools.permutations(range(len(q)), count):
        prob, left = 1.0, 1.0
        for x in seq:
            prob, left = prob * q[x] / left, left - q[x]
        law[seq] = prob
    return law


def test_the_compiled_draw_picks_the_token_the_cumsum_picks():
    """``draw_index`` (the CPU path of sample_token) against torch's float64 prefix sums and
    searchsorted, for the same uniforms: the same token every time, over sparse nuclei, dense
    rows, tiny masses and uniforms at the ends."""
    from engine.kernels.build import compiled_kernels

    extension = compiled_kernels()
    if extension is None:
        pytest.fail("the kernels did not build: a C++ compiler and ninja are part of the install")
    generator = torch.Generator().manual_seed(11)
    rows = [logits_to_probs(torch.randn(151_936, generator=generator) * scale, 0.6, top_p)
            for scale, top_p in ((4.0, 0.9), (1.0, 1.0), (12.0, 0.5))]
    rows.append(torch.tensor([0.0, 1e-30, 0.0, 3e-8, 0.5, 0.0]))
    checked = 0
    for row in rows:
        cdf = torch.cumsum(row, dim=-1, dtype=torch.float64)
        for u01 in torch.cat([torch.rand(300, generator=generator, dtype=torch.float64),
                              torch.tensor([0.0, 1e-300, 0.5, 1 - 2 ** -53], dtype=torch.float64)]).tolist():
            expected = int(torch.searchsorted(cdf, torch.tensor([u01], dtype=torch.float64) * cdf[-1], right=True))
            assert extension.draw_index(row, u01) == (expected if expected < row.shape[0] else -1)
            checked += 1
    assert checked == 4 * 304


def test_the_compiled_ranking_is_torchs_argmax_and_topk_with_ties_in_index_order():
    """``top_indices`` (greedy verification's argmax, the draft's top-k children) against torch on
    vocabulary-sized rows of every kind: distinct values give topk's indices; k = 1 is argmax's
    first maximum; equal values come in index order; a NaN row falls back to torch's argmax."""
    from engine.kernels.build import compiled_kernels
    from engine.core.sampling import compiled, top_indices

    extension = compiled_kernels()
    if extension is None:
        pytest.fail("the kernels did not build: a C++ compiler and ninja are part of the install")
    assert compiled("top_indices") is extension.top_indices
    generator = torch.Generator().manual_seed(5)
    rows = torch.randn(4, 151_936, generator=generator) * torch.tensor([[0.1], [1.0], [4.0], [30.0]])
    rows[3, -7:] = 1e4 + torch.arange(7.0)  # the largest values at the very end
    for k in (1, 2, 3, 8, 64):
        assert top_indices(rows, k) == torch.topk(rows, k, dim=-1).indices.tolist()
    assert [row[0] for row in top_indices(rows, 1)] == rows.argmax(dim=-1).tolist()
    assert top_indices(torch.softmax(rows, dim=-1), 2) == torch.topk(rows, 2, dim=-1).indices.tolist()

    ties = torch.zeros(3, 1000)
    ties[0, [40, 7, 500]] = 2.0
    ties[1, 999] = -1.0
    ties[2] = float("-inf")
    assert top_indices(ties, 4) == [[7, 40, 500, 0], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert [row[0] for row in top_indices(ties, 1)] == ties.argmax(dim=-1).tolist()
    assert extension.top_indices(ties[:1, :5], 5).tolist() == [[0, 1, 2, 3, 4]]  # shorter than a vector

    broken = torch.randn(2, 300, generator=generator)
    broken[1, 200] = float("nan")
    assert extension.top_indices(broken, 1)[1, 0] == -1
    assert top_indices(broken, 1) == broken.argmax(dim=-1, keepdim=True).tolist()  # torch's NaN-is-max


@pytest.mark.parametrize("q", [[0.4, 0.3, 0.2, 0.1, 0.0], [0.97, 0.02, 0.006, 0.004, 0.0]],
                         ids=["spread", "one-token-holds-97pc"])  # the second needs the mass-removal fallback
def test_children_without_replacement_follow_the_sequential_law(q):
    """Thresholds: chi-square p > 1e-3 over cells with expected count >= 5, total variation < 0.01,
    with 40,000 draws of 3 ordered children; the zero-probability token is never drawn."""
    from collections import Counter

    from scipy.stats import chisquare

    from engine.core.sampling import sample_children

    generator = torch.Generator().manual_seed(11)
    probs = torch.tensor(q, dtype=torch.float32)
    seen = Counter(tuple(sample_children(probs, 3, True, generator).tolist()) for _ in range(DRAWS))
    law = _ordered_law(q, 3)
    assert all(4 not in seq and len(set(seq)) == 3 for seq in seen)
    cells = [seq for seq, prob in law.items() if prob * DRAWS >= 5]
    observed = [seen[seq] for seq in cells] + [DRAWS - sum(seen[seq] for seq in cells)]
    expected = [law[seq] * DRAWS for seq in cells] + [DRAWS * (1 - sum(law[seq] for seq in cells))]
    if expected[-1] < 1e-9:
        observed, expected = observed[:-1], expected[:-1]
    assert chisquare(observed, expected).pvalue > 1e-3
    assert 0.5 * sum(abs(seen[seq] / DRAWS - prob) for seq, prob in law.items()) < 0.01


def test_sample_token_follows_q_and_never_draws_a_zero():
    """Thresholds: chi-square p > 1e-3 over 40,000 draws; zero-probability tokens (first, middle,
    last) never come out; a single-token support always gives that token."""
    from collections import Counter

    from scipy.stats import chisquare

    from engine.core.sampling import sample_token

    generator = torch.Generator().manual_seed(5)
    q = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.125, 0.125, 0.0])
    seen = Counter(sample_token(q, generator) for _ in range(DRAWS))
    assert set(seen) == {1, 3, 4, 5}
    assert chisquare([seen[x] for x in (1, 3, 4, 5)], [DRAWS * float(q[x]) for x in (1, 3, 4, 5)]).pvalue > 1e-3
    one_hot = torch.zeros(151936)
    one_hot[-1] = 1.0
    assert {sample_token(one_hot, generator) for _ in range(50)} == {151935}


def test_with_replacement_children_repeat_and_support_caps_distinct_children():
    from engine.core.sampling import sample_children

    generator = torch.Generator().manual_seed(2)
    q = torch.tensor([0.0, 0.9, 0.1])
    assert sorted(sample_children(q, 5, True, generator).tolist()) == [1, 2]  # only two tokens have mass
    repeats = sample_children(q, 6, False, generator).tolist()
    assert len(repeats) == 6 and set(repeats) <= {1, 2} and repeats.count(1) >= 2


def test_a_row_of_minus_infinity_is_uniform_and_other_rows_are_untouched():
    """A row with no finite logit (every token masked) is taken as uniform at T > 0, as before the
    shift-and-scale became one pass; a row beside it keeps its own softmax, -inf entries at 0."""
    logits = torch.tensor([[float("-inf")] * 4, [0.0, 1.0, float("-inf"), 2.0]])
    expected = torch.softmax(torch.tensor([0.0, 1.0, float("-inf"), 2.0]) / 0.7, dim=-1)
    for probs in (logits_to_probs(logits, temperature=0.7), logits_to_probs(logits, 0.7, 0.999)):
        assert torch.equal(probs[0], torch.full((4,), 0.25))
        torch.testing.assert_close(probs[1], expected, rtol=1e-6, atol=0)
        assert probs[1, 2] == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), -1e-3])
def test_the_verifiers_check_refuses_every_kind_of_broken_row(bad):
    from engine.core.verify import check_distributions
    from engine.errors import InvalidDistributionError

    probs = torch.full((3, 8), 1 / 8)
    check_distributions(probs)
    for row in range(3):
        broken = probs.clone()
        broken[row, 5] = bad
        with pytest.raises(InvalidDistributionError):
            check_distributions(broken)
    with pytest.raises(InvalidDistributionError):
        check_distributions(torch.zeros(2, 8))


def test_a_process_samples_through_the_same_functions_from_its_first_draw():
    """The compiled kernels are looked up at the first draw, not when an int4 model happens to load
    them: before, a process drew with torch's functions until then and with the kernels after, so
    the same seed drew differently mid-process. In a fresh interpreter: the first top-p law already
    comes from the kernels, and the same seeds draw the same tokens after a k-quant model loads."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = """
import torch
from engine.core.sampling import COMPILED, logits_to_probs, sample_token
assert not COMPILED
logits = torch.randn(3, 151_936, generator=torch.Generator().manual_seed(3)) * 2

def draws():
    probs = logits_to_probs(logits, 0.8, 0.95)
    return [sample_token(probs[r], torch.Generator().manual_seed(s)) for r in range(3) for s in range(30)]

first = draws()
from engine.kernels.build import compiled_kernels
assert compiled_kernels() is not None and COMPILED["nucleus_probs"] is compiled_kernels().nucleus_probs
from engine.backends.kquant_model import kquant_model
import tiny_models as tm
kquant_model(tm.qwen2(seed=1, vocab_size=64, hidden_size=256, layers=1))
assert draws() == first
print("same draws")
"""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'tests'}"}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0 and "same draws" in out.stdout, out.stderr[-2000:]
