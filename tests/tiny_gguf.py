"""Tiny random GGUF models, written the way llama.cpp's ``convert_hf_to_gguf.py`` writes them.

Each file starts life as a random Hugging Face model (``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM`` or ``Gemma3ForCausalLM``). Its tensors are then renamed to GGUF names and
transformed exactly as the converter does, and written with ``gguf.GGUFWriter`` together with the
hyperparameter keys, a tokenizer and a chat template. The independent reference for a loader is
transformers' own GGUF reader (:func:`reference_model`), which for an F32 file reproduces the HF
model to float rounding.

Conventions (checked against transformers' reader by ``tests/test_tiny_gguf.py``):

* llama: ``attn_q``/``attn_k`` rows are permuted per head from HF's half-split rotary layout to
  llama.cpp's interleaved one: ``w.reshape(n_head, 2, head_dim // 2, in).swapaxes(1, 2)``, with
  ``n_head = kv_heads`` for ``attn_k``. transformers undoes it with ``_reverse_permute_weights``.
  No other architecture is permuted (qwen2/qwen3/gemma3 use the HF layout, llama.cpp NEOX rope).
* gemma3: every ``*norm.weight`` (input/post-attention/pre- and post-feed-forward, q/k norms and
  the final norm) is stored as ``w + 1``: HF's Gemma3RMSNorm multiplies by ``1 + w`` and llama.cpp
  by the stored value. transformers' reader subtracts the 1 again.
* llama.cpp pads the token list to the embedding's row count with ``[PAD{i}]`` tokens of type
  UNUSED (``extra_vocab_rows``), as in Qwen2.5-7B's 152,064 rows for 151,665 real tokens.
* norms and biases are always F32; ``qtype`` applies to every 2-D matrix, embedding and output
  included.

Weight scale (so the logits are peaked): every linear weight has std ``1/sqrt(in_features)``
(activations stay O(1), so attention and rope matter), untied embeddings std 1, and the output
matrix (or the tied embedding) std ``LOGIT_STD / sqrt(hidden)``: after the final RMSNorm that gives
logits of std about ``LOGIT_STD = 8``, whose top-1 margin over 384 tokens exceeds 1 at roughly
three positions in four. Norm weights are ``1 + 0.1 N(0, 1)`` (gemma: offsets ``0.1 N(0, 1)``), and
biases ``0.1 N(0, 1)``, so a wrongly handled norm or bias shows in the logits.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, LlamaFileType, TokenType

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")

LOGIT_STD = 8.0
NORM_STD = 0.1
BIAS_STD = 0.1

Q = GGMLQuantizationType
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
LEGACY_QUANT_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
K_QUANT_TYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
QTYPES = FLOAT_TYPES + LEGACY_QUANT_TYPES + K_QUANT_TYPES

FILE_TYPES = {
    Q.F32: LlamaFileType.ALL_F32,
    Q.F16: LlamaFileType.MOSTLY_F16,
    Q.BF16: LlamaFileType.MOSTLY_BF16,
    Q.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    Q.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    Q.Q4_1: LlamaFileType.MOSTLY_Q4_1,
    Q.Q5_0: LlamaFileType.MOSTLY_Q5_0,
    Q.Q5_1: LlamaFileType.MOSTLY_Q5_1,
    Q.Q2_K: LlamaFileType.MOSTLY_Q2_K,
    Q.Q3_K: LlamaFileType.MOSTLY_Q3_K_M,
    Q.Q4_K: LlamaFileType.MOSTLY_Q4_K_M,
    Q.Q5_K: LlamaFileType.MOSTLY_Q5_K_M,
    Q.Q6_K: LlamaFileType.MOSTLY_Q6_K,
}

# Byte offsets of the fp16 super-block scales (d, and dmin where the type has one) in a K block.
K_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}

# Llama 3.x rope scaling (Llama-3.2 has factor 32 over 8192 positions). Here the original context
# is an eighth of the tiny model's, so that the scaled frequencies matter within a short text.
LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def llama3_rope(context: int) -> dict:
    """The Llama 3.x ``rope_scaling`` entries for a model of ``context`` positions."""
    return {**LLAMA3_ROPE, "original_max_position_embeddings": max(context // 8, 16)}

# Text the byte-level and sentencepiece merges are learned from.
CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello, world! This is a tiny model that "
    "speaks in tokens. The cat sat on the mat, and the dog sat on the log. In the beginning "
    "there was text, and the text was split into tokens, and the tokens were merged into words. "
    "Speculative decoding drafts a few tokens with a small model and checks them with a large one. "
    "Once upon a time, there was a little model that wanted to write stories about the sea, the "
    "sun and the stars. It is what it is; what is done is done. 0123456789 + - * / = ( ) [ ] { }"
)


@dataclass(frozen=True)
class ArchSpec:
    """What differs between the architectures, on the HF side and in the file."""

    model_class: str
    config_class: str
    rope_theta: float
    rms_eps: float
    tied: bool
    default_head_dim: int | None  # None: hidden // heads
    tokenizer_model: str  # "gpt2" (byte-level BPE) or "llama" (sentencepiece)
    tokenizer_pre: str | None
    specials: tuple[str, ...]
    bos: str
    eos: str
    eot: str
    pad: str | None
    add_bos: bool
    chat_template: str


LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n{{ message['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

SPECS: dict[str, ArchSpec] = {
    "llama": ArchSpec(
        "LlamaForCausalLM", "LlamaConfig", 500000.0, 1e-5, False, None, "gpt2", "llama-bpe",
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        bos="<|begin_of_text|>", eos="<|eot_id|>", eot="<|eot_id|>", pad=None, add_bos=True,
        chat_template=LLAMA_TEMPLATE,
    ),
    "qwen2": ArchSpec(
        "Qwen2ForCausalLM", "Qwen2Config", 1000000.0, 1e-6, False, None, "gpt2", "qwen2", QWEN_SPECIALS,
        bos="<|endoftext|>", eos="<|im_end|>", eot="<|im_end|>", pad="<|endoftext|>", add_bos=False,
        chat_template=CHATML_TEMPLATE,
    ),
    # transformers' reader ignores qwen3.attention.key_length and falls back on Qwen3Config's 128.
    "qwen3": ArchSpec(
        "Qwen3ForCausalLM", "Qwen3Config", 1000000.0, 1e-6, False, 128, "gpt2", "qwen2", QWEN_SPECIALS,
        bos="<|endoftext|>", eos="<|im_end|>", eot="<|im_end|>", pad="<|endoftext|>", add_bos=False,
        chat_template=CHATML_TEMPLATE,
    ),
    # transformers' reader leaves query_pre_attn_scalar at Gemma3TextConfig's 256 while llama.cpp
    # scales by 1/sqrt(head_dim), so the two agree only for head_dim 256 (Gemma 3 1B/4B/12B).
    "gemma3": ArchSpec(
        "Gemma3ForCausalLM", "Gemma3TextConfig", 1000000.0, 1e-6, True, 256, "llama", None,
        ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"),
        bos="<bos>", eos="<eos>", eot="<end_of_turn>", pad="<pad>", add_bos=True,
        chat_template=GEMMA_TEMPLATE,
    ),
}


# --------------------------------------------------------------------------- tokenizers


@dataclass
class Vocab:
    """A tokenizer as llama.cpp stores it."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    scores: list[float] | None = None

    def index(self, text: str) -> int:
        return self.tokens.index(text)


