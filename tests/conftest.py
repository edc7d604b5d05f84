"""Shared fixtures. The real default pair is loaded once per test session."""
from __future__ import annotations

import pytest
import torch

from engine.prompts import encode_chat, load_prompt_set


@pytest.fixture(scope="session")
def real_pair():
    """``(target, draft, tokenizer)`` of the embedded Qwen2.5-Coder pair, float32 on CPU."""
    from engine.models import load_default_pair
    return load_default_pair(dtype=torch.float32)


@pytest.fixture(scope="session")
def chat_prompts(real_pair) -> list[list[int]]:
    """Token ids of the bundled chat prompts (chat template applied)."""
    tokenizer = real_pair[2]
    return [encode_chat(tokenizer, p["messages"]) for p in load_prompt_set("chat")]
