"""Any served GGUF file (:mod:`engine.models.gguf_arch`) built straight into the engine's model,
its matrices as the file stores them, with no float32 copy of its weights at any point.

transformers' ``gguf_file=`` loader dequantises every tensor to float. The engine needs none of
that: its linear layers are the file's own blocks (:func:`~engine.backends.kquant_model.pack_gguf_tensor`, through the kernels of
:mod:`engine.backends.blocks`), its token embedding stays in its blocks
(:class:`engine.backends.gguf_embedding.GGUFEmbedding`) and only the norms and biases are read as
float32. The model skeleton comes from the config with its parameters on the meta device
(accelerate's ``init_empty_weights``), so nothing is allocated twice.

The config comes from the file's hyperparameters (:func:`engine.models.gguf_arch.config_values`),
the tokenizer from the file's ``tokenizer.ggml.*`` through transformers' converter; both are saved
once beside the packed weights (``<cache>/kquant/<file>-<identity>-v2``, :func:`model_dir`), and later
starts read those small files.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.backends.gguf_embedding import TOKEN_EMBEDDING, gguf_embedding
from engine.backends.gguf_file import GGUFTensor, MetadataReader, read_dequantised, read_header, tensor_table
from engine.backends.kquant import CACHE_FORMAT, KQuantLinear
from engine.backends.kquant_model import finish_kquant, gguf_linear_tensors, pack_gguf_tensor, read_cache, \
    write_cache
from engine.errors import ModelLoadError
from engine.models.gguf_arch import DEFAULT_TEMPLATES, Architecture, architecture_of, config_values, \
    end_of_turn_ids, hf_config, rope_freq_factors, unpermute_rows

log = logging.getLogger(__name__)

METADATA_FORMAT = 3  # bump when the files kept beside the packed weights change (2: any file, keyed by identity; 3: pad/unk ids, qwen2 without head_dim)
# One first-start metadata reading at a time: it swaps two module globals of gguf and transformers.
_METADATA_LOCK = threading.Lock()
# Tokenizers loaded from a kept directory, by the digest of the files that define them (all but the
# chat template, the config and the weights): a draft whose files equal its target's shares them.
_TOKENIZERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_TOKENIZERS_LOCK = threading.Lock()
NOT_TOKENIZER_FILES = ("config.json", "chat_template.jinja")


def file_identity(gguf: Path, table: dict[str, GGUFTensor] | None = None) -> str:
    """What names a GGUF file's kept files: its size and a hash of its header (metadata and tensor
    table, which name every tensor's type, shape and place), not of its gigabytes of blocks. A file
    edited in place keeps its size only if its header keeps its length; its header hash then moves.
    ``table``: the file's tensor table, when the caller has read it already."""
    size = gguf.stat().st_size
    header = min((t.offset for t in (tensor_table(gguf) if table is None else table).values()), default=size)
    digest = hashlib.sha256(str(size).encode())
    with open(gguf, "rb") as f:
        digest.update(f.read(header))
    return digest.hexdigest()[:16]


def model_dir(gguf: Path, table: dict[str, GGUFTensor] | None = None) -> Path:
    """Where the packed weights, config and tokenizer of the GGUF file ``gguf`` are kept (``table``:
    its tensor table, when read already)."""
    from engine.user_cache import cache_dir

    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in gguf.stem)[:80]
    return cache_dir() / "kquant" / f"{stem}-{file_identity(gguf, table)}-v{METADATA_FORMAT}"


@dataclass(frozen=True)
class GGUFModelFile:
    """One GGUF file read for serving: its metadata, tensor table and served architecture."""

    path: Path
    metadata: dict
    table: dict[str, GGUFTensor]
    arch: Architecture

    @property
    def tokens(self) -> list[str]:
        return list(self.metadata.get("tokenizer.ggml.tokens") or [])

    @property
    def vocab_rows(self) -> int:
        return self.table[TOKEN_EMBEDDING].rows


def open_gguf(path: str | Path) -> GGUFModelFile:
    """Read and check a GGUF model file's header: one-line :class:`ModelLoadError` for a file that
    is not a GGUF, is damaged, or is not a causal LM of a served architecture."""
    path = Path(path)
    try:
        metadata, table = read_header(path)
    except (OSError, ValueError) as exc:
        message = str(exc).replace("\n", " ")
        raise ModelLoadError(message if path.name in message else f"{path.name}: {message}") from exc
    arch = architecture_of(metadata, path.name)
    if TOKEN_EMBEDDING not in table or len(table[TOKEN_EMBEDDING].dims) != 2:
        raise ModelLoadError(f"{path.name} has no token embedding ({TOKEN_EMBEDDING}): not a causal LM file")
    if not metadata.get("tokenizer.ggml.tokens") or "tokenizer.ggml.model" not in metadata:
        raise ModelLoadError(f"{path.name} has no tokenizer (tokenizer.ggml.tokens / .model): a GGUF written "
                             f"without one cannot be served")
    return GGUFModelFile(path, metadata, table, arch)


