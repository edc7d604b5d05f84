"""Conversations that last, through the app (tiny pair, real tokenizer, handlers called directly):
an answer is saved with its steps, a new app on the same store lists it and reopens its messages,
tree and replay; stopped answers, regenerate, new chat, rename, delete and search; history off."""
from __future__ import annotations

import sqlite3

import pytest
import test_app_support as support

from app.serving.history import HistoryStore, open_store
from app.page import answer_stream, ui
from app.serving.pair import make_engine
from app.serving.worker import Worker


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    yield from support.one_torch_thread()


@pytest.fixture(scope="module")
def worker():
    yield from support.tiny_worker()


def new_app(worker, path):
    store = HistoryStore(path)
    return ui.build_demo(worker, worker.tokenizer, {"history": store}).chat_app


def ask(app, message, history=(), max_new=6):
    updates = list(app.respond(message, list(history), answer_stream.Run(), "Be brief.", 0.0, 1.0, max_new, 0,
                               "sequoia", 8, 4, False, False, False))
    return updates[-1]


def test_an_answer_is_saved_and_a_new_app_reopens_it_with_its_steps(worker, tmp_path):
    app = new_app(worker, tmp_path / "c.sqlite3")
    c = app.c
    first = ask(app, "Hello there")
    cid = first[c.conv_id]
    assert cid and [v for _, v in first[c.conv_list]["choices"]] == [cid] and first[c.conv_list]["value"] == cid
    second = ask(app, "And then?", first[c.history])
    assert second[c.conv_id] == cid  # the same conversation grows
    steps = second[c.run].steps
    assert steps

    again = new_app(worker, tmp_path / "c.sqlite3")  # a restart: a new app on the same file
    listed = again.conversations.conversation_list()
    assert listed["choices"] == [("Hello there", cid)]
    out = again.conversations.restore(cid, None)  # the page's load with the id the browser kept
    a = again.c
    assert out[a.history] == second[c.history] and out[a.system] == "Be brief." and out[a.conv_title] == "Hello there"
    assert [s.committed for s in out[a.run].steps] == [s.committed for s in steps]
    assert out[a.run].texts == second[c.run].texts
    assert out[a.slider]["visible"] == (len(steps) > 1) and out[a.tree_plot] is not None
    assert out[a.conv_id] == cid and out[a.conv_list]["value"] == cid
    # the next answer in the reopened app continues the stored conversation
    third = ask(again, "One more", out[a.history])
    assert third[a.conv_id] == cid and len(again.conversations.store.load(cid).messages) == 6


def test_regenerate_clear_rename_search_and_delete(worker, tmp_path):
    app = new_app(worker, tmp_path / "c.sqlite3")
    c = app.c
    first = ask(app, "Write about oak trees")
    cid = first[c.conv_id]
    regen = list(app.regenerate(first[c.history], first[c.run], "", 0.0, 1.0, 4, 1, "sequoia", 8, 4, False, False,
                                False))[-1]
    assert regen[c.conv_id] == cid and len(app.conversations.store.load(cid).messages) == 2
    # regenerate keeps the first answer as a sibling: ‹ 2 / 2 ›, and ‹ shows the first with its steps
    assert regen[c.sibling_row]["visible"] and "Answer: 2 / 2" in regen[c.sibling_text]
    back = app.conversations.previous_answer(cid, None)
    assert back[c.history] == first[c.history] and "Answer: 1 / 2" in back[c.sibling_text]
    assert [st.committed for st in back[c.run].steps] == [st.committed for st in first[c.run].steps]
    assert "No other version" in app.conversations.previous_answer(cid, None)[c.status]
    assert app.conversations.next_answer(cid, None)[c.history] == regen[c.history]
    cleared = app.clear(None)
    assert cleared[c.conv_id] == "" and cleared[c.conv_list]["value"] is None
    other = ask(app, "Rivers please")
    assert other[c.conv_id] != cid
    assert [v for _, v in app.conversations.conversation_list()["choices"]] == [other[c.conv_id], cid]  # newest first
    assert [v for _, v in app.conversations.search_conversations("OAK", None)["choices"]] == [cid]
    assert app.conversations.rename_conversation(cid, "Oaks")[c.conv_list]["choices"][1] == ("Oaks", cid)
    assert c.delete_row in app.conversations.ask_delete(cid)
    gone = app.conversations.delete_conversation(cid, None)
    assert gone[c.conv_id] == "" and [v for _, v in gone[c.conv_list]["choices"]] == [other[c.conv_id]]
    missing = app.conversations.restore(cid, None)  # a deleted conversation's id in the browser: a new chat
    assert missing[c.conv_id] == "" and c.chatbot not in missing


def test_a_stopped_answer_is_saved_as_stopped(tmp_path):
    tokenizer = support.tokenizer()
    target, draft = support.tiny_pair()
    engine = support.SlowEngine(make_engine(target, draft, tokenizer), delay=0.05)
    slow = Worker(engine, tokenizer, {"target": "tiny-target", "draft": "tiny-draft"})
    try:
        app = new_app(slow, tmp_path / "c.sqlite3")
        c = app.c
        updates = []
        for update in app.respond("Count to a hundred", [], answer_stream.Run(), "", 0.0, 1.0, 200, 0, "sequoia",
                                  8, 4, False, False, False):
            updates.append(update)
            if engine.steps_run >= 3:
                app.stop(None)
        last = updates[-1]
        assert last[c.history][-1]["role"] == "assistant" and last[c.history][-1]["note"] == "stopped"
        stored = app.conversations.store.load(last[c.conv_id])
        assert stored.messages == last[c.history] and stored.steps
        db = sqlite3.connect(app.conversations.store.path)
        assert db.execute("SELECT stopped FROM nodes WHERE role = 'assistant'").fetchall() == [(1,)]
    finally:
        slow.close()