def _learn_merges(words: list[list[str]], count: int, known: set[str]) -> list[tuple[str, str]]:
    """Greedy BPE training: the ``count`` most frequent adjacent pairs, merged in turn.

    Ties break on the pair's text, so the result is deterministic. Once the corpus is fully merged,
    synthetic letter pairs keep the vocabulary growing to any size.
    """
    merges: list[tuple[str, str]] = []
    while len(merges) < count:
        pairs = Counter((a, b) for word in words for a, b in zip(word, word[1:]))
        if pairs:
            (a, b), _ = min(pairs.items(), key=lambda item: (-item[1], item[0]))
        else:
            a, b = _synthetic_pair(known)
        merges.append((a, b))
        known.add(a + b)
        words = [_apply_merge(word, a, b) for word in words]
    return merges


def _synthetic_pair(known: set[str]) -> tuple[str, str]:
    """A new merge of two lowercase letters (or letter + known token) once the corpus runs dry."""
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    for a in [*letters, *sorted(known, key=lambda t: (len(t), t))]:
        for b in letters:
            if a in known and b in known and a + b not in known:
                return a, b
    raise ValueError("no new merge can be made")


def _apply_merge(word: list[str], a: str, b: str) -> list[str]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(a + b)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def _merge_budget(vocab: int, fixed: int, arch: str) -> int:
    budget = vocab - fixed
    if budget < 0:
        raise ValueError(f"vocab={vocab} is too small for {arch}: it needs at least {fixed} tokens")
    return budget


