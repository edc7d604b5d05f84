"""Tiny random causal LMs built in code, for engine tests that must not touch the real models.

Every builder seeds torch itself, so the same arguments give the same weights. The models are
float32, in eval mode, and use the SDPA attention path (the one the engine relies on for its
custom 4-D tree masks).
"""
from __future__ import annotations

import copy

import torch
import transformers

VOCAB = 64
MAX_POSITIONS = 256


def _finish(model: torch.nn.Module) -> torch.nn.Module:
    model = model.to(torch.float32).eval()
    # No eos, so Hugging Face's generate() stops on the budget only, like the engine with stop_token_ids=[].
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _build(config_class, model_class, seed: int, **config) -> torch.nn.Module:
    config = config_class(tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0,
                          attn_implementation="sdpa", **config)
    with torch.random.fork_rng(devices=[]):  # leave the global RNG of other tests alone
        torch.manual_seed(seed)
        model = model_class(config)
    return _finish(model)


def qwen2(seed: int = 0, vocab_size: int = VOCAB, hidden_size: int = 32, layers: int = 2,
          max_positions: int = MAX_POSITIONS) -> torch.nn.Module:
    """A random ``Qwen2ForCausalLM`` with grouped-query attention (4 query heads, 2 KV heads)."""
    return _build(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, seed, vocab_size=vocab_size,
                  hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions)


def llama(seed: int = 0, vocab_size: int = VOCAB, hidden_size: int = 32, layers: int = 2,
          max_positions: int = MAX_POSITIONS) -> torch.nn.Module:
    """A random ``LlamaForCausalLM`` (multi-head attention, untied output head).

    Untied on purpose: a tiny random model with tied embeddings mostly predicts its own input token,
    so every draft agrees with every target and the tests would prove little.
    """
    return _build(transformers.LlamaConfig, transformers.LlamaForCausalLM, seed, vocab_size=vocab_size,
                  hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=max_positions)


def clone(model: torch.nn.Module) -> torch.nn.Module:
    """An independent copy with identical weights (a draft that always agrees with its target)."""
    return copy.deepcopy(model).eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The new tokens of Hugging Face's own greedy decoding (the reference the engine must match)."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=device),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                             max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def min_top2_gap(model: torch.nn.Module, sequence: list[int], prompt_len: int) -> float:
    """Smallest gap between the two largest logits over the positions that chose ``sequence[prompt_len:]``.

    A gap near zero means a near tie, where tiny numerical differences (tree attention vs. a causal
    forward) may legitimately flip the greedy choice.
    """
    with torch.inference_mode():
        logits = model(torch.tensor([sequence], device=next(model.parameters()).device)).logits[0, prompt_len - 1:-1].float()
    top2 = torch.topk(logits, 2, dim=-1).values
    return float((top2[:, 0] - top2[:, 1]).min())


def perturbed(model: torch.nn.Module, noise: float, seed: int = 0) -> torch.nn.Module:
    """A copy of ``model`` with Gaussian noise of std ``noise`` added to every weight matrix.

    Such a draft agrees with its target often but not always, so trees get accepted paths through
    second- and third-ranked children, not just the first-choice chain.
    """
    copy_ = clone(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in copy_.parameters():
            if param.dim() >= 2:
                param.add_(torch.randn(param.shape, generator=generator).to(param.device) * noise)
    return copy_
