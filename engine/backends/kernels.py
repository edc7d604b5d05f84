"""CPU fast path: float32 linear layers on prepacked oneDNN weights.

Decoding is memory-bound: a forward over a handful of tree tokens should cost about what one
token costs. torch's default CPU path (``F.linear`` through MKL) does not get there: one row
streams the weight on one core (~15 GB/s here), and 2-16 rows take a GEMM path that costs 2-3x
one row. oneDNN's inner product on a weight reordered once into its blocked layout uses both
cores at ~35 GB/s for 1-16 rows alike: measured on the 1.5B target's matrices (2 cores, AVX-512),
the MLP's 8960 x 1536 product takes 1.4-2.1 ms for 1-8 rows against 3.3-7 ms, the 151936 x 1536
head 33-48 ms for 1-16 rows against 58-124 ms.

The product is the same float32 product in another summation order (|diff| ~1e-6 per layer,
like any change of BLAS kernel). The packed weight replaces the original (same size, so memory
does not double); :func:`unpack_linears` restores the original exactly.
"""
from __future__ import annotations

import types
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.backends.mapped import backing_file, file_mappings, own_copy, returning_freed_memory


READERS = 4  # threads reading weights off their file at once (capped by torch's thread count)


def packing_available() -> bool:
    """True when this torch build has oneDNN's packed linear (x86 CPU builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packed_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, W, b)`` for ``x [..., in]`` with ``W`` packed by :func:`pack_linears`."""
    return torch.ops.mkldnn._linear_pointwise(x, module.weight, module.bias, "none", [], "")


def pack_linears(model: torch.nn.Module) -> int:
    """Repack every CPU float32 ``nn.Linear`` of ``model`` in place for :func:`packed_linear`;
    returns how many were packed (0 when oneDNN is unavailable). Idempotent."""
    if not packing_available():
        return 0
    with returning_freed_memory():
        return _pack_linears(model)


def _pack_linears(model: torch.nn.Module) -> int:
    count, mappings = 0, file_mappings()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(module) is torch.nn.Linear and not is_packed(module) and weight.device.type == "cpu" \
                and weight.dtype == torch.float32:
            with torch.no_grad():
                dense = own_copy(weight, mappings)  # read off the file: its map never becomes resident
                module.weight = torch.nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(dense, None),
                                                   requires_grad=False)
                del dense
            module.forward = types.MethodType(packed_linear, module)
            module.__deepcopy__ = types.MethodType(_copy_packed, module)  # packed tensors cannot be deep-copied
            count += 1
    if count:
        own_memory(model)
    return count


def own_memory(model: torch.nn.Module, mapped_only: bool = False) -> None:
    """Give ``model``'s dense tensors storage of their own. Weights loaded from safetensors are
    views of one memory map of the file, which stays mapped (and resident) while any view lives:
    once the linear layers are repacked or quantised, copying the few tensors left (embeddings,
    norms, biases) lets the whole file go. Mapped tensors are read from the file
    (:func:`engine.backends.mapped.own_copy`), so the map itself never becomes resident.
    ``mapped_only``: copy only those, for a model whose other tensors are known to be its own."""
    mappings = file_mappings()
    with torch.no_grad():
        tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]
                   if t.device.type == "cpu" and not t.is_mkldnn
                   and (not mapped_only or backing_file(t.data, mappings) is not None)}.values()
        # the reads release the GIL: a warm start copies its 1.3 GB of packed weights on every core
        with ThreadPoolExecutor(max(1, min(READERS, torch.get_num_threads()))) as pool:
            copies = list(pool.map(lambda tensor: own_copy(tensor.data, mappings), tensors))
        for tensor, copy in zip(tensors, copies):
            tensor.data = copy


def unpack_linears(model: torch.nn.Module) -> int:
    """Undo :func:`pack_linears`: dense weights (bit-identical to the originals) and torch's own
    ``forward``; returns how many layers were restored."""
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and is_packed(module):
            module.weight = torch.nn.Parameter(module.weight.detach().to_dense(), requires_grad=False)
            del module.forward, module.__deepcopy__  # back to nn.Linear's own
            count += 1
    return count


def _copy_packed(module: torch.nn.Linear, memo: dict) -> torch.nn.Linear:
    """``copy.deepcopy`` of a packed layer: a packed layer of its own with the same weights."""
    twin = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
    twin.weight = torch.nn.Parameter(module.weight.detach().to_dense(), requires_grad=False)
    if module.bias is not None:
        twin.bias = torch.nn.Parameter(module.bias.detach().clone(), requires_grad=False)
    pack_linears(twin)
    memo[id(module)] = twin
    return twin


def is_packed(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.is_mkldnn


def on_cpu_fp32(model: torch.nn.Module) -> bool:
    """True when ``model``'s first floating parameter lives on the CPU in float32."""
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    return param is not None and param.device.type == "cpu" and param.dtype == torch.float32


def prepare(*models: torch.nn.Module | None) -> None:
    """Ready models for the engine's CPU fast path, in place: every CPU float32 ``nn.Linear``
    is repacked for oneDNN (:func:`pack_linears`); other models, and a quantised draft (no float32
    ``nn.Linear`` left, see :mod:`engine.backends.quantize`), are untouched. An explicit step, taken by the
    loaders (:func:`engine.models.loading.load_pair`) and never by building an engine: a caller's model
    stays as it was unless the caller prepares it. :func:`unpack_linears` undoes it."""
    for model in models:
        if model is not None and on_cpu_fp32(model):
            pack_linears(model)
