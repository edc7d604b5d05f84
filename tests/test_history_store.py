"""The conversation store (app.serving.history): schema and migrations, atomic per-answer writes,
files it must not touch (corrupt, foreign, newer, read-only), two writers at once, search, and a
writer killed mid-write. No models: step records are made by hand."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from app.serving import history
from app.serving.history import HistoryStore, open_store
from engine.core.records import StepRecord, StepTimings

ROOT = Path(__file__).resolve().parent.parent


def step(index, committed=(11, 12)) -> StepRecord:
    return StepRecord(index=index, tokens=[10, 11, 12], parents=[-1, 0, 1], ranks=[0, 1, 1],
                      draft_probs=[1.0, 0.5, 0.5], target_probs=[1.0, 0.6, 0.4], accepted=[0, 1],
                      committed=list(committed), timings=StepTimings(0.01, 0.02, 0.0))


def chat(*texts):
    roles = ("user", "assistant")
    return [{"role": roles[i % 2], "content": t} for i, t in enumerate(texts)]


def test_a_new_store_has_the_latest_schema_and_marks_its_file(tmp_path):
    s = HistoryStore(tmp_path / "x" / "c.sqlite3")  # the folder is made
    assert s.schema_version == history.SCHEMA_VERSION == len(history.MIGRATIONS)
    db = sqlite3.connect(s.path)
    assert db.execute("PRAGMA application_id").fetchone()[0] == history.APP_ID
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_an_empty_file_and_an_older_schema_are_migrated_keeping_what_was_saved(tmp_path):
    empty = tmp_path / "empty.sqlite3"
    empty.touch()
    assert HistoryStore(empty).schema_version == history.SCHEMA_VERSION
    old = tmp_path / "old.sqlite3"
    db = sqlite3.connect(old)
    db.executescript(history.MIGRATIONS[0])
    db.execute(f"PRAGMA application_id = {history.APP_ID}")
    db.execute("PRAGMA user_version = 1")
    db.execute("INSERT INTO conversations VALUES ('a', 'Old one', '', 1.0, 1.0)")
    db.execute("INSERT INTO messages (conversation, position, role, content) VALUES ('a', 0, 'user', 'hi')")
    db.commit()
    db.close()
    s = HistoryStore(old)
    assert s.schema_version == history.SCHEMA_VERSION
    loaded = s.load("a")
    assert loaded.title == "Old one" and loaded.messages == [{"role": "user", "content": "hi"}]


def test_answers_are_saved_with_settings_steps_and_earlier_answers_kept(tmp_path):
    s = HistoryStore(tmp_path / "c.sqlite3")
    h = chat("Tell me about trees, with a very long first message that makes a long title indeed yes", "Trees.")
    cid = s.save(None, "Be brief.", h, {"temperature": 0.0}, [step(0), step(1)], {10: "a", 11: "b"})
    assert s.list()[0][:2] == (cid, history.title_of(h)) and s.list()[0][1].endswith("…")
    h2 = h + chat("More?", "Roots.")[:2]
    h2[-1]["note"] = "stopped"
    s.save(cid, "Be brief.", h2, {"temperature": 0.5}, [step(0, (13,))], {13: "c"}, stopped=True)
    c = s.load(cid)
    assert [m["content"] for m in c.messages] == ["Tell me about trees, with a very long first message that makes a "
                                                  "long title indeed yes", "Trees.", "More?", "Roots."]
    assert c.messages[-1]["note"] == "stopped" and c.system == "Be brief."
    assert c.settings == {"temperature": 0.5} and [st.committed for st in c.steps] == [[13]] and c.texts == {13: "c"}
    db = sqlite3.connect(s.path)
    assert db.execute("SELECT id, parent, stopped, steps IS NOT NULL FROM nodes ORDER BY id").fetchall() == \
        [(0, None, 0, 0), (1, 0, 0, 1), (2, 1, 0, 0), (3, 2, 1, 1)]  # the first answer's steps stay
    assert s.rename(cid, "  Trees  and roots ") and s.load(cid).title == "Trees and roots"
    s.save(cid, "", h2 + chat("x", "y"))  # a renamed title stays
    assert s.load(cid).title == "Trees and roots"
    assert s.delete(cid) and s.load(cid) is None and s.list() == []
    assert db.execute("SELECT count(*) FROM nodes").fetchone()[0] == 0


def test_a_failed_write_leaves_the_conversation_as_it_was(tmp_path, monkeypatch):
    s = HistoryStore(tmp_path / "c.sqlite3")
    cid = s.save(None, "", chat("one", "two"), {}, [step(0)], {})

    def broken(steps, texts):
        raise sqlite3.OperationalError("database or disk is full")
    monkeypatch.setattr(history, "pack_steps", broken)
    with pytest.raises(sqlite3.OperationalError):
        s.save(cid, "", chat("changed", "all"), {}, [step(0)], {})
    monkeypatch.undo()
    with sqlite3.connect(s.path) as db:  # mid-transaction failure: nothing of it
        db.execute("CREATE TRIGGER full BEFORE INSERT ON nodes WHEN NEW.content = 'boom' "
                   "BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END")
    with pytest.raises(sqlite3.DatabaseError):
        s.save(cid, "new system", chat("one", "two", "three", "boom"), {}, [step(0)], {})
    c = s.load(cid)
    assert [m["content"] for m in c.messages] == ["one", "two"] and c.system == "" and len(c.steps) == 1


@pytest.mark.parametrize("content", [b"this is not a database at all" * 100,
                                     b"SQLite format 3\x00" + b"\xff" * 5000])
def test_a_corrupt_file_turns_history_off_and_is_not_touched(tmp_path, content):
    path = tmp_path / history.FILE_NAME
    path.write_bytes(content)
    store, line = open_store(tmp_path)
    assert store is None and line.startswith("History is off:") and "\n" not in line
    assert path.read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == [history.FILE_NAME]


def test_a_foreign_or_newer_database_is_left_alone(tmp_path):
    path = tmp_path / history.FILE_NAME
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE notes (x)")
    db.execute("INSERT INTO notes VALUES (1)")
    db.commit()
    db.close()
    before = path.read_bytes()
    store, line = open_store(tmp_path)
    assert store is None and "another program" in line and path.read_bytes() == before
    path.unlink()
    HistoryStore(path).close()
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {history.SCHEMA_VERSION + 1}")
    db.close()
    store, line = open_store(tmp_path)
    assert store is None and "newer version" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_turns_history_off(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        store, line = open_store(folder)
        assert store is None and line.startswith("History is off:")
        store, line = open_store(folder / "below")
        assert store is None and "cannot make the folder" in line
    finally:
        folder.chmod(0o755)


def test_the_data_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("SEQUOIA_DATA", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert history.default_data_dir() == tmp_path / "xdg" / "sequoia-chat"
    monkeypatch.setenv("SEQUOIA_DATA", str(tmp_path / "mine"))
    assert history.default_data_dir() == tmp_path / "mine"
    store, line = open_store()
    assert store.path == tmp_path / "mine" / history.FILE_NAME and str(store.path) in line


def test_two_writers_at_once_lose_nothing(tmp_path):
    path = tmp_path / "c.sqlite3"
    stores = [HistoryStore(path), HistoryStore(path)]  # two connections, as two processes have
    errors = []

    def write(k):
        try:
            for i in range(40):
                cid = stores[k].save(None, "", chat(f"writer {k} question {i}", "answer"), {}, [step(0)], {})
                stores[k].save(cid, "", chat(f"writer {k} question {i}", "answer", "again", "more"), {}, [step(1)], {})
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=write, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    listed = stores[0].list(limit=1000)
    assert len(listed) == 80
    assert all(len(stores[1].load(cid).messages) == 4 for cid, _, _ in listed)


def test_search_matches_titles_and_text_newest_first(tmp_path):
    s = HistoryStore(tmp_path / "c.sqlite3")
    a = s.save(None, "", chat("About oak trees", "Oaks are slow."))
    time.sleep(0.01)
    b = s.save(None, "", chat("Rivers", "A river meets the sea; oak barges float."))
    time.sleep(0.01)
    s.save(None, "", chat("100% sure_thing", "yes"))
    assert [r[0] for r in s.list("oak")] == [b, a]
    assert [r[0] for r in s.list("SLOW")] == [a]
    assert len(s.list("100%")) == 1 and s.list("0%x") == [] and len(s.list("e_t")) == 1
    assert s.list("nothing like this") == []


WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from app.serving.history import HistoryStore
    from engine.core.records import StepRecord, StepTimings
    s = HistoryStore(sys.argv[1])
    steps = [StepRecord(index=i, tokens=[10, 11, 12], parents=[-1, 0, 1], ranks=[0, 1, 1],
                        draft_probs=[1.0, 0.5, 0.5], target_probs=[1.0, 0.6, 0.4], accepted=[0, 1],
                        committed=[11, 12], timings=StepTimings(0.01, 0.02, 0.0)) for i in range(300)]
    i = 0
    while True:
        history = [{{"role": "user", "content": f"question {{i}}"}}, {{"role": "assistant", "content": "x" * 20000}}]
        cid = s.save(None, "", history, {{"i": i}}, steps, {{10: "a"}})
        print(cid, i, flush=True)
        i += 1
""")


