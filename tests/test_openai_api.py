"""The OpenAI-compatible endpoints on a real local server (tiny pair, real tokenizer), driven with the
official ``openai`` client: answers equal the engine's own, streamed or not; parameters are
honoured; bad input gets OpenAI's error shape with a 4xx status; clients run concurrently."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
import test_app_support as support

from app.serving import jobs

from app.api import openai_api

from app.api import openai_requests

from app.page import ui
from app.serving import worker as worker_module
from app.serving.pair import make_engine
from app.serving.worker import Worker
from engine.models.prompts import encode_chat
from engine.tuning.tree_store import build_tree

MODEL = "tiny-target"
QUESTION = [{"role": "user", "content": "Write a haiku about trees"}]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    yield from support.one_torch_thread()


@pytest.fixture(scope="module")
def server():
    """``(worker, base_url)``: the app with the API mounted, as launch.py serves it (the engine wrapped
    in :class:`test_app_support.SlowEngine`, which can slow its steps down)."""
    tok = support.tokenizer()
    target, draft = support.tiny_pair()
    worker = Worker(support.SlowEngine(make_engine(target, draft, tok)), tok, {"target": MODEL, "draft": "tiny-draft"})
    demo = ui.build_demo(worker, tok)
    app, url, _ = ui.launch(demo, server_name="127.0.0.1", server_port=support.free_port(),
                            prevent_thread_lock=True, quiet=True)
    openai_api.mount(app, worker, {"tree_size": 8, "depth": 4})
    yield worker, url.rstrip("/") + "/v1"
    demo.close()
    worker.close()


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def engine_answer(worker, messages, max_new=24, size=8, depth=4, **kwargs) -> tuple[str, list[int]]:
    engine = make_engine(worker.engine.target, worker.engine.draft, worker.tokenizer)
    tokens = engine.generate(encode_chat(worker.tokenizer, messages), max_new_tokens=max_new,
                             tree=build_tree(size, depth), **kwargs).tokens
    return worker.tokenizer.decode(tokens, skip_special_tokens=True), tokens


def streamed(c: openai.OpenAI, **kwargs) -> tuple[str, list]:
    chunks = list(c.chat.completions.create(model=MODEL, stream=True, **kwargs))
    return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), chunks


def test_models_lists_the_target(server):
    _, base = server
    models = client(base).models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].owned_by == "sequoia-chat"


def test_non_streamed_greedy_answer_equals_the_engine(server):
    worker, base = server
    text, tokens = engine_answer(worker, QUESTION)
    out = client(base).chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    assert out.object == "chat.completion" and out.model == MODEL
    assert out.choices[0].message.content == text and out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == len(tokens) == 24
    assert out.usage.prompt_tokens == len(encode_chat(worker.tokenizer, QUESTION))
    spec = out.model_extra["sequoia"]
    assert spec["tree"]["size"] == 8 and spec["tree"]["depth"] == 4 and spec["method"] == "sequoia"
    assert spec["steps"] >= 1 and spec["tokens_per_step"] == pytest.approx(24 / spec["steps"])
    assert 0 <= spec["accepted_draft_tokens"] <= spec["drafted_tokens"] + spec["copied_tokens"]
    assert spec["drafted_tokens"] <= 7 * spec["steps"] and spec["drafted_tokens"] % 7 == 0  # whole trees, or none
    assert sum(spec["accepted_by_source"].values()) == spec["accepted_draft_tokens"]
    assert spec["first_token_s"] > 0 and spec["prefill_s"] >= 0


def test_streamed_greedy_answer_equals_the_engine(server):
    worker, base = server
    text, _ = engine_answer(worker, QUESTION, max_new=40)
    joined, chunks = streamed(client(base), messages=QUESTION, temperature=0, max_tokens=40,
                              stream_options={"include_usage": True})
    assert joined == text
    content = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(content) >= 3, "the answer should arrive in several chunks"
    last = [ch for ch in chunks if ch.choices][-1]
    assert last.choices[0].finish_reason == "length" and last.model_extra["sequoia"]["steps"] >= 1
    assert chunks[-1].usage.completion_tokens == 40


def sse_lines(base: str, path: str, body: dict) -> list[str]:
    """The raw ``data:`` payloads of a streamed answer, in order."""
    with httpx.stream("POST", f"{base}{path}", json=body | {"stream": True}, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def test_a_stream_is_json_chunks_then_one_done_line(server):
    _, base = server
    payloads = sse_lines(base, "/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 6,
                                                     "temperature": 0})
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_long_prompt_streams_only_comments_until_the_first_token(server):
    """While the prompt is read, a stream carries SSE comments (which keep proxies waiting and that
    clients skip), never a data chunk with text."""
    worker, base = server
    engine = worker.engine._engine
    before, engine.prefill_chunk = engine.prefill_chunk, 8
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": " ".join(["word"] * 60)}], "max_tokens": 4,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{base}/chat/completions", json=body, timeout=120) as response:
            lines = [line for line in response.iter_lines() if line]
    finally:
        engine.prefill_chunk = before
    comments = [i for i, line in enumerate(lines) if line.startswith(": reading the prompt")]
    texts = [i for i, line in enumerate(lines) if line.startswith("data: {") and
             json.loads(line[6:])["choices"] and json.loads(line[6:])["choices"][0]["delta"].get("content")]
    assert len(comments) >= 4 and texts and max(comments) < min(texts)
    assert lines[-1] == "data: [DONE]"


def test_text_completions_continue_the_prompt_as_given(server):
    """/v1/completions: no chat template, the prompt's own tokens; OpenAI's text_completion shape."""
    worker, base = server
    prompt = "def fibonacci(n):"
    ids = worker.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    engine = make_engine(worker.engine.target, worker.engine.draft, worker.tokenizer)
    expected = worker.tokenizer.decode(engine.generate(ids, max_new_tokens=12, tree=build_tree(8, 4)).tokens,
                                       skip_special_tokens=True)
    answer = client(base).completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert answer.object == "text_completion" and answer.choices[0].text == expected
    assert answer.choices[0].finish_reason == "length" and answer.usage.prompt_tokens == len(ids)
    payloads = sse_lines(base, "/completions", {"model": MODEL, "prompt": [prompt], "max_tokens": 12,
                                                "temperature": 0})
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == expected
    assert all(ch["object"] == "text_completion" for ch in chunks)
    assert client(base).completions.create(model=MODEL, prompt=prompt, temperature=0).usage.completion_tokens == 16
    for bad, param in (({"prompt": ""}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
                       ({"prompt": "x", "suffix": "y"}, "suffix"), ({"prompt": "x", "echo": True}, "echo")):
        response = httpx.post(f"{base}/completions", json={"model": MODEL, **bad}, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, bad


def test_sampling_parameters_and_seed_are_honoured(server):
    worker, base = server
    c = client(base)
    options = dict(temperature=0.9, top_p=0.8, max_new=20)
    text7, _ = engine_answer(worker, QUESTION, seed=7, temperature=0.9, top_p=0.8, max_new=20)
    text8, _ = engine_answer(worker, QUESTION, seed=8, temperature=0.9, top_p=0.8, max_new=20)
    assert text7 != text8, "pick seeds whose samples differ"
    for seed, text in ((7, text7), (8, text8)):
        out = c.chat.completions.create(model=MODEL, messages=QUESTION, temperature=options["temperature"],
                                        top_p=options["top_p"], max_tokens=options["max_new"], seed=seed)
        assert out.choices[0].message.content == text


def test_stop_strings_cut_the_answer(server):
    worker, base = server
    text, _ = engine_answer(worker, QUESTION, max_new=40)
    start = next(i for i in range(8, len(text) - 3) if text.find(text[i:i + 3]) == i and text[i:i + 3].strip())
    stop = text[start:start + 3]
    c = client(base)
    out = c.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=40,
                                    stop=[stop, "never-in-the-answer"])
    assert out.choices[0].message.content == text[:start] and out.choices[0].finish_reason == "stop"
    joined, chunks = streamed(c, messages=QUESTION, temperature=0, max_tokens=40, stop=stop)
    assert joined == text[:start] and [ch for ch in chunks if ch.choices][-1].choices[0].finish_reason == "stop"
    assert support.wait_until(lambda: worker.busy == 0, 10), "the job should end at the stop string"


def test_two_clients_at_once_get_their_own_answers(server):
    worker, base = server
    a = [{"role": "user", "content": "Question from client A"}]
    b = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Question from client B"}]
    expected = [engine_answer(worker, a, max_new=32)[0], engine_answer(worker, b, max_new=32, size=5, depth=2)[0]]
    got = support.run_in_threads([
        lambda: streamed(client(base), messages=a, temperature=0, max_tokens=32)[0],
        lambda: client(base).chat.completions.create(
            model=MODEL, messages=b, temperature=0, max_tokens=32,
            extra_body={"sequoia": {"tree_size": 5, "depth": 2}}).choices[0].message.content])
    assert got == expected


def test_a_user_key_reuses_its_conversation_cache(server):
    worker, base = server
    c = client(base)
    first = c.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=8, user="alice")
    assert first.model_extra["sequoia"]["reused_prompt_tokens"] == 0
    follow = QUESTION + [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "Another one"}]
    second = c.chat.completions.create(model=MODEL, messages=follow, temperature=0, max_tokens=8, user="alice")
    assert second.model_extra["sequoia"]["reused_prompt_tokens"] >= len(encode_chat(worker.tokenizer, QUESTION))
    assert second.choices[0].message.content == engine_answer(worker, follow, max_new=8)[0]
    assert "api:127.0.0.1|api-user:alice" in worker.kv_store.keys()
    # the same 'user' from another address is another conversation: nothing of alice's is reused
    elsewhere = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120, http_client=httpx.Client(
        transport=httpx.HTTPTransport(local_address="127.0.0.2")))
    probe = elsewhere.chat.completions.create(model=MODEL, messages=follow, temperature=0, max_tokens=8, user="alice")
    assert probe.model_extra["sequoia"]["reused_prompt_tokens"] == 0


def test_models_never_show_a_local_path():
    from types import SimpleNamespace

    for target, shown in (("/home/me/models/Qwen2.5-7B", "Qwen2.5-7B"), ("~/models/mine/", "mine"),
                          ("./local", "local"), ("C:\\models\\qwen", "qwen"), ("Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-1.5B")):
        assert openai_requests.model_id(SimpleNamespace(info={"target": target})) == shown


@pytest.mark.parametrize("body, status, param, code", [
    ({"model": MODEL, "messages": QUESTION, "temperature": 3}, 400, "temperature", "invalid_value"),
    ({"model": MODEL, "messages": QUESTION, "top_p": 0}, 400, "top_p", "invalid_value"),
    ({"model": MODEL, "messages": QUESTION, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"model": MODEL, "messages": QUESTION, "seed": 1.5}, 400, "seed", "invalid_value"),
    ({"model": MODEL, "messages": QUESTION, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
    ({"model": MODEL, "messages": QUESTION, "n": 2}, 400, "n", "unsupported_parameter"),
    ({"model": MODEL, "messages": []}, 400, "messages", "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role", "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "invalid_value"),
    ({"model": MODEL, "messages": QUESTION + [{"role": "assistant", "content": "x"}]}, 400, "messages",
     "invalid_value"),
    ({"model": MODEL, "messages": QUESTION, "max_tokens": 10 ** 6}, 400, "max_tokens", "invalid_value"),  # the ceiling
    ({"model": MODEL, "messages": QUESTION, "sequoia": {"method": "magic"}}, 400, "sequoia.method", "invalid_value"),
    ({"model": MODEL, "messages": QUESTION, "sequoia": {"tree_size": 4, "depth": 9}}, 400, "sequoia.depth",
     "invalid_value"),
    ({"model": MODEL, "messages": QUESTION, "sequoia": {"auto": "yes"}}, 400, "sequoia.auto", "invalid_value"),
    ({"model": "gpt-4o", "messages": QUESTION}, 404, "model", "model_not_found"),
    ({"model": MODEL, "messages": QUESTION, "frequency_penalty": 0.5}, 400, "frequency_penalty", "unsupported_parameter"),
    ({"model": MODEL, "messages": QUESTION, "response_format": {"type": "json_object"}}, 400, "response_format",
     "unsupported_parameter"),
    ({"model": MODEL, "messages": QUESTION, "logit_bias": {"11": 5}}, 400, "logit_bias", "unsupported_parameter"),
], ids=["temperature", "top_p", "max_tokens", "seed", "stop", "n", "empty", "role", "content", "last-assistant",
        "ceiling", "method", "depth", "auto", "model", "penalty", "response_format", "logit_bias"])
def test_bad_input_gets_an_openai_error(server, body, status, param, code):
    worker, base = server
    jobs_before = next(jobs._ids)
    response = httpx.post(f"{base}/chat/completions", json=body, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert error["message"] and "\n" not in error["message"]
    assert next(jobs._ids) == jobs_before + 1  # no job was made for it


def test_the_official_client_raises_the_matching_errors(server):
    _, base = server
    c = client(base)
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(model=MODEL, messages=QUESTION, temperature=-1)
    assert bad.value.status_code == 400 and bad.value.code == "invalid_value" and bad.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="no-such-model", messages=QUESTION)
    with pytest.raises(openai.BadRequestError):
        streamed(c, messages=[{"role": "assistant", "content": "no question"}])


def test_malformed_requests_and_unknown_paths(server):
    _, base = server
    bad = httpx.post(f"{base}/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(f"{base}/chat/completions", json=[1, 2]).status_code == 400
    missing = httpx.get(f"{base}/embeddings")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert httpx.get(f"{base}/chat/completions").status_code == 405


# A slow answer: 2000 tokens at most 5 a step (depth 4) is 400 steps or more, 20 s at 0.05 s a step.
SLOW_STEP_S = 0.05
SLOW_BODY = {"model": MODEL, "messages": QUESTION, "max_tokens": 2000, "temperature": 0}
FULL_ANSWER_STEPS = 2000 // 5


@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "whole"])
def test_a_client_that_goes_away_frees_the_engine(server, streamed):
    """The job stops within a second or two of the client leaving, long before the answer could
    have ended on its own."""
    worker, base = server
    worker.engine.delay = SLOW_STEP_S
    steps = worker.engine.steps_run
    try:
        if streamed:
            with httpx.stream("POST", f"{base}/chat/completions", json=SLOW_BODY | {"stream": True},
                              timeout=30) as response:
                lines = response.iter_lines()  # kept: a dropped iterator closes the connection
                assert '"role": "assistant"' in next(line for line in lines if line)
                assert support.wait_until(lambda: worker.engine.steps_run > steps + 5 and worker.busy == 1, 30)
        else:  # a whole answer: the client gives up waiting for it (as the openai client's timeout does)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{base}/chat/completions", json=SLOW_BODY, timeout=httpx.Timeout(30, read=3))
            assert worker.engine.steps_run > steps + 5
        assert support.wait_until(lambda: worker.busy == 0, 5), "the engine kept decoding for a client that left"
        assert worker.engine.steps_run - steps < FULL_ANSWER_STEPS // 2
    finally:
        worker.engine.delay = 0.0


def test_a_client_gets_429_past_its_share_and_the_ui_keeps_answering(server):
    """One client may have MAX_PER_CLIENT answers waiting or running; the next gets 429 with
    Retry-After. Meanwhile Gradio's own endpoints still answer (the API waits in its own threads)."""
    import threading

    worker, base = server
    worker.engine.delay = SLOW_STEP_S
    root = base[:-len("/v1")]
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(httpx.post(
        f"{base}/chat/completions", json=SLOW_BODY, timeout=120).status_code)) for _ in range(worker_module.MAX_PER_CLIENT)]
    try:
        for thread in threads:
            thread.start()
        assert support.wait_until(lambda: worker.busy == worker_module.MAX_PER_CLIENT, 30)
        refused = httpx.post(f"{base}/chat/completions", json=SLOW_BODY, timeout=30)
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) > 0
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        with pytest.raises(openai.RateLimitError):
            client(base).chat.completions.create(**SLOW_BODY)
        assert httpx.get(f"{root}/config", timeout=10).status_code == 200
    finally:
        worker.engine.delay = 0.0
        for job in [worker._current, *worker._pending]:
            if job is not None:
                job.cancel()
        for thread in threads:
            thread.join(60)
    assert support.wait_until(lambda: worker.busy == 0, 10)


