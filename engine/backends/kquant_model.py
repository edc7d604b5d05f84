"""Whole k-quant models: a float model's (or a GGUF's) linear layers packed into
:class:`~engine.backends.kquant.KQuantLinear`, the packed layers cached per weights file, and the
model readied to run (the k-quant attention, :class:`~engine.backends.kquant.FixedSiLU` and the
lean forward of :mod:`engine.backends.lean`).

The layers and their packing are :mod:`engine.backends.kquant`'s, the compiled kernels they call
are built and loaded by :mod:`engine.kernels`; this module stands above the layers and the lean
forward, which runs on the layers' packed tensors.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from engine.backends.gguf_file import GGUFTensor, read_blocks, tensor_table
from engine.backends.kquant import ATTENTION_NAME, PACKED_NAMES, TILE, KQuantLinear, packed_bytes, padded_size, \
    quantize_q4k, register_attention, use_fixed_activation
from engine.backends.lean import attach

# GGUF tensor name (after ``blk.N.``) -> Hugging Face module path (after ``model.layers.N.``), for
# the llama-style architectures whose converters keep q/k unpermuted (qwen2).
GGUF_LINEARS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_linear_tensors(table: dict[str, GGUFTensor]) -> dict[str, GGUFTensor]:
    """Hugging Face module name -> GGUF tensor for every linear layer of a llama-style GGUF's
    ``table`` (:func:`engine.backends.gguf_file.tensor_table`; the output head included), whatever its type."""
    linears = {}
    for tensor in table.values():
        parts = tensor.name.split(".")
        if parts[-1] != "weight" or len(tensor.dims) != 2:
            continue
        if parts[0] == "blk" and parts[2] in GGUF_LINEARS:
            linears[f"model.layers.{parts[1]}.{GGUF_LINEARS[parts[2]]}"] = tensor
        elif tensor.name == "output.weight":
            linears["lm_head"] = tensor
    return linears


def pack_gguf_tensor(gguf_path: Path, tensor: GGUFTensor, row_order: list[int] | None = None,
                     dequantise_unserved: bool = False) -> tuple[str, dict[str, torch.Tensor]]:
    """``(kind, packed tensors)`` of a GGUF matrix, its blocks served exactly as stored
    (:func:`~engine.backends.blocks.pack_blocks`: every type llama-quantize writes), its rows taken
    in ``row_order`` when given (whole rows of blocks: exact). A type no kernel serves raises
    :class:`~engine.backends.blocks.UnsupportedBlockType` (nothing is re-quantised behind the
    file's back), or with ``dequantise_unserved`` is dequantised to float32 (the values
    transformers' reader gives)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from engine.backends.blocks import SERVED_TYPES, UnsupportedBlockType, pack_blocks, pack_float

    served = tensor.qtype in SERVED_TYPES
    if not served and not dequantise_unserved:
        raise UnsupportedBlockType(f"{gguf_path.name}: {tensor.name} is {GGMLQuantizationType(tensor.qtype).name}, "
                                   f"a block type without a kernel here (served: "
                                   f"{', '.join(sorted(t.name for t in SERVED_TYPES))}); "
                                   f"--dequantise-unserved runs it as float32")
    blocks = read_blocks(gguf_path, tensor)
    if row_order is not None:
        blocks = blocks[row_order]
    if served:
        return pack_blocks(tensor.qtype, blocks, tensor.dims[0])
    return pack_float(torch.from_numpy(dequantize(blocks, tensor.qtype).astype("float32")))


def kquant_model(model: torch.nn.Module, gguf_path: Path | None = None, cache_file: Path | None = None,
                 embedding: torch.nn.Module | None = None) -> torch.nn.Module:
    """A copy of the CPU float32 ``model`` whose linear layers are :class:`KQuantLinear` and whose
    attention is :func:`~engine.backends.kquant.kquant_attention`; ``model`` is not changed, and no
    float32 weight of a replaced layer is read.

    With ``gguf_path`` (the GGUF ``model`` was dequantised from) the layers keep that file's own
    blocks of any served type, exactly (:mod:`engine.backends.blocks`); layers the file does not
    hold (and every layer without a GGUF) are quantised to Q4_K by
    :func:`~engine.backends.kquant.quantize_q4k` when their outputs are a multiple of 16
    (inputs are padded with zeros to whole super-blocks of 256).
    ``cache_file``: where the packed layers of *these exact* weights are kept (the caller names
    it after them): read when present and fitting, written otherwise, so later starts skip packing.
    ``embedding``: the input embedding the copy takes instead of ``model``'s (e.g. a
    :class:`~engine.backends.gguf_embedding.GGUFEmbedding`); ``model``'s is then never copied."""
    from engine.backends.kernels import on_cpu_fp32

    if not on_cpu_fp32(model):
        raise ValueError("the int4 target is built from a CPU float32 model; this one is elsewhere")
    layers = (cache_file and read_cache(cache_file, model)) or _pack_layers(model, gguf_path)
    if cache_file and not cache_file.exists():
        write_cache(cache_file, layers)
    memo = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    memo.update({id(model.get_submodule(name)): layer for name, layer in layers.items()})
    quantized = copy.deepcopy(model, memo)  # shares every tensor left; the replaced layers are the new ones
    if embedding is not None:
        quantized.set_input_embeddings(embedding)  # before own_memory: the float one is never copied
    return finish_kquant(quantized)


def finish_kquant(model: torch.nn.Module, mapped_only: bool = False) -> torch.nn.Module:
    """Ready a model whose linear layers are :class:`KQuantLinear`: its tensors get memory of their
    own (only those mapped from a file with ``mapped_only``, see
    :func:`engine.backends.kernels.own_memory`), attention becomes
    :func:`~engine.backends.kquant.kquant_attention` and the lean forward is attached."""
    from engine.backends.kernels import own_memory

    register_attention()
    own_memory(model, mapped_only)
    model.set_attn_implementation(ATTENTION_NAME)
    use_fixed_activation(model)
    attach(model)
    return model.eval()


def _pack_layers(model: torch.nn.Module, gguf_path: Path | None) -> dict[str, KQuantLinear]:
    from_file = {name: t for name, t in gguf_linear_tensors(tensor_table(gguf_path)).items()
                 if t.rows % TILE == 0} if gguf_path else {}
    layers = {}
    for name, linear in model.named_modules():
        if type(linear) is not torch.nn.Linear:
            continue
        if name in from_file:
            tensor = from_file[name]
            if (tensor.rows, tensor.dims[0]) != (linear.out_features, linear.in_features):
                raise ValueError(f"{gguf_path.name}: {name} does not match the model's layer")
            layers[name] = KQuantLinear(*pack_gguf_tensor(gguf_path, tensor), linear.in_features,
                                        linear.out_features, linear.bias)
        elif linear.out_features % TILE == 0:
            weight = linear.weight.detach()
            weight = weight.to_dense() if weight.is_mkldnn else weight
            padded = torch.nn.functional.pad(weight.float(), (0, padded_size(linear.in_features) - linear.in_features))
            layers[name] = KQuantLinear("q4k", quantize_q4k(padded), linear.in_features, linear.out_features,
                                        linear.bias)
    return layers


def read_cache(path: Path, model: torch.nn.Module) -> dict[str, KQuantLinear] | None:
    """The cached layers when the file exists and fits ``model``'s linear layers, else None."""
    import json

    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            kinds = json.loads(f.metadata()["kinds"])
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except (OSError, SafetensorError, KeyError, ValueError):
        return None
    layers = {}
    for name, kind in kinds.items():
        try:
            linear = model.get_submodule(name)
        except AttributeError:
            return None
        if type(linear) is not torch.nn.Linear:
            return None
        parts = {key.rpartition(".")[2]: t for key, t in tensors.items() if key.rpartition(".")[0] == name}
        main = parts.get(PACKED_NAMES[kind][0]) if kind in PACKED_NAMES else None
        if main is None or main.numel() * main.element_size() != packed_bytes(kind, linear.out_features,
                                                                                linear.in_features):
            return None
        layers[name] = KQuantLinear(kind, parts, linear.in_features, linear.out_features, linear.bias)
    return layers


def write_cache(path: Path, layers: dict[str, KQuantLinear]) -> None:
    """Write the packed layers atomically; a failure only costs packing again at the next start."""
    import json

    from engine.user_cache import save_cache_atomically

    tensors = {f"{name}.{key}": t for name, layer in layers.items() for key, t in layer.packed().items()}
    save_cache_atomically(path, tensors, "the int4 target",
                          metadata={"kinds": json.dumps({n: layer.kind for n, layer in layers.items()})})