def test_a_writer_killed_mid_write_leaves_a_sound_file_and_earlier_answers(tmp_path):
    path = tmp_path / "c.sqlite3"
    proc = subprocess.Popen([sys.executable, "-c", WRITER.format(root=str(ROOT)), str(path)],
                            stdout=subprocess.PIPE, text=True)
    saved = []
    try:
        while len(saved) < 25:
            line = proc.stdout.readline()
            assert line, "the writer ended early"
            saved.append(line.split())
        time.sleep(0.003)  # somewhere inside a later save
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.close()
    s = HistoryStore(path)
    for cid, i in saved:
        c = s.load(cid)
        assert c.messages[0]["content"] == f"question {i}" and c.settings == {"i": int(i)} and len(c.steps) == 300
    assert all(len(s.load(cid).messages) == 2 for cid, _, _ in s.list(limit=10_000))  # no half-written answer


def test_a_folder_that_cannot_be_made_turns_history_off(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("mine")
    store, line = open_store(blocker / "sequoia-chat")
    assert store is None and "cannot make the folder" in line and blocker.read_text() == "mine"


def test_a_turn_another_tab_answered_meanwhile_is_a_branch_beside_it_not_over_it(tmp_path):
    s = HistoryStore(tmp_path / "c.sqlite3")
    cid = s.save(None, "", chat("q1", "a1"))
    s.save(cid, "", chat("q1", "a1", "tab A asks", "A's answer"))
    assert s.save(cid, "", chat("q1", "a1", "tab B asks", "B's answer")) == cid  # B's page had not seen A's turn
    c = s.load(cid)
    assert [m["content"] for m in c.messages] == ["q1", "a1", "tab B asks", "B's answer"] and c.branches == [(2, 2, 2)]
    assert s.switch(cid, -1, position=2)
    assert [m["content"] for m in s.load(cid).messages] == ["q1", "a1", "tab A asks", "A's answer"]
    s.save(cid, "", chat("q1", "a1", "tab A asks", "A's answer", "A again", "more"))  # A goes on on its branch
    c = s.load(cid)
    assert [m["content"] for m in c.messages][2:] == ["tab A asks", "A's answer", "A again", "more"]
    assert c.branches == [(2, 1, 2)] and len(s.list()) == 1 and c.title == "q1"


def test_regenerate_keeps_the_answers_it_replaces_as_siblings(tmp_path):
    s = HistoryStore(tmp_path / "c.sqlite3")
    cid = s.save(None, "", chat("q1", "first"), {"seed": 0}, [step(0)], {})
    assert s.load(cid).answers == (1, 1) and not s.switch(cid, -1)
    s.save(cid, "", chat("q1", "second"), {"seed": 1}, [step(0), step(1)], {})
    s.save(cid, "", chat("q1", "third"), {"seed": 2}, [step(0, (13,))], {})
    c = s.load(cid)
    assert c.messages[-1]["content"] == "third" and c.answers == (3, 3)
    assert not s.switch(cid, 1)
    assert s.switch(cid, -1) and s.switch(cid, -1)
    c = s.load(cid)
    assert c.messages[-1]["content"] == "first" and c.answers == (1, 3) and c.settings == {"seed": 0}
    assert len(c.steps) == 1 and not s.switch(cid, -1)
    assert s.switch(cid, 1)
    c = s.load(cid)
    assert c.messages[-1]["content"] == "second" and c.answers == (2, 3) and len(c.steps) == 2
    s.save(cid, "", chat("q1", "second", "q2", "a2"))  # a follow-up: the new last answer has no siblings
    assert s.load(cid).answers == (1, 1) and s.load(cid).branches == [(1, 2, 3)]
    s.save(cid, "", chat("q1", "second", "q2", "a2bis"))
    assert s.load(cid).answers == (2, 2)
    assert s.delete(cid)
    assert sqlite3.connect(s.path).execute("SELECT count(*) FROM nodes").fetchone()[0] == 0


def test_an_edited_message_is_a_branch_with_its_own_answers_and_the_old_one_comes_back(tmp_path):
    """Edit message 1 of a two-turn chat: ‹ 2 / 2 › at message 1; ‹ brings back the old message with
    everything that followed it (and its answer's steps), › the edited one."""
    s = HistoryStore(tmp_path / "c.sqlite3")
    cid = s.save(None, "", chat("oak?", "Oaks."), {}, [step(0)], {})
    s.save(cid, "", chat("oak?", "Oaks.", "elm?", "Elms."), {"seed": 3}, [step(0), step(1)], {})
    s.save(cid, "", chat("beech?", "Beeches."), {"seed": 4}, [step(0, (13,))], {})  # message 1 edited
    c = s.load(cid)
    assert [m["content"] for m in c.messages] == ["beech?", "Beeches."] and c.branches == [(0, 2, 2)]
    assert c.answers == (1, 1) and c.title == "oak?" and len(s.list()) == 1
    assert not s.switch(cid, 1, position=0) and not s.switch(cid, -1, position=5)
    assert s.switch(cid, -1, position=0)
    c = s.load(cid)
    assert [m["content"] for m in c.messages] == ["oak?", "Oaks.", "elm?", "Elms."] and c.branches == [(0, 1, 2)]
    assert c.settings == {"seed": 3} and len(c.steps) == 2
    assert s.switch(cid, 1, position=0)
    assert [m["content"] for m in s.load(cid).messages] == ["beech?", "Beeches."]
    assert [cid] == [r[0] for r in s.list("elm")]  # search finds text on any branch


def test_a_schema_3_file_keeps_its_messages_and_regenerated_answers_as_siblings(tmp_path):
    path = tmp_path / "v3.sqlite3"
    db = sqlite3.connect(path)
    for script in history.MIGRATIONS[:3]:
        db.executescript(script)
    db.execute(f"PRAGMA application_id = {history.APP_ID}")
    db.execute("PRAGMA user_version = 3")
    db.execute("INSERT INTO conversations (id, title, system, created, updated) VALUES ('a', 'Old', 'sys', 1, 2)")
    blob = history.pack_steps([step(0), step(1)], {10: "x"})
    for position, role, content, variant in ((0, "user", "q", 0), (1, "assistant", "second", 1)):
        db.execute("INSERT INTO messages (conversation, position, role, content, settings, steps, variant) VALUES "
                   "('a', ?, ?, ?, ?, ?, ?)", (position, role, content, '{"seed": 1}' if variant else None,
                                               blob if variant else None, variant))
    db.execute("INSERT INTO alternatives (conversation, position, variant, content, settings) VALUES "
               "('a', 1, 0, 'first', '{\"seed\": 0}')")
    db.commit()
    db.close()
    s = HistoryStore(path)
    c = s.load("a")
    assert s.schema_version == history.SCHEMA_VERSION and c.title == "Old" and c.system == "sys"
    assert [m["content"] for m in c.messages] == ["q", "second"] and c.answers == (2, 2)
    assert c.settings == {"seed": 1} and len(c.steps) == 2 and c.texts == {10: "x"}
    assert s.switch("a", -1) and s.load("a").messages[-1]["content"] == "first" and s.load("a").settings == {"seed": 0}
    tables = {r[0] for r in sqlite3.connect(path).execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert tables == {"conversations", "nodes"}
