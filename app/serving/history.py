"""The page's conversations on disk: one SQLite file (WAL) in the user's data folder.

Each conversation keeps its title, system prompt, created and updated times and its messages as
a tree (``nodes``: each message has a parent, the one before it), with the leaf of the branch on
show: Regenerate adds a sibling of the answer it replaces, an edited message a sibling of the
message it edits, and a turn another tab answered meanwhile a sibling of that tab's, so nothing is
ever overwritten; ‹ k / n › steps between the siblings of any message on the branch. Each answer
keeps the settings it was decoded with, whether it was stopped, and its step records (the export
format of :mod:`app.views.conversation`, zlib-compressed), so its tree, replay and chart come back
after a restart. Every answer is saved in one transaction.

A file that is not this app's database (corrupt, foreign, from a newer version), a folder that
cannot be written or a full disk turns history off with one line saying why: nothing already on
disk is ever truncated or replaced. Other writers (another tab, another process) are waited for
(``busy_timeout``)."""
from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

APP_ID = 0x53514348  # PRAGMA application_id: "SQCH", marks the file as this app's
FILE_NAME = "conversations.sqlite3"
BUSY_TIMEOUT_MS = 10_000
TITLE_CHARS = 60

# schema migrations: MIGRATIONS[k] takes the file from user_version k to k + 1; only ever append
MIGRATIONS: list[str] = [
    # 1: conversations and their messages
    """
    CREATE TABLE conversations (
        id TEXT PRIMARY KEY,
        title TEXT NOT NULL,
        system TEXT NOT NULL DEFAULT '',
        created REAL NOT NULL,
        updated REAL NOT NULL
    );
    CREATE TABLE messages (
        conversation TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        position INTEGER NOT NULL,
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        note TEXT NOT NULL DEFAULT '',
        settings TEXT,
        steps BLOB,
        PRIMARY KEY (conversation, position)
    );
    """,
    # 2: newest first without a sort; a stopped answer says so
    """
    CREATE INDEX conversations_by_update ON conversations(updated DESC);
    ALTER TABLE messages ADD COLUMN stopped INTEGER NOT NULL DEFAULT 0;
    """,
    # 3: regenerate keeps the answers it replaces (the last answer's siblings, numbered by variant)
    """
    ALTER TABLE messages ADD COLUMN variant INTEGER NOT NULL DEFAULT 0;
    CREATE TABLE alternatives (
        conversation TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        position INTEGER NOT NULL,
        variant INTEGER NOT NULL,
        content TEXT NOT NULL,
        note TEXT NOT NULL DEFAULT '',
        settings TEXT,
        steps BLOB,
        stopped INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (conversation, position, variant)
    );
    """,
    # 4: messages as a tree (edits and other tabs' turns branch too); the conversation's branch on show
    lambda db: _messages_to_nodes(db),
]
SCHEMA_VERSION = len(MIGRATIONS)

NODES = """
    CREATE TABLE nodes (
        conversation TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        id INTEGER NOT NULL,
        parent INTEGER,
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        note TEXT NOT NULL DEFAULT '',
        settings TEXT,
        steps BLOB,
        stopped INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (conversation, id)
    );
    CREATE INDEX nodes_by_parent ON nodes(conversation, parent);
    ALTER TABLE conversations ADD COLUMN leaf INTEGER;
"""


def _messages_to_nodes(db: sqlite3.Connection) -> None:
    """Schema 3 → 4: each conversation's messages become a chain of nodes, and the answers
    Regenerate kept become siblings of the one on show (in the order they were made)."""
    _run_script(db, NODES)
    for (cid,) in db.execute("SELECT id FROM conversations").fetchall():
        shown = db.execute("SELECT position, variant, role, content, note, settings, steps, stopped FROM messages "
                           "WHERE conversation = ? ORDER BY position", (cid,)).fetchall()
        kept = db.execute("SELECT position, variant, 'assistant', content, note, settings, steps, stopped FROM "
                          "alternatives WHERE conversation = ?", (cid,)).fetchall()
        parent, next_id = None, 0
        for row in shown:
            siblings = sorted([row] + [k for k in kept if k[0] == row[0]], key=lambda r: r[1])
            for sibling in siblings:
                db.execute("INSERT INTO nodes (conversation, id, parent, role, content, note, settings, steps, stopped) "
                           "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", (cid, next_id, parent, *sibling[2:]))
                if sibling is row:
                    shown_id = next_id
                next_id += 1
            parent = shown_id
        db.execute("UPDATE conversations SET leaf = ? WHERE id = ?", (parent, cid))
    db.execute("DROP TABLE alternatives")
    db.execute("DROP TABLE messages")


