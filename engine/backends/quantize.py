"""Cheap drafts: quantised copies of a CPU float32 draft model.

The draft's outputs only move the acceptance rate, never the engine's output (the target alone
decides every committed token), so the draft may be approximated to make each level cheaper:

- ``int4``: weights as 4-bit integers in groups of 32 input features with a bf16 scale and zero
  per group, activations in bf16, through torch's CPU int4 kernel. One eighth of the fp32
  bytes; on CPUs with AVX-512 bf16 it is 5-8x faster than fp32 per level. The default pair's
  draft comes from a Q4_K GGUF, whose sub-blocks are exactly such groups, so little is lost.
- ``int8``: torch's dynamic int8 linear (weights int8 per tensor, activations quantised per call).
  Fast on AVX2-only CPUs, but its rows depend on the rest of the batch and it agrees less.
- ``q4k``: the target's k-quant kernels (:mod:`engine.backends.kquant`): the GGUF's own Q4_K/Q6_K
  blocks where it has them, the other layers quantised to Q4_K (inputs padded to whole super-blocks
  of 256), activations int8 per super-block, no bf16 conversions.
- ``auto``: q4k where the kernels build, else int4 on CPUs with native bf16, else int8 (see
  :func:`fastest_format`).

The target is another matter: every committed token is its argmax (or its sample), so it must be
computed the same way however many tokens a forward verifies. ``--target-format int4`` keeps it in
its GGUF Q4_K/Q6_K blocks with batch-invariant kernels (:mod:`engine.backends.kquant`), never through the
draft formats above: torch's int4 product rounds activations to bf16 and its attention depends on
the batch width (up to 0.16 in a logit on the real pair), which breaks greedy identity at near-ties.
"""
from __future__ import annotations

import copy
import warnings
from pathlib import Path

import torch

from engine.backends.kernels import on_cpu_fp32, own_memory, unpack_linears
from engine.backends.mapped import FileMapping, file_mappings, own_copy
from engine.kernels.cpu import cpu_flags
from engine.user_cache import save_cache_atomically

DRAFT_FORMATS = ("auto", "int4", "int8", "q4k", "none")
TARGET_FORMATS = ("float32", "int4", "auto")
INT4_GROUP = 32
INT4_CACHE_FORMAT = 1  # bump when pack_int4's layout or rounding changes


