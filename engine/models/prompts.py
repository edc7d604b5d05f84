"""The bundled chat prompt set (``assets/prompts/chat.json``) used by tests, calibration and benchmarks."""
from __future__ import annotations

import json
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[2] / "assets"


def load_prompt_set(name: str = "chat") -> list[dict]:
    """Entries ``{"kind": str, "messages": [{"role", "content"}, ...]}``."""
    return json.loads((ASSETS / "prompts" / f"{name}.json").read_text())["prompts"]


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation with the chat template and the assistant's generation prompt."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return list(encoded["input_ids"])
