"""A lean forward for the k-quant models: every decoder layer in the kernels' extension, in one
call per forward on a growing KV cache (``forward_layers``, which writes keys and values straight
into the cache's buffers), else in two calls a layer around the cache's own update.

A Hugging Face decoder layer costs about as much in Python and torch dispatch as in arithmetic on
2 CPU cores once its matrices are 4-bit: every layer runs a dozen module calls, keyword-argument
plumbing, an attention-interface lookup and some forty small torch operations. :class:`LeanDecoder`
runs each layer as the extension's ``LeanLayer`` (``engine/kernels/csrc/kquant.cpp``): the norm,
q/k/v as one kernel pass over their stacked tiles, rotary, then (after the KV-cache write)
attention, the output projection, the residual and the MLP. Per element those
are the model's own operations in the same order: the norms through the same ATen calls, SiLU
through the kernels' fixed function that the model's own MLPs call too
(:class:`engine.backends.kquant.FixedSiLU`), adds, products and rotary by hand (the same IEEE operations, as the extension is built without
fused multiply-adds), and the kernel computes each output column with the same instructions
whatever the other columns. The logits are therefore those of the model's own forward, bit for bit
(``tests/test_lean.py`` checks it on tiny models and on the real pair), and exactness arguments
about the model carry over unchanged.

Models built by :func:`engine.backends.kquant_model.kquant_model` or read from a GGUF file get one
when their layers are Llama's or one of its kin: Qwen2 and Llama (RMSNorm, rotary embeddings,
SiLU-gated MLP, full attention), Qwen3 (per-head q/k norms) and Gemma 3 (q/k norms, norms of the
attention's and the MLP's outputs, ``1 + w`` norm weights, GELU-tanh, sliding-window layers with
their own rotary base), as their ``lean_forward`` attribute, which the runner calls instead of the
model (:func:`engine.core.runner.run_model`); every other model runs its own forward.
"""
from __future__ import annotations

import inspect

import torch

from engine.backends.kquant import FIXED_ACTIVATIONS, PACKED_NAMES, KQuantLinear, activation_name
from engine.core.kv_cache import commit_all, reserve_all
from engine.core.runner import sliding_window, windowed
from engine.kernels.build import compiled_kernels

LEAN_MODEL_TYPES = ("qwen2", "llama", "qwen3", "gemma3_text")
ATTRIBUTE = "lean_forward"  # where a model keeps its LeanDecoder; the runner looks for it there
ROTARY_CHUNK = 1024  # the rotary tables grow by whole chunks of positions
SLIDING = "sliding_attention"


def _spec(linear: KQuantLinear) -> tuple:
    """How the extension takes a layer: ``(kind, packed tensors, outputs, packed inputs, bias)``."""
    bias = linear._parameters.get("bias")
    return (linear.kind, [linear._buffers[name] for name in PACKED_NAMES[linear.kind]], linear.out_features,
            linear.padded_in, None if bias is None else bias.detach())


def _norm(norm: torch.nn.Module | None) -> tuple[torch.Tensor, float]:
    """``(the weight the norm multiplies by, its epsilon)``: Gemma's norms multiply by ``1 + w``
    (added here as its forward adds it, one float32 rounding), the others by ``w``; none: empty."""
    if norm is None:
        return torch.empty(0), 0.0
    if hasattr(norm, "variance_epsilon"):
        return norm.weight.detach(), float(norm.variance_epsilon)
    return 1.0 + norm.weight.detach().float(), float(norm.eps)


def native_layer(layer: torch.nn.Module, sliding: bool = False):
    """The extension's ``LeanLayer`` over one decoder layer's tensors (shared, not copied)."""
    attn, mlp = layer.self_attn, layer.mlp
    heads, kv_heads = attn.config.num_attention_heads, attn.config.num_key_value_heads
    gemma = hasattr(layer, "pre_feedforward_layernorm")  # its post_attention_layernorm follows attention
    norm1 = _norm(layer.input_layernorm)
    norm2 = _norm(layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm)
    native = compiled_kernels().LeanLayer(
        norm1[0], norm1[1], norm2[0], norm2[1],
        [_spec(attn.q_proj), _spec(attn.k_proj), _spec(attn.v_proj)], [_spec(attn.o_proj)],
        [_spec(mlp.gate_proj), _spec(mlp.up_proj)], [_spec(mlp.down_proj)],
        heads, kv_heads, attn.head_dim, float(attn.scaling))
    q_norm, k_norm = _norm(getattr(attn, "q_norm", None)), _norm(getattr(attn, "k_norm", None))
    post_attention = _norm(layer.post_attention_layernorm if gemma else None)
    post_mlp = _norm(layer.post_feedforward_layernorm if gemma else None)
    native.extras(q_norm[0], k_norm[0], q_norm[1], post_attention[0], post_mlp[0], post_attention[1],
                  activation_name(attn.config) == "gelu_pytorch_tanh", sliding)
    return native


