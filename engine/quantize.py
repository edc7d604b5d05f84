"""Cheap drafts: quantised copies of a CPU float32 draft model.

The draft's outputs only move the acceptance rate, never the engine's output (the target alone
decides every committed token), so the draft may be approximated to make each level cheaper:

- ``int4``: weights as 4-bit integers in groups of 32 input features with a bf16 scale and zero
  per group, activations in bf16, through torch's CPU int4 kernel. One eighth of the fp32
  bytes; on CPUs with AVX-512 bf16 it is 5-8x faster than fp32 per level. The default pair's
  draft comes from a Q4_K GGUF, whose sub-blocks are exactly such groups, so little is lost.
- ``int8``: torch's dynamic int8 linear (weights int8 per tensor, activations quantised per call).
  Fast on AVX2-only CPUs, but its rows depend on the rest of the batch and it agrees less.
- ``auto``: time the formats on a draft-shaped product on this machine and take the fastest.

The target is never quantised: its numerics define the output.
"""
from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Callable

import torch

from .kernels import on_cpu_fp32, own_memory, pack_linears, unpack_linears

DRAFT_FORMATS = ("auto", "int4", "int8", "none")
INT4_GROUP = 32


class Int4Linear(torch.nn.Module):
    """``y = x @ W.T + b`` with ``W [out, in]`` held as 4-bit groups (see the module docstring).

    ``forward``: ``x [..., in]`` (any float dtype) -> ``[..., out]`` in ``x``'s dtype.
    """

    def __init__(self, linear: torch.nn.Linear, group_size: int = INT4_GROUP) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = linear.in_features, linear.out_features, group_size
        packed, scales_zeros = pack_int4(linear.weight.detach().float(), group_size)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scales_zeros)
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


def pack_int4(weight: torch.Tensor, group_size: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit quantisation of ``weight [out, in]`` per group of ``group_size`` inputs.

    Returns torch's packed CPU layout ``[out, in / 2]`` (uint8) and ``scales_zeros
    [in / group_size, out, 2]`` (bf16), with ``w ~= (q - 8) * scale + zero`` for q in 0..15.
    """
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"int4 needs the input size ({in_features}) to be a multiple of {group_size}")
    groups = weight.reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-10)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(out_features, in_features), 2)
    scales_zeros = torch.stack([scale, low + 8 * scale], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return packed, scales_zeros


def int4_draft(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the CPU float32 ``model`` whose ``nn.Linear`` layers (the output head included)
    are :class:`Int4Linear`; ``model`` stays intact."""
    quantized = _copy_all_but_linears(model)
    for parent in list(quantized.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child.in_features % INT4_GROUP == 0:
                setattr(parent, name, Int4Linear(child))
    own_memory(quantized)
    return quantized.eval()


def int8_draft(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the CPU float32 ``model`` whose ``nn.Linear`` layers are torch's dynamic int8
    linear; ``model`` stays intact.

    The int8 product depends on the other rows of the batch, so logits of a tree pass and a
    causal pass differ slightly; a draft's logits only change acceptance.
    """
    from torch.ao.quantization import quantize_dynamic

    quantized = _copy_all_but_linears(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notice: the op itself is supported
        quantize_dynamic(quantized, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    own_memory(quantized)
    return quantized.eval()


def _copy_all_but_linears(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model``'s modules sharing all its tensors: the caller replaces the copy's linear
    layers with quantised ones and gives the rest memory of its own, so ``model`` stays intact
    and no float32 weight is ever duplicated."""
    if not on_cpu_fp32(model):
        raise ValueError("draft quantisation runs on the CPU in float32; this model is elsewhere")
    unpack_linears(model)  # an engine may have packed it; packed weights cannot be copied
    shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return copy.deepcopy(model, memo=shared)


def draft_format(model: torch.nn.Module) -> str:
    """``"int4"``, ``"int8"`` or ``"none"``: how ``model``'s linear layers are stored."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

    kinds = {type(m) for m in model.modules()}
    return "int4" if Int4Linear in kinds else "int8" if DynamicInt8Linear in kinds else "none"


def quantize_draft(model: torch.nn.Module, fmt: str = "auto") -> torch.nn.Module:
    """The draft in format ``fmt`` (one of :data:`DRAFT_FORMATS`). Only CPU float32 drafts are
    quantised; others are returned as they are (``auto``) or refused (an explicit format)."""
    if fmt not in DRAFT_FORMATS:
        raise ValueError(f"draft format must be one of {', '.join(DRAFT_FORMATS)}, got {fmt!r}")
    if fmt == "none" or (fmt == "auto" and not on_cpu_fp32(model)):
        return model
    if fmt == "auto":
        fmt = fastest_format(model.config.hidden_size)
    return {"int4": int4_draft, "int8": int8_draft, "none": lambda m: m}[fmt](model)


def fastest_format(hidden: int, rows: tuple[int, ...] = (1, 4), repeats: int = 5) -> str:
    """The draft format to use on this machine: ``int4`` when it beats fp32 on a ``[4 * hidden,
    hidden]`` product (timed for each of ``rows``; a few milliseconds), else ``int8`` when that
    does, else ``none``.

    int4 comes first because it keeps the draft's agreement with the target (default pair, greedy
    top-1: int4 0.80, fp32 0.81, int8 0.69) at about int8's speed for the narrow levels CPUs draft
    (whole default draft, one level of 1 / 4 tokens: int4 26 / 43 ms, int8 28 / 34 ms, fp32 155 /
    318 ms on an AVX-512 bf16 CPU). Where int4 is slow (no fast bf16), int8 is the fallback.
    """
    linear = torch.nn.Linear(hidden, 4 * hidden, bias=False)
    torch.nn.init.normal_(linear.weight, std=0.02)
    with torch.inference_mode():
        candidates: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"none": _fp32_product(linear)}
        if hidden % INT4_GROUP == 0:
            candidates["int4"] = Int4Linear(linear)
        candidates["int8"] = int8_draft(torch.nn.Sequential(linear))
        times = {name: sum(_median_seconds(fn, torch.randn(n, hidden), repeats) for n in rows)
                 for name, fn in candidates.items()}
    return next((name for name in ("int4", "int8") if times.get(name, math.inf) < times["none"]), "none")


def _fp32_product(linear: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """The float32 product as the engine runs it (packed, see :mod:`engine.kernels`)."""
    packed = copy.deepcopy(linear)
    pack_linears(packed)
    return packed


def _median_seconds(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, repeats: int) -> float:
    fn(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
