"""Token log-probabilities: the engine's ``logprobs`` option (tiny models built in code) and the
OpenAI API's ``logprobs`` / ``top_logprobs`` (a real local server on the tiny pair over the real
tokenizer, the official ``openai`` client for chat, httpx for /v1/completions and the refusals).

Every logprob is checked against the log_softmax of the logits of a model no engine has touched,
at every position of the answer: what the target says, whatever the sampling settings. Asking
for them changes no token.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest
import test_app_support as support
import tiny_models as tm
import torch

from app.api import openai_api

from app.page import ui
from app.serving.pair import make_engine
from app.serving.worker import Worker
from engine import SpeculativeEngine, StepRecord, Tree
from engine.core.copy_policy import StepClock
from engine.core.records import TokenLogprob
from engine.errors import InvalidParameterError
from engine.models.prompts import encode_chat
from engine.tuning.tree_store import build_tree

TOLERANCE = 1e-4
PROMPT = [5, 17, 3, 42, 9, 11, 5, 17, 3, 42, 9]  # repeats itself: copies from the context get proposed


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    yield from support.one_torch_thread()


def reference_scores(model: torch.nn.Module, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """log_softmax of ``model``'s logits predicting each token of ``answer`` after ``prompt``
    (one plain forward, float32): ``[len(answer), V]``."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_same_ranking(got: list[tuple[object, float]], scores: torch.Tensor, name=lambda t: t) -> None:
    """``got`` [(token, logprob)] is the top of ``scores [V]`` in order (near ties may swap)."""
    values, ids = torch.topk(scores, len(got))
    assert [v for _, v in got] == pytest.approx(values.tolist(), abs=TOLERANCE)
    for rank, (token, _) in enumerate(got):
        tied = {ids[r].item() for r in range(len(got)) if abs(values[r] - values[rank]) < TOLERANCE}
        assert token == name(ids[rank].item()) or token in {name(t) for t in tied}, (rank, token)


# ----- the engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models():
    target = tm.qwen2(seed=2)
    return target, tm.perturbed(target, noise=0.003), tm.qwen2(seed=2)  # the last: never given to an engine


SETTINGS = {
    "target-alone-greedy": dict(tree=None),
    "target-alone-sampled": dict(tree=None, temperature=0.8, seed=3),
    "tree-greedy": dict(tree=Tree.k_ary(2, 2)),
    "tree-sampled": dict(tree=build_tree(8, 3), temperature=0.8, top_p=0.9, seed=5),
    "tree-sampled-static-cache": dict(tree=build_tree(8, 3), temperature=0.8, seed=6, static_cache=True),
    "specinfer": dict(tree=Tree.k_ary(2, 2), temperature=0.8, seed=1, method="specinfer"),
    "topk": dict(tree=Tree.k_ary(2, 2), temperature=0.8, seed=1, method="topk"),
    "chain": dict(tree=Tree.chain(3), temperature=0.8, seed=2, method="chain"),
    "copies-greedy": dict(tree=Tree.k_ary(2, 2), copies=True),
    "copies-sampled": dict(tree=Tree.k_ary(2, 2), temperature=0.8, seed=4, copies=True),
    "copies-alone": dict(tree=None, copies=True, prediction=[42, 9, 11, 5, 17]),
}


@pytest.mark.parametrize("setting", SETTINGS.values(), ids=SETTINGS.keys())
def test_engine_logprobs_are_the_targets_own_and_change_no_token(models, setting, monkeypatch):
    target, draft, fresh = models
    # copies are sized by measured step times: without them (the default costs) and on fresh
    # engines (no acceptance learnt before), both runs plan the same trees
    monkeypatch.setattr(StepClock, "observe", lambda *args, **kwargs: None)
    setting = dict(setting)
    options = {"stop_token_ids": [], "static_cache": setting.pop("static_cache", False)}
    plain = SpeculativeEngine(target, draft, **options).generate(PROMPT, max_new_tokens=24, **setting)
    scored = SpeculativeEngine(target, draft, **options).generate(PROMPT, max_new_tokens=24, logprobs=5, **setting)
    assert scored.tokens == plain.tokens and [s.accepted for s in scored.steps] == [s.accepted for s in plain.steps]
    assert all(s.token_logprobs == [] for s in plain.steps), "off: nothing is computed"
    entries = [e for step in scored.steps for e in step.token_logprobs]
    assert all(len(s.token_logprobs) == len(s.committed) for s in scored.steps)
    assert [e.token for e in entries] == scored.tokens
    if setting.get("copies") and not setting.get("temperature"):  # the copied branches were taken
        assert sum(s.accepted_by_source()["copy"] for s in scored.steps) > 0
    scores = reference_scores(fresh, PROMPT, scored.tokens)
    for position, entry in enumerate(entries):
        assert entry.logprob == pytest.approx(scores[position, entry.token].item(), abs=TOLERANCE), position
        assert len(entry.top) == 5
        assert_same_ranking(entry.top, scores[position])


