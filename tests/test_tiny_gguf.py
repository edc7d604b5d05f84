"""The tiny GGUF writer against transformers' own GGUF reader.

For F32 files the reader must reproduce the HF model the file was written from to float rounding,
which pins down llama.cpp's conventions (llama q/k row permutation, gemma's ``w + 1`` norms).
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import tiny_gguf as tg  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog. Hello, world!"
# gemma3 gets six layers (five sliding, one global) and a window shorter than TEXT.
ARCH_KWARGS = {"gemma3": {"layers": 6, "sliding_window": 6}}


def _write(tmp: Path, arch: str, qtype: str = "F32", **kwargs):
    """``(hf_model, vocab, path, reference, tokenizer)`` for one file."""
    kwargs = {**ARCH_KWARGS.get(arch, {}), **kwargs}
    model, vocab = tg.build_tiny_model(arch, **kwargs)
    path = tg.write_model_gguf(tmp / f"{arch}-{qtype}.gguf", arch, model, vocab, qtype,
                               rope_freqs=kwargs.get("rope_freqs", False))
    reference, tokenizer = tg.reference_model(path)
    return model, vocab, path, reference, tokenizer


@pytest.fixture(scope="module", params=tg.ARCHITECTURES)
def f32(request, tmp_path_factory):
    return (request.param, *_write(tmp_path_factory.mktemp(request.param), request.param))


def _ids(tokenizer) -> list[int]:
    return tokenizer(TEXT)["input_ids"]


def test_config_matches_what_was_written(f32):
    arch, model, _, _, reference, _ = f32
    want, got = model.config, reference.config
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(got, key) == getattr(want, key), key
    # Qwen2Config keeps no head_dim: it is always hidden_size // num_attention_heads there
    assert getattr(got, "head_dim", got.hidden_size // got.num_attention_heads) == want.head_dim
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps)
    if arch == "gemma3":
        assert got.sliding_window == want.sliding_window == 6
        assert got.layer_types == want.layer_types
        assert got.rope_parameters["full_attention"]["rope_theta"] == want.rope_parameters["full_attention"]["rope_theta"]
    else:
        assert got.rope_parameters["rope_theta"] == want.rope_parameters["rope_theta"]


def test_f32_logits_equal_the_hf_model(f32):
    _, model, _, _, reference, tokenizer = f32
    ids = _ids(tokenizer)
    assert len(ids) > 20
    torch.testing.assert_close(tg.teacher_forced_logits(reference, ids), tg.teacher_forced_logits(model, ids),
                               atol=1e-4, rtol=1e-5)


def test_logits_are_peaked(f32):
    _, model, _, _, _, tokenizer = f32
    top = tg.teacher_forced_logits(model, _ids(tokenizer)).topk(2).values
    assert ((top[:, 0] - top[:, 1]) > 1).float().mean() >= 0.5


def test_tokenizer_round_trips_and_has_the_chat_template(f32):
    arch, _, vocab, path, _, tokenizer = f32
    spec = tg.SPECS[arch]
    assert len(vocab.tokens) == 384
    for text in (TEXT, "Speculative decoding, 42 times: (a+b)*c = 7 ~ {x}|y"):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
        assert max(ids) < 384
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert spec.eot in tg.SPECS[arch].chat_template
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    markers = [t for t in spec.specials if t in prompt]
    assert markers and all(vocab.index(t) in ids for t in markers)  # each marker is one token
    assert tokenizer.decode(ids) == prompt
    starts_with_bos = _ids(tokenizer)[0] == vocab.index(spec.bos)
    assert starts_with_bos == spec.add_bos
    reader = gguf.GGUFReader(path)
    assert reader.fields["tokenizer.ggml.eot_token_id"].parts[-1][0] == vocab.index(spec.eot)


def test_tensors_are_f32_and_named_as_llama_cpp_names_them(f32):
    arch, model, _, path, _, _ = f32
    names = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert ("output.weight" in names) != model.config.tie_word_embeddings
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in names.values())
    expected = {"llama": [], "qwen2": ["blk.0.attn_q.bias", "blk.0.attn_v.bias"],
                "qwen3": ["blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"],
                "gemma3": ["blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight", "blk.0.ffn_norm.weight",
                           "blk.0.attn_q_norm.weight"]}[arch]
    assert set(expected) <= set(names)
    if arch == "gemma3":  # stored as 1 + w
        stored = np.asarray(names["output_norm.weight"].data)
        np.testing.assert_allclose(stored, model.model.norm.weight.detach().numpy() + 1, rtol=1e-6)


@pytest.mark.parametrize("arch,patch", [("llama", "llama_permute"), ("gemma3", "gemma_norm_shift")])
def test_conventions_matter(arch, patch, tmp_path, monkeypatch):
    """Without the permutation or the +1, the reader's model is a different one."""
    monkeypatch.setattr(tg, patch, lambda weights, *args: weights)
    model, _, _, reference, tokenizer = _write(tmp_path, arch, layers=2)
    ids = _ids(tokenizer)
    diff = (tg.teacher_forced_logits(reference, ids) - tg.teacher_forced_logits(model, ids)).abs().max()
    assert diff > 1e-2


