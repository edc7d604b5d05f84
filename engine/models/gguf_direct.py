"""An embedded model built straight from its GGUF file in the k-quant format, with no float32 copy
of its weights at any point.

transformers' ``gguf_file=`` loader dequantises every tensor to float (about a minute per model
here, and 9.6 GB of safetensors to keep it). A k-quant model needs none of that: its linear layers
are the file's own Q4_K/Q6_K blocks (:func:`engine.backends.kquant_model.pack_gguf_tensor`; other types
are dequantised one matrix at a time and quantised to Q4_K), its token embedding stays in its
blocks (:class:`engine.backends.gguf_embedding.GGUFEmbedding`) and only the norms and biases are
read as float32. The model skeleton comes from the config with its parameters on the meta device
(accelerate's ``init_empty_weights``), so nothing is allocated twice.

The config and tokenizer are what transformers derives from the GGUF's metadata, saved once beside
the packed weights (``<cache>/kquant/<model>-v1``); later starts read those small files.
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
from pathlib import Path

import torch

from engine.backends.gguf_embedding import TOKEN_EMBEDDING, gguf_embedding
from engine.backends.gguf_file import GGUFTensor, MetadataReader, read_dequantised, tensor_table
from engine.backends.kquant import CACHE_FORMAT, KQuantLinear
from engine.backends.kquant_model import GGUF_LINEARS, finish_kquant, gguf_linear_tensors, pack_gguf_tensor, \
    read_cache, write_cache
from engine.errors import ModelLoadError

log = logging.getLogger(__name__)

METADATA_FORMAT = 1  # bump when the files kept beside the packed weights change
# GGUF tensor name (after ``blk.N.``) -> Hugging Face parameter (after ``model.layers.N.``) for the
# float tensors of a qwen2-style block: the linear layers' biases and the two norms.
GGUF_BLOCK_FLOATS = {
    **{f"{gguf}.bias": f"{hf}.bias" for gguf, hf in GGUF_LINEARS.items()},
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
}
GGUF_FLOATS = {"output_norm.weight": "model.norm.weight"}
# One first-start metadata reading at a time: it swaps two module globals of gguf and transformers.
_METADATA_LOCK = threading.Lock()
# Tokenizers loaded from a kept directory, by the digest of the files that define them (all but the
# chat template, the config and the weights): a draft whose files equal its target's shares them.
_TOKENIZERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_TOKENIZERS_LOCK = threading.Lock()
NOT_TOKENIZER_FILES = ("config.json", "chat_template.jinja")


def kquant_dir(name: str) -> Path:
    """Where the packed weights, config and tokenizer of embedded model ``name`` are kept."""
    from engine.user_cache import cache_dir

    return cache_dir() / "kquant" / f"{name}-v{METADATA_FORMAT}"


def load_kquant_gguf(gguf: Path, directory: Path):
    """``(model, tokenizer)`` for the GGUF at ``gguf`` (a qwen2-style file), the model in the
    k-quant format; ``directory`` keeps its config, tokenizer and packed weights for later starts."""
    from transformers import AutoConfig

    if not (directory / "config.json").exists():
        _save_metadata(gguf, directory)
    config = AutoConfig.from_pretrained(directory)
    return kquant_from_gguf(gguf, config, directory / f"kquant-v{CACHE_FORMAT}.safetensors"), load_tokenizer(directory)


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


def kquant_from_gguf(gguf: Path, config, cache_file: Path | None = None) -> torch.nn.Module:
    """The model ``config`` describes, with every weight from ``gguf`` and its linear layers as
    :class:`KQuantLinear` (packed once into ``cache_file`` when given, read back from it later).
    Bit-identical to :func:`engine.backends.kquant_model.kquant_model` of the float32 model
    transformers loads from the same file, without building that model."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    table = tensor_table(gguf)
    # parameters on the meta device, buffers (rotary) real; no random initialisation of parameters
    # that every one gets replaced below (on the meta device it still costs about 0.1 s a model)
    with init_empty_weights(include_buffers=False), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    layers = (cache_file and read_cache(cache_file, model)) or _pack(gguf, table, model)
    if cache_file and not cache_file.exists():
        write_cache(cache_file, layers)
        for stale in cache_file.parent.glob("kquant-v*.safetensors"):  # packed for an older layout
            if stale != cache_file:
                stale.unlink(missing_ok=True)
    for name, layer in layers.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    with torch.no_grad():
        for hf_name, tensor in _float_tensors(table).items():
            module_name, _, attribute = hf_name.rpartition(".")
            values = torch.from_numpy(read_dequantised(gguf, tensor))
            setattr(model.get_submodule(module_name), attribute, torch.nn.Parameter(values, requires_grad=False))
    if TOKEN_EMBEDDING in table:
        model.set_input_embeddings(gguf_embedding(gguf, TOKEN_EMBEDDING, table))
    missing = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise ModelLoadError(f"{gguf.name} has no tensor for {', '.join(missing[:3])}"
                             f"{' …' if len(missing) > 3 else ''}: not a qwen2-style GGUF")
    return finish_kquant(model, mapped_only=True)  # the rest was read or packed into memory of its own


def _pack(gguf: Path, table: dict[str, GGUFTensor], model: torch.nn.Module) -> dict[str, KQuantLinear]:
    """Every linear layer of ``model`` packed from its GGUF tensor (a tied output head from the token embedding)."""
    tensors = gguf_linear_tensors(table)
    if "lm_head" not in tensors and TOKEN_EMBEDDING in table:
        tensors["lm_head"] = table[TOKEN_EMBEDDING]
    linears = {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    for name, linear in linears.items():
        tensor = tensors.get(name)
        if tensor is None or (tensor.rows, tensor.dims[0]) != (linear.out_features, linear.in_features):
            raise ModelLoadError(f"{gguf.name}: no tensor of {linear.out_features} x {linear.in_features} "
                                 f"for {name}: not a qwen2-style GGUF")
    # numpy's array work releases the GIL: one thread a core packs the layers side by side
    with ThreadPoolExecutor(max(1, min(len(os.sched_getaffinity(0)), 4))) as pool:
        packed = dict(zip(linears, pool.map(lambda name: pack_gguf_tensor(gguf, tensors[name]), linears)))
    return {name: KQuantLinear(*packed[name], linear.in_features, linear.out_features) for name, linear in linears.items()}


def _float_tensors(table: dict[str, GGUFTensor]) -> dict[str, GGUFTensor]:
    """Hugging Face parameter name -> GGUF tensor for the biases and norms."""
    floats = {}
    for name, tensor in table.items():
        parts = name.split(".", 2)
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in GGUF_BLOCK_FLOATS:
            floats[f"model.layers.{parts[1]}.{GGUF_BLOCK_FLOATS[parts[2]]}"] = tensor
        elif name in GGUF_FLOATS:
            floats[GGUF_FLOATS[name]] = tensor
    return floats


def _save_metadata(gguf: Path, directory: Path) -> None:
    """The config and tokenizer transformers derives from ``gguf``'s metadata, written atomically."""
    from transformers import AutoConfig, AutoTokenizer

    log.info("reading the config and tokenizer of %s (once)", gguf.name)
    with _METADATA_LOCK, _fast_metadata_reading():
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
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