def load_gguf(path: str | Path, dequantise_unserved: bool = False):
    """``(model, tokenizer)`` for any served GGUF file, the model's matrices as the file stores
    them (:func:`engine.backends.kquant_model.pack_gguf_tensor`), its tokenizer and chat template
    the file's own. Its config, tokenizer and packed weights are kept in :func:`model_dir` for
    later starts. ``dequantise_unserved``: a block type without a kernel is dequantised to float32
    (said in the log and the model's ``as_stored`` note) instead of refused."""
    from transformers import AutoConfig

    source = open_gguf(path)
    directory = model_dir(source.path, source.table)
    if not (directory / "config.json").exists():
        _save_metadata(source, directory)
    config = AutoConfig.from_pretrained(directory)
    cache_file = directory / f"kquant-v{CACHE_FORMAT}{'-f32' if dequantise_unserved else ''}.safetensors"
    model = build_model(source, config, cache_file, dequantise_unserved)
    return model, load_tokenizer(directory)


def load_tokenizer(directory: Path):
    """The tokenizer kept in ``directory``. When a tokenizer of the same files is already loaded
    (the embedded draft's equal its target's but for the chat template), a shallow copy of it with
    this directory's chat template is returned: building a 151,936-token BPE tokenizer takes
    about 1 s of a warm start. The copy shares the loaded one's backend, as two users of one
    tokenizer do."""
    from transformers import AutoTokenizer

    _keep_added_tokens(directory)
    digest = hashlib.sha256()
    for path in sorted(directory.iterdir()):
        if path.name not in NOT_TOKENIZER_FILES and path.suffix != ".safetensors" and path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    key = digest.hexdigest()
    with _TOKENIZERS_LOCK:
        loaded = _TOKENIZERS.get(key)
    if loaded is None:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        with _TOKENIZERS_LOCK:
            _TOKENIZERS[key] = tokenizer
        return tokenizer
    twin = copy.copy(loaded)
    template = directory / "chat_template.jinja"
    twin.chat_template = template.read_text(encoding="utf-8") if template.is_file() else None
    return twin