class Int4Linear(torch.nn.Module):
    """``y = x @ W.T + b`` with ``W [out, in]`` held as 4-bit groups (see the module docstring).

    ``forward``: ``x [..., in]`` (any float dtype) -> ``[..., out]`` in ``x``'s dtype.
    """

    def __init__(self, linear: torch.nn.Linear, group_size: int = INT4_GROUP,
                 mappings: list[FileMapping] | None = None,
                 quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """``quantized``: ``linear``'s weight as :func:`pack_int4` returned it earlier (from a cache)."""
        super().__init__()
        self.in_features, self.out_features, self.group_size = linear.in_features, linear.out_features, group_size
        packed, scales_zeros = quantized or pack_int4(own_copy(linear.weight, mappings).float(), group_size)
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


def int4_draft(model: torch.nn.Module, cache_file: Path | None = None,
               embedding: torch.nn.Module | None = None) -> torch.nn.Module:
    """A copy of the CPU float32 ``model`` whose ``nn.Linear`` layers (the output head included)
    are :class:`Int4Linear`; ``model`` stays intact.

    ``cache_file``: where the quantised weights of *these exact* float weights are kept (the
    caller names the file after the weights): read from it when it matches the model's layers,
    written to it otherwise, so later starts skip the quantisation. ``embedding``: see
    :func:`quantize_draft`."""
    quantized, mappings = _copy_all_but_linears(model, embedding), file_mappings()
    layers = {name: module for name, module in quantized.named_modules()
              if type(module) is torch.nn.Linear and module.in_features % INT4_GROUP == 0}
    cached = _read_int4_cache(cache_file, layers) if cache_file else None
    for name, linear in layers.items():
        parent, _, attribute = name.rpartition(".")
        setattr(quantized.get_submodule(parent), attribute,
                Int4Linear(linear, mappings=mappings, quantized=cached and cached[name]))
    own_memory(quantized)
    if cache_file and cached is None:
        _write_int4_cache(cache_file, {name: quantized.get_submodule(name) for name in layers})
    return quantized.eval()


def _read_int4_cache(path: Path, layers: dict[str, torch.nn.Linear]
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    """The cached ``(packed, scales_zeros)`` per layer name, or None when the file is missing or
    does not fit ``layers`` (another model, another layout)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(path)
    except (OSError, SafetensorError):
        return None
    cached = {}
    for name, linear in layers.items():
        packed, scales_zeros = tensors.get(f"{name}.packed"), tensors.get(f"{name}.scales_zeros")
        if packed is None or scales_zeros is None or \
                tuple(packed.shape) != (linear.out_features, linear.in_features // 2) or \
                tuple(scales_zeros.shape) != (linear.in_features // INT4_GROUP, linear.out_features, 2):
            return None
        cached[name] = (packed, scales_zeros)
    return cached


def _write_int4_cache(path: Path, layers: dict[str, Int4Linear]) -> None:
    """Write the layers' packed weights (see :func:`save_cache_atomically`)."""
    tensors = {f"{name}.{key}": getattr(layer, key) for name, layer in layers.items()
               for key in ("packed", "scales_zeros")}
    save_cache_atomically(path, tensors, "the int4 draft")


def int8_draft(model: torch.nn.Module, embedding: torch.nn.Module | None = None) -> torch.nn.Module:
    """A copy of the CPU float32 ``model`` whose ``nn.Linear`` layers are torch's dynamic int8
    linear; ``model`` stays intact.

    The int8 product depends on the other rows of the batch, so logits of a tree pass and a
    causal pass differ slightly; a draft's logits only change acceptance. ``embedding``: see
    :func:`quantize_draft`.
    """
    from torch.ao.quantization import quantize_dynamic

    quantized = _copy_all_but_linears(model, embedding)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notice: the op itself is supported
        quantize_dynamic(quantized, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    own_memory(quantized)
    return quantized.eval()


def _copy_all_but_linears(model: torch.nn.Module, embedding: torch.nn.Module | None = None) -> torch.nn.Module:
    """A copy of ``model``'s modules sharing all its tensors: the caller replaces the copy's linear
    layers with quantised ones and gives the rest memory of its own, so ``model`` stays intact
    and no float32 weight is ever duplicated. ``embedding`` (when given) is the copy's input
    embedding in place of ``model``'s, which the copy then neither shares nor copies."""
    if not on_cpu_fp32(model):
        raise ValueError("draft quantisation runs on the CPU in float32; this model is elsewhere")
    unpack_linears(model)  # an engine may have packed it; packed weights cannot be copied
    shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    quantized = copy.deepcopy(model, memo=shared)
    if embedding is not None:
        quantized.set_input_embeddings(embedding)  # before the caller's own_memory: never copied
    return quantized


def draft_format(model: torch.nn.Module) -> str:
    """``"q4k"`` (a k-quant target, :mod:`engine.backends.kquant`), ``"int4"``, ``"int8"`` or ``"none"``:
    how ``model``'s linear layers are stored."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

    from engine.backends.kquant import KQuantLinear

    kinds = {type(m) for m in model.modules()}
    if KQuantLinear in kinds:
        return "q4k"
    return "int4" if Int4Linear in kinds else "int8" if DynamicInt8Linear in kinds else "none"


def quantize_draft(model: torch.nn.Module, fmt: str = "auto", cache_dir: Path | None = None,
                   embedding: torch.nn.Module | None = None, gguf: Path | None = None) -> torch.nn.Module:
    """The draft in format ``fmt`` (one of :data:`DRAFT_FORMATS`). Only CPU float32 drafts are
    quantised; others are returned as they are (``auto``) or refused (an explicit format).
    ``cache_dir``: a folder for the quantised weights of these exact float weights (int4 only).
    ``embedding``: the input embedding a quantised copy takes instead of ``model``'s (e.g. a
    :class:`~engine.backends.gguf_embedding.GGUFEmbedding` of the same rows), so ``model``'s float
    embedding is never copied; unused when ``model`` is returned as it is. ``gguf``: the GGUF file
    ``model`` was dequantised from, whose Q4_K/Q6_K blocks ``q4k`` keeps as they are."""
    if fmt not in DRAFT_FORMATS:
        raise ValueError(f"draft format must be one of {', '.join(DRAFT_FORMATS)}, got {fmt!r}")
    if fmt == "none" or (fmt == "auto" and not on_cpu_fp32(model)):
        return model
    if fmt == "auto":
        fmt = fastest_format()
    if fmt == "q4k":
        from engine.backends.kquant import CACHE_FORMAT
        from engine.backends.kquant_model import kquant_model

        return kquant_model(model, gguf, cache_dir and cache_dir / f"kquant-v{CACHE_FORMAT}.safetensors", embedding)
    if fmt == "int4":
        return int4_draft(model, cache_dir and cache_dir / f"int4-g{INT4_GROUP}-v{INT4_CACHE_FORMAT}.safetensors",
                          embedding)
    return int8_draft(model, embedding)


def target_quantization(fmt: str, model_on_cpu_fp32: bool = True) -> str:
    """What the loader does to a target of format ``fmt`` (one of :data:`TARGET_FORMATS`):
    ``"q4k"`` (the k-quant target of :mod:`engine.backends.kquant`, CPU float32 models only) or ``"none"``.
    ``auto`` is ``q4k`` for a CPU float32 target, float32 elsewhere."""
    if fmt not in TARGET_FORMATS:
        raise ValueError(f"target format must be one of {', '.join(TARGET_FORMATS)}, got {fmt!r}")
    if fmt == "auto":
        return "q4k" if model_on_cpu_fp32 else "none"
    if fmt == "int4" and not model_on_cpu_fp32:
        raise ValueError("the int4 target runs on the CPU in float32 activations: drop --target-format int4 "
                         "or run on the CPU")
    return "none" if fmt == "float32" else "q4k"


def fastest_format() -> str:
    """The draft format for this CPU: ``q4k`` where the k-quant kernels build, else ``int4`` where
    the CPU has native bf16 arithmetic (AVX-512 bf16 or AMX), else ``int8``.

    q4k keeps the GGUF's own blocks, computes each row on its own (int8 activations per row and
    super-block) and runs through the lean forward (:mod:`engine.backends.lean`), two native calls
    a layer. One level of the default draft for 1 / 2 / 4 / 8 tokens, alternating in one process:
    q4k 17 / 20 / 26 / 49 ms, int4 26 / 31 / 42 / 69 ms on a 2-core AVX-512 VNNI + bf16 EPYC
    (2026-11-25); q4k 30 / 33 / 46 / 83 ms, int4 59 / 68 / 78 / 142 ms, int8 44 / 48 / 48 / 58 ms
    on a 2-core AVX2 EPYC, where int4 converts every activation to bf16 in software. int8 quantises
    activations with one scale for the whole batch, so a prompt's outlier token coarsens every
    other row of its prefill (the draft's cache after a prefill differs from its step-by-step
    cache by 30% of its norm); it is the last resort. Decided from what builds and the CPU's
    flags rather than timed: on a shared 2-core machine a start-up timing of these millisecond
    products flips from run to run.
    """
    from engine.kernels.build import kernels_available

    if kernels_available():
        return "q4k"
    return "int4" if cpu_has_bf16() else "int8"


def cpu_has_bf16() -> bool:
    """True when this x86 CPU advertises native bf16 instructions (Linux ``/proc/cpuinfo``)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags
