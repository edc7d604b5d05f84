"""Any GGUF file, served as stored: tiny random models of each architecture written as llama.cpp's
converter writes them (tests/tiny_gguf.py), in every block type, loaded by the engine
(engine/models/gguf_direct.py) and compared with transformers' own GGUF reader on the same file
(it dequantises independently and runs its own forward).

Bounds: float types (F32, F16, BF16) multiply float32 activations by the stored values converted
exactly, so only the summation order differs from the reference: |Δ logit| <= 1e-3 of the
position's logit range. Integer types multiply the stored integers by activations quantised to
int8 (llama.cpp's scheme: per 32 inputs for the legacy types, per 256 for the k-quants): |Δ| <= 4%
of the range (the real files: tests/test_gguf_real_files.py). These random tiny models
have many near-ties (logits of std 8 over 384 tokens), so here top-1 must agree wherever the
reference's top-2 margin exceeds twice the largest |Δ logit| seen (there a flip is impossible), and
at >= 95% of all positions.
"""
from __future__ import annotations

import pytest
import tiny_gguf
import tiny_models as tm
import torch
from gguf import GGMLQuantizationType as Q

from engine import SpeculativeEngine, Tree
from engine.backends.kquant import KQuantLinear
from engine.errors import ModelLoadError, VocabularyMismatchError
from engine.models.gguf_direct import load_gguf, open_gguf
from engine.models.pair_rule import check_pair

TEXT = tiny_gguf.CORPUS[:600]
FLOAT_BOUND, INTEGER_BOUND = 1e-3, 0.04
# every block type at least once, every architecture with several
CASES = [
    ("llama", Q.F32), ("llama", Q.Q8_0), ("llama", Q.Q4_1), ("llama", Q.Q4_K), ("llama", Q.Q3_K),
    ("qwen2", Q.F16), ("qwen2", Q.Q5_0), ("qwen2", Q.Q5_1), ("qwen2", Q.Q2_K), ("qwen2", Q.Q6_K),
    ("qwen3", Q.BF16), ("qwen3", Q.Q4_0), ("qwen3", Q.Q5_K),
    ("gemma3", Q.F32), ("gemma3", Q.Q8_0), ("gemma3", Q.Q5_0), ("gemma3", Q.Q4_K),
]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SEQUOIA_CACHE", str(tmp_path / "cache"))


def compare(path, positions: int = 100) -> tuple[float, float, float]:
    """``(top-1 agreement, the same where the reference's margin exceeds 2 max |Δ|, worst |Δ logit| /
    logit range)`` of our model against the reference."""
    ours, tokenizer = load_gguf(path)
    reference, ref_tokenizer = tiny_gguf.reference_model(path)
    ids = ref_tokenizer(TEXT)["input_ids"][:positions]
    assert tokenizer(TEXT)["input_ids"][:positions] == ids
    with torch.inference_mode():
        mine = ours(torch.tensor([ids])).logits[0]
        theirs = reference(torch.tensor([ids])).logits[0]
    same = mine.argmax(-1) == theirs.argmax(-1)
    top2 = theirs.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (mine - theirs).abs().max()
    worst = ((mine - theirs).abs().amax(-1) / (theirs.amax(-1) - theirs.amin(-1))).max().item()
    return same.double().mean().item(), same[clear].double().mean().item() if clear.any() else 1.0, worst


@pytest.mark.parametrize("arch,qtype", CASES, ids=[f"{a}-{q.name}" for a, q in CASES])
def test_logits_agree_with_transformers_reader(tmp_path, arch, qtype):
    path = tiny_gguf.write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, qtype, seed=3,
                                     layers=6 if arch == "gemma3" else 2,
                                     sliding_window=24 if arch == "gemma3" else None)
    agree, agree_clear, worst = compare(path)
    floats = qtype in (Q.F32, Q.F16, Q.BF16)
    assert worst <= (FLOAT_BOUND if floats else INTEGER_BOUND), f"{arch} {qtype.name}: logits moved {worst:.4f}"
    assert agree_clear == 1.0, f"{arch} {qtype.name}: top-1 differs where the margin is clear"
    assert agree >= (0.99 if floats else 0.95), f"{arch} {qtype.name}: top-1 agrees at {agree:.3f}"