QUANTIZED = [("llama", "Q8_0"), ("qwen2", "F16"), ("qwen3", "Q4_0"), ("gemma3", "BF16"), ("qwen2", "Q5_1"),
             ("llama", "Q4_K"), ("qwen3", "Q6_K"), ("gemma3", "Q5_K"), ("qwen2", "Q2_K"), ("llama", "Q3_K")]


@pytest.mark.parametrize("arch,qtype", QUANTIZED)
def test_quantized_files_load(arch, qtype, tmp_path):
    model, _, path, reference, tokenizer = _write(tmp_path, arch, qtype, layers=2)
    kind = gguf.GGMLQuantizationType[qtype]
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert tensors["blk.0.attn_q.weight"].tensor_type == kind
    assert tensors["token_embd.weight"].tensor_type == kind
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    ids = _ids(tokenizer)
    got = tg.teacher_forced_logits(reference, ids)
    assert torch.isfinite(got).all()
    # the reader's weights are the file's, dequantised
    stored = gguf.quants.dequantize(tensors["blk.0.ffn_down.weight"].data, kind)
    np.testing.assert_allclose(reference.model.layers[0].mlp.down_proj.weight.detach().numpy(), stored, rtol=1e-6)
    if kind in tg.K_QUANT_TYPES:  # random blocks: only the scale is the HF model's
        want = model.model.layers[0].mlp.down_proj.weight.detach().numpy()
        assert 0.5 < np.sqrt(np.mean(stored**2)) / want.std() < 2
    else:  # real quantization of the HF weights: same predictions, mostly
        agree = (got.argmax(-1) == tg.teacher_forced_logits(model, ids).argmax(-1)).float().mean()
        assert agree >= 0.6


def test_extra_vocab_rows_are_padded_as_llama_cpp_pads_them(tmp_path):
    model, vocab, _, reference, tokenizer = _write(tmp_path, "qwen2", extra_vocab_rows=64)
    assert len(vocab.tokens) == reference.config.vocab_size == 448
    assert vocab.tokens[384] == "[PAD384]" and vocab.types[384] == gguf.TokenType.UNUSED
    ids = _ids(tokenizer)
    torch.testing.assert_close(tg.teacher_forced_logits(reference, ids), tg.teacher_forced_logits(model, ids),
                               atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("arch,loads", [("llama", True), ("qwen2", False)])
def test_rows_beyond_the_token_list(arch, loads, tmp_path):
    """Only llama's file states vocab_size; elsewhere the reader counts the tokens and mismatches."""
    if not loads:
        with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
            _write(tmp_path, arch, extra_vocab_rows=64, pad_token_list=False)
        return
    model, vocab, _, reference, tokenizer = _write(tmp_path, arch, extra_vocab_rows=64, pad_token_list=False)
    assert len(vocab.tokens) == 384 and reference.config.vocab_size == 448
    ids = _ids(tokenizer)
    torch.testing.assert_close(tg.teacher_forced_logits(reference, ids), tg.teacher_forced_logits(model, ids),
                               atol=1e-4, rtol=1e-5)


def test_rope_freqs_are_written_but_the_reader_ignores_them(tmp_path):
    model, _, path, reference, tokenizer = _write(tmp_path, "llama", rope_freqs=True)
    factors = next(t for t in gguf.GGUFReader(path).tensors if t.name == "rope_freqs.weight")
    assert np.asarray(factors.data).shape == (model.config.head_dim // 2,)
    assert reference.config.rope_parameters["rope_type"] == "default"
    # the reader's model is the same weights with plain rope
    plain = tg.build_tiny_model("llama")[0]
    ids = _ids(tokenizer)
    torch.testing.assert_close(tg.teacher_forced_logits(reference, ids), tg.teacher_forced_logits(plain, ids),
                               atol=1e-4, rtol=1e-5)
    assert (tg.teacher_forced_logits(model, ids) - tg.teacher_forced_logits(plain, ids)).abs().max() > 1e-2


def test_qwen3_head_dim_other_than_128_is_not_loadable(tmp_path):
    """transformers' reader drops qwen3.attention.key_length and assumes Qwen3Config's 128."""
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        _write(tmp_path, "qwen3", head_dim=64)


def test_token_types_add_and_retype_tokens(tmp_path):
    user = int(gguf.TokenType.USER_DEFINED)
    _, vocab, _, reference, tokenizer = _write(tmp_path, "qwen3", token_types={"<think>": user, "\u0120the": user})
    assert len(vocab.tokens) == 384 and vocab.types[vocab.index("<think>")] == user
    ids = tokenizer("<think>the cat</think>", add_special_tokens=False)["input_ids"]
    assert vocab.index("<think>") in ids
    assert tokenizer.decode(ids) == "<think>the cat</think>"