def _extras(token_types: Mapping[str, int] | None) -> dict[str, int]:
    return {text: int(kind) for text, kind in (token_types or {}).items()}


def byte_level_vocab(spec: ArchSpec, vocab: int, token_types: Mapping[str, int] | None) -> Vocab:
    """GPT-2 style byte-level BPE: the 256 byte symbols, learned merges, then the special tokens.

    ``token_types`` maps extra token texts (byte-level spelled) to a ``TokenType``; a text already
    in the vocabulary only has its type changed. Extras and merges together fill ``vocab``.
    """
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spell = bytes_to_unicode()
    base = list(spell.values())
    extras = _extras(token_types)
    new_extras = [text for text in extras if text not in base and text not in spec.specials]
    budget = _merge_budget(vocab, len(base) + len(spec.specials) + len(new_extras), "byte-level BPE")
    pieces = re.findall(r" ?\w+| ?[^\s\w]+|\s+", CORPUS)
    words = [[spell[b] for b in piece.encode()] for piece in pieces]
    known = set(base) | set(new_extras)
    merges = _learn_merges(words, budget + len(new_extras), known)
    merged = [a + b for a, b in merges]
    learned = [text for text in dict.fromkeys(merged) if text not in set(base) | set(new_extras)]
    if len(learned) < budget:
        raise ValueError(f"the corpus yields only {len(learned)} merges, {budget} needed")
    learned = learned[:budget]
    keep = set(base) | set(learned) | set(new_extras)
    merges = [(a, b) for a, b in merges if a in keep and b in keep and a + b in keep]
    tokens = base + learned + new_extras + list(spec.specials)
    types = [int(TokenType.NORMAL)] * (len(base) + len(learned)) + [
        extras[t] for t in new_extras
    ] + [int(TokenType.CONTROL)] * len(spec.specials)
    for text, kind in extras.items():
        types[tokens.index(text)] = kind
    return Vocab(tokens, types, [f"{a} {b}" for a, b in merges])


def sentencepiece_vocab(spec: ArchSpec, vocab: int, token_types: Mapping[str, int] | None) -> Vocab:
    """Gemma-style sentencepiece: specials, 256 ``<0xNN>`` byte-fallback tokens, pieces by merge rank.

    Spaces are spelled "▁". Like Gemma's file there are no merges; transformers rebuilds them from
    the token order. Scores are ``-index`` (higher ranks first), token types as llama.cpp writes them.
    """
    extras = _extras(token_types)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    text = CORPUS.replace(" ", "\u2581")
    chars = sorted(set(text))
    new_extras = [t for t in extras if t not in spec.specials and t not in byte_tokens and t not in chars]
    budget = _merge_budget(vocab, len(spec.specials) + 256 + len(chars) + len(new_extras), "sentencepiece")
    words = [list(word) for word in re.findall(r"\u2581?[^\u2581]+|\u2581+", text)]
    merges = _learn_merges(words, budget + len(new_extras), set(chars))
    pieces = [t for t in dict.fromkeys(a + b for a, b in merges) if t not in chars and t not in new_extras][:budget]
    if len(pieces) < budget:
        raise ValueError(f"the corpus yields only {len(pieces)} pieces, {budget} needed")
    tokens = list(spec.specials) + byte_tokens + chars + pieces + new_extras
    special_types = [int(TokenType.UNKNOWN) if t == "<unk>" else int(TokenType.CONTROL) for t in spec.specials]
    types = special_types + [int(TokenType.BYTE)] * 256 + [int(TokenType.NORMAL)] * (len(chars) + len(pieces))
    types += [extras[t] for t in new_extras]
    for t, kind in extras.items():
        types[tokens.index(t)] = kind
    return Vocab(tokens, types, [], scores=[-float(i) for i in range(len(tokens))])


