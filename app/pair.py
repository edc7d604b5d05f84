"""Model pairs for the app: a tiny random pair (with the real Qwen tokenizer) for trying the UI
without the real weights. The auto-tuner comes from :func:`engine.tuning.optimizer.load_tuner`."""
from __future__ import annotations

import os

import torch


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
