"""Random-weight models with the shapes of real ones, built in code (no download).

Latency depends on shapes, not weight values, so a Llama-2-7B-shaped target and a
Llama-68M-shaped draft give the hardware profile of that pair on machines that cannot fetch it.
Acceptance, of course, is meaningless between random models: benchmarks pair these profiles
with acceptance vectors calibrated on real pairs.
"""
from __future__ import annotations

import torch
import transformers

SHAPES: dict[str, dict] = {
    # meta-llama/Llama-2-7b-hf
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
    # JackFram/llama-68m, Sequoia's draft for Llama-2-7B
    "llama-68m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=12,
                      num_key_value_heads=12, vocab_size=32000, max_position_embeddings=2048),
    # small enough for exactness tests in float32, with a real-size vocabulary
    "llama-test": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048),
}


def synthetic_model(shape: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                    seed: int = 0, init_std: float = 0.02) -> torch.nn.Module:
    """A random ``LlamaForCausalLM`` of a named shape, built directly on ``device`` in ``dtype``."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: choose from {', '.join(SHAPES)}")
    config = transformers.LlamaConfig(**SHAPES[shape], tie_word_embeddings=False, initializer_range=init_std,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=0,
                                      attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()
