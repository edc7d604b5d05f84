"""The real app on a local server (in this process, tiny models), driven with gradio_client."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_app_support as support
from gradio_client import Client  # noqa: E402

from app.views.conversation import safe_markdown
from app.serving.pair import make_engine
from engine.tuning.tree_store import build_tree

# outputs of the /chat endpoint (gr.State outputs are not part of the API)
CHATBOT, MSG, TREE_PLOT, SLIDER, STEPS_PLOT, STATS, STATUS, COMPARE, HIGHLIGHT, EXPORT = range(10)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    yield from support.one_torch_thread()


def chat_args(message, max_new=24, size=8, depth=4, temperature=0.0, compare=False, system=""):
    # message, system, temperature, top_p, max_new, seed, method, size, depth, auto, compare, highlight
    return (message, system, temperature, 1.0, max_new, 0, "sequoia", size, depth, False, compare, False)


def answer_text(chatbot) -> str:
    last = chatbot[-1]
    assert last["role"] == "assistant"
    content = last["content"]
    return "".join(part["text"] for part in content) if isinstance(content, list) else content


@pytest.fixture(scope="module")
def server():
    yield from support.tiny_server()


def client(url) -> Client:
    return Client(url, verbose=False, download_files=False)


def expected(worker, message, max_new=24, size=8, depth=4):
    text, _ = support.reference_text(make_engine(worker.engine.target, worker.engine.draft, worker.tokenizer),
                                     worker.tokenizer, [{"role": "user", "content": message}],
                                     max_new_tokens=max_new, tree=build_tree(size, depth))
    return safe_markdown(text)


def test_greedy_turn_returns_the_engine_text_and_streams(server):
    worker, url = server
    c = client(url)
    job = c.submit(*chat_args("Write a haiku about trees", max_new=48), api_name="/chat")
    final = job.result(timeout=60)
    assert answer_text(final[CHATBOT]) == expected(worker, "Write a haiku about trees", max_new=48)
    assert "Done: 48 tokens" in final[STATUS]
    assert "tokens/step" in final[STATS]
    assert final[TREE_PLOT]["type"] == "plotly" and '"kind":"nodes"' in final[TREE_PLOT]["plot"]
    assert final[SLIDER]["visible"] is True and final[SLIDER]["maximum"] >= 2
    partial = [out[CHATBOT] for out in job.outputs()
               if isinstance(out[CHATBOT], list) and len(out[CHATBOT]) == 2]
    lengths = [len(answer_text(chat)) for chat in partial]
    assert len(set(lengths)) >= 3, f"expected several partial updates, got lengths {lengths}"
    assert lengths == sorted(lengths)
    # a second turn of the same session continues the conversation
    final2 = c.predict(*chat_args("And one about rivers", max_new=8), api_name="/chat")
    assert [m["role"] for m in final2[CHATBOT]] == ["user", "assistant", "user", "assistant"]


def test_empty_message_is_ignored_with_a_notice(server):
    _, url = server
    out = client(url).predict(*chat_args("   "), api_name="/chat")
    assert "Empty message ignored" in out[STATUS]


def test_stop_mid_answer_returns_promptly_and_the_next_request_works(server):
    worker, url = server
    c = client(url)
    worker.engine.delay = 0.03
    try:
        job = c.submit(*chat_args("Tell me a very long story", max_new=2000), api_name="/chat")
        assert support.wait_until(lambda: worker.engine.steps_run > 0 and len(job.outputs()) >= 2, 30)
        c.predict(api_name="/stop")
        assert support.wait_until(lambda: worker.busy == 0, 5), "the engine kept decoding after Stop"
        final = job.result(timeout=30)
        assert "Stopped after" in final[STATUS]
        assert "*stopped*" in answer_text(final[CHATBOT])
    finally:
        worker.engine.delay = 0.0
    out = c.predict(*chat_args("Short one", max_new=8), api_name="/chat")  # same tab: history kept
    assert "Done: 8 tokens" in out[STATUS] and len(out[CHATBOT]) == 4
    out = client(url).predict(*chat_args("Short one", max_new=8), api_name="/chat")  # a new tab
    assert answer_text(out[CHATBOT]) == expected(worker, "Short one", max_new=8)


def test_two_concurrent_clients_both_finish_correctly(server):
    worker, url = server
    worker.engine.delay = 0.01
    try:
        a, b = client(url), client(url)
        jobs = [a.submit(*chat_args("Question from tab A", max_new=20), api_name="/chat"),
                b.submit(*chat_args("Question from tab B", max_new=20, size=5, depth=4), api_name="/chat")]
        outs = [job.result(timeout=60) for job in jobs]
    finally:
        worker.engine.delay = 0.0
    statuses = [out[STATUS] for job in jobs for out in job.outputs() if isinstance(out[STATUS], str)]
    assert any("Waiting for the engine: 1 request ahead of yours" in s for s in statuses)  # the queue shows
    assert answer_text(outs[0][CHATBOT]) == expected(worker, "Question from tab A", max_new=20)
    assert answer_text(outs[1][CHATBOT]) == expected(worker, "Question from tab B", max_new=20, size=5, depth=4)


def test_compare_mode_shows_both_timings(server):
    _, url = server
    out = client(url).predict(*chat_args("Compare me", max_new=12, compare=True), api_name="/chat")
    assert out[COMPARE]["visible"] is True
    html = out[COMPARE]["value"]
    assert "target alone" in html and "identical tokens" in html and "tokens/s" in html
    assert "the target alone" in out[STATS]  # the measured baseline feeds the speedup
    assert "target alone measured:" in out[STATS] and "estimated" not in out[STATS]  # and says it was measured
    assert "measured just now" in html


def test_replay_step_and_clear(server):
    _, url = server
    c = client(url)
    out = c.predict(*chat_args("Replay", max_new=16), api_name="/chat")
    tree, steps, step_text, _ = c.predict(1, False, api_name="/show_step")
    assert "Step 1:" in tree["plot"]
    assert "Step 1 wrote:" in step_text and "sc-step-now" in step_text  # the replayed step's text, marked
    cleared = c.predict(api_name="/clear")
    assert cleared[CHATBOT] == []
    assert out[SLIDER]["maximum"] >= 2


def test_a_client_that_goes_away_frees_the_engine(server):
    worker, url = server
    worker.engine.delay = 0.03
    try:
        job = client(url).submit(*chat_args("A long answer nobody waits for", max_new=2000), api_name="/chat")
        assert support.wait_until(lambda: worker.busy == 1 and len(job.outputs()) >= 2, 30)
        job.cancel()
        assert support.wait_until(lambda: worker.busy == 0, 10), "the engine kept decoding for a cancelled event"
    finally:
        worker.engine.delay = 0.0


def test_export_then_import_round_trip_and_bad_files(server, tmp_path):
    from gradio_client import handle_file
    _, url = server
    c = client(url)
    out = c.predict(*chat_args("Remember <this>", max_new=6), api_name="/chat")
    exported = json.loads(Path(out[EXPORT]["value"]["path"]).read_text())
    assert [m["role"] for m in exported["messages"]] == ["user", "assistant"]
    assert exported["messages"][0]["content"] == "Remember <this>"

    other = client(url)
    assert exported["steps"] and exported["token_texts"]  # the last answer's steps travel with it
    chat, system, status, _, tree, *_ = other.predict(handle_file(out[EXPORT]["value"]["path"]),
                                                      api_name="/import_conversation")
    assert "Imported 2 messages" in status
    assert f"the last answer's {len(exported['steps'])} steps" in status
    assert "Step " in tree["plot"] and '"kind":"nodes"' in tree["plot"]  # its trees come back for replay
    assert [m["role"] for m in chat] == ["user", "assistant"]
    # the imported conversation is the context of the next turn
    nxt = other.predict(*chat_args("Continue", max_new=4), api_name="/chat")
    assert len(nxt[CHATBOT]) == 4

    bad = tmp_path / "bad.json"
    bad.write_text("this is not json")
    status = other.predict(handle_file(str(bad)), api_name="/import_conversation")[2]
    assert "Import failed" in status and "not a JSON file" in status
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps({"messages": [{"role": "user", "content": "x" * 100_000}] * 12}))
    status = other.predict(handle_file(str(huge)), api_name="/import_conversation")[2]
    assert "Import failed" in status and "MB" in status


def test_oldest_turns_are_dropped_when_the_context_is_full(server):
    worker, url = server
    c = client(url)
    worker.engine.max_context = 160  # the wrapper's view: what the UI budgets against
    try:
        long = "tree " * 60
        first = c.predict(*chat_args(long, max_new=8, size=5), api_name="/chat")
        assert "Done" in first[STATUS] and "left out" not in first[STATUS]
        second = c.predict(*chat_args(long, max_new=8, size=5), api_name="/chat")
        assert "oldest message" in second[STATUS] and "left out of the prompt" in second[STATUS]
        assert "Done" in second[STATUS]
        too_long = c.predict(*chat_args("tree " * 400, max_new=8, size=5), api_name="/chat")
        assert "Not sent" in too_long[STATUS]
    finally:
        del worker.engine.max_context


def test_loading_a_missing_model_keeps_the_pair(server, monkeypatch):
    worker, url = server
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    page = client(url)  # the event is private (never callable by name): sent as the page sends it, by index
    index = next(d["id"] for d in page.config["dependencies"] if d.get("api_name") == "load_pair")
    page.endpoints[index].is_valid = True
    status, info, header, _ = page.predict("sequoia-test-org/missing-model", "sequoia-test-org/missing-draft",
                                           "float32", "cpu", False, fn_index=index)
    assert "Could not load the pair" in status and "still in use" in status
    assert worker.info["target"] == "tiny-target" and worker.pair_version == 0


def test_regenerate_replaces_the_last_answer(server):
    worker, url = server
    c = client(url)
    first = c.predict(*chat_args("Regenerate me", max_new=10), api_name="/chat")
    again = c.predict(*chat_args("", max_new=10)[1:], api_name="/regenerate")  # the settings only
    assert [m["role"] for m in again[CHATBOT]] == ["user", "assistant"]
    assert answer_text(again[CHATBOT]) == answer_text(first[CHATBOT])  # greedy: the same answer
    assert "Nothing to regenerate" in client(url).predict(*chat_args("")[1:], api_name="/regenerate")[STATUS]


def test_auto_tree_in_the_ui(server):
    from test_app_worker import fake_tuner
    worker, url = server
    worker.set_tuner(fake_tuner())
    try:
        args = list(chat_args("Pick the tree for me", max_new=10))
        args[9] = True  # auto
        out = client(url).predict(*args, api_name="/chat")
    finally:
        worker.set_tuner(None)
    assert "Sequoia, auto:" in out[STATUS] and "predicted" in out[STATUS]  # the method is named
    assert '"predicted"' in out[STEPS_PLOT]["plot"]  # the predicted speedup line


def test_an_engine_failure_is_reported_and_the_next_turn_works(server):
    worker, url = server
    c = client(url)
    worker.engine.fail_after = 2
    out = c.predict(*chat_args("This one breaks", max_new=40), api_name="/chat")
    assert "The engine failed" in out[STATUS] and "simulated engine failure" in out[STATUS]
    assert "error: RuntimeError" in answer_text(out[CHATBOT])  # the partial answer stays, marked
    out = c.predict(*chat_args("This one works", max_new=6), api_name="/chat")
    assert "Done: 6 tokens" in out[STATUS]