def test_without_a_store_nothing_changes_and_a_note_says_why(worker, tmp_path):
    demo = ui.build_demo(worker, worker.tokenizer)
    app = demo.chat_app
    assert app.conversations.store is None and not hasattr(app.c, "conv_id")
    assert ask(app, "Hello")[app.c.history][-1]["role"] == "assistant"
    (tmp_path / "conversations.sqlite3").write_bytes(b"not a database" * 10)
    store, line = open_store(tmp_path)
    demo = ui.build_demo(worker, worker.tokenizer, {"history": store, "history_note": line})
    assert "History is off" in demo.chat_app.conversations.note


def test_launch_flags_choose_the_folder_or_keep_nothing(tmp_path, monkeypatch):
    import launch
    monkeypatch.setenv("SEQUOIA_DATA", str(tmp_path / "env"))
    store, line = launch.open_history(launch.parse_args(["--data-dir", str(tmp_path / "mine")]))
    assert store.path.parent == tmp_path / "mine" and str(store.path) in line
    store.close()
    store, line = launch.open_history(launch.parse_args([]))
    assert store.path.parent == tmp_path / "env"
    store.close()
    for argv in (["--no-history"], ["--tiny"]):
        store, line = launch.open_history(launch.parse_args(argv))
        assert store is None and "History is off" in line
    assert not (tmp_path / "other").exists()


def test_a_failed_save_keeps_the_answer_and_says_it_was_not_saved(worker, tmp_path, monkeypatch):
    app = new_app(worker, tmp_path / "c.sqlite3")
    c = app.c

    def full(*args, **kwargs):
        raise sqlite3.OperationalError("database or disk is full")
    monkeypatch.setattr(app.conversations.store, "save", full)
    with pytest.warns(UserWarning, match="not saved to the history"):
        last = ask(app, "Hello there")
    assert last[c.history][-1]["role"] == "assistant" and c.conv_id not in last
    assert "Not saved to the history: database or disk is full" in last[c.status]


def test_editing_an_earlier_message_answers_again_from_there_and_keeps_what_followed(worker, tmp_path):
    """Edit message 1 of a two-turn chat: the conversation is answered again from the edited
    message, as a branch of the same conversation; ‹ 1 / 2 › at message 1 brings back what
    followed the old message (its answers' trees too), › the edited one; a regenerate on the
    branch adds a second ‹ › point, and the menu picks which one steps."""
    import gradio as gr

    app = new_app(worker, tmp_path / "c.sqlite3")
    c = app.c
    first = ask(app, "Tell me about oak trees")
    second = ask(app, "And about elms?", first[c.history])
    cid = second[c.conv_id]
    edit = gr.EditData(None, {"index": 0, "value": "Tell me about beech trees", "previous_value": ""})
    updates = list(app.edit_message(second[c.history], second[c.run], "Be brief.", 0.0, 1.0, 6, 0, "sequoia", 8, 4,
                                    False, False, False, False, edit, None))
    out = updates[-1]
    history = out[c.history]
    assert [m["role"] for m in history] == ["user", "assistant"]
    assert history[0]["content"] == "Tell me about beech trees" and history[1]["content"]
    assert out[c.run].steps and out[c.conv_id] == cid and len(app.conversations.conversation_list()["choices"]) == 1
    assert out[c.sibling_row]["visible"] and "Your message 1: 2 / 2" in out[c.sibling_text]
    assert not out[c.branch_at]["visible"] and out[c.branch_at]["value"] == 0
    back = app.conversations.previous_answer(cid, 0, None)
    assert back[c.history] == second[c.history] and "Your message 1: 1 / 2" in back[c.sibling_text]
    assert [st.committed for st in back[c.run].steps] == [st.committed for st in second[c.run].steps]
    assert "Your message 1: 1 of 2" in back[c.status]
    assert app.conversations.next_answer(cid, 0, None)[c.history] == history
    regen = list(app.regenerate(history, out[c.run], "", 0.0, 1.0, 4, 1, "sequoia", 8, 4, False, False, False))[-1]
    assert "Answer: 2 / 2" in regen[c.sibling_text] and regen[c.branch_at]["visible"]
    assert [v for _, v in regen[c.branch_at]["choices"]] == [0, 1] and regen[c.branch_at]["value"] == 1
    picked = app.conversations.choose_branch(cid, 0)
    assert "Your message 1: 2 / 2" in picked[c.sibling_text] and picked[c.branch_at]["value"] == 0
    assert app.conversations.previous_answer(cid, 0, None)[c.history] == second[c.history]
    assert app.conversations.next_answer(cid, 0, None)[c.history] == regen[c.history]  # the newest continuation
    refused = list(app.edit_message(second[c.history], second[c.run], "", 0.0, 1.0, 6, 0, "sequoia", 8, 4, False,
                                    False, False, False, gr.EditData(None, {"index": 1, "value": "x",
                                                                            "previous_value": ""}), None))
    assert "Only your own messages" in refused[-1][c.status]  # an answer is not the user's to edit
