"""Model pairs for the app: which model names the UI may load (:func:`validate_model_id`) and how
they load, how a loaded pair becomes an engine (:func:`make_engine`) and what the Models panel
says of it (:func:`describe_pair`); the real Qwen tokenizer alone, and a tiny random pair over it
for trying the UI without the real weights. The auto-tuner comes from
:func:`engine.tuning.optimizer.load_tuner`."""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from engine.backends.gguf_embedding import GGUFEmbedding
from engine.backends.kernels import prepare
from engine.backends.quantize import draft_format
from engine.core.speculative import SpeculativeEngine
from engine.errors import ModelLoadError


def load_tokenizer(path: str | os.PathLike | None = None):
    """The real Qwen2.5 tokenizer of the embedded pair (tokenizer files only: no weights are read).

    Looked for in ``path``, then in the dequantised cache of the embedded target or draft, then
    in the draft's assembled GGUF (assembled from the installed parts when needed: about 400 MB
    written once to the cache). Raises ModelLoadError when none is available.
    """
    from transformers import AutoTokenizer

    from engine.models.loading import CACHE_FORMAT, DEFAULT_DRAFT, DEFAULT_TARGET, assemble_gguf
    from engine.user_cache import cache_dir

    if path is not None:
        return AutoTokenizer.from_pretrained(str(path))
    for source in (DEFAULT_TARGET, DEFAULT_DRAFT):
        directory = cache_dir() / "dequantised" / f"{source.name}-float32-v{CACHE_FORMAT}"
        if (directory / "tokenizer.json").exists():
            return AutoTokenizer.from_pretrained(str(directory))
    gguf = assemble_gguf(DEFAULT_DRAFT)
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def tiny_pair(tokenizer, hidden_size: int = 32, layers: int = 2, noise: float = 0.003, seed: int = 0,
              max_positions: int = 4096):
    """A random ``Qwen2ForCausalLM`` target over the tokenizer's vocabulary and a perturbed copy
    as its draft: the answers are gibberish, but trees, acceptance and timing are real."""
    import copy

    import transformers

    config = transformers.Qwen2Config(
        vocab_size=max(len(tokenizer), 151936),  # Qwen2.5 pads its 151,665 tokens to 151,936
        hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        target = transformers.Qwen2ForCausalLM(config).eval()
    draft = copy.deepcopy(target).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in draft.parameters():
            if param.dim() >= 2:
                param.add_(torch.randn(param.shape, generator=generator) * noise)
    for model in (target, draft):
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = None
    return target, draft


def stop_token_ids(model, tokenizer) -> list[int]:
    """The model's own stop tokens plus the tokenizer's end-of-sequence and end-of-turn tokens."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        vocab = tokenizer.get_vocab()
        for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>"):
            if name in vocab:
                ids.add(int(vocab[name]))
    return sorted(ids)


def make_engine(target, draft, tokenizer, planner=None) -> SpeculativeEngine:
    """The engine the app uses for a pair it loaded: the models are prepared for the CPU fast path
    first (:func:`engine.backends.kernels.prepare`), and the engine stops on the tokenizer's end-of-turn
    tokens too. ``planner``: an :class:`engine.tuning.planner.TreePlanner` (the worker gives one)."""
    prepare(target, draft)
    return SpeculativeEngine(target, draft, stop_token_ids=stop_token_ids(target, tokenizer), planner=planner)


def weight_count(model) -> int:
    """Parameters, the weights of quantised linear layers (held as packed buffers) and of an
    embedding kept in GGUF blocks included."""
    if model is None:
        return 0
    quantised = sum(m.in_features * m.out_features for m in model.modules()
                    if hasattr(m, "in_features") and not isinstance(m, torch.nn.Linear))
    blocks = sum(m.num_embeddings * m.embedding_dim for m in model.modules() if isinstance(m, GGUFEmbedding))
    return sum(p.numel() for p in model.parameters()) + quantised + blocks


def describe_pair(target, draft, target_name: str, draft_name: str) -> dict:
    """What the Models panel shows."""
    param = next(target.parameters())
    return {"target": target_name, "draft": draft_name, "device": str(param.device),
            "dtype": str(param.dtype).removeprefix("torch."), "target_params": weight_count(target),
            "draft_params": weight_count(draft), "draft_format": draft_format(draft) if draft is not None else "none",
            "target_format": draft_format(target),
            "target_stored": getattr(target, "as_stored", None),
            "draft_stored": getattr(draft, "as_stored", None) if draft is not None else None,
            "max_context": int(getattr(target.config, "max_position_embeddings", 0) or 0)}


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")


def validate_model_id(value: str, role: str, models_dir: Path | None = None) -> str:
    """An embedded name, a Hugging Face id (``owner/name``) or a folder under ``models_dir``.

    The UI may name local folders only inside the configured models folder (symlinks resolved),
    never elsewhere on disk; anything else that looks like a path, a URL or ``..`` is refused.
    Raises :class:`ModelLoadError`.
    """
    value = (value or "").strip()
    if not value:
        raise ModelLoadError(f"the {role} model is empty: give a Hugging Face id (owner/name) or a local directory")
    if len(value) > 300:
        raise ModelLoadError(f"the {role} model id is too long")
    if value in ("default-target", "default-draft"):
        return value
    if models_dir is not None:
        root = Path(models_dir).expanduser().resolve()
        candidate = (root / Path(value).expanduser()).resolve()  # an absolute value replaces root here
        if candidate.is_dir():
            if root not in candidate.parents:
                raise ModelLoadError(_outside(value, models_dir))
            return str(candidate)
    if value.startswith(("/", "~", ".")) or "\\" in value or re.match(r"[A-Za-z]:", value):
        raise ModelLoadError(_outside(value))  # whether or not it exists: the answer tells nothing of the disk
    _refuse_local_path(value, models_dir)
    if not _HUB_ID.match(value) or ".." in value:
        where = f"a folder under {models_dir}" if models_dir is not None else "a local folder (none configured)"
        raise ModelLoadError(f"'{value}' is neither {where} nor a Hugging Face id like Qwen/Qwen2.5-0.5B-Instruct")
    return value


def _outside(value: str, models_dir: Path | None = None) -> str:
    return (f"'{value}' names a local path that is not a folder in the models folder: the app loads local "
            f"models only from there (launch.py --models-dir), by their name in it")


def _refuse_local_path(value: str, models_dir: Path | None) -> None:
    """A name that is not a folder under the models folder must never reach ``from_pretrained`` as a
    path: ``secret/model`` passes the hub-id pattern, yet transformers loads the folder of that name
    under the server's working directory when there is one. Such names are refused."""
    if os.path.lexists(value) or os.path.lexists(os.path.expanduser(value)):
        raise ModelLoadError(_outside(value, models_dir))


def default_loader(model_id: str, dtype: torch.dtype, device: str, trust_remote_code: bool,
                    draft_format: str = "none"):
    """:func:`engine.models.loading.load_model` for ids :func:`validate_model_id` passed: an absolute folder
    under the models folder, an embedded name, or a hub id, which must reach the hub (or its cache)
    only, so one that names a path here is refused again right before loading."""
    from engine.models.loading import DEFAULT_IDS, load_model
    if not os.path.isabs(model_id) and model_id not in DEFAULT_IDS:
        _refuse_local_path(model_id, None)
    return load_model(model_id, dtype, device, trust_remote_code, draft_format)