def test_every_matrix_is_served_in_its_own_block_type(tmp_path):
    path = tiny_gguf.write_tiny_gguf(tmp_path / "q.gguf", "qwen2", Q.Q5_1, seed=1)
    model, _ = load_gguf(path)
    kinds = {m.kind for m in model.modules() if isinstance(m, KQuantLinear)}
    assert kinds == {"q5_1"}
    assert model.as_stored.startswith("Q5_1 100%")


def test_llama3_rope_freqs_are_applied_as_llama_cpp_does(tmp_path):
    """transformers' reader ignores ``rope_freqs``; the HF model the file was written from uses
    llama3 rope scaling, whose per-pair factors the tensor holds: ours matches that model."""
    kwargs = dict(seed=2, rope_freqs=True, context=512)
    path = tiny_gguf.write_tiny_gguf(tmp_path / "l3.gguf", "llama", Q.F32, **kwargs)
    built, _ = tiny_gguf.build_tiny_model("llama", **kwargs)
    ours, tokenizer = load_gguf(path)
    ids = tokenizer(TEXT)["input_ids"][:100]
    with torch.inference_mode():
        gap = (ours(torch.tensor([ids])).logits - built(torch.tensor([ids])).logits).abs().max().item()
    assert gap < 1e-3


def test_gemma3_greedy_trees_past_the_window_are_its_own_greedy_decoding(tmp_path):
    path = tiny_gguf.write_tiny_gguf(tmp_path / "g.gguf", "gemma3", Q.Q8_0, seed=4, layers=6, sliding_window=8)
    target, tokenizer = load_gguf(path)
    draft, _ = load_gguf(path)
    prompt = tokenizer(TEXT)["input_ids"][:20]
    reference = tm.hf_greedy(target, prompt, 30)
    engine = SpeculativeEngine(target, draft, stop_token_ids=[])
    for tree in (Tree.chain(3), Tree.k_ary(2, 2)):
        assert engine.generate(prompt, max_new_tokens=30, temperature=0, tree=tree, copies=False).tokens == reference


def test_padding_rows_pass_the_pair_rule_and_draft_exactly(tmp_path):
    """A target with 64 padding rows more than its draft (Qwen2.5-7B against 0.5B): the pair rule
    lets it draft, the draft gives q = 0 past its rows, and greedy output is the target's."""
    from engine.models.loading import load_pair

    target_path = tiny_gguf.write_tiny_gguf(tmp_path / "t.gguf", "qwen2", Q.Q8_0, seed=5, extra_vocab_rows=64)
    draft_path = tiny_gguf.write_tiny_gguf(tmp_path / "d.gguf", "qwen2", Q.Q4_0, seed=5)
    check_pair(open_gguf(target_path), open_gguf(draft_path))
    target, draft, tokenizer = load_pair(str(target_path), str(draft_path))
    assert draft.get_output_embeddings().out_features == target.get_output_embeddings().out_features == 384 + 64
    prompt = tokenizer(TEXT)["input_ids"][:12]
    reference = tm.hf_greedy(target, prompt, 16)
    result = SpeculativeEngine(target, draft, stop_token_ids=[]).generate(prompt, max_new_tokens=16, temperature=0,
                                                                          tree=Tree.chain(3), copies=False)
    assert result.tokens == reference


def test_the_pair_rule_names_the_first_token_that_differs(tmp_path):
    target = tiny_gguf.write_tiny_gguf(tmp_path / "t.gguf", "llama", Q.F32, seed=1)
    draft = tiny_gguf.write_tiny_gguf(tmp_path / "d.gguf", "llama", Q.F32, seed=1, token_types={"<|fresh|>": 3})
    with pytest.raises(VocabularyMismatchError, match=r"disagree at token \d+: '<\|fresh\|>' vs") as info:
        check_pair(open_gguf(target), open_gguf(draft))
    assert "\n" not in str(info.value)
    padded = tiny_gguf.write_tiny_gguf(tmp_path / "p.gguf", "llama", Q.F32, seed=1, extra_vocab_rows=200)
    with pytest.raises(VocabularyMismatchError, match="more than 128 apart"):
        check_pair(open_gguf(target), open_gguf(padded))
    other = tiny_gguf.write_tiny_gguf(tmp_path / "g.gguf", "gemma3", Q.F32, seed=1)
    with pytest.raises(VocabularyMismatchError, match="different tokenizers"):
        check_pair(open_gguf(target), open_gguf(other))


