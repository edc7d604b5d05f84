"""Real GGUF files of other architectures, served as stored (engine/models/gguf_direct.py), against
the independent reader: transformers' own GGUF loader dequantises the same file itself and runs its
own forward. SmolLM2-135M-Instruct Q4_1 (llama: q/k stored permuted, Q8_0 embedding) and
Gemma-3-270M Q4_K_M (gemma3: Q5_0, Q4_K, Q8_0 and Q6_K blocks, sliding-window layers, tied output).

Agreement bound: our matrices multiply the stored integers by activations quantised to int8, as
llama.cpp does: per 32 inputs for the legacy types (Q4_1, Q5_0, Q8_0: its Q8_0/Q8_1 activations),
per 256 for the k-quants (its Q8_K); the reference multiplies float32 dequantised weights by float32
activations. That rounding (1/254 of a group's largest activation) moves logits, most on a model with
outlier activations (SmolLM2), and flips top-1 where the reference's top-2 are close. Measured
(2026-12-07, Intel Xeon, AVX-512 VNNI), teacher-forced, this text / 512 tokens of docs/teaching.md:
SmolLM2-135M top-1 at 57 of 59 / 496 of 512 positions, worst |Δ| 3.5% / 4.2% of a position's logit
range; Gemma-3-270M 58 of 60 / 475 of 512, worst 7.7% / 6.4%. Activations per 256 everywhere (before)
gave SmolLM2 53 of 59 / 482 of 512, worst 19%. Gemma's GELU is the kernels' (fixed_exp.h: 0.8 ulp
on average against float64, ATen's 7.7): with ATen's, which the reference runs too, Gemma agrees at
59 of 60 / 487 of 512, with a float64 GELU at 59 of 60 / 485 of 512, the same mean |Δ| each: the
flips are near ties that any rounding moves. Fake-quantising
transformers' own model per 32 gives the same picture (SmolLM2 96% of 400 positions; per 16: no
flip on this text), so the issue's 99% is out of reach of int8 activations on these files: the tests
hold the figures above (``BOUNDS``) and that a flip happens only at a near tie.
"""
from __future__ import annotations

import pytest
import real_gguf
import tiny_models as tm
import torch

from engine import SpeculativeEngine, Tree
from engine.backends.kquant import KQuantLinear
from engine.errors import ModelLoadError
from engine.models.gguf_direct import open_gguf
from engine.models.loading import load_model

pytestmark = pytest.mark.xdist_group("gguf-files")
# per file: (least top-1 agreement, largest |Δ logit| as a share of the position's logit range)
BOUNDS = {"smollm2": (0.95, 0.06), "gemma3": (0.96, 0.12)}
NEAR_TIE = 1.0  # a top-1 flip is allowed only where the reference's top-2 margin is below this (logits)
TEXT = ("The quick brown fox jumps over the lazy dog. In Python, a list comprehension such as "
        "[x * x for x in range(10)] builds a list of squares; a generator expression builds them lazily. "
        "Paris is the capital of France, and Berlin is the capital of Germany.")
FILES = {"smollm2": real_gguf.smollm2, "gemma3": real_gguf.gemma3}


@pytest.fixture(scope="module", params=list(FILES))
def served(request):
    """``(name, path, our model, our tokenizer)``."""
    path = FILES[request.param]()
    model, tokenizer = load_model(str(path), torch.float32, "cpu", False, "auto")
    return request.param, path, model, tokenizer


@pytest.fixture(scope="module")
def reference(served):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, path, _, _ = served
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_the_file_is_served_as_stored(served):
    name, path, model, _ = served
    table = open_gguf(path).table
    linears = [m for m in model.modules() if isinstance(m, KQuantLinear)]
    assert len(linears) == 7 * model.config.num_hidden_layers + 1
    kinds = {m.kind.replace("_", "") for m in linears}
    stored = {t.qtype.name.lower().replace("_", "") for t in table.values() if len(t.dims) == 2}
    assert kinds == stored, f"{name}: the layers' kinds {kinds} are not the file's types {stored}"
    assert "%" in model.as_stored and "dequantised" not in model.as_stored