def test_a_web_pages_simple_cross_site_post_is_refused(server):
    """A page on any site can POST ``text/plain`` (or a form) to localhost without a CORS
    preflight; the API takes only ``application/json`` bodies, which such a page cannot send."""
    worker, base = server
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    steps = worker.engine.steps_run
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"content-type": content_type} if content_type else {}
        response = httpx.post(f"{base}/chat/completions", content=body.encode(), headers=headers,
                              timeout=30)
        assert response.status_code == 415, (content_type, response.text)
        assert response.json()["error"]["code"] == "unsupported_media_type"
    assert worker.engine.steps_run == steps, "a refused request reached the engine"
    ok = httpx.post(f"{base}/chat/completions", content=body.encode(),
                    headers={"content-type": "application/json; charset=utf-8"}, timeout=120)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("host", ["evil.example", "rebind.attacker.test:80", "localhost.evil.example",
                                  "x.localhost", "192.0.2.7"])
def test_a_foreign_host_name_is_refused_everywhere(server, host):
    """DNS rebinding: a name the attacker controls, pointed at 127.0.0.1, reaches the server with
    that name as its Host. Every path answers 403 to it, the UI, Gradio's API and /v1 alike."""
    _, base = server
    root = base[:-len("/v1")]
    for url in (root + "/", root + "/config", base + "/models"):
        response = httpx.get(url, headers={"host": host}, timeout=30)
        assert response.status_code == 403, (url, host, response.status_code)
        assert "not allowed" in response.text
    post = httpx.post(base + "/chat/completions", headers={"host": host},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert post.status_code == 403


def test_the_loopback_names_get_in(server):
    _, base = server
    port = base.rsplit(":", 1)[1].split("/")[0]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "LOCALHOST", "127.0.0.2"):
        assert httpx.get(base + "/models", headers={"host": host}, timeout=30).status_code == 200, host