def build_vocab(arch: str, vocab: int, extra_rows: int, token_types: Mapping[str, int] | None,
                pad_token_list: bool = True) -> Vocab:
    """The tokenizer for ``arch``, padded to the embedding's rows as llama.cpp's converter pads it.

    ``pad_token_list=False`` leaves the ``extra_rows`` rows without tokens (not what llama.cpp writes;
    transformers' reader then sizes the model from the token list and fails for qwen2/qwen3/gemma3).
    """
    spec = SPECS[arch]
    builder = byte_level_vocab if spec.tokenizer_model == "gpt2" else sentencepiece_vocab
    result = builder(spec, vocab, token_types)
    assert len(result.tokens) == vocab, (len(result.tokens), vocab)
    for i in range(vocab, vocab + extra_rows if pad_token_list else vocab):
        result.tokens.append(f"[PAD{i}]")
        result.types.append(int(TokenType.UNUSED))
        if result.scores is not None:
            result.scores.append(-1000.0)
    return result


# --------------------------------------------------------------------------- HF model


def _resolve_head_dim(arch: str, hidden: int, heads: int, head_dim: int | None) -> int:
    if head_dim is not None:
        return head_dim
    default = SPECS[arch].default_head_dim
    return default if default is not None else hidden // heads


def hf_config(arch: str, *, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
              intermediate: int, rows: int, tied: bool, context: int, sliding_window: int | None,
              rope_freqs: bool, vocab: Vocab):
    """The transformers config of the tiny model, with the special token ids of ``vocab``."""
    import transformers

    spec = SPECS[arch]
    rope = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if rope_freqs:
        rope = {"rope_type": "llama3", "rope_theta": spec.rope_theta, **llama3_rope(context)}
    kwargs = dict(
        vocab_size=rows, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=context, rms_norm_eps=spec.rms_eps, tie_word_embeddings=tied,
        bos_token_id=vocab.index(spec.bos), eos_token_id=vocab.index(spec.eos),
        pad_token_id=vocab.index(spec.pad) if spec.pad else None,
    )
    if arch == "gemma3":
        kwargs.update(sliding_window=sliding_window or min(context, 512), query_pre_attn_scalar=head_dim,
                      rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                       "full_attention": rope})
    else:
        kwargs.update(rope_parameters=rope)
    config = getattr(transformers, spec.config_class)(**kwargs)
    config._attn_implementation = "eager"
    return config


@torch.no_grad()
def init_weights(model: torch.nn.Module, arch: str, seed: int, tied: bool) -> None:
    """Seeded random weights at the scales documented in the module docstring."""
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            value = NORM_STD * noise + (0.0 if arch == "gemma3" else 1.0)
        elif name.endswith(".bias"):
            value = BIAS_STD * noise
        elif name.endswith("embed_tokens.weight"):
            value = noise * (LOGIT_STD / math.sqrt(hidden) if tied else 1.0)
        elif name == "lm_head.weight":
            value = noise * LOGIT_STD / math.sqrt(hidden)
        else:
            value = noise / math.sqrt(param.shape[1])
        param.copy_(value)


def build_hf_model(arch: str, config, seed: int) -> torch.nn.Module:
    """The random HF model, float32 and in eval mode."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, SPECS[arch].model_class)(config).float().eval()
    init_weights(model, arch, seed, config.tie_word_embeddings)
    return model


# --------------------------------------------------------------------------- tensors


def llama_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """HF's half-split rotary rows -> llama.cpp's interleaved pairs, per head."""
    rows = weights.shape[0]
    return weights.reshape(n_head, 2, rows // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def gemma_norm_shift(weights: np.ndarray) -> np.ndarray:
    """Gemma's zero-centred RMSNorm offset ``w`` -> the multiplier ``1 + w`` llama.cpp stores."""
    return weights + 1.0


def llama3_rope_factors(head_dim: int, rope: Mapping) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp writes for Llama 3.x: one divisor per frequency."""
    theta = rope["rope_theta"]
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def gguf_tensors(model: torch.nn.Module, arch: str) -> dict[str, np.ndarray]:
    """The model's tensors under GGUF names, transformed as convert_hf_to_gguf transforms them."""
    config = model.config
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        stem, suffix = hf_name.rsplit(".", 1)
        name = name_map.get_name(stem)
        if name is None:
            raise KeyError(f"no GGUF name for {hf_name}")
        data = tensor.detach().float().numpy().copy()
        if arch == "llama" and name.endswith(".attn_q"):
            data = llama_permute(data, config.num_attention_heads)
        elif arch == "llama" and name.endswith(".attn_k"):
            data = llama_permute(data, config.num_key_value_heads)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            data = gemma_norm_shift(data)
        out[f"{name}.{suffix}"] = data
    return out