def _run_script(db: sqlite3.Connection, script: str) -> None:
    """Each statement of ``script`` in the transaction that is open (``executescript`` would commit it)."""
    for statement in script.split(";"):
        if statement.strip():
            db.execute(statement)


class HistoryUnavailable(Exception):
    """The store cannot be used; the message is the one line to show."""


def default_data_dir() -> Path:
    """``$SEQUOIA_DATA``, else ``$XDG_DATA_HOME/sequoia-chat``, else ``~/.local/share/sequoia-chat``."""
    if os.environ.get("SEQUOIA_DATA"):
        return Path(os.environ["SEQUOIA_DATA"]).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "sequoia-chat"


@dataclass
class Conversation:
    """One stored conversation, the branch on show. ``messages``: ``{"role", "content"}`` (plus
    ``"note"`` when there is one) in order; ``steps``/``texts``: the last answer's step records and
    token texts; ``branches``: ``(position, k, n)`` for each message on the branch that has
    siblings (it is the k-th of n)."""

    id: str
    title: str
    system: str
    created: float
    updated: float
    messages: list = field(default_factory=list)
    settings: dict = field(default_factory=dict)  # the last answer's
    steps: list = field(default_factory=list)
    texts: dict = field(default_factory=dict)
    branches: list = field(default_factory=list)

    @property
    def answers(self) -> tuple[int, int]:
        """``(k, n)``: the last answer is the k-th of its n siblings (``(1, 1)``: it has none)."""
        last = len(self.messages) - 1
        return next(((k, n) for position, k, n in self.branches if position == last), (1, 1))


