"""What a GGUF file means: each served architecture as data (its Hugging Face model type, the
tensor names of a block, the hyperparameter keys and the few forward differences), read from the
file's own metadata, never from a hub.

An architecture is a table, not a forward: the model is Hugging Face's class for the model type,
built on the meta device and filled with the file's tensors by :mod:`engine.models.gguf_model`.
The one conversion llama.cpp makes to a file's tensors that is undone here is the llama family's
q/k row permutation (its converter interleaves each head's rotary halves; rows of blocks are
reordered back, exactly). Gemma's norms are stored as ``1 + w`` by llama.cpp and kept so: the
model's own ``(1 + w)`` is given ``stored - 1``, as transformers' GGUF reader does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from engine.backends.kquant_model import GGUF_LINEARS as LINEARS  # a block's matrices: GGUF -> HF names
from engine.errors import ModelLoadError

LLAMA_FLOATS = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
BIASES = {f"{gguf}.bias": f"{hf}.bias" for gguf, hf in LINEARS.items() if gguf in ("attn_q", "attn_k", "attn_v")}
QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
GEMMA3_FLOATS = {
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight", "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    **QK_NORMS,
}
# Keys whose presence says the file is something this engine does not serve, with the reason.
NOT_SERVED_KEYS = {
    "expert_count": "a mixture of experts", "pooling_type": "an embedding model",
    "vision.block_count": "a vision projector", "clip.has_vision_encoder": "a vision projector",
}
# Texts that end a turn in the chat templates of the served families (llama.cpp detects them the same way).
END_OF_TURN_TEXTS = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "<|eom_id|>")
# Templates for files that carry none (Gemma 3's GGUF releases do not), by architecture.
DEFAULT_TEMPLATES = {
    "gemma3": ("{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' "
               "else 'user' %}{% if message['role'] == 'system' %}{{ '<start_of_turn>user\n' + message['content'] + "
               "'\n\n' }}{% else %}{% if not (loop.index0 > 0 and loop.previtem['role'] == 'system') %}"
               "{{ '<start_of_turn>' + role + '\n' }}{% endif %}{{ message['content'] | trim + '<end_of_turn>\n' }}"
               "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"),
}


@dataclass(frozen=True)
class Architecture:
    """One ``general.architecture`` the engine serves."""

    name: str                       # general.architecture
    model_type: str                 # the Hugging Face config's model type
    floats: dict[str, str]          # a block's float tensors: GGUF name after blk.N. -> HF name after model.layers.N.
    permuted_qk: bool = False       # llama.cpp stores q/k rows permuted (the llama family)
    norm_offset: float = 0.0        # HF norm weight = stored + norm_offset (gemma: stored 1 + w)
    embedding_scale: bool = False   # the token embedding is multiplied by sqrt(hidden) (gemma)
    extra: dict[str, Any] = field(default_factory=dict)  # fixed config entries (activation, ...)


ARCHITECTURES = {
    "llama": Architecture("llama", "llama", LLAMA_FLOATS, permuted_qk=True),
    "qwen2": Architecture("qwen2", "qwen2", {**LLAMA_FLOATS, **BIASES}),
    "qwen3": Architecture("qwen3", "qwen3", {**LLAMA_FLOATS, **QK_NORMS}),
    "gemma3": Architecture("gemma3", "gemma3_text", GEMMA3_FLOATS, norm_offset=-1.0, embedding_scale=True,
                           extra={"hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
                                  "attn_logit_softcapping": None}),
}
SUPPORTED = ", ".join(ARCHITECTURES)
GEMMA3_GLOBAL_EVERY = 6  # llama.cpp's gemma3 layer pattern: every 6th layer attends globally, the rest in the window
GEMMA3_LOCAL_ROPE_BASE = 10_000.0  # llama.cpp's (and transformers') rope base of gemma3's sliding layers


def architecture_of(metadata: dict[str, Any], file_name: str) -> Architecture:
    """The served architecture of a file whose metadata is ``metadata``; a one-line
    :class:`ModelLoadError` naming it and listing the supported ones otherwise."""
    name = metadata.get("general.architecture")
    if not isinstance(name, str):
        raise ModelLoadError(f"{file_name}: no general.architecture in its metadata: not a model GGUF")
    for suffix, what in NOT_SERVED_KEYS.items():
        if f"{name}.{suffix}" in metadata or suffix in metadata:
            raise ModelLoadError(f"{file_name} is {what} ({name}), which is not served: supported are "
                                 f"causal LMs of the architectures {SUPPORTED}")
    if name not in ARCHITECTURES:
        raise ModelLoadError(f"{file_name}: architecture {name!r} is not served (supported: {SUPPORTED})")
    return ARCHITECTURES[name]


def _key(metadata: dict[str, Any], arch: str, key: str, default: Any = None, kind: type = int) -> Any:
    """``{arch}.{key}`` as ``kind``; ``default`` when absent (None: required)."""
    value = metadata.get(f"{arch}.{key}", default)
    if value is None:
        raise ModelLoadError(f"the file has no {arch}.{key}: an incomplete {arch} GGUF")
    try:
        return kind(value)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{arch}.{key} is {value!r}, not a {kind.__name__}") from exc


def config_values(arch: Architecture, metadata: dict[str, Any], vocab_rows: int, tied: bool,
                  has_bias: bool) -> dict[str, Any]:
    """The Hugging Face config entries that the file's hyperparameters give (``vocab_rows``: the
    token embedding's rows; ``tied``: no separate output matrix; ``has_bias``: q/k/v biases)."""
    a = arch.name
    hidden, heads = _key(metadata, a, "embedding_length"), _key(metadata, a, "attention.head_count")
    if hidden <= 0 or heads <= 0 or hidden > 1 << 17 or heads > 1024:
        raise ModelLoadError(f"absurd sizes in the file: {hidden} hidden, {heads} heads")
    head_dim = _key(metadata, a, "attention.key_length", hidden // heads)
    rope_dims = _key(metadata, a, "rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ModelLoadError(f"partial rotary embeddings ({rope_dims} of {head_dim} dimensions) are not served")
    scaling = metadata.get(f"{a}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ModelLoadError(f"rope scaling {scaling!r} is not served (none, linear, or llama3's rope_freqs)")
    theta = _key(metadata, a, "rope.freq_base", 10_000.0, float)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if scaling == "linear":
        rope = {"rope_type": "linear", "rope_theta": theta, "factor": _key(metadata, a, "rope.scaling.factor", None, float)}
    values: dict[str, Any] = {
        "vocab_size": vocab_rows, "hidden_size": hidden, "num_hidden_layers": _key(metadata, a, "block_count"),
        "intermediate_size": _key(metadata, a, "feed_forward_length"), "num_attention_heads": heads,
        "num_key_value_heads": _key(metadata, a, "attention.head_count_kv", heads), "head_dim": head_dim,
        "max_position_embeddings": _key(metadata, a, "context_length", 4096),
        "rms_norm_eps": _key(metadata, a, "attention.layer_norm_rms_epsilon", 1e-6, float),
        "tie_word_embeddings": tied, "rope_parameters": rope, "attention_bias": has_bias,
        **{f"{name}_token_id": metadata[f"tokenizer.ggml.{key}_token_id"]
           for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))
           if f"tokenizer.ggml.{key}_token_id" in metadata},
        **arch.extra,
    }
    if f"{a}.attention.key_length" not in metadata and arch.name in ("llama", "qwen2"):
        values.pop("head_dim")  # the config derives hidden / heads itself
    if arch.name == "qwen2":
        values.pop("attention_bias")
        values["use_sliding_window"] = False
    if arch.name == "gemma3":
        values.update(_gemma3_values(metadata, values))
    return values


def _gemma3_values(metadata: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's window, layer pattern, the sliding layers' rope and the query scale, as llama.cpp
    reads a gemma3 file (its 27B, 62 layers, scales queries by hidden / heads, the others by head_dim)."""
    layers = values["num_hidden_layers"]
    window = _key(metadata, "gemma3", "attention.sliding_window", 4096)
    pattern = ["full_attention" if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention" for i in range(layers)]
    theta = values["rope_parameters"]["rope_theta"]
    scalar = values["hidden_size"] // values["num_attention_heads"] if layers == 62 else values["head_dim"]
    return {"sliding_window": window, "layer_types": pattern, "query_pre_attn_scalar": scalar,
            "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": theta},
                                "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_BASE}}}


def hf_config(arch: Architecture, values: dict[str, Any]):
    """The Hugging Face config object of ``arch`` with ``values``."""
    from transformers import AutoConfig

    return AutoConfig.for_model(arch.model_type, **values)


def unpermute_rows(heads: int, rows: int) -> list[int]:
    """The row order that undoes llama.cpp's q/k permutation of a ``rows``-row matrix of ``heads``
    heads: its converter stores, per head, the rotary pairs interleaved (rows ``0, D/2, 1, D/2+1,
    ...`` of the Hugging Face head); row ``i`` of the result is the stored row holding HF row ``i``."""
    dim = rows // heads
    if dim * heads != rows or dim % 2:
        raise ModelLoadError(f"cannot undo the q/k permutation of {rows} rows over {heads} heads")
    half = dim // 2
    order = []
    for head in range(heads):
        # HF row h*dim + j (j < half) was written at stored row h*dim + 2j; j >= half at 2(j-half)+1
        order += [head * dim + (2 * j if j < half else 2 * (j - half) + 1) for j in range(dim)]
    return order


def rope_freq_factors(values: list[float], head_dim: int) -> list[float]:
    """Llama 3.x's ``rope_freqs`` tensor (one factor per rotary pair, llama.cpp's freq_factors:
    each pair's frequency is divided by its factor), checked against the head size."""
    if len(values) != head_dim // 2 or not all(math.isfinite(v) and v > 0 for v in values):
        raise ModelLoadError(f"rope_freqs has {len(values)} factors for {head_dim // 2} rotary pairs, or a bad one")
    return values


def end_of_turn_ids(metadata: dict[str, Any], tokens: list[str]) -> list[int]:
    """The ids that end an answer: the file's EOS and EOT ids and, when none of those is a turn's
    end itself (Gemma's files name ``<eos>`` only), the tokens whose text ends a turn in the served
    families' templates."""
    ids = [metadata.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                       "tokenizer.ggml.eom_token_id")]
    found = [int(i) for i in ids if isinstance(i, int) and 0 <= i < len(tokens)]
    if not any(tokens[i] in END_OF_TURN_TEXTS for i in found):
        by_text = {t: i for i, t in enumerate(tokens) if t in END_OF_TURN_TEXTS}
        found += [by_text[t] for t in END_OF_TURN_TEXTS if t in by_text]
    return list(dict.fromkeys(found))