def test_engine_logprobs_count_and_validation(models):
    target, draft, _ = models
    engine = SpeculativeEngine(target, draft, stop_token_ids=[])
    none = engine.generate(PROMPT, max_new_tokens=6, tree=Tree.chain(2), logprobs=0)
    assert all(e.top == [] for s in none.steps for e in s.token_logprobs)
    most = engine.generate(PROMPT, max_new_tokens=6, tree=Tree.chain(2), logprobs=20)
    assert all(len(e.top) == 20 for s in most.steps for e in s.token_logprobs)
    for bad in (-1, 21, 2.0, True, "5"):
        with pytest.raises(InvalidParameterError):
            engine.stream(PROMPT, max_new_tokens=4, logprobs=bad)


def test_a_record_with_logprobs_survives_json(models):
    target, draft, _ = models
    step = SpeculativeEngine(target, draft, stop_token_ids=[]).generate(
        PROMPT, max_new_tokens=4, tree=Tree.chain(2), logprobs=3).steps[0]
    raw = json.loads(json.dumps(step.to_dict()))
    raw.pop("timings")
    again = StepRecord(**raw)
    assert again.token_logprobs == step.token_logprobs and isinstance(again.token_logprobs[0], TokenLogprob)


# ----- the API ---------------------------------------------------------------------------------
MODEL = "tiny-target"
QUESTION = [{"role": "user", "content": "Write a haiku about trees"}]


@pytest.fixture(scope="module")
def server():
    """``(worker, base_url, fresh target)``: the app with the API mounted (tree 8, depth 4 by
    default), and a copy of its target that no engine has prepared or run."""
    from app.serving.pair import tiny_pair

    tok = support.tokenizer()
    target, draft = support.tiny_pair()
    worker = Worker(make_engine(target, draft, tok), tok, {"target": MODEL, "draft": "tiny-draft"})
    demo = ui.build_demo(worker, tok)
    app, url, _ = ui.launch(demo, server_name="127.0.0.1", server_port=support.free_port(),
                            prevent_thread_lock=True, quiet=True)
    openai_api.mount(app, worker, {"tree_size": 8, "depth": 4})
    fresh, _ = tiny_pair(tok, noise=0.003)  # the same seed: the same weights as the served target
    yield worker, url.rstrip("/") + "/v1", fresh
    demo.close()
    worker.close()


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def engine_tokens(worker, prompt: list[int], max_new: int, size: int = 8, depth: int = 4, **kwargs) -> list[int]:
    """The answer of a separate engine on the served models, without logprobs."""
    engine = make_engine(worker.engine.target, worker.engine.draft, worker.tokenizer)
    tree = build_tree(size, depth) if size > 1 else None
    return engine.generate(prompt, max_new_tokens=max_new, tree=tree, **kwargs).tokens


def token_name(tokenizer):
    return lambda token: tokenizer.decode([token])


def check_chat_logprobs(content: list, tokens: list[int], scores: torch.Tensor, tokenizer, top: int) -> None:
    """Each entry names its token and carries the fresh target's logprob of it and its top ``top``."""
    assert len(content) == len(tokens)
    for position, (entry, token) in enumerate(zip(content, tokens)):
        assert entry.token == tokenizer.decode([token])
        assert entry.logprob == pytest.approx(scores[position, token].item(), abs=TOLERANCE), position
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        assert len(entry.top_logprobs) == top
        assert_same_ranking([(t.token, t.logprob) for t in entry.top_logprobs], scores[position],
                            token_name(tokenizer))


CHAT_SETTINGS = {
    "greedy-tree": dict(temperature=0, sequoia=None, size=8, depth=4),
    "sampled-tree": dict(temperature=0.8, seed=11, sequoia={"tree_size": 8, "depth": 3}, size=8, depth=3),
    "greedy-target-alone": dict(temperature=0, sequoia={"method": "autoregressive"}, size=1, depth=1),
}