def test_logits_agree_with_transformers_own_reader(served, reference):
    name, _, model, tokenizer = served
    ref_model, ref_tokenizer = reference
    ids = ref_tokenizer(TEXT)["input_ids"]
    assert tokenizer(TEXT)["input_ids"] == ids
    with torch.inference_mode():
        ours = model(torch.tensor([ids])).logits[0]
        theirs = ref_model(torch.tensor([ids])).logits[0]
    same = ours.argmax(-1) == theirs.argmax(-1)
    top2 = theirs.topk(2, -1).values
    span = (theirs.amax(-1) - theirs.amin(-1))
    worst = ((ours - theirs).abs().amax(-1) / span).max().item()
    least, largest = BOUNDS[name]
    assert same.double().mean().item() >= least, f"top-1 agrees at {same.double().mean():.3f} of {len(ids)} positions"
    assert worst <= largest, f"a logit moved by {worst:.3f} of its position's range"
    assert ((top2[:, 0] - top2[:, 1])[~same] < NEAR_TIE).all(), "top-1 flipped where the reference was clear"


def test_the_chat_template_and_stops_come_from_the_file(served):
    name, path, model, tokenizer = served
    messages = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    marker = {"smollm2": "<|im_start|>assistant", "gemma3": "<start_of_turn>model"}[name]
    assert text.rstrip().endswith(marker)
    end = {"smollm2": "<|im_end|>", "gemma3": "<end_of_turn>"}[name]
    stops = model.generation_config.eos_token_id
    assert tokenizer.convert_tokens_to_ids(end) in (stops if isinstance(stops, list) else [stops])
    if name == "smollm2":
        assert tokenizer.chat_template == open_gguf(path).metadata["tokenizer.chat_template"]


@pytest.mark.parametrize("tree", [Tree.chain(4), Tree.k_ary(2, 3)], ids=["chain4", "2ary3"])
def test_greedy_self_speculation_is_the_models_own_greedy_decoding(served, tree):
    """A second load of the same file as the draft: every tree gives exactly the target's own
    greedy tokens (Hugging Face's generate on the model object, no engine involved)."""
    _, path, model, tokenizer = served
    draft, _ = load_model(str(path), torch.float32, "cpu", False, "auto")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                           add_generation_prompt=True, return_dict=True)["input_ids"]
    reference = tm.hf_greedy(model, list(prompt), 24)
    engine = SpeculativeEngine(model, draft, stop_token_ids=[])  # the reference does not stop either
    result = engine.generate(list(prompt), max_new_tokens=24, temperature=0, tree=tree, copies=False)
    assert result.tokens == reference


def test_a_cross_type_draft_of_the_same_model_drafts_exactly(served, tmp_path_factory):
    """The file re-quantised to Q5_0 (gguf's own quantiser, every matrix; real_gguf.requantised) is
    a draft of another block type that passes the pair rule: trees drafted by it give exactly the
    target's own greedy tokens, and it agrees with the target often enough to be a draft."""
    from gguf import GGMLQuantizationType as Q

    from engine.models.pair_rule import check_pair

    name, path, model, tokenizer = served
    draft_path = real_gguf.requantised(path, Q.Q5_0, tmp_path_factory.mktemp("draft") / f"{name}-q5_0.gguf")
    check_pair(open_gguf(path), open_gguf(draft_path))
    draft, _ = load_model(str(draft_path), torch.float32, "cpu", False, "auto")
    assert {m.kind for m in draft.modules() if isinstance(m, KQuantLinear)} == {"q5_0"}
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                           add_generation_prompt=True, return_dict=True)["input_ids"]
    reference = tm.hf_greedy(model, list(prompt), 24)
    engine = SpeculativeEngine(model, draft, stop_token_ids=[])
    for tree in (Tree.chain(4), Tree.k_ary(2, 3)):
        result = engine.generate(list(prompt), max_new_tokens=24, temperature=0, tree=tree, copies=False)
        assert result.tokens == reference
    assert result.tokens_per_step > 1.5, "a Q5_0 copy of the target should mostly agree with it"


def test_a_truncated_copy_is_refused_in_one_line(tmp_path):
    path = real_gguf.smollm2()
    cut = tmp_path / "cut.gguf"
    with open(path, "rb") as f:
        cut.write_bytes(f.read(path.stat().st_size // 3))
    with pytest.raises(ModelLoadError) as info:
        load_model(str(cut), torch.float32, "cpu", False, "auto")
    assert "\n" not in str(info.value) and "cut.gguf" in str(info.value)


def test_the_two_families_do_not_draft_for_each_other():
    from engine.errors import VocabularyMismatchError
    from engine.models.pair_rule import check_pair

    with pytest.raises(VocabularyMismatchError, match="tokenizer"):
        check_pair(open_gguf(real_gguf.gemma3()), open_gguf(real_gguf.smollm2()))