def pack_steps(steps: Sequence, texts: dict | None) -> bytes | None:
    """Step records and token texts as :func:`app.views.conversation.export_conversation` writes
    them, compressed; None without steps."""
    if not steps:
        return None
    data = {"steps": [s.to_dict() for s in steps], "token_texts": {str(k): v for k, v in (texts or {}).items()}}
    return zlib.compress(json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8"), 6)


def unpack_steps(blob: bytes | None) -> tuple[list, dict]:
    """The step records and token texts :func:`pack_steps` stored (``([], {})`` if unreadable)."""
    if not blob:
        return [], {}
    from app.views.conversation import import_steps
    try:
        return import_steps(zlib.decompress(blob).decode("utf-8"))
    except (zlib.error, UnicodeDecodeError, ValueError):
        return [], {}


def title_of(history: Sequence[dict]) -> str:
    first = next((m["content"] for m in history if m.get("role") == "user"), "") or "New chat"
    line = " ".join(first.split())
    return line if len(line) <= TITLE_CHARS else line[:TITLE_CHARS - 1].rstrip() + "…"


def _like(text: str) -> str:
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


class HistoryStore:
    """The conversation store at ``path`` (made, with its folder, if missing). Raises
    :class:`HistoryUnavailable` (one line) when the file is not this app's database, is newer
    than this app, or cannot be opened or written; the file is left as it was."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._db = self._open()

    # ----- opening --------------------------------------------------------------------------
    def _open(self) -> sqlite3.Connection:
        path = self.path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise HistoryUnavailable(f"cannot make the folder {path.parent} ({exc.strerror or exc})") from None
        existed = path.exists() and path.stat().st_size > 0
        if existed and not os.access(path, os.R_OK | os.W_OK):
            raise HistoryUnavailable(f"{path} cannot be read and written")
        if existed:
            with open(path, "rb") as f:
                if f.read(16) != b"SQLite format 3\x00":
                    raise HistoryUnavailable(f"{path} is not an SQLite database (left as it is)")
        try:
            db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                                 check_same_thread=False)
        except sqlite3.Error as exc:
            raise HistoryUnavailable(f"cannot open {path} ({exc})") from None
        try:
            db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            app_id = db.execute("PRAGMA application_id").fetchone()[0]
            version = db.execute("PRAGMA user_version").fetchone()[0]
            tables = db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
            if app_id != APP_ID and (tables or version):
                raise HistoryUnavailable(f"{path} is another program's database (left as it is)")
            if version > SCHEMA_VERSION:
                raise HistoryUnavailable(f"{path} was written by a newer version of the app (schema {version}, "
                                         f"this one knows {SCHEMA_VERSION}); left as it is")
            if existed and db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                raise HistoryUnavailable(f"{path} is damaged (left as it is)")
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = NORMAL")
            db.execute("PRAGMA foreign_keys = ON")
            self._migrate(db, version)
        except HistoryUnavailable:
            db.close()
            raise
        except sqlite3.Error as exc:
            db.close()
            raise HistoryUnavailable(f"cannot use {path} ({exc})") from None
        return db

    @staticmethod
    def _migrate(db: sqlite3.Connection, version: int) -> None:
        """Run the migrations past ``version``, each in its own transaction with its version bump."""
        while version < SCHEMA_VERSION:
            db.execute("BEGIN IMMEDIATE")
            try:
                now = db.execute("PRAGMA user_version").fetchone()[0]  # another process may have migrated
                if now > version:
                    db.execute("COMMIT")
                    version = now
                    continue
                step = MIGRATIONS[version]
                step(db) if callable(step) else _run_script(db, step)
                db.execute(f"PRAGMA application_id = {APP_ID}")
                db.execute(f"PRAGMA user_version = {version + 1}")
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            version += 1

    @property
    def schema_version(self) -> int:
        with self._lock:
            return self._db.execute("PRAGMA user_version").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, work):
        """Run ``work(db)`` in one transaction (waiting for other writers); errors roll it back."""
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                out = work(db)
                db.execute("COMMIT")
                return out
            except BaseException:
                db.execute("ROLLBACK")
                raise

    # ----- writing ----------------------------------------------------------------------------
    def save(self, conversation: str | None, system: str, history: Sequence[dict], settings: dict | None = None,
             steps: Sequence | None = None, texts: dict | None = None, stopped: bool = False) -> str:
        """Save ``history`` (after an answer) in conversation ``conversation`` (a new one if None or
        unknown), in one transaction, and show it: the longest run of its first messages already
        stored is kept (with their answers' steps), the rest (always the last answer) is added
        beside what was there; the last message, when it is an answer, gets ``settings``,
        ``steps``/``texts`` and ``stopped``. Returns the conversation's id."""
        history = list(history)
        blob = pack_steps(steps or [], texts)
        settings_text = json.dumps(settings or {}, ensure_ascii=False)

        def work(db):
            now = time.time()
            cid = conversation
            head = None if cid is None else db.execute("SELECT leaf FROM conversations WHERE id = ?",
                                                        (cid,)).fetchone()
            if head is None:
                cid = cid or uuid.uuid4().hex
                db.execute("INSERT INTO conversations (id, title, system, created, updated) VALUES (?, ?, ?, ?, ?)",
                           (cid, title_of(history), system or "", now, now))
            else:
                db.execute("UPDATE conversations SET system = ?, updated = ? WHERE id = ?", (system or "", now, cid))
            tree = _Tree.read(db, cid, head[0] if head else None)
            answered = bool(history) and history[-1]["role"] == "assistant"
            parent, start = tree.longest_stored(history[:len(history) - answered])
            next_id = tree.next_id
            for position in range(start, len(history)):
                m = history[position]
                answer = answered and position == len(history) - 1
                db.execute("INSERT INTO nodes (conversation, id, parent, role, content, note, settings, steps, "
                           "stopped) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                           (cid, next_id, parent, m["role"], m["content"], m.get("note") or "",
                            settings_text if answer else None, blob if answer else None, int(bool(stopped) and answer)))
                parent, next_id = next_id, next_id + 1
            db.execute("UPDATE conversations SET leaf = ? WHERE id = ?", (parent, cid))
            return cid

        return self._write(work)

    def rename(self, conversation: str, title: str) -> bool:
        title = " ".join(str(title or "").split())[:200]
        if not title:
            return False
        return self._write(lambda db: db.execute("UPDATE conversations SET title = ? WHERE id = ?",
                                                 (title, conversation)).rowcount > 0)

    def switch(self, conversation: str, step: int, position: int = -1) -> bool:
        """Show the sibling ``step`` places on (-1: the one before) of the message at ``position``
        of the branch on show (-1: the last), with its newest continuation; False when there is
        none that way."""
        def work(db):
            head = db.execute("SELECT leaf FROM conversations WHERE id = ?", (conversation,)).fetchone()
            tree = _Tree.read(db, conversation, head[0] if head else None)
            path = tree.path()
            at = position + len(path) if position < 0 else position
            if not 0 <= at < len(path):
                return False
            siblings = tree.children[tree.parents[path[at]]]
            index = siblings.index(path[at]) + int(step)
            if not 0 <= index < len(siblings) or step == 0:
                return False
            db.execute("UPDATE conversations SET leaf = ? WHERE id = ?", (tree.newest_leaf(siblings[index]),
                                                                         conversation))
            return True
        return self._write(work)

    def delete(self, conversation: str) -> bool:
        def work(db):
            db.execute("DELETE FROM nodes WHERE conversation = ?", (conversation,))
            return db.execute("DELETE FROM conversations WHERE id = ?", (conversation,)).rowcount > 0
        return self._write(work)

    # ----- reading ----------------------------------------------------------------------------
    def list(self, search: str = "", limit: int = 200) -> list[tuple[str, str, float]]:
        """``(id, title, updated)`` newest first; ``search`` matches titles and the text of any branch."""
        search = " ".join(str(search or "").split())
        with self._lock:
            if not search:
                rows = self._db.execute("SELECT id, title, updated FROM conversations ORDER BY updated DESC "
                                        "LIMIT ?", (limit,))
            else:
                like = _like(search)
                rows = self._db.execute(
                    "SELECT id, title, updated FROM conversations c WHERE title LIKE ?1 ESCAPE '\\' OR EXISTS "
                    "(SELECT 1 FROM nodes m WHERE m.conversation = c.id AND m.content LIKE ?1 ESCAPE '\\') "
                    "ORDER BY updated DESC LIMIT ?2", (like, limit))
            return [tuple(r) for r in rows.fetchall()]

    def load(self, conversation: str) -> Conversation | None:
        """The conversation's branch on show, its siblings' counts and its last answer's settings
        and steps, or None."""
        with self._lock:
            head = self._db.execute("SELECT id, title, system, created, updated, leaf FROM conversations "
                                    "WHERE id = ?", (conversation,)).fetchone()
            if head is None:
                return None
            tree = _Tree.read(self._db, conversation, head[5])
            path = tree.path()
            last = self._db.execute("SELECT settings, steps FROM nodes WHERE conversation = ? AND id = ?",
                                    (conversation, path[-1])).fetchone() if path else None
        out = Conversation(*head[:5])
        for position, node in enumerate(path):
            role, content, note = tree.messages[node]
            out.messages.append({"role": role, "content": content, **({"note": note} if note else {})})
            siblings = tree.children[tree.parents[node]]
            if len(siblings) > 1:
                out.branches.append((position, siblings.index(node) + 1, len(siblings)))
        if last is not None and last[0] is not None and out.messages[-1]["role"] == "assistant":
            out.settings = json.loads(last[0] or "{}")
            out.steps, out.texts = unpack_steps(last[1])
        return out


@dataclass
class _Tree:
    """One conversation's messages as a tree: ``parents[id]``, ``children[parent]`` (ids in the
    order they were made; parent None: the first messages), the ``leaf`` on show, and each
    message's ``(role, content, note)``."""

    parents: dict
    children: dict
    leaf: int | None
    messages: dict

    @classmethod
    def read(cls, db: sqlite3.Connection, conversation: str, leaf: int | None) -> "_Tree":
        rows = db.execute("SELECT id, parent, role, content, note FROM nodes WHERE conversation = ? ORDER BY id",
                          (conversation,)).fetchall()
        parents, children, messages = {}, {None: []}, {}
        for node, parent, *message in rows:
            parents[node] = parent
            children.setdefault(parent, []).append(node)
            messages[node] = tuple(message)
        return cls(parents, children, leaf if leaf in parents else None, messages)

    @property
    def next_id(self) -> int:
        return max(self.parents, default=-1) + 1

    def path(self) -> list[int]:
        """The ids from the first message to the leaf on show."""
        out, node = [], self.leaf
        while node is not None:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def longest_stored(self, history: Sequence[dict]) -> tuple[int | None, int]:
        """``(parent, count)``: how many first messages of ``history`` are stored as a branch (those
        on show first), and the id of the last of them (None: none)."""
        shown, parent = set(self.path()), None
        for count, m in enumerate(history):
            want = (m["role"], m["content"], m.get("note") or "")
            same = [k for k in self.children.get(parent, []) if self.messages[k] == want]
            if not same:
                return parent, count
            parent = next((k for k in same if k in shown), same[-1])
        return parent, len(history)

    def newest_leaf(self, node: int) -> int:
        """The end of ``node``'s newest continuation (its last-made child's, and so on)."""
        while self.children.get(node):
            node = self.children[node][-1]
        return node


def open_store(data_dir: str | os.PathLike | None = None) -> tuple[HistoryStore | None, str]:
    """``(store, line)``: the store in ``data_dir`` (default :func:`default_data_dir`) and where it
    is, or ``(None, why history is off)``."""
    folder = Path(data_dir).expanduser() if data_dir else default_data_dir()
    try:
        store = HistoryStore(folder / FILE_NAME)
    except HistoryUnavailable as exc:
        return None, f"History is off: {exc}."
    return store, f"Conversations are kept in {store.path} (--no-history keeps none)."
