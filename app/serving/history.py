"""The page's conversations on disk: one SQLite file (WAL) in the user's data folder.

Each conversation keeps its title, system prompt, created and updated times and its messages;
each answer keeps the settings it was decoded with, whether it was stopped, and its step records
(the export format of :mod:`app.views.conversation`, zlib-compressed), so its tree, replay and
chart come back after a restart; Regenerate keeps the answers it replaces (the last answer's
siblings, ``alternatives``). Every answer is saved in one transaction.

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
]
SCHEMA_VERSION = len(MIGRATIONS)


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
    """One stored conversation. ``messages``: ``{"role", "content"}`` (plus ``"note"`` when there
    is one) in order; ``steps``/``texts``: the last answer's step records and token texts."""

    id: str
    title: str
    system: str
    created: float
    updated: float
    messages: list = field(default_factory=list)
    settings: dict = field(default_factory=dict)  # the last answer's
    steps: list = field(default_factory=list)
    texts: dict = field(default_factory=dict)
    answers: tuple = (1, 1)  # the last answer is the k-th of n (regenerate keeps the others)


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
                for statement in MIGRATIONS[version].split(";"):
                    if statement.strip():
                        db.execute(statement)
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
        """Save ``history`` (after an answer) as conversation ``conversation`` (a new one if None or
        unknown), in one transaction: messages that changed from the first difference on are
        replaced, earlier ones (and their answers' steps) kept; the last message, when it is an
        answer, gets ``settings``, ``steps``/``texts`` and ``stopped``. Returns its id."""
        history = list(history)
        blob = pack_steps(steps or [], texts)
        settings_text = json.dumps(settings or {}, ensure_ascii=False)

        def work(db):
            now = time.time()
            cid = conversation
            head = None if cid is None else db.execute("SELECT title FROM conversations WHERE id = ?",
                                                        (cid,)).fetchone()
            stored = [] if head is None else db.execute(
                "SELECT role, content, note FROM messages WHERE conversation = ? ORDER BY position", (cid,)).fetchall()
            last = len(history) - 1
            keep = 0
            while keep < min(len(stored), last) and stored[keep] == (
                    history[keep]["role"], history[keep]["content"], history[keep].get("note") or ""):
                keep += 1
            # the stored conversation moved on elsewhere (another tab answered in it): this one is
            # kept beside it, as a copy under the same title, rather than over it
            fork = head is not None and keep < min(len(stored), last)
            if fork:
                cid, keep = None, 0
            if head is None or fork:
                # a fork keeps the title unless its first message was edited (a new question)
                title = head[0] if fork and history and stored[0][1] == history[0]["content"] else title_of(history)
                cid = cid or uuid.uuid4().hex
                db.execute("INSERT INTO conversations (id, title, system, created, updated) VALUES (?, ?, ?, ?, ?)",
                           (cid, title, system or "", now, now))
            else:
                db.execute("UPDATE conversations SET system = ?, updated = ? WHERE id = ?", (system or "", now, cid))
            variant = 0
            regenerated = not fork and head is not None and keep == last and len(stored) > last and \
                stored[last][0] == "assistant" and history[last]["role"] == "assistant"
            if regenerated:  # the answer it replaces is kept as a sibling
                db.execute("INSERT INTO alternatives (conversation, position, variant, content, note, settings, steps, "
                           "stopped) SELECT conversation, position, variant, content, note, settings, steps, stopped "
                           "FROM messages WHERE conversation = ? AND position = ?", (cid, last))
                variant = 1 + db.execute("SELECT max(variant) FROM alternatives WHERE conversation = ? AND "
                                         "position = ?", (cid, last)).fetchone()[0]
            db.execute("DELETE FROM alternatives WHERE conversation = ? AND position >= ?",
                       (cid, last + 1 if regenerated else keep))
            db.execute("DELETE FROM messages WHERE conversation = ? AND position >= ?", (cid, keep))
            for position in range(keep, len(history)):
                m = history[position]
                answer = position == last and m["role"] == "assistant"
                db.execute("INSERT INTO messages (conversation, position, role, content, note, settings, steps, "
                           "stopped, variant) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                           (cid, position, m["role"], m["content"], m.get("note") or "",
                            settings_text if answer else None, blob if answer else None,
                            int(bool(stopped) and answer), variant if answer else 0))
            return cid

        return self._write(work)

    def rename(self, conversation: str, title: str) -> bool:
        title = " ".join(str(title or "").split())[:200]
        if not title:
            return False
        return self._write(lambda db: db.execute("UPDATE conversations SET title = ? WHERE id = ?",
                                                 (title, conversation)).rowcount > 0)

    def switch(self, conversation: str, step: int) -> bool:
        """Show the last answer's sibling ``step`` places on (-1: the one before), in one
        transaction; False when there is none that way."""
        def work(db):
            row = db.execute("SELECT position, variant FROM messages WHERE conversation = ? AND role = 'assistant' "
                             "AND position = (SELECT max(position) FROM messages WHERE conversation = ?)",
                             (conversation, conversation)).fetchone()
            if row is None:
                return False
            position, variant = row
            others = [v for (v,) in db.execute("SELECT variant FROM alternatives WHERE conversation = ? AND "
                                               "position = ?", (conversation, position))]
            variants = sorted(others + [variant])
            index = variants.index(variant) + int(step)
            if not others or not 0 <= index < len(variants):
                return False
            target = variants[index]
            key = (conversation, position)
            db.execute("INSERT INTO alternatives (conversation, position, variant, content, note, settings, steps, "
                       "stopped) SELECT conversation, position, variant, content, note, settings, steps, stopped "
                       "FROM messages WHERE conversation = ? AND position = ?", key)
            db.execute("UPDATE messages SET (variant, content, note, settings, steps, stopped) = (SELECT variant, "
                       "content, note, settings, steps, stopped FROM alternatives WHERE conversation = ?1 AND "
                       "position = ?2 AND variant = ?3) WHERE conversation = ?1 AND position = ?2", key + (target,))
            db.execute("DELETE FROM alternatives WHERE conversation = ? AND position = ? AND variant = ?", key + (target,))
            return True
        return self._write(work)

    def delete(self, conversation: str) -> bool:
        def work(db):
            db.execute("DELETE FROM alternatives WHERE conversation = ?", (conversation,))
            db.execute("DELETE FROM messages WHERE conversation = ?", (conversation,))
            return db.execute("DELETE FROM conversations WHERE id = ?", (conversation,)).rowcount > 0
        return self._write(work)

    # ----- reading ----------------------------------------------------------------------------
    def list(self, search: str = "", limit: int = 200) -> list[tuple[str, str, float]]:
        """``(id, title, updated)`` newest first; ``search`` matches titles and message text."""
        search = " ".join(str(search or "").split())
        with self._lock:
            if not search:
                rows = self._db.execute("SELECT id, title, updated FROM conversations ORDER BY updated DESC "
                                        "LIMIT ?", (limit,))
            else:
                like = _like(search)
                rows = self._db.execute(
                    "SELECT id, title, updated FROM conversations c WHERE title LIKE ?1 ESCAPE '\\' OR EXISTS "
                    "(SELECT 1 FROM messages m WHERE m.conversation = c.id AND m.content LIKE ?1 ESCAPE '\\') "
                    "ORDER BY updated DESC LIMIT ?2", (like, limit))
            return [tuple(r) for r in rows.fetchall()]

    def load(self, conversation: str) -> Conversation | None:
        """The conversation with its messages and its last answer's settings and steps, or None."""
        with self._lock:
            head = self._db.execute("SELECT id, title, system, created, updated FROM conversations WHERE id = ?",
                                    (conversation,)).fetchone()
            if head is None:
                return None
            rows = self._db.execute("SELECT role, content, note, settings, steps, variant FROM messages "
                                    "WHERE conversation = ? ORDER BY position", (conversation,)).fetchall()
            others = [] if not rows or rows[-1][0] != "assistant" else [v for (v,) in self._db.execute(
                "SELECT variant FROM alternatives WHERE conversation = ? AND position = ?",
                (conversation, len(rows) - 1))]
        out = Conversation(*head)
        for role, content, note, *_ in rows:
            out.messages.append({"role": role, "content": content, **({"note": note} if note else {})})
        answers = [r for r in rows if r[0] == "assistant" and r[3] is not None]
        if rows and rows[-1][0] == "assistant" and answers:
            out.settings = json.loads(answers[-1][3] or "{}")
            out.steps, out.texts = unpack_steps(answers[-1][4])
            variants = sorted(others + [rows[-1][5]])
            out.answers = (variants.index(rows[-1][5]) + 1, len(variants))
        return out


def open_store(data_dir: str | os.PathLike | None = None) -> tuple[HistoryStore | None, str]:
    """``(store, line)``: the store in ``data_dir`` (default :func:`default_data_dir`) and where it
    is, or ``(None, why history is off)``."""
    folder = Path(data_dir).expanduser() if data_dir else default_data_dir()
    try:
        store = HistoryStore(folder / FILE_NAME)
    except HistoryUnavailable as exc:
        return None, f"History is off: {exc}."
    return store, f"Conversations are kept in {store.path} (--no-history keeps none)."