def _keep_added_tokens(directory: Path) -> None:
    """Copy the added tokens' table of ``directory``'s ``tokenizer.json`` into its
    ``tokenizer_config.json`` (as ``added_tokens_decoder``), once. ``save_pretrained`` keeps them in
    ``tokenizer.json`` only, and without the table transformers parses that whole 11 MB file in
    Python once more at every load (about 0.3 s of a warm start) just to read them. The same
    entries either way, so the same tokenizer."""
    settings_file = directory / "tokenizer_config.json"
    try:
        settings = json.loads(settings_file.read_text(encoding="utf-8"))
        if "added_tokens_decoder" in settings:
            return
        added = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    except (OSError, ValueError, KeyError):
        return  # not a kept tokenizer of this form: transformers reads it its own way
    settings["added_tokens_decoder"] = {str(token.pop("id")): token for token in added}
    partial = settings_file.with_name(f"{settings_file.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(settings, indent=2, ensure_ascii=False), encoding="utf-8")
    os.replace(partial, settings_file)  # atomic: a concurrent start reads the old file or the new one


def build_model(source: GGUFModelFile, config, cache_file: Path | None = None,
                dequantise_unserved: bool = False) -> torch.nn.Module:
    """The model ``config`` describes, every weight from ``source``'s file: linear layers as
    :class:`KQuantLinear` of the file's own blocks (packed once into ``cache_file`` when given, read
    back from it later), the token embedding in its blocks, norms and biases as float32."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    gguf, table, arch = source.path, source.table, source.arch
    # parameters on the meta device, buffers (rotary) real; no random initialisation of parameters
    # that every one gets replaced below (on the meta device it still costs about 0.1 s a model)
    with init_empty_weights(include_buffers=False), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    layers = (cache_file and read_cache(cache_file, model)) or _pack(source, model, dequantise_unserved)
    if cache_file and not cache_file.exists():
        write_cache(cache_file, layers)
        for stale in cache_file.parent.glob("kquant-v*.safetensors"):  # packed for an older layout
            if stale != cache_file and stale.name.endswith("-f32.safetensors") == cache_file.name.endswith("-f32.safetensors"):
                stale.unlink(missing_ok=True)
    for name, layer in layers.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    with torch.no_grad():
        for hf_name, tensor in float_tensors(arch, table).items():
            module_name, _, attribute = hf_name.rpartition(".")
            values = torch.from_numpy(read_dequantised(gguf, tensor))
            if arch.norm_offset and "norm" in hf_name:
                values = values + arch.norm_offset
            setattr(model.get_submodule(module_name), attribute, torch.nn.Parameter(values, requires_grad=False))
    embedding = gguf_embedding(gguf, TOKEN_EMBEDDING, table)
    model.set_input_embeddings(ScaledEmbedding(embedding, config.hidden_size ** 0.5) if arch.embedding_scale
                               else embedding)
    _apply_rope_freqs(source, model)
    missing = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise ModelLoadError(f"{gguf.name} has no tensor for {', '.join(missing[:3])}"
                             f"{' …' if len(missing) > 3 else ''}: an incomplete {arch.name} GGUF")
    stops = end_of_turn_ids(source.metadata, source.tokens)
    model.generation_config.eos_token_id = stops[0] if len(stops) == 1 else stops or None  # one as an int, as HF's
    model.as_stored = stored_types(source, dequantise_unserved)
    model.gguf_source = source  # what the pair rule reads (engine.models.pair_rule)
    return finish_kquant(model, mapped_only=True)  # the rest was read or packed into memory of its own


class ScaledEmbedding(torch.nn.Module):
    """Gemma's token embedding: the rows times ``sqrt(hidden)`` (a float32 product, as
    ``Gemma3TextScaledWordEmbedding`` computes it), the rows kept in their GGUF blocks."""

    def __init__(self, inner: torch.nn.Module, scale: float) -> None:
        super().__init__()
        self.inner, self.num_embeddings, self.embedding_dim = inner, inner.num_embeddings, inner.embedding_dim
        self.register_buffer("embed_scale", torch.tensor(scale, dtype=torch.float32), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids) * self.embed_scale


def float_tensors(arch: Architecture, table: dict[str, GGUFTensor]) -> dict[str, GGUFTensor]:
    """Hugging Face parameter name -> GGUF tensor for the norms and biases."""
    floats = {}
    for name, tensor in table.items():
        parts = name.split(".", 2)
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in arch.floats:
            floats[f"model.layers.{parts[1]}.{arch.floats[parts[2]]}"] = tensor
    if "output_norm.weight" in table:
        floats["model.norm.weight"] = table["output_norm.weight"]
    return floats


def _pack(source: GGUFModelFile, model: torch.nn.Module, dequantise_unserved: bool) -> dict[str, KQuantLinear]:
    """Every linear layer of ``model`` packed from its GGUF tensor as stored (q/k rows of the llama
    family back in Hugging Face's order)."""
    tensors = gguf_linear_tensors(source.table)
    tensors.setdefault("lm_head", source.table[TOKEN_EMBEDDING])  # a tied output head
    linears = {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    for name, linear in linears.items():
        tensor = tensors.get(name)
        if tensor is None or (tensor.rows, tensor.dims[0]) != (linear.out_features, linear.in_features):
            raise ModelLoadError(f"{source.path.name}: no tensor of {linear.out_features} x {linear.in_features} "
                                 f"for {name}: an incomplete or inconsistent {source.arch.name} GGUF")
    orders = _row_orders(source, model.config, linears)

    def pack(name: str):
        try:
            return pack_gguf_tensor(source.path, tensors[name], orders.get(name), dequantise_unserved)
        except ValueError as exc:  # UnsupportedBlockType and a damaged tensor: one line naming the file
            raise ModelLoadError(str(exc) if source.path.name in str(exc) else f"{source.path.name}: {exc}") from exc

    # numpy's array work releases the GIL: one thread a core packs the layers side by side
    with ThreadPoolExecutor(max(1, min(len(os.sched_getaffinity(0)), 4))) as pool:
        packed = dict(zip(linears, pool.map(pack, linears)))
    return {name: KQuantLinear(*packed[name], linear.in_features, linear.out_features) for name, linear in linears.items()}


def _row_orders(source: GGUFModelFile, config, linears: dict) -> dict[str, list[int]]:
    """The row orders that undo llama.cpp's q/k permutation (the llama family only)."""
    if not source.arch.permuted_qk:
        return {}
    orders = {}
    for name, linear in linears.items():
        if name.endswith("self_attn.q_proj"):
            orders[name] = unpermute_rows(config.num_attention_heads, linear.out_features)
        elif name.endswith("self_attn.k_proj"):
            orders[name] = unpermute_rows(config.num_key_value_heads, linear.out_features)
    return orders


def _apply_rope_freqs(source: GGUFModelFile, model: torch.nn.Module) -> None:
    """Llama 3.x's per-pair frequency factors (the ``rope_freqs`` tensor), as llama.cpp applies them:
    each rotary pair's inverse frequency divided by its factor."""
    tensor = source.table.get("rope_freqs.weight")
    if tensor is None:
        return
    rotary = model.model.rotary_emb
    factors = torch.tensor(rope_freq_factors(read_dequantised(source.path, tensor).tolist(),
                                             2 * rotary.inv_freq.numel()), dtype=torch.float32)
    rotary.inv_freq = rotary.inv_freq / factors
    rotary.original_inv_freq = rotary.inv_freq


def stored_types(source: GGUFModelFile, dequantised: bool) -> str:
    """The block types of the file's matrices, largest share first ("Q4_K 62%, Q6_K 12%, ..."), and
    whether any was dequantised: the model card's note."""
    from collections import Counter

    from engine.backends.blocks import SERVED_TYPES

    weights = Counter()
    for tensor in source.table.values():
        if len(tensor.dims) == 2:
            weights[tensor.qtype] += tensor.rows * tensor.dims[0]
    total = sum(weights.values()) or 1
    note = ", ".join(f"{t.name} {100 * n / total:.0f}%" for t, n in weights.most_common())
    unserved = [t.name for t in weights if t not in SERVED_TYPES]
    return note + (f"; {', '.join(unserved)} dequantised to float32" if dequantised and unserved else "")


def _save_metadata(source: GGUFModelFile, directory: Path) -> None:
    """The config (from the file's hyperparameters, :mod:`engine.models.gguf_arch`) and the tokenizer
    (transformers' conversion of the file's ``tokenizer.ggml.*``, with the file's chat template or
    its family's when it carries none), written atomically."""
    from transformers import AutoTokenizer

    table, arch = source.table, source.arch
    tied = "output.weight" not in table
    has_bias = any(name.endswith("attn_q.bias") for name in table)
    config = hf_config(arch, config_values(arch, source.metadata, source.vocab_rows, tied, has_bias))
    log.info("reading the tokenizer of %s (once)", source.path.name)
    try:
        with _METADATA_LOCK, _fast_metadata_reading():
            tokenizer = AutoTokenizer.from_pretrained(source.path.parent, gguf_file=source.path.name)
    except Exception as exc:  # noqa: BLE001 - transformers' converter raises many kinds for a tokenizer it cannot read
        raise ModelLoadError(f"{source.path.name}: its tokenizer could not be read ({exc})".replace("\n", " ")) from exc
    if not tokenizer.chat_template:
        tokenizer.chat_template = source.metadata.get("tokenizer.chat_template") or DEFAULT_TEMPLATES.get(arch.name)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=directory.name + ".partial-"))
    try:
        settings = config.to_dict()
        settings.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(settings, indent=2))
        tokenizer.save_pretrained(tmp)
        if directory.exists():  # packed weights of an earlier, incomplete start are kept
            for kept in directory.iterdir():
                if kept.suffix == ".safetensors":
                    os.replace(kept, tmp / kept.name)
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    except OSError as exc:
        raise ModelLoadError(f"could not write {directory} ({exc}): check the cache folder's free space") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _fast_metadata_reading() -> Iterator[None]:
    """transformers reads a qwen2 GGUF's metadata for the config with ``gguf.GGUFReader`` (about
    7 s: it builds an array per value of the 151k-token vocabulary), and reads it again for the
    tokenizer. Within this block the reader is :class:`engine.backends.gguf_file.MetadataReader`
    (the same fields in a fraction of a second) and the first reading of a file
    (``load_gguf_checkpoint`` without tensors) serves the later ones, each caller getting a copy.
    The swap is process-wide while it lasts (a first start's few seconds): it serves only the
    metadata readings made inside it, one at a time (``_METADATA_LOCK``)."""
    import gguf
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    original_reader, original_reading, readings = gguf.GGUFReader, gguf_utils.load_gguf_checkpoint, {}

    def shared(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return original_reading(path, return_tensors, **kwargs)
        key = os.fspath(path)
        if key not in readings:
            readings[key] = original_reading(path, return_tensors=False)
        return copy.deepcopy(readings[key])

    gguf.GGUFReader, gguf_utils.load_gguf_checkpoint = MetadataReader, shared
    try:
        yield
    finally:
        gguf.GGUFReader, gguf_utils.load_gguf_checkpoint = original_reader, original_reading
