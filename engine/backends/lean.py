"""A lean forward for the k-quant models: one Python loop over the decoder layers, no module calls.

A Hugging Face decoder layer costs about as much in Python as in arithmetic on 2 CPU cores once
its matrices are 4-bit: every layer runs a dozen module calls, keyword-argument plumbing, an
attention-interface lookup and the mask slicing of :func:`engine.backends.kquant.kquant_attention`.
:class:`LeanDecoder` runs the same torch operations in the same order, straight from the layers'
tensors, with q/k/v and gate/up each as one kernel call over their matrices stacked along the
outputs (:func:`fuse`): the k-quant kernel computes every output column with the same instructions
whatever the other columns, so a fused product equals the separate ones bit for bit. The logits are
therefore those of the model's own forward, bit for bit (``tests/test_lean.py`` checks it on tiny
models and on the real pair), and exactness arguments about the model carry over unchanged.

Only llama-style models built by :func:`engine.backends.kquant.kquant_model` get one (Qwen2,
Llama: RMSNorm, rotary embeddings, SiLU-gated MLP, full attention), as their ``lean_forward``
attribute, which the runner calls instead of the model (:func:`engine.core.runner.run_model`);
every other model runs its own forward.
"""
from __future__ import annotations

import torch

from engine.backends.kquant import PACKED_NAMES, KQuantLinear, _extension

LEAN_MODEL_TYPES = ("qwen2", "llama")
ATTRIBUTE = "lean_forward"  # where a model keeps its LeanDecoder; the runner looks for it there


def fuse(linears: list[KQuantLinear]) -> KQuantLinear:
    """One :class:`KQuantLinear` computing ``linears`` side by side (``[..., in] -> [..., sum of
    outs]``); each given layer's buffers become views into the stacked ones, so no byte is held twice.
    The packed layouts are tile-major (16 outputs a tile), so stacking along the outputs is a
    concatenation of the flat buffers."""
    kind, in_features = linears[0].kind, linears[0].in_features
    if any(layer.kind != kind or layer.in_features != in_features for layer in linears):
        raise ValueError("only layers of one k-quant kind and one input size can be fused")
    biases = [layer._parameters.get("bias") for layer in linears]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        raise ValueError("fused layers must all have a bias or none")
    stacked = {name: torch.cat([layer._buffers[name] for layer in linears]) for name in PACKED_NAMES[kind]}
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    fused = KQuantLinear(kind, stacked, in_features, sum(layer.out_features for layer in linears), bias)
    for name, whole in stacked.items():
        offset = 0
        for layer in linears:
            size = layer._buffers[name].numel()
            layer._buffers[name] = whole[offset:offset + size]
            offset += size
    return fused


def _fused_groups(linears: list[KQuantLinear]) -> list[tuple[KQuantLinear, list[int]]]:
    """``linears`` (in order) as runs of neighbours that can share one kernel call (same kind and
    bias presence): ``[(module, [out sizes of its parts])]``."""
    groups: list[list[KQuantLinear]] = []
    for layer in linears:
        last = groups[-1][-1] if groups else None
        if last is not None and last.kind == layer.kind and (last.bias is None) == (layer.bias is None):
            groups[-1].append(layer)
        else:
            groups.append([layer])
    return [(group[0] if len(group) == 1 else fuse(group), [layer.out_features for layer in group])
            for group in groups]


class _LeanLayer:
    """One decoder layer's tensors and fused products."""

    def __init__(self, layer: torch.nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.index = attn.layer_idx
        self.norm1, self.eps1 = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.norm2, self.eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon
        self.qkv = _fused_groups([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = attn.o_proj
        self.gate_up = _fused_groups([mlp.gate_proj, mlp.up_proj])
        self.down = mlp.down_proj
        self.head_dim, self.scaling = attn.head_dim, float(attn.scaling)


def _products(groups: list[tuple[KQuantLinear, list[int]]], x: torch.Tensor) -> list[torch.Tensor]:
    """The outputs of the original layers, in order, from their fused groups."""
    parts: list[torch.Tensor] = []
    for module, sizes in groups:
        out = module(x)
        parts.extend(out.split(sizes, dim=-1) if len(sizes) > 1 else (out,))
    return parts


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2RMSNorm / LlamaRMSNorm on float32, the same operations in the same order."""
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return weight * (hidden * torch.rsqrt(variance + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LeanDecoder:
    """The forward of a k-quant llama-style causal LM as one loop (see the module docstring). It
    holds the model's submodules, never the model, so the model owns it without a cycle."""

    def __init__(self, model: torch.nn.Module) -> None:
        base = model.model
        self.embed, self.rotary, self.lm_head = base.embed_tokens, base.rotary_emb, model.lm_head
        self.final_norm, self.final_eps = base.norm.weight, base.norm.variance_epsilon
        self.layers = [_LeanLayer(layer) for layer in base.layers[: model.config.num_hidden_layers]]

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache,
                 logits_to_keep: int = 0) -> torch.Tensor:
        """Logits ``[1, q', V]`` of ``ids [1, q]`` at ``positions [1, q]``, attending through
        ``cache`` (a transformers ``Cache``, updated in place) under ``mask`` (additive float
        ``[1, 1, q, L]``, or None: causal); ``logits_to_keep`` as in transformers (0: all)."""
        ext = _extension()
        hidden = self.embed(ids)
        cos, sin = self.rotary(hidden, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q_len = ids.shape[1]
        rows: torch.Tensor | None = None  # the attention mask's rows for this window, made once
        for layer in self.layers:
            residual = hidden
            x = _rms_norm(hidden, layer.norm1, layer.eps1)
            query, key, value = (t.view(1, q_len, -1, layer.head_dim).transpose(1, 2)
                                 for t in _products(layer.qkv, x))
            query = (query * cos) + (_rotate_half(query) * sin)
            key = (key * cos) + (_rotate_half(key) * sin)
            key, value = cache.update(key, value, layer.index)
            if rows is None:
                rows = _mask_rows(mask, q_len, key.shape[2])
            attended = ext.attention(query[0].contiguous(), key[0].contiguous(), value[0].contiguous(), rows,
                                     layer.scaling)
            hidden = residual + layer.o_proj(attended[None].reshape(1, q_len, -1).contiguous())
            residual = hidden
            x = _rms_norm(hidden, layer.norm2, layer.eps2)
            gate, up = _products(layer.gate_up, x)
            hidden = residual + layer.down(torch.nn.functional.silu(gate) * up)
        hidden = _rms_norm(hidden, self.final_norm, self.final_eps)
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
    and whose attention is the k-quant kernel's (what :func:`kquant_model` builds)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in LEAN_MODEL_TYPES or _extension() is None:
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
    """Give ``model`` (just built by :func:`kquant_model`) its :class:`LeanDecoder` as
    ``model.lean_forward`` when :func:`supports` says so; True when it has one."""
    if ATTRIBUTE not in model.__dict__:
        if not supports(model):
            return False
        model.__dict__[ATTRIBUTE] = LeanDecoder(model)
    return True
