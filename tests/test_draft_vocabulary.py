"""A draft whose head computes a sub-vocabulary (:mod:`engine.backends.draft_vocabulary`): the kept
rows are the full head's bits, every other token is -inf, the model it came from is untouched,
and the engine stays exact with it (greedy: the target's own decoding; sampling: the target's
law, by the KS test of ``test_engine_sampling``)."""
from __future__ import annotations

import copy

import pytest
import test_app_support as support
import tiny_models as tm
import torch
from test_engine_sampling import PIT_SAMPLES, PIT_TOKENS, PROMPT, pit_values, sharpened
from test_kquant import packed, random_blocks
from test_verify_stats import P_MIN

from engine import SpeculativeEngine, Tree
from engine.backends.draft_vocabulary import SubVocabularyHead, ascii_token_ids, kept_count, with_draft_vocabulary
from engine.core.step import draft_for_prompt
from engine.backends.kquant import KQuantLinear, select_outputs, unpack_weight
from engine.backends.kquant_model import kquant_model
from engine.core.runner import DynamicRunner
from engine.errors import InvalidParameterError
from engine.kernels.build import kernels_available
from engine.models.prompts import encode_chat
from engine.models.loading import restrict_draft


@pytest.fixture(scope="module", autouse=True)
def compiled_and_single_thread():
    if not kernels_available():
        pytest.fail("the k-quant kernels did not build: a C++ compiler and ninja are part of the install")
    yield from support.one_torch_thread()