class LeanDecoder:
    """The forward of a k-quant llama-style causal LM as one loop (see the module docstring). It
    holds the model's submodules, never the model, so the model owns it without a cycle; the
    extension's layers are made on first use (and again in a deep copy, which drops them)."""

    def __init__(self, model: torch.nn.Module) -> None:
        base, config = model.model, model.config
        self.embed, self.rotary = base.embed_tokens, base.rotary_emb
        self.final_norm, self.lm_head = base.norm, model.lm_head
        self.decoder_layers = list(base.layers[: config.num_hidden_layers])
        kinds = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
        self.sliding = [kind == SLIDING for kind in kinds[: config.num_hidden_layers]]
        self.window = sliding_window(config) if any(self.sliding) else None
        # Gemma's rotary embedding takes the layer type (a base of its own for the sliding layers)
        self.typed_rotary = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self._native: list | None = None
        self._final_norm: tuple[torch.Tensor, float] | None = None  # (weight it multiplies by, epsilon), with _native
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # layer type -> [P, D] cos, sin

    def __getstate__(self) -> dict:  # the extension's objects do not copy (they are remade), nor the tables
        return {**self.__dict__, "_native": None, "_final_norm": None, "_tables": {}}

    def _rotary(self, hidden: torch.Tensor, positions: torch.Tensor,
                layer_type: str = "full_attention") -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[1, q, D]`` at ``positions [1, q]``: rows of tables the model's own rotary
        embedding filled for positions 0..P-1 (P a multiple of :data:`ROTARY_CHUNK`), the same bits
        as calling it on these positions (each position's row is its own products and cosines)."""
        top = int(positions.max()) + 1
        table = self._tables.get(layer_type)
        if table is None or top > table[0].shape[0]:
            where = torch.arange(-(-top // ROTARY_CHUNK) * ROTARY_CHUNK)[None]
            cos, sin = self.rotary(hidden, where, layer_type) if self.typed_rotary else self.rotary(hidden, where)
            table = self._tables[layer_type] = (cos[0], sin[0])
        return table[0][positions], table[1][positions]

    def _rows(self, mask: torch.Tensor | None, positions: torch.Tensor, keys: int, sliding: bool) -> torch.Tensor:
        """The kernel's mask rows ``[q, keys]`` for a full or a sliding-window layer: the latter's
        leave out the slots at or before ``position - window`` too (the runner's mask, causal when
        None), as the runner masks the model's own forward (:func:`engine.core.runner.windowed`)."""
        q_len = positions.shape[1]
        if not sliding:
            return _mask_rows(mask, q_len, keys)
        if mask is None:  # causal: query i sees the slots up to keys - q_len + i
            seen = torch.arange(keys)[None, :] <= torch.arange(keys - q_len, keys)[:, None]
            mask = torch.where(seen, 0.0, torch.finfo(torch.float32).min)[None, None]
        return _mask_rows(windowed(mask, positions, self.window), q_len, keys)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache,
                 logits_to_keep: int = 0) -> torch.Tensor:
        """Logits ``[1, q', V]`` of ``ids [1, q]`` at ``positions [1, q]``, attending through
        ``cache`` (a transformers ``Cache`` keeping every position, updated in place) under ``mask``
        (additive float ``[1, 1, q, L]``, or None: causal); ``logits_to_keep`` as in transformers (0: all)."""
        if self._native is None:
            self._native = [native_layer(layer, sliding) for layer, sliding in zip(self.decoder_layers, self.sliding)]
            self._final_norm = _norm(self.final_norm)
        hidden = self.embed(ids)
        rotary = {False: self._rotary(hidden, positions)}
        if self.window is not None:
            rotary[True] = self._rotary(hidden, positions, SLIDING)
        q_len = ids.shape[1]
        buffers = reserve_all(cache, q_len)
        if buffers is not None:  # a growing cache: one call runs every layer, writing keys in place
            keys, values, filled = buffers
            seen = filled + q_len
            local = (*rotary[True], self._rows(mask, positions, seen, True)) if self.window is not None \
                else (torch.empty(0),) * 3
            hidden = compiled_kernels().forward_layers(self._native, hidden, *rotary[False], keys, values, filled,
                                                       _mask_rows(mask, q_len, seen), *local)
            commit_all(cache, seen)
        else:
            rows: dict[bool, torch.Tensor] = {}  # the attention masks' rows for this window, made once
            for index, layer in enumerate(self._native):
                sliding = self.sliding[index]
                query, key, value = layer.attention_in(hidden, *rotary[sliding])
                key, value = cache.update(key, value, index)
                if sliding not in rows:
                    rows[sliding] = self._rows(mask, positions, key.shape[2], sliding)
                hidden = layer.attention_out(hidden, query, key, value, rows[sliding])
        hidden = compiled_kernels().rms_norm(hidden, *self._final_norm)
        return self.lm_head(hidden[:, -logits_to_keep:, :] if logits_to_keep else hidden)


def _mask_rows(mask: torch.Tensor | None, q_len: int, keys: int) -> torch.Tensor:
    """The kernel's mask ``[q, keys]`` (float, additive) from the runner's ``[1, 1, q, >= keys]``,
    as :func:`engine.backends.kquant.kquant_attention` derives it; empty for causal."""
    if mask is None:
        return torch.empty(0)
    rows = mask[0, 0, :, -keys:] if mask.shape[-1] >= keys else mask[0, 0]
    rows = torch.where(rows, 0.0, float("-inf")) if rows.dtype == torch.bool else rows.float()
    return rows.expand(q_len, keys).contiguous()


def _rope_types(config) -> set[str]:
    """The rotary types a config names: one, or one per layer type (Gemma 3's ``rope_parameters``)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    if parameters and all(isinstance(v, dict) for v in parameters.values()):
        return {v.get("rope_type", "default") for v in parameters.values()}
    return {parameters.get("rope_type", "default")}


def supports(model: torch.nn.Module) -> bool:
    """True for a CPU float32 model of a type in :data:`LEAN_MODEL_TYPES` whose decoder matrices are
    all :class:`KQuantLinear` and whose attention is the k-quant kernel's (what
    :func:`~engine.backends.kquant_model.kquant_model` and the GGUF reader build), with rotary
    tables that depend on the position alone, no logit soft-capping, and sliding windows only
    where the runner masks them (Gemma 3's layer types)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if config is None or model_type not in LEAN_MODEL_TYPES or compiled_kernels() is None:
        return False
    if getattr(config, "_attn_implementation", None) != "kquant":
        return False
    kinds = set(getattr(config, "layer_types", None) or ())
    if kinds - {"full_attention", SLIDING} or (SLIDING in kinds and not (model_type == "gemma3_text"
                                                                         and sliding_window(config))):
        return False
    if activation_name(config) not in FIXED_ACTIVATIONS or not _rope_types(config) <= {"default", "linear"}:
        return False
    if any(getattr(config, name, None) for name in ("final_logit_softcapping", "attn_logit_softcapping",
                                                    "use_bidirectional_attention")):
        return False
    if model.model.layers[0].self_attn.head_dim % 16:
        return False
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    for layer in model.model.layers:
        modules = [getattr(layer.self_attn, n) for n in names] + \
            [getattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(m) is not KQuantLinear for m in modules):
            return False
    return True


def attach(model: torch.nn.Module) -> bool:
    """Give ``model`` (just built by :func:`~engine.backends.kquant_model.kquant_model`) its
    :class:`LeanDecoder` as ``model.lean_forward`` when :func:`supports` says so; True when it has one."""
    if ATTRIBUTE not in model.__dict__:
        if not supports(model):
            return False
        model.__dict__[ATTRIBUTE] = LeanDecoder(model)
    return True
