"""A user's GGUF file through ``launch.py``, as a user starts it (``--target FILE --draft FILE``, a
real process on a local port), answered through the official ``openai`` client: the model is the
file's own name, the launch prints its block types and load time, and greedy answers, chat and text
completions, streamed or not, are the model's own greedy decoding: Hugging Face's ``generate`` on a
model object loaded from the same file in this process, which no engine touched. SmolLM2-135M Q4_1
(llama) and Gemma-3-270M Q4_K_M (gemma3: sliding windows, BOS added), installed test-only."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import real_gguf
import test_app_support as support
import tiny_models as tm
import torch

from engine.models.loading import load_model

pytestmark = pytest.mark.xdist_group("gguf-files")
ROOT = Path(__file__).resolve().parent.parent
FILES = {"smollm2": real_gguf.smollm2, "gemma3": real_gguf.gemma3}
STORED = {"smollm2": "Q4_1 79%, Q8_0 21%", "gemma3": "Q5_0"}  # what the launch line names
START_TIMEOUT_S = 600
NEW_TOKENS = 32


class Launched:
    """``launch.py`` running in its own process group; its output lines kept in ``lines``."""

    def __init__(self, args: list[str], port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.process = subprocess.Popen([sys.executable, "launch.py", *args, "--port", str(port)], cwd=ROOT,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))
            if f"running at {self.url}" in line:
                self.ready.set()

    def wait(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.ready.wait(1):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail("launch.py did not serve:\n" + "\n".join(self.lines[-30:]))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module", params=list(FILES))
def launched(request):
    """``(name, path, the running launch, an openai client)``."""
    path = FILES[request.param]()
    app = Launched(["--target", str(path), "--draft", str(path), "--offline", "--no-measure", "--no-history"],
                   support.free_port())
    app.wait()
    client = openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    yield request.param, path, app, client
    app.stop()


@pytest.fixture(scope="module")
def own_model(launched):
    """The model and tokenizer read from the same file here, for the references."""
    _, path, _, _ = launched
    return load_model(str(path), torch.float32, "cpu", False, "auto")


def own_greedy_text(model, tokenizer, prompt: list[int]) -> str:
    """The model's own greedy continuation of ``prompt`` up to its first stop token, as text."""
    tokens = tm.hf_greedy(model, prompt, NEW_TOKENS)
    stops = model.generation_config.eos_token_id
    stops = set(stops if isinstance(stops, list) else [stops])
    cut = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
    return tokenizer.decode(tokens[:cut], skip_special_tokens=True)


def test_the_launch_names_the_file_its_block_types_and_its_load_time(launched):
    name, path, app, client = launched
    loaded = next(line for line in app.lines if line.startswith("loaded in"))
    assert STORED[name] in loaded and path.name in loaded, loaded
    assert [m.id for m in client.models.list().data] == [path.name]


def test_a_greedy_chat_answer_is_the_models_own_greedy_decoding(launched, own_model):
    _, path, _, client = launched
    model, tokenizer = own_model
    messages = [{"role": "user", "content": "Name three colours and say why the sky is blue."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    expected = own_greedy_text(model, tokenizer, list(prompt))
    answer = client.chat.completions.create(model=path.name, messages=messages, temperature=0,
                                            max_tokens=NEW_TOKENS)
    assert answer.choices[0].message.content == expected
    streamed = client.chat.completions.create(model=path.name, messages=messages, temperature=0,
                                              max_tokens=NEW_TOKENS, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == expected


def test_a_greedy_text_completion_continues_the_prompt_as_the_model_would(launched, own_model):
    name, path, _, client = launched
    model, tokenizer = own_model
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    ids = tokenizer(prompt)["input_ids"]  # the file's BOS first where it says to add one (gemma3)
    assert (ids[0] == tokenizer.bos_token_id) == (name == "gemma3")
    expected = own_greedy_text(model, tokenizer, ids)
    answer = client.completions.create(model=path.name, prompt=prompt, temperature=0, max_tokens=NEW_TOKENS)
    assert answer.choices[0].text == expected and answer.usage.prompt_tokens == len(ids)
    again = client.completions.create(model=path.name, prompt=tokenizer.decode(ids), temperature=0,
                                      max_tokens=NEW_TOKENS)  # a BOS written out is not doubled
    assert again.choices[0].text == expected and again.usage.prompt_tokens == len(ids)