def random_k_blocks(shape: tuple[int, int], qtype: GGMLQuantizationType, std: float,
                    rng: np.random.Generator) -> np.ndarray:
    """Random but valid K-quant blocks whose dequantised values have about ``std`` RMS.

    gguf-py has no K quantizer, so the quant bytes are random and the fp16 super-block scales
    (``d``, ``dmin``) are set to one common value, calibrated on a first dequantisation.
    """
    rows, cols = shape
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if cols % block_elems:
        raise ValueError(f"{qtype.name} needs widths that are multiples of {block_elems}, got {cols}")
    raw = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)

    def set_scales(value: float) -> None:
        scale = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
        for offset in K_SCALE_OFFSETS[qtype]:
            raw[:, :, offset : offset + 2] = scale

    set_scales(1.0)
    flat = raw.reshape(rows, -1)
    rms = float(np.sqrt(np.mean(gguf.quants.dequantize(flat, qtype).astype(np.float64) ** 2)))
    set_scales(std / max(rms, 1e-12))
    return raw.reshape(rows, -1)


def encode_tensor(data: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator) -> tuple[np.ndarray, GGMLQuantizationType]:
    """``(array, type)`` for the writer: norms/biases F32, matrices in ``qtype``."""
    if data.ndim < 2 or qtype == Q.F32:
        return data.astype(np.float32), Q.F32
    if qtype == Q.F16:
        return data.astype(np.float16), Q.F16
    if qtype in K_QUANT_TYPES:
        return random_k_blocks(data.shape, qtype, float(data.std()), rng), qtype
    return gguf.quants.quantize(data.astype(np.float32), qtype), qtype


# --------------------------------------------------------------------------- metadata


def write_hyperparameters(writer: gguf.GGUFWriter, arch: str, config, qtype: GGMLQuantizationType, name: str) -> None:
    """Every key llama.cpp's converter writes for these architectures."""
    writer.add_name(name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_file_type(FILE_TYPES[qtype])
    if arch == "gemma3":
        writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
        writer.add_sliding_window(config.sliding_window)
    else:
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if arch == "llama":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(config.head_dim)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_tokenizer(writer: gguf.GGUFWriter, arch: str, vocab: Vocab) -> None:
    """The ``tokenizer.*`` keys, as llama.cpp's vocab export writes them."""
    spec = SPECS[arch]
    writer.add_tokenizer_model(spec.tokenizer_model)
    if spec.tokenizer_pre is not None:
        writer.add_tokenizer_pre(spec.tokenizer_pre)
    else:
        writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab.tokens)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.index(spec.bos))
    writer.add_eos_token_id(vocab.index(spec.eos))
    writer.add_eot_token_id(vocab.index(spec.eot))
    if spec.pad is not None:
        writer.add_pad_token_id(vocab.index(spec.pad))
    if "<unk>" in spec.specials:
        writer.add_unk_token_id(vocab.index("<unk>"))
    writer.add_add_bos_token(spec.add_bos)
    if spec.tokenizer_model == "llama":
        writer.add_add_eos_token(False)
        writer.add_add_space_prefix(False)
    writer.add_chat_template(spec.chat_template)


# --------------------------------------------------------------------------- entry points


def _qtype(qtype: GGMLQuantizationType | str) -> GGMLQuantizationType:
    result = GGMLQuantizationType[qtype.upper()] if isinstance(qtype, str) else GGMLQuantizationType(qtype)
    if result not in QTYPES:
        raise ValueError(f"unsupported qtype {result.name}; choose from {[t.name for t in QTYPES]}")
    return result