@pytest.mark.parametrize("setting", CHAT_SETTINGS.values(), ids=CHAT_SETTINGS.keys())
def test_chat_logprobs_are_the_targets_and_change_nothing(server, setting):
    worker, base, fresh = server
    tok = worker.tokenizer
    prompt = encode_chat(tok, QUESTION)
    sampling = {k: setting[k] for k in ("temperature", "seed") if k in setting}
    tokens = engine_tokens(worker, prompt, 24, setting["size"], setting["depth"], **sampling)
    extra = {"extra_body": {"sequoia": setting["sequoia"]}} if setting["sequoia"] else {}
    options = dict(model=MODEL, messages=QUESTION, max_tokens=24, **sampling, **extra)
    plain = client(base).chat.completions.create(**options)
    scored = client(base).chat.completions.create(logprobs=True, top_logprobs=5, **options)
    text = tok.decode(tokens, skip_special_tokens=True)
    assert plain.choices[0].message.content == scored.choices[0].message.content == text
    assert plain.choices[0].logprobs is None
    assert scored.choices[0].logprobs.refusal is None
    check_chat_logprobs(scored.choices[0].logprobs.content, tokens, reference_scores(fresh, prompt, tokens), tok, 5)
    joined = b"".join(bytes(e.bytes) for e in scored.choices[0].logprobs.content)
    assert joined.decode("utf-8", "replace") == text


def test_logprobs_without_top_logprobs_name_the_chosen_token_only(server):
    worker, base, _ = server
    out = client(base).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0,
                                               logprobs=True)
    assert len(out.choices[0].logprobs.content) == 6
    assert all(e.top_logprobs == [] for e in out.choices[0].logprobs.content)
    off = httpx.post(f"{base}/chat/completions", timeout=120, json={
        "model": MODEL, "messages": QUESTION, "max_tokens": 4, "temperature": 0, "logprobs": False}).json()
    assert off["choices"][0]["logprobs"] is None


def streamed_logprobs(base: str, **options) -> tuple[str, list, list]:
    """``(text, logprob entries, chunks)`` of a streamed chat answer, the entries joined in order."""
    chunks = list(client(base).chat.completions.create(model=MODEL, stream=True, **options))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    entries = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    return text, entries, chunks


def test_streamed_logprobs_follow_the_text_of_each_chunk(server):
    worker, base, _ = server
    options = dict(messages=QUESTION, max_tokens=40, temperature=0, logprobs=True, top_logprobs=3)
    whole = client(base).chat.completions.create(model=MODEL, **options)
    text, entries, chunks = streamed_logprobs(base, **options)
    assert text == whole.choices[0].message.content
    assert [e.model_dump() for e in entries] == [e.model_dump() for e in whole.choices[0].logprobs.content]
    sent, spelled = b"", b""
    for ch in chunks:  # the entries so far spell the start of the text sent so far, and keep up with it
        if ch.choices:
            sent += (ch.choices[0].delta.content or "").encode()
            spelled += b"".join(bytes(e.bytes) for e in (ch.choices[0].logprobs.content if ch.choices[0].logprobs else []))
            assert sent.startswith(spelled) and len(sent) - len(spelled) < 16
    assert spelled == sent


def test_no_logprob_follows_a_stop_string(server):
    worker, base, _ = server
    tok = worker.tokenizer
    tokens = engine_tokens(worker, encode_chat(tok, QUESTION), 40)
    text = tok.decode(tokens, skip_special_tokens=True)
    start = next(i for i in range(8, len(text) - 3) if text.find(text[i:i + 3]) == i and text[i:i + 3].strip())
    stop = text[start:start + 3]
    kept = max(n for n in range(len(tokens) + 1) if len(tok.decode(tokens[:n], skip_special_tokens=True)) <= start)
    options = dict(messages=QUESTION, max_tokens=40, temperature=0, logprobs=True, stop=stop)
    whole = client(base).chat.completions.create(model=MODEL, **options)
    assert whole.choices[0].message.content == text[:start] and whole.choices[0].finish_reason == "stop"
    assert [e.token for e in whole.choices[0].logprobs.content] == [tok.decode([t]) for t in tokens[:kept]]
    streamed_text, entries, _ = streamed_logprobs(base, **options)
    assert streamed_text == text[:start]
    assert [e.model_dump() for e in entries] == [e.model_dump() for e in whole.choices[0].logprobs.content]