@pytest.fixture(scope="module")
def keyed_server():
    """``(worker, base_url)``: the app served with an API key, as ``launch.py --api-key`` does."""
    tok = support.tokenizer()
    target, draft = support.tiny_pair()
    worker = Worker(make_engine(target, draft, tok), tok, {"target": MODEL, "draft": "tiny-draft"})
    demo = ui.build_demo(worker, tok)
    app, url, _ = ui.launch(demo, server_name="127.0.0.1", server_port=support.free_port(),
                            prevent_thread_lock=True, quiet=True,
                            guards=ui.Guards(api_key=API_KEY, cors_origins=frozenset({ALLOWED_ORIGIN})))
    openai_api.mount(app, worker, {"tree_size": 8, "depth": 4}, api_key=API_KEY)
    yield worker, url.rstrip("/")
    demo.close()
    worker.close()


API_KEY = "test-key-7f3a"
ALLOWED_ORIGIN = "https://tools.example:8443"
EVIL = "https://evil.example"


def test_with_an_api_key_the_api_wants_the_bearer_token(keyed_server):
    _, root = keyed_server
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {API_KEY}"}):
        response = httpx.get(f"{root}/v1/models", headers=headers, timeout=30)
        assert response.status_code == 401, headers
        assert response.json()["error"]["code"] == "invalid_api_key"
        post = httpx.post(f"{root}/v1/chat/completions", headers=headers, timeout=30,
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert post.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        client(f"{root}/v1").models.list()
    keyed = openai.OpenAI(base_url=f"{root}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    assert keyed.models.list().data[0].id == MODEL
    answer = keyed.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert answer.choices[0].message.content is not None


def test_with_an_api_key_the_page_wants_it_as_the_password(keyed_server):
    _, root = keyed_server
    assert httpx.get(f"{root}/config", timeout=30).status_code == 401
    with httpx.Client(base_url=root, timeout=30) as browser:
        refused = browser.post("/login", data={"username": "me", "password": "wrong"})
        assert refused.status_code >= 400
        assert browser.post("/login", data={"username": "me", "password": API_KEY}).status_code == 200
        assert browser.get("/config").status_code == 200


# ----- cross-origin requests (app/cross_origin.py) ------------------------------------------------
def _port(base: str) -> str:
    return base.rsplit(":", 1)[1].split("/")[0]


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]"])
def test_a_foreign_page_can_read_nothing_and_change_nothing(server, host):
    """Gradio answered a foreign Origin with credentials whenever the Host was not exactly a
    loopback name it knows ([::1], a LAN address): a page the user visits could drive the UI."""
    _, base = server
    root = f"http://127.0.0.1:{_port(base)}"
    headers = {"host": f"{host}:{_port(base)}", "origin": EVIL}
    for path in ("/config", "/v1/models", "/gradio_api/info"):
        read = httpx.get(root + path, headers=headers, timeout=30)
        assert "access-control-allow-origin" not in read.headers, path
        assert "access-control-allow-credentials" not in read.headers, path
    for path in ("/gradio_api/queue/join", "/gradio_api/upload", "/v1/chat/completions"):
        preflight = httpx.options(root + path, headers=headers | {"access-control-request-method": "POST",
                                                                  "access-control-request-headers": "content-type"})
        assert preflight.status_code == 403 and "access-control-allow-origin" not in preflight.headers, path
    upload = httpx.post(root + "/gradio_api/upload", headers=headers, files={"files": ("a.txt", b"x")}, timeout=30)
    assert upload.status_code == 403  # a form POST needs no preflight: refused before the route
    post = httpx.post(root + "/v1/chat/completions", headers=headers, timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert post.status_code == 403 and post.json()["error"]["code"] == "cors"


def test_the_pages_own_requests_still_pass(server):
    _, base = server
    own = f"http://127.0.0.1:{_port(base)}"
    post = httpx.post(base + "/chat/completions", headers={"origin": own}, timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert post.status_code == 200, post.text


def test_a_listed_origin_may_call_v1_without_credentials(keyed_server):
    _, root = keyed_server
    origin = {"origin": ALLOWED_ORIGIN}
    preflight = httpx.options(f"{root}/v1/chat/completions", timeout=30, headers=origin | {
        "access-control-request-method": "POST", "access-control-request-headers": "authorization, content-type"})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in preflight.headers
    answer = httpx.post(f"{root}/v1/chat/completions", timeout=60,
                        headers=origin | {"authorization": f"Bearer {API_KEY}"},
                        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "access-control-allow-credentials" not in answer.headers
    # the listed origin gets /v1 only, never the UI's routes
    ui_preflight = httpx.options(f"{root}/gradio_api/queue/join", timeout=30,
                                 headers=origin | {"access-control-request-method": "POST"})
    assert ui_preflight.status_code == 403
    assert "access-control-allow-origin" not in httpx.get(f"{root}/v1/models", timeout=30, headers={
        "origin": EVIL, "authorization": f"Bearer {API_KEY}"}).headers


# ----- input caps -------------------------------------------------------------------------------
def test_oversized_and_malformed_bodies_get_openai_errors_and_queue_nothing(server):
    worker, base = server
    jobs_before = next(jobs._ids)
    url = f"{base}/chat/completions"
    json_headers = {"content-type": "application/json"}
    big = httpx.post(url, content=b" " * (openai_requests.MAX_BODY_BYTES + 1), headers=json_headers, timeout=60)
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the cap holds while reading
        for _ in range(openai_requests.MAX_BODY_BYTES // (1 << 20) + 2):
            yield b" " * (1 << 20)
    assert httpx.post(url, content=chunks(), headers=json_headers, timeout=60).status_code == 413
    deep = httpx.post(url, content=b"[" * 100_000 + b"]" * 100_000, headers=json_headers, timeout=60)
    assert deep.status_code == 400 and deep.json()["error"]["message"].startswith("the request body is not valid")
    for stop in ("x" * (openai_requests.MAX_STOP_CHARS + 1), ["a", "b", "c", "d", "e"], [""]):
        response = httpx.post(url, json={"model": MODEL, "messages": QUESTION, "stop": stop}, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == "stop", stop
    many = [{"role": "user", "content": "x" * 150_000}] * 15  # 2.25 M characters
    response = httpx.post(url, json={"model": MODEL, "messages": many}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert next(jobs._ids) == jobs_before + 1  # nothing reached the queue


def test_a_client_is_its_ipv4_address_or_its_ipv6_64():
    key = openai_api.client_key
    assert key("127.0.1.7") == "api:127.0.1.7" != key("127.0.1.8")
    assert key("2001:db8:1:2::1") == key("2001:db8:1:2:ffff::9") == "api:2001:db8:1:2::/64"
    assert key("2001:db8:1:3::1") != key("2001:db8:1:2::1")
    assert key("::ffff:10.0.0.7") == key("10.0.0.7") and key(None) == "api:unknown"


# ----- conformance ------------------------------------------------------------------------------
def test_a_stated_default_max_tokens_a_ceiling_and_a_fresh_seed(server):
    """A request that names no max_tokens gets DEFAULT_MAX_TOKENS (not the rest of a 32k context:
    one such job held the worker for minutes), or the rest of the context where less is left; one
    above the server's ceiling is a 400 naming it."""
    worker, _ = server
    body = {"model": MODEL, "messages": QUESTION, "temperature": 0.8}
    call = openai_requests.parse_chat(body, worker, {"tree_size": 8, "depth": 4})
    assert call.request.settings.max_new_tokens == openai_requests.DEFAULT_MAX_TOKENS
    short = worker.engine.max_context
    try:
        worker.engine.max_context = call.prompt_tokens + 8 + 100  # 100 tokens of room beside the tree
        assert openai_requests.parse_chat(body, worker, {}).request.settings.max_new_tokens == 100
    finally:
        worker.engine.max_context = short
    assert openai_requests.parse_chat(body, worker, {"max_tokens": 50}).request.settings.max_new_tokens == 50
    for limit, asked in ((openai_requests.MAX_TOKENS_LIMIT, openai_requests.MAX_TOKENS_LIMIT + 1), (64, 65)):
        with pytest.raises(openai_requests.APIError, match=f"at most {limit}") as refused:
            openai_requests.parse_chat(body | {"max_tokens": asked}, worker, {"max_tokens_limit": limit})
        assert refused.value.status == 400 and refused.value.param == "max_tokens"
    assert openai_requests.parse_chat(body | {"max_tokens": 64}, worker, {"max_tokens_limit": 64})
    seeds = {openai_requests.parse_chat(body, worker, {}).request.settings.seed for _ in range(5)}
    assert len(seeds) > 1  # seed 0 every time made sampled answers repeat
    assert openai_requests.parse_chat(body | {"seed": 7}, worker, {}).request.settings.seed == 7
    # harmless values of the refused parameters pass
    assert openai_requests.parse_chat(body | {"frequency_penalty": 0, "response_format": {"type": "text"}}, worker, {})


def test_developer_and_system_messages_anywhere(server):
    worker, base = server
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "system", "content": "Now answer in French."},
                {"role": "user", "content": [{"type": "text", "text": "How are "}, {"type": "text", "text": "you?"}]}]
    call = openai_requests.parse_chat({"model": MODEL, "messages": messages}, worker, {})
    assert call.request.system == "Be brief."
    assert call.request.messages[2] == {"role": "system", "content": "Now answer in French."}
    assert call.request.messages[3]["content"] == "How are you?"
    answer = client(base).chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert answer.choices[0].finish_reason == "length"
    assert answer.choices[0].message.content == engine_answer(worker, [
        {"role": "system", "content": "Be brief."}, *messages[1:4], {"role": "user", "content": "How are you?"}],
        max_new=4)[0]


# ----- real clients' request sequences, replayed -------------------------------------------------
@pytest.mark.parametrize("recording", ["open_webui", "continue"])
def test_recorded_client_sequences_pass_unchanged(server, recording):
    """The requests Open WebUI and the Continue extension send, as recorded in tests/data/clients,
    each answered with 200 and a well-formed object or stream."""
    from pathlib import Path

    worker, base = server
    requests = json.loads((Path(__file__).parent / "data" / "clients" / f"{recording}.json").read_text())["requests"]
    worker.engine.max_context = 600  # the answers that default to the rest of the context stay short
    try:
        replay(base, recording, requests)
    finally:
        del worker.engine.max_context


def replay(base: str, recording: str, requests: list[dict]) -> None:
    for i, call in enumerate(requests):
        body = json.loads(json.dumps(call.get("body", {})).replace('"MODEL"', json.dumps(MODEL)))
        if call["method"] == "GET":
            response = httpx.get(base + call["path"], timeout=30)
            assert response.status_code == 200 and response.json()["data"][0]["id"] == MODEL
        elif body.get("stream"):
            payloads = sse_lines(base, call["path"], body)
            assert payloads[-1] == "[DONE]", (recording, i)
            chunks = [json.loads(p) for p in payloads[:-1]]
            assert not any("error" in ch for ch in chunks), (recording, i, chunks[-1])
            finish = [ch["choices"][0]["finish_reason"] for ch in chunks if ch.get("choices")]
            assert finish[-1] in ("stop", "length") and all(f is None for f in finish[:-1])
        else:
            response = httpx.post(base + call["path"], json=body, timeout=120)
            assert response.status_code == 200, (recording, i, response.text)
            choice = response.json()["choices"][0]
            assert isinstance(choice.get("text", (choice.get("message") or {}).get("content")), str)


def test_predicted_outputs_keep_the_answer_and_count_the_accepted_prediction(server):
    """OpenAI's Predicted Outputs through the official client: the expected answer is copied from,
    the answer is still exactly the engine's greedy one, and usage says how much of it was kept."""
    worker, base = server
    text, tokens = engine_answer(worker, QUESTION, max_new=32)
    expected = text[:len(text) // 2] + " something else entirely " + text[len(text) // 2:]
    out = client(base).chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32,
                                               prediction={"type": "content", "content": expected})
    assert out.choices[0].message.content == text
    details = out.usage.completion_tokens_details
    predicted = len(worker.tokenizer.encode(expected, add_special_tokens=False))
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == predicted
    assert details.accepted_prediction_tokens >= 4, details
    assert out.model_extra["sequoia"]["accepted_by_source"]["copy"] >= details.accepted_prediction_tokens
    plain = client(base).chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=8)
    assert plain.usage.completion_tokens_details is None  # no prediction, no details


LONE = "ok \ud800 end"  # a lone UTF-16 surrogate: JSON carries it as "\\ud800", UTF-8 cannot


@pytest.mark.parametrize("path, body, param", [
    ("/completions", {"prompt": LONE}, "prompt"),
    ("/completions", {"prompt": [LONE]}, "prompt"),
    ("/chat/completions", {"messages": QUESTION, "prediction": {"type": "content", "content": LONE}},
     "prediction.content"),
    ("/chat/completions", {"messages": QUESTION, "prediction": {"type": "content",
                                                                "content": [{"type": "text", "text": LONE}]}},
     "prediction.content"),
    ("/chat/completions", {"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
    ("/chat/completions", {"messages": [{"role": "system", "content": [{"type": "text", "text": LONE}]}] + QUESTION},
     "messages[0].content"),
], ids=["prompt", "prompt-list", "prediction", "prediction-parts", "message", "system-parts"])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, path, body, param):
    """The tokenizer cannot take a lone surrogate: in a prompt or a prediction it was a 500
    (TypeError); a message's was silently replaced."""
    _, base = server
    jobs_before = next(jobs._ids)
    response = httpx.post(base + path, content=json.dumps({"model": MODEL, "max_tokens": 2, **body}),
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, "invalid_value", "invalid_request_error")
    assert "surrogate" in error["message"]
    assert next(jobs._ids) == jobs_before + 1


def test_max_tokens_that_leave_the_prompt_no_room_is_a_400(server):
    """max_tokens = the context minus the tree's size leaves the prompt exactly 0 tokens, which
    read as "no limit" and reached the engine (500)."""
    worker, base = server
    jobs_before = next(jobs._ids)
    room = worker.engine.max_context - 8  # the server's default tree: 8 nodes
    for path, body, param in (("/chat/completions", {"messages": QUESTION}, "messages"),
                              ("/completions", {"prompt": "def f(x):"}, "prompt")):
        for max_tokens in (room, room - 1):
            response = httpx.post(base + path, json={"model": MODEL, "max_tokens": max_tokens, **body}, timeout=60)
            assert response.status_code == 400, (path, max_tokens, response.text)
            error = response.json()["error"]
            assert (error["param"], error["code"]) == (param, "context_length_exceeded"), (path, max_tokens)
    assert next(jobs._ids) == jobs_before + 1


@pytest.mark.parametrize("prediction", [{"type": "text", "content": "x"}, {"content": "x"}, "just a string",
                                        {"type": "content", "content": 5},
                                        {"type": "content", "content": [{"type": "image_url"}]}])
def test_a_malformed_prediction_is_refused(server, prediction):
    _, base = server
    with pytest.raises(openai.BadRequestError) as caught:
        client(base).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, prediction=prediction)
    assert caught.value.body["param"] == "prediction"
