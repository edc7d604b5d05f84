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

Only llama-style models built by :func:`engine.backends.kquant_model.kquant_model` get one (Qwen2,
Llama: RMSNorm, rotary embeddings, SiLU-gated MLP, full attention), as their ``lean_forward``
attribute, which the runner calls instead of the model (:func:`engine.core.runner.run_model`);
every other model runs its own forward.
"""
from __future__ import annotations

import torch

from engine.backends.kquant import PACKED_NAMES, KQuantLinear
from engine.core.kv_cache import commit_all, reserve_all
from engine.kernels.build import compiled_kernels

LEAN_MODEL_TYPES = ("qwen2", "llama")
ATTRIBUTE = "lean_forward"  # where a model keeps its LeanDecoder; the runner looks for it there
ROTARY_CHUNK = 1024  # the rotary tables grow by whole chunks of positions


def _spec(linear: KQuantLinear) -> tuple:
    """How the extension takes a layer: ``(kind, packed tensors, outputs, packed inputs, bias)``."""
    bias = linear._parameters.get("bias")
    return (linear.kind, [linear._buffers[name] for name in PACKED_NAMES[linear.kind]], linear.out_features,
            linear.padded_in, None if bias is None else bias.detach())


def native_layer(layer: torch.nn.Module):
    """The extension's ``LeanLayer`` over one decoder layer's tensors (shared, not copied)."""
    attn, mlp = layer.self_attn, layer.mlp
    heads, kv_heads = attn.config.num_attention_heads, attn.config.num_key_value_heads
    return compiled_kernels().LeanLayer(
        layer.input_layernorm.weight.detach(), float(layer.input_layernorm.variance_epsilon),
        layer.post_attention_layernorm.weight.detach(), float(layer.post_attention_layernorm.variance_epsilon),
        [_spec(attn.q_proj), _spec(attn.k_proj), _spec(attn.v_proj)], [_spec(attn.o_proj)],
        [_spec(mlp.gate_proj), _spec(mlp.up_proj)], [_spec(mlp.down_proj)],
        heads, kv_heads, attn.head_dim, float(attn.scaling))


class LeanDecoder:
    """The forward of a k-quant llama-style causal LM as one loop (see the module docstring). It
    holds the model's submodules, never the model, so the model owns it without a cycle; the
    extension's layers are made on first use (and again in a deep copy, which drops them)."""

    def __init__(self, model: torch.nn.Module) -> None:
        base = model.model
        self.embed, self.rotary = base.embed_tokens, base.rotary_emb
        self.final_norm, self.lm_head = base.norm, model.lm_head
        self.decoder_layers = list(base.layers[: model.config.num_hidden_layers])
        self._native: list | None = None
        self._cos: torch.Tensor | None = None  # [P, D]: the rotary embedding at positions 0..P-1
        self._sin: torch.Tensor | None = None

    def __getstate__(self) -> dict:  # the extension's objects do not copy (they are remade), nor the tables
        return {**self.__dict__, "_native": None, "_cos": None, "_sin": None}

    def _rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[1, q, D]`` at ``positions [1, q]``: rows of tables the model's own rotary
        embedding filled for positions 0..P-1 (P a multiple of :data:`ROTARY_CHUNK`), the same bits
        as calling it on these positions (each position's row is its own products and cosines)."""
        top = int(positions.max()) + 1
        if self._cos is None or top > self._cos.shape[0]:
            cos, sin = self.rotary(hidden, torch.arange(-(-top // ROTARY_CHUNK) * ROTARY_CHUNK)[None])
            self._cos, self._sin = cos[0], sin[0]
        return self._cos[positions], self._sin[positions]

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache,
                 logits_to_keep: int = 0) -> torch.Tensor:
        """Logits ``[1, q', V]`` of ``ids [1, q]`` at ``positions [1, q]``, attending through
        ``cache`` (a transformers ``Cache``, updated in place) under ``mask`` (additive float
        ``[1, 1, q, L]``, or None: causal); ``logits_to_keep`` as in transformers (0: all)."""
        if self._native is None:
            self._native = [native_layer(layer) for layer in self.decoder_layers]
        hidden = self.embed(ids)
        cos, sin = self._rotary(hidden, positions)
        q_len = ids.shape[1]
        buffers = reserve_all(cache, q_len)
        if buffers is not None:  # a growing cache: one call runs every layer, writing keys in place
            keys, values, filled = buffers
            hidden = compiled_kernels().forward_layers(self._native, hidden, cos, sin, keys, values, filled,
                                                 _mask_rows(mask, q_len, filled + q_len))
            commit_all(cache, filled + q_len)
        else:
            rows: torch.Tensor | None = None  # the attention mask's rows for this window, made once
            for index, layer in enumerate(self._native):
                query, key, value = layer.attention_in(hidden, cos, sin)
                key, value = cache.update(key, value, index)
                if rows is None:
                    rows = _mask_rows(mask, q_len, key.shape[2])
                hidden = layer.attention_out(hidden, query, key, value, rows)
        hidden = compiled_kernels().rms_norm(hidden, self.final_norm.weight.detach(), float(self.final_norm.variance_epsilon))
        return self.lm_head(hidden[:, -logits_to_keep:, :] if logits_to_keep else hidden)


def _mask_rows(mask: torch.Tensor | None, q_len: int, keys: int) -> torch.Tensor:
    """The kernel's mask ``[q, keys]`` (float, additive) from the runner's ``[1, 1, q, >= keys]``,
    as :func:`engine.backends.kquant.kquant_attention` derives it; empty for causal."""
    if mask is None:
        return torch.empty(0)
    rows = mask[0, 0, :, -keys:] if mask.shape[-1] >= keys else mask[0, 0]
    rows = torch.where(rows, 0.0, float("-inf")) if rows.dtype == torch.bool else rows.float()
    return rows.expand(q_len, keys).contiguous()


def supports(model: torch.nn.Module) -> bool:
    """True for a CPU float32 llama-style model whose decoder matrices are all :class:`KQuantLinear`
    and whose attention is the k-quant kernel's (what
    :func:`~engine.backends.kquant_model.kquant_model` builds)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in LEAN_MODEL_TYPES or compiled_kernels() is None:
        return False
    if getattr(config, "_attn_implementation", None) != "kquant":
        return False
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return False
    if config.hidden_act != "silu" or config.rope_parameters.get("rope_type", "default") != "default":
        return False
    if (config.hidden_size // config.num_attention_heads) % 16:
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