def test_text_completions_give_legacy_logprobs(server):
    worker, base, fresh = server
    tok = worker.tokenizer
    prompt = "def fibonacci(n):"
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    tokens = engine_tokens(worker, ids, 12)
    scores = reference_scores(fresh, ids, tokens)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 3}
    answer = httpx.post(f"{base}/completions", json=body, timeout=120).json()
    choice = answer["choices"][0]
    assert choice["text"] == tok.decode(tokens, skip_special_tokens=True)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [tok.decode([t]) for t in tokens]
    assert logprobs["token_logprobs"] == pytest.approx([scores[i, t].item() for i, t in enumerate(tokens)],
                                                       abs=TOLERANCE)
    for position, (token, top) in enumerate(zip(logprobs["tokens"], logprobs["top_logprobs"])):
        values, best = torch.topk(scores[position], 3)
        expected = {tok.decode([t]): v for t, v in zip(best.tolist(), values.tolist())}
        expected.setdefault(token, scores[position, tokens[position]].item())
        assert top == pytest.approx(expected, abs=TOLERANCE)
    offsets = [len(tok.decode(tokens[:n], skip_special_tokens=True)) for n in range(len(tokens))]
    assert logprobs["text_offset"] == offsets
    plain = httpx.post(f"{base}/completions", json=body | {"logprobs": None}, timeout=120).json()
    assert plain["choices"][0]["logprobs"] is None and plain["choices"][0]["text"] == choice["text"]
    with httpx.stream("POST", f"{base}/completions", json=body | {"stream": True}, timeout=120) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    parts = [ch["choices"][0]["logprobs"] for ch in chunks if ch["choices"][0]["logprobs"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for part in parts for v in part[key]] == logprobs[key], key


@pytest.mark.parametrize("path, body, param", [
    ("/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/chat/completions", {"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
    ("/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/completions", {"logprobs": 6}, "logprobs"),
    ("/completions", {"logprobs": True}, "logprobs"),
    ("/completions", {"logprobs": -1}, "logprobs"),
], ids=["top-21", "top-negative", "top-without-logprobs", "top-with-false", "logprobs-int", "legacy-6",
        "legacy-bool", "legacy-negative"])
def test_bad_logprobs_get_a_400(server, path, body, param):
    _, base, _ = server
    shape = {"messages": QUESTION} if path == "/chat/completions" else {"prompt": "x"}
    response = httpx.post(f"{base}{path}", json={"model": MODEL, "max_tokens": 2, **shape, **body}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, "invalid_value")


# ----- which entries go with which text (app.openai_logprobs, through openai_api.Answer) ---------
def record(tokens: list[int], finish: str | None = None) -> StepRecord:
    """A target-alone step that committed ``tokens`` (each scored -1, no alternatives)."""
    n = len(tokens)
    return StepRecord(index=0, tokens=[0], parents=[-1], ranks=[0], draft_probs=[1.0], target_probs=[1.0],
                      accepted=list(range(n)), committed=list(tokens), finish_reason=finish,
                      token_logprobs=[TokenLogprob(t, -1.0) for t in tokens])


def byte_tokens(tok, data: bytes) -> list[int]:
    """The single-byte tokens of a byte-level BPE vocabulary that spell ``data``."""
    from app.api.openai_logprobs import _byte_decoder

    alphabet = {b: c for c, b in _byte_decoder().items()}
    return [tok.convert_tokens_to_ids(alphabet[b]) for b in data]


def test_a_character_spelled_by_byte_tokens_is_released_whole():
    tok = support.tokenizer()
    answer = openai_api.Answer(tok, [], logprobs=True)
    hello, bang = tok.encode("Hi", add_special_tokens=False), tok.encode("!", add_special_tokens=False)
    emoji = byte_tokens(tok, "😀".encode())
    assert answer.add(record(hello)) == "Hi" and [e.text for e in answer.trail.take()] == ["Hi"]
    assert answer.add(record(emoji[:2])) == "" and answer.trail.take() == []  # half a character: held
    assert answer.add(record(emoji[2:] + bang)) == "😀!"
    entries = answer.trail.take()
    assert [bytes(e.raw) for e in entries] == [b"\xf0", b"\x9f", b"\x98", b"\x80", b"!"]
    assert [(e.start, e.end) for e in entries] == [(2, 3)] * 4 + [(3, 4)]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert answer.add(record([im_end], "stop")) == "" and answer.trail.take() == []  # the end of the turn
    assert answer.logprobs(text=False)["content"][0] == {"token": "Hi", "logprob": -1.0, "bytes": [72, 105],
                                                         "top_logprobs": []}
    assert answer.logprobs(text=True)["text_offset"] == [0, 2, 2, 2, 2, 3]


def exact_ends(tok, tokens: list[int]) -> list[tuple[int, bool]]:
    """Per token, the length of the answer's text up to it and whether that ends inside a character,
    decoding the whole prefix each time (the trail's reference)."""
    out = []
    for n in range(1, len(tokens) + 1):
        text = tok.decode(tokens[:n], skip_special_tokens=True)
        out.append((len(text), text.endswith("\ufffd")))
    return out


class CountingTokenizer:
    """``tok``, counting the tokens its ``decode`` is given."""

    def __init__(self, tok) -> None:
        self.tok, self.decoded = tok, 0

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kwargs)


@pytest.mark.parametrize("seed", range(4))
def test_token_offsets_inside_a_step_are_those_of_the_whole_prefix_and_cost_no_square(seed):
    """Answers of prose, code, emoji spelled byte by byte, CJK and special tokens, cut into steps of
    1-9 tokens at random: each entry ends where decoding the whole prefix says, while the trail
    decodes a bounded number of tokens a token, not the prefix."""
    import random

    tok = support.tokenizer()
    rng = random.Random(seed)
    pieces = [tok.encode(t, add_special_tokens=False) for t in
              ("Here is the code:\n", "def f(x):\n    return x * 2  # twice\n", " 漢字とかな", " ok.", "  spaced  out ")]
    pieces += [byte_tokens(tok, "😀".encode()), byte_tokens(tok, "é".encode()), [tok.convert_tokens_to_ids("<|im_start|>")]]
    tokens = [t for _ in range(60) for t in rng.choice(pieces)]
    counting = CountingTokenizer(tok)
    answer = openai_api.Answer(counting, [], logprobs=True)
    done = 0
    while done < len(tokens):
        step = tokens[done:done + rng.randint(1, 9)]
        answer.add(record(step))
        done += len(step)
        assert answer.growing.text == tok.decode(tokens[:done], skip_special_tokens=True)
    entries = answer.trail.pending + answer.trail.released
    reference, end, opened = exact_ends(tok, tokens), 0, False
    for entry, (length, ragged) in zip(entries, reference):
        inside = opened and bool(entry.raw) and 0x80 <= entry.raw[0] < 0xC0
        assert (entry.start, entry.end) == (max(0, end - 1) if inside else end, max(end, length))
        end, opened = max(end, length), ragged
    assert len(entries) == len(tokens)
    assert counting.decoded < 40 * len(tokens), (counting.decoded, len(tokens))  # the whole prefix: ~len² / 2


def test_growing_text_falls_back_to_the_whole_prefix_where_a_window_would_differ():
    """A decoder whose text depends on where decoding starts (it numbers the words it writes): the
    window's text does not begin with the anchor's, so the whole prefix is decoded."""
    from app.api.growing_text import GrowingText

    class Numbering:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(f"{i}:{t}" for i, t in enumerate(ids))

    growing, tokens = GrowingText(Numbering()), []
    for step in ([5, 6], [7], [8, 9, 10], [11]):
        tokens += step
        ends = growing.extend(step, each=True)
        assert growing.text == Numbering().decode(tokens)
        assert [length for length, _ in ends] == [len(Numbering().decode(tokens[:n]))
                                                 for n in range(len(tokens) - len(step) + 1, len(tokens) + 1)]


def test_a_token_reaching_into_a_stop_string_is_not_shown():
    tok = support.tokenizer()
    answer = openai_api.Answer(tok, ["o w"], logprobs=True)
    words = [tok.encode(w, add_special_tokens=False)[0] for w in ("Say", " hello", " world", " again")]
    start = tok.convert_tokens_to_ids("<|im_start|>")
    assert answer.add(record(words[:1] + [start])) == "Say"
    assert [e.text for e in answer.trail.take()] == ["Say", "<|im_start|>"]  # no text of its own
    assert answer.add(record(words[1:])) == " hell" and answer.stopped
    assert answer.trail.take() == [] and answer.trail.pending[0].text == " hello"
