"""Shared fixtures. The real default pair is loaded once per test session, as the app serves it:
the int4 (k-quant) target on the CPU.

Greedy references come from the target as loaded, before anything prepares it for the engine
(:func:`engine.backends.kernels.prepare`) or builds an engine on it: Hugging Face's own ``generate``
through the model's own modules (its k-quant linear layers, attention and activation), not the
lean forward the engine runs. The float32 target transformers dequantises is loaded only for the
tests that compare with it (:func:`float_target`)."""
from __future__ import annotations

import os

import pytest
import torch

from engine.models.prompts import encode_chat, load_prompt_set

REFERENCE_TOKENS = 64   # new tokens of each greedy reference
REFERENCE_PROMPTS = 5   # the first five bundled prompts; the fifth ends with EOS well before the budget


@pytest.fixture(scope="session")
def _stock_pair():
    """``(target, draft, tokenizer)`` as loaded (the int4 target, as in the app), not yet prepared."""
    from engine.backends.kquant import KQuantLinear
    from engine.models.loading import load_default_pair

    pair = load_default_pair(dtype=torch.float32, prepare=False)
    assert isinstance(pair[0].lm_head, KQuantLinear), "the suite checks the target the app serves: int4 on CPU"
    return pair


@pytest.fixture(scope="session")
def float_target():
    """``(model, tokenizer)``: the float32 target transformers dequantises from the GGUF."""
    from engine.models.loading import load_model
    return load_model("default-target", torch.float32, "cpu", False, "none")


@pytest.fixture(scope="session")
def chat_prompts(_stock_pair) -> list[list[int]]:
    """Token ids of the bundled chat prompts (chat template applied)."""
    tokenizer = _stock_pair[2]
    return [encode_chat(tokenizer, p["messages"]) for p in load_prompt_set("chat")]


@pytest.fixture(scope="session")
def greedy_references(_stock_pair, chat_prompts) -> list[list[int]]:
    """The int4 target's own greedy continuation (``generate(do_sample=False)``) of the first
    prompts, computed on the untouched target (checked: no layer is packed, no method patched)."""
    from engine.backends.kernels import is_packed

    target = _stock_pair[0]
    assert not any(is_packed(m) or "forward" in vars(m) for m in target.modules()), \
        "the reference target was already changed"
    refs = []
    for ids in chat_prompts[:REFERENCE_PROMPTS]:
        with torch.inference_mode():
            out = target.generate(torch.tensor([ids]), max_new_tokens=REFERENCE_TOKENS, do_sample=False)
        refs.append(out[0, len(ids):].tolist())
    return refs


SECOND_TURN = "Now explain the same idea in one short sentence for a beginner."


@pytest.fixture(scope="session")
def multiturn_reference(_stock_pair, greedy_references) -> dict:
    """A two-turn conversation on the first bundled prompt: its first answer is the greedy reference
    (``greedy_references[0]``); the second prompt is the whole conversation with the chat template
    re-applied (the answer's text as the assistant turn) plus :data:`SECOND_TURN`, and ``reference``
    is the untouched target's own greedy continuation of it."""
    target, _, tokenizer = _stock_pair
    first = load_prompt_set("chat")[0]["messages"]
    answer = tokenizer.decode(greedy_references[0], skip_special_tokens=True)
    messages = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": SECOND_TURN}]
    ids = encode_chat(tokenizer, messages)
    with torch.inference_mode():
        out = target.generate(torch.tensor([ids]), max_new_tokens=REFERENCE_TOKENS, do_sample=False)
    return {"prompt": ids, "reference": out[0, len(ids):].tolist()}


LONG_REFERENCE_TOKENS = 32
LONG_PROMPT_FUNCTIONS = 12  # 320 prompt tokens: one whole prefill chunk of 256 and part of a second


@pytest.fixture(scope="session")
def long_reference(_stock_pair, greedy_references) -> tuple[list[int], list[int]]:
    """``(prompt, reference)``: a question about a pasted Python module (longer than one prefill
    chunk) and the untouched target's own greedy continuation of it."""
    target, _, tokenizer = _stock_pair
    module = "\n".join(f"def scale_{i}(x: int) -> int:\n    return x * {i} + {i * i}\n" for i in range(LONG_PROMPT_FUNCTIONS))
    question = f"Here is a module:\n```python\n{module}```\nWhich function returns 42 for x = 1, and why?"
    ids = encode_chat(tokenizer, [{"role": "user", "content": question}])
    with torch.inference_mode():
        out = target.generate(torch.tensor([ids]), max_new_tokens=LONG_REFERENCE_TOKENS, do_sample=False)
    return ids, out[0, len(ids):].tolist()


@pytest.fixture(scope="session")
def real_pair(_stock_pair, greedy_references, multiturn_reference, long_reference):
    """``(target, draft, tokenizer)`` of the embedded Qwen2.5-Coder pair (the int4 target) on the CPU,
    prepared for the engine as the app and CLIs load it (after the greedy references were taken)."""
    from engine.backends.kernels import prepare

    target, draft, tokenizer = _stock_pair
    prepare(target, draft)
    return target, draft, tokenizer


def pytest_configure(config):
    """Under xdist each worker gets its share of the cores: torch's threads on a 2-core machine with
    two workers would otherwise be four, and each parallel region would wait on a descheduled one.
    Tests about thread counts set their own."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, torch.get_num_threads() // workers))


REAL_MODEL_FIXTURES = {"_stock_pair", "real_pair", "float_target", "chat_prompts", "greedy_references",
                       "multiturn_reference", "long_reference"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n 2 --dist loadgroup`` (``make test``) every test that touches the real pair
    runs in one worker, so the pair is loaded once and never twice at a time (24 GiB machines);
    the tiny-model tests share out over the workers."""
    for item in items:
        if item.get_closest_marker("real_pair") or REAL_MODEL_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.xdist_group("real-models"))