def build_tiny_model(arch: str, *, seed: int = 0, layers: int = 2, hidden: int = 256, heads: int = 4,
                     kv_heads: int = 2, head_dim: int | None = None, intermediate: int = 512, vocab: int = 384,
                     tied: bool | None = None, context: int = 512, sliding_window: int | None = None,
                     rope_freqs: bool = False, extra_vocab_rows: int = 0,
                     token_types: Mapping[str, int] | None = None,
                     pad_token_list: bool = True) -> tuple[torch.nn.Module, Vocab]:
    """The random HF model and the tokenizer that :func:`write_tiny_gguf` writes."""
    if arch not in SPECS:
        raise ValueError(f"unknown architecture {arch!r}; choose from {ARCHITECTURES}")
    if rope_freqs and arch != "llama":
        raise ValueError("rope_freqs (Llama 3.x rope scaling) exists only for llama")
    if sliding_window is not None and arch != "gemma3":
        raise ValueError("llama.cpp writes a sliding window only for gemma3 here")
    spec = SPECS[arch]
    tokenizer = build_vocab(arch, vocab, extra_vocab_rows, token_types, pad_token_list)
    config = hf_config(
        arch, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
        head_dim=_resolve_head_dim(arch, hidden, heads, head_dim), intermediate=intermediate,
        rows=vocab + extra_vocab_rows, tied=spec.tied if tied is None else tied, context=context,
        sliding_window=sliding_window, rope_freqs=rope_freqs, vocab=tokenizer,
    )
    return build_hf_model(arch, config, seed), tokenizer


def write_model_gguf(path: Path, arch: str, model: torch.nn.Module, vocab: Vocab,
                     qtype: GGMLQuantizationType | str = "F32", *, seed: int = 0, rope_freqs: bool = False) -> Path:
    """Write an HF model of ``arch`` and its tokenizer to ``path`` the way convert_hf_to_gguf does."""
    qtype = _qtype(qtype)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    write_hyperparameters(writer, arch, config, qtype, f"tiny-{arch}-{qtype.name.lower()}")
    write_tokenizer(writer, arch, vocab)
    rng = np.random.default_rng(seed + 1)
    tensors = gguf_tensors(model, arch)
    if rope_freqs:
        tensors = {"rope_freqs.weight": llama3_rope_factors(config.head_dim, config.rope_parameters), **tensors}
    for name, data in tensors.items():
        array, kind = encode_tensor(data, qtype, rng)
        writer.add_tensor(name, array, raw_dtype=kind if kind not in (Q.F32, Q.F16) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_gguf(path: Path, arch: str, qtype: GGMLQuantizationType | str = "F32", *, seed: int = 0,
                    layers: int = 2, hidden: int = 256, heads: int = 4, kv_heads: int = 2, head_dim: int | None = None,
                    intermediate: int = 512, vocab: int = 384, tied: bool | None = None, context: int = 512,
                    sliding_window: int | None = None, rope_freqs: bool = False, extra_vocab_rows: int = 0,
                    token_types: Mapping[str, int] | None = None, pad_token_list: bool = True) -> Path:
    """Write a tiny random ``arch`` model to ``path`` as llama.cpp's converter would; return the path.

    ``head_dim=None`` means hidden // heads for llama/qwen2, 128 for qwen3 and 256 for gemma3 (the
    values transformers' reader assumes, see :data:`SPECS`). ``tied=None`` is the family default
    (tied for gemma3 only). ``token_types`` maps token texts to ``gguf.TokenType`` values: new
    texts are added to the vocabulary (still ``vocab`` tokens in all), known ones retyped.
    ``extra_vocab_rows`` adds embedding/output rows with ``[PAD{i}]`` UNUSED tokens, as llama.cpp
    does; ``pad_token_list=False`` leaves those rows without tokens instead.
    Use :func:`build_tiny_model` with the same arguments for the HF model itself.
    """
    model, tokenizer = build_tiny_model(
        arch, seed=seed, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        intermediate=intermediate, vocab=vocab, tied=tied, context=context, sliding_window=sliding_window,
        rope_freqs=rope_freqs, extra_vocab_rows=extra_vocab_rows, token_types=token_types,
        pad_token_list=pad_token_list,
    )
    return write_model_gguf(path, arch, model, tokenizer, qtype, seed=seed, rope_freqs=rope_freqs)


def reference_model(path: Path):
    """``(model, tokenizer)`` from transformers' own GGUF reader: float32, eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer


@torch.no_grad()
def teacher_forced_logits(model: torch.nn.Module, ids) -> torch.Tensor:
    """Float32 logits ``(len(ids), vocab_rows)`` for one sequence, every position at once."""
    input_ids = torch.as_tensor(list(ids), dtype=torch.long)[None]
    return model(input_ids=input_ids).logits[0].float()