def rewrite(path, out, change) -> None:
    """A copy of the GGUF at ``path`` with ``change(fields: dict, tensors: list)`` applied, through
    gguf's own reader and writer."""
    import gguf

    reader = gguf.GGUFReader(path)
    fields = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        fields[name] = field
    tensors = [(t.name, t.data, t.tensor_type, t.shape) for t in reader.tensors]
    arch = change(fields, tensors) or reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch)
    for name, field in fields.items():
        value = field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, kind)
    for name, data, qtype, shape in tensors:
        writer.add_tensor(name, data, raw_shape=data.shape if qtype in (Q.F32, Q.F16) else None, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_an_unserved_architecture_is_refused_in_one_line(tmp_path):
    path = tiny_gguf.write_tiny_gguf(tmp_path / "l.gguf", "llama", Q.F32, seed=1)
    other = tmp_path / "mamba.gguf"
    rewrite(path, other, lambda fields, tensors: "mamba")
    with pytest.raises(ModelLoadError, match=r"architecture 'mamba' is not served \(supported: llama, qwen2, qwen3, gemma3\)"):
        load_gguf(other)


def test_a_file_without_a_layer_its_header_names_is_refused(tmp_path):
    """A file whose hyperparameters name two layers but which lacks one matrix: a clear error
    naming it, not a model with meta weights."""
    path = tiny_gguf.write_tiny_gguf(tmp_path / "l.gguf", "llama", Q.F32, seed=1)
    short = tmp_path / "short.gguf"
    rewrite(path, short, lambda fields, tensors: [tensors.remove(t) for t in list(tensors)
                                                  if t[0] == "blk.1.ffn_down.weight"] and None)
    with pytest.raises(ModelLoadError, match=r"no tensor of .* for model\.layers\.1\.mlp\.down_proj"):
        load_gguf(short)
    assert torch.get_default_device().type == "cpu"


def test_a_file_without_a_tokenizer_is_refused(tmp_path):
    path = tiny_gguf.write_tiny_gguf(tmp_path / "l.gguf", "llama", Q.F32, seed=1)
    bare = tmp_path / "bare.gguf"
    rewrite(path, bare, lambda fields, tensors: [fields.pop(k) for k in list(fields) if k.startswith("tokenizer.")] and None)
    with pytest.raises(ModelLoadError, match="has no tokenizer"):
        load_gguf(bare)


def test_a_block_type_without_a_kernel_is_refused_unless_asked(tmp_path):
    """An IQ4_NL matrix: refused naming the tensor and the type; with ``dequantise_unserved`` it runs
    as float32 (the values transformers' reader gives), and the model card says so."""
    import numpy as np
    from gguf.quants import quant_shape_to_byte_shape

    path = tiny_gguf.write_tiny_gguf(tmp_path / "l.gguf", "llama", Q.Q8_0, seed=1)
    odd = tmp_path / "iq.gguf"

    def to_iq4(fields, tensors):
        for i, (name, data, qtype, shape) in enumerate(tensors):
            if name == "blk.0.ffn_up.weight":
                rows, cols = int(shape[1]), int(shape[0])
                rng = np.random.default_rng(0)
                raw = rng.integers(0, 256, size=(rows, *quant_shape_to_byte_shape((cols,), Q.IQ4_NL)), dtype=np.uint8)
                raw.reshape(rows, -1, 18)[:, :, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # sane scales
                tensors[i] = (name, raw, Q.IQ4_NL, shape)

    rewrite(path, odd, to_iq4)
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_up\.weight is IQ4_NL, a block type without a kernel"):
        load_gguf(odd)
    model, _ = load_gguf(odd, dequantise_unserved=True)
    assert "IQ4_NL dequantised to float32" in model.as_stored