@pytest.mark.parametrize("kind,in_features", [("q4k", 512), ("q4k", 896), ("q6k", 512)])
def test_selected_outputs_are_the_same_blocks_retiled(kind, in_features):
    """Any 16 rows, in any order, of a packed weight (896 inputs: the stored half super-block)."""
    full = KQuantLinear(kind, packed(kind, random_blocks(kind, 64, -(-in_features // 256) * 256, seed=3)),
                        in_features, 64)
    rows = torch.tensor([5, 0, 17, 63, 40, 41, 2, 9, 10, 11, 12, 13, 14, 15, 33, 34])
    part = KQuantLinear(kind, select_outputs(kind, full.packed(), 64, rows), in_features, 16)
    assert torch.equal(unpack_weight(kind, part.packed(), 16, part.padded_in),
                       unpack_weight(kind, full.packed(), 64, full.padded_in)[rows])
    x = torch.randn(3, in_features)
    assert torch.equal(part(x), full(x)[:, rows])
    with pytest.raises(ValueError, match="tiles of 16"):
        select_outputs(kind, full.packed(), 64, rows[:10])


def test_ascii_tokens_of_a_byte_level_vocabulary():
    vocabulary = {"def": 0, "\u0120world": 1, "\u010a": 2, "\u00e4\u00bd\u0142": 3, "caf\u00c3\u00a9": 4, "{}": 5}
    assert sorted(ascii_token_ids(vocabulary)) == [0, 1, 2, 5]  # a space, a newline; not CJK, not é


def test_the_restricted_head_keeps_the_full_heads_bits_and_leaves_the_draft_alone():
    draft = kquant_model(tm.qwen2(seed=8, vocab_size=64, hidden_size=128, layers=1))
    head, lean = draft.lm_head, draft.__dict__["lean_forward"]
    restricted = with_draft_vocabulary(draft, [1, 2, 3, 40, 63, 99, -1])  # ids outside the vocabulary ignored
    assert draft.lm_head is head and lean.lm_head is head, "the draft it came from changed"
    assert isinstance(restricted.lm_head, SubVocabularyHead) and kept_count(restricted) == 5
    assert restricted.__dict__["lean_forward"].lm_head is restricted.lm_head
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    with torch.inference_mode():
        full = DynamicRunner(draft).forward(ids, 0)
        lean_logits = DynamicRunner(restricted).forward(ids, 0)
        own_logits = restricted(torch.tensor([ids])).logits[0]  # transformers' forward takes the same head
    kept = torch.tensor([1, 2, 3, 40, 63])
    outside = torch.ones(64, dtype=torch.bool)
    outside[kept] = False
    for logits in (lean_logits, own_logits):
        assert torch.equal(logits[:, kept], full[:, kept])
        assert bool((logits[:, outside] == float("-inf")).all())
    assert kept_count(with_draft_vocabulary(restricted, range(64))) == 64  # all ids: the whole head again
    with pytest.raises(ValueError, match="at least one"):
        with_draft_vocabulary(draft, [])


def test_restrict_draft_takes_auto_zero_or_a_count_and_refuses_anything_else():
    draft = kquant_model(tm.qwen2(seed=8, vocab_size=64, hidden_size=128, layers=1))

    class Tokenizer:
        added_tokens_decoder = {60: "<|im_end|>"}

    assert restrict_draft(draft, "some/model", Tokenizer(), "auto") is draft  # only the embedded draft
    assert restrict_draft(draft, "some/model", Tokenizer(), 0) is draft
    assert restrict_draft(draft, "some/model", Tokenizer(), "16").lm_head.kept.tolist() == [*range(16), 60]
    with pytest.raises(InvalidParameterError, match="count of token ids"):
        restrict_draft(draft, "some/model", Tokenizer(), "-3")
    with pytest.raises(InvalidParameterError, match="k-quant draft"):
        restrict_draft(tm.qwen2(seed=8, vocab_size=64), "some/model", Tokenizer(), 16)


KEPT = 24  # the tiny restricted draft can propose tokens 0..23 of 32


def restricted_pair(vocab: int = 32, kept: int = KEPT):
    """A tiny target, its float original, and a k-quant draft near it that can only propose
    ``kept`` of the ``vocab`` tokens."""
    float_target = sharpened(tm.qwen2(seed=6, vocab_size=vocab, hidden_size=256, layers=1), 6.0)
    draft = kquant_model(tm.perturbed(float_target, 0.05, seed=1))
    return float_target, with_draft_vocabulary(draft, range(kept))


@pytest.mark.parametrize("tree", [Tree.chain(3), Tree.k_ary(2, 2)], ids=["chain3", "2ary2"])
def test_greedy_with_a_restricted_draft_is_the_targets_own_decoding(tree):
    target, draft = restricted_pair()
    reference = copy.deepcopy(target)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    with torch.inference_mode():
        ref = reference.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    assert any(token >= KEPT for token in ref), "the reference never needs a token the draft cannot propose"
    engine = SpeculativeEngine(target, draft)
    assert engine.generate(prompt, max_new_tokens=24, temperature=0.0, tree=tree, stop_token_ids=[], copies=False).tokens == ref


@pytest.mark.parametrize("method,tree,temperature,top_p", [
    ("sequoia", Tree.k_ary(2, 2), 0.7, 0.8),
    ("chain", Tree.chain(3), 1.0, 1.0),
])
def test_answers_with_a_restricted_draft_follow_the_targets_law(method, tree, temperature, top_p):
    """600 answers of 6 tokens; Kolmogorov-Smirnov test of the target's randomised PIT values
    against the uniform law, p-value > 1e-3 (as ``test_engine_sampling``). Tokens the draft
    cannot propose must be sampled (through the residual), and drafts accepted: over 150 in all
    (this perturbed draft gets about 190 accepted at T = 0.7)."""
    from scipy.stats import kstest

    target, draft = restricted_pair()
    engine = SpeculativeEngine(target, draft, stop_token_ids=[])
    generator = torch.Generator().manual_seed(99)
    values, outside, accepted = [], 0, 0
    for seed in range(PIT_SAMPLES):
        result = engine.generate(PROMPT, max_new_tokens=PIT_TOKENS, temperature=temperature, top_p=top_p,
                                 tree=tree, seed=seed, method=method, copies=False)
        values += pit_values(target, result.tokens, temperature, top_p, generator)
        outside += sum(token >= KEPT for token in result.tokens)
        accepted += sum(step.accepted_draft_tokens for step in result.steps)
    assert kstest(values, "uniform").pvalue > P_MIN
    assert outside > PIT_SAMPLES // 2 and accepted > PIT_SAMPLES // 4, (outside, accepted)


def test_a_prompt_mostly_outside_the_kept_ids_is_drafted_with_the_whole_head():
    """The choice is the prompt's (at least 90% kept ids: the restricted head); the drafted tokens
    show which head drafted; greedy answers are the target's own either way."""
    target, draft = restricted_pair()
    whole = draft.__dict__["draft_for_prompt"].whole
    inside, outside = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [3, 26, 24, 27, 30, 31, 29, 28, 25, 23]
    assert draft_for_prompt(draft, inside) is draft and draft_for_prompt(draft, outside) is whole
    assert draft_for_prompt(whole, outside) is whole and type(whole.lm_head) is KQuantLinear
    reference = copy.deepcopy(target)
    engine = SpeculativeEngine(target, draft)
    for prompt, drafts_outside in ((inside, False), (outside, True)):
        with torch.inference_mode():
            ref = reference.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):]
        result = engine.generate(prompt, max_new_tokens=24, temperature=0.0, tree=Tree.k_ary(3, 2), stop_token_ids=[], copies=False)
        assert result.tokens == ref.tolist()
        drafted = [token for step in result.steps for token in step.tokens[1:]]
        assert any(token >= KEPT for token in drafted) == drafts_outside


def test_a_deep_copy_of_a_restricted_draft_chooses_among_its_own_models():
    """A copy's per-prompt choice returns the copy (restricted) or the copy's whole model, never the
    original objects: a copied draft must not draft with the weights it was copied from."""
    _, draft = restricted_pair()
    twin = copy.deepcopy(draft)
    inside, outside = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [3, 26, 24, 27, 30, 31, 29, 28, 25, 23]
    assert draft_for_prompt(twin, inside) is twin
    whole, twin_whole = draft_for_prompt(draft, outside), draft_for_prompt(twin, outside)
    assert twin_whole is not whole and type(twin_whole.lm_head) is KQuantLinear
    assert twin_whole.lm_head is twin.lm_head.full  # the copy's two heads stay one weight, as the original's
    assert torch.equal(twin_whole.lm_head.qs, whole.lm_head.qs) and twin_whole.lm_head.qs is not whole.lm_head.qs


def test_the_embedded_draft_computes_its_frequent_and_ascii_tokens(real_pair):
    """The real pair as the app loads it: the draft's head keeps 95,889 of 151,936 ids (the first
    32,768, every ASCII token, the added ones), whose logits are the full head's bits."""
    _, draft, tokenizer = real_pair
    head = draft.get_output_embeddings()
    assert isinstance(head, SubVocabularyHead) and kept_count(draft) == 95_889
    kept = set(head.kept.tolist())
    assert {tokenizer.convert_tokens_to_ids(t) for t in ("```", "<|im_end|>", "\u0120Ownership")} <= kept
    x = torch.randn(2, head.in_features)
    with torch.inference_mode():
        logits, full = head(x), head.full(x)
    assert torch.equal(logits[:, head.kept], full[:, head.kept])
    assert int(torch.isinf(logits).sum()) == 2 * (151_936 - 95_889)
    chat = [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}]
    assert draft_for_prompt(draft, encode_chat(tokenizer, chat)) is draft
    chat = [{"role": "user", "content": "\u7528\u51e0\u53e5\u8bdd\u89e3\u91ca\u4e00\u4e0b\u4e3a\u4ec0\u4e48"
                                        "\u5929\u7a7a\u662f\u84dd\u8272\u7684\uff0c\u5e76\u5199\u4e00\u4e2a"
                                        "\u5224\u65ad\u8d28\u6570\u7684\u51fd\u6570\u3002"}]
    whole = draft_for_prompt(draft, encode_chat(tokenizer, chat))
    assert whole is not draft and kept_count(whole) == 151_936  # Chinese: the whole head
