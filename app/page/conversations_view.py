"""The sidebar of stored conversations (:mod:`app.serving.history`): each answer kept when it ends,
the list newest first with search, open, rename, delete, new chat, F5's restore, and the ‹ k / n ›
row that steps between a message's siblings (regenerated answers, edited messages). :class:`app.page.handlers.ChatApp` holds one; the layout wires its
methods to the sidebar's components."""
from __future__ import annotations

import html
import sqlite3
import threading

import gradio as gr

from app.page.answer_stream import Ask, Run, run_views
from app.serving.history import Conversation, HistoryStore
from app.views.conversation import display_messages
from app.views.text import status_html


class ConversationsView:
    """The conversations' handlers, for ``app`` (a :class:`app.page.handlers.ChatApp`: its components,
    Clear and export); ``store``: the history (None: off, ``note`` says why)."""

    def __init__(self, app, store: HistoryStore | None, note: str | None = None) -> None:
        self.app, self.store, self.note = app, store, note or ""
        self._conversations: dict[str, str] = {}  # per session: the conversation it has open
        self._lock = threading.Lock()

    def closed(self, session: str) -> dict:
        """Updates when the session's conversation is closed (Clear, New chat): the stored one stays,
        the next answer starts a new one."""
        if self.store is None:
            return {}
        c = self.app.c
        self._session_conversation(session, None, set_=True)
        return {c.conv_id: "", c.conv_list: self.conversation_list(), c.conv_title: "", **self.branches(None)}

    def _session_conversation(self, session: str, conversation: str | None = None, set_: bool = False) -> str | None:
        with self._lock:
            if set_:
                if conversation:
                    self._conversations[session] = conversation
                else:
                    self._conversations.pop(session, None)
            return self._conversations.get(session)

    def keep(self, session: str, ask: Ask, update: dict) -> None:
        """Save the conversation ``update`` (an answer's last) ends with, in one transaction, as the
        session's open conversation (a new one if none), and add the new id and list to ``update``."""
        c = self.app.c
        history, run = update.get(c.history), update.get(c.run)
        if not history:
            return
        last = history[-1]
        answer = last["role"] == "assistant"
        steps = run.steps if answer and isinstance(run, Run) and run.steps else None
        try:
            cid = self.store.save(self._session_conversation(session), ask.controls.system, history,
                                    ask.export_settings() if answer else None, steps,
                                    run.texts if steps else None, stopped=answer and last.get("note") == "stopped")
        except sqlite3.Error as exc:
            gr.Warning(f"This answer was not saved to the history: {exc}")
            update[c.status] = update.get(c.status, "") + status_html(
                html.escape(f"Not saved to the history: {exc}."), "warn")
            return
        self._session_conversation(session, cid, set_=True)
        update[c.conv_id] = cid
        update[c.conv_list] = self.conversation_list("", cid)
        try:
            stored = self.store.load(cid)
        except sqlite3.Error:
            stored = None
        update.update(self.branches(stored))
        if stored is not None:  # the Rename box names the conversation the answer went to
            update[c.conv_title] = stored.title

    def branches(self, stored: Conversation | None, at: int | None = None) -> dict:
        """The ‹ k / n › row under the chat, for the message at position ``at`` of ``stored``'s branch
        (None, or one without siblings: the last that has some); hidden when none has. The menu
        beside it, shown when several messages have siblings, picks which one ‹ › steps."""
        c = self.app.c
        points = stored.branches if stored is not None else []
        if not points:
            return {c.sibling_row: gr.update(visible=False), c.sibling_text: "",
                    c.branch_at: gr.update(choices=[], value=None, visible=False)}
        position, k, n = next((b for b in points if b[0] == at), points[-1])
        names = [(f"{_message_name(stored.messages, p)} · {i} of {m}", p) for p, i, m in points]
        return {c.sibling_row: gr.update(visible=True),
                c.sibling_text: f"<div class='sc-siblings'>{html.escape(_message_name(stored.messages, position))}: "
                                f"{k} / {n}</div>",
                c.branch_at: gr.update(choices=names, value=position, visible=len(points) > 1)}

    def choose_branch(self, conversation, at):
        """The ‹ k / n › row for the message picked in the menu."""
        stored = self._load(conversation)
        return self.branches(stored, _position(at))

    def _load(self, conversation) -> Conversation | None:
        if self.store is None or not conversation:
            return None
        try:
            return self.store.load(str(conversation))
        except sqlite3.Error:
            return None

    def previous_answer(self, conversation, at=None, request: gr.Request | None = None):
        return self.switch_answer(conversation, -1, at, request)

    def next_answer(self, conversation, at=None, request: gr.Request | None = None):
        return self.switch_answer(conversation, 1, at, request)

    def switch_answer(self, conversation, step: int, at=None, request: gr.Request | None = None):
        """Show the sibling ``step`` places on (‹ -1, › +1) of the message at position ``at`` (None:
        the last one that has siblings), with what followed it and its last answer's tree and replay."""
        c = self.app.c
        stored = self._load(conversation)
        if stored is None:
            return {c.status: status_html("No saved conversation is open.", "warn")}
        points = [p for p, _, _ in stored.branches]
        position = _position(at) if _position(at) in points else (points[-1] if points else -1)
        try:
            moved = self.store.switch(str(conversation), int(step), position)
        except sqlite3.Error as exc:
            return {c.status: status_html(html.escape(f"Could not switch: {exc}"), "error")}
        if not moved:
            return {c.status: status_html("No other version that way.", "info")}
        now = self._load(conversation)
        if now is None:
            return self.open_conversation(conversation, request)  # gone meanwhile: says so
        out = self._show(now, request, position)
        shown = next((b for b in now.branches if b[0] == position), None)
        if shown is not None:
            out[c.status] = status_html(f"{_message_name(now.messages, position)}: {shown[1]} of {shown[2]}.", "ok")
        return out

    def conversation_list(self, search: str = "", selected: str | None = None):
        """The sidebar's list of stored conversations, newest first (``search``: in titles and text)."""
        if self.store is None:
            return gr.update(choices=[], value=None)
        try:
            rows = self.store.list(search)
        except sqlite3.Error:
            rows = []
        choices = [(title, cid) for cid, title, _ in rows]
        return gr.update(choices=choices, value=selected if any(cid == selected for _, cid in choices) else None)

    def search_conversations(self, search, conversation):
        return self.conversation_list(str(search or "")[:200], conversation or None)

    def open_conversation(self, conversation, request: gr.Request | None = None, at: int | None = None):
        """Show a stored conversation: its text at once, the last answer's tree, replay and chart
        (``at``: the message whose siblings ‹ › steps)."""
        c = self.app.c
        stored = None
        if self.store is not None and conversation:
            try:
                stored = self.store.load(str(conversation))
            except sqlite3.Error as exc:
                gr.Warning(f"Could not read the conversation: {exc}")
        if stored is None:
            return {c.conv_list: self.conversation_list(), c.conv_id: "",
                    c.status: status_html("That conversation is no longer in the history.", "warn")}
        return self._show(stored, request, at)

    def _show(self, stored: Conversation, request: gr.Request | None, at: int | None) -> dict:
        """The page showing ``stored`` as this session's open conversation (see :meth:`open_conversation`)."""
        c = self.app.c
        session = getattr(request, "session_hash", None) or "local"
        out = self.app.clear(request)  # replaces this session's conversation (an answer streaming is stopped)
        self._session_conversation(session, stored.id, set_=True)
        history = stored.messages
        out.update(self.branches(stored, at))
        out.update({c.chatbot: display_messages(history), c.history: history, c.system: stored.system,
                    c.conv_id: stored.id, c.conv_list: self.conversation_list("", stored.id),
                    c.conv_title: stored.title, c.status: status_html(
                        html.escape(f"Opened “{stored.title}”: {len(history)} messages."), "ok"),
                    c.export_btn: self.app.export_file(stored.system, history, stored.settings)})
        if stored.steps:
            run = Run(steps=stored.steps, texts=stored.texts)
            out.update(run_views(self.app, run, len(run.steps) - 1, True))
            out[c.run] = run
            out[c.export_btn] = self.app.export_file(stored.system, history, stored.settings, run)
        return out

    def restore(self, conversation, request: gr.Request | None = None):
        """On page load: reopen the conversation this browser had open (F5, a restart), and list them."""
        c = self.app.c
        if conversation and self.store is not None:
            out = self.open_conversation(conversation, request)
            if c.chatbot in out:
                return out
        return {c.conv_list: self.conversation_list(), c.conv_id: ""}

    def new_chat(self, request: gr.Request | None = None):
        out = self.app.clear(request)
        out[self.app.c.status] = status_html("New chat.", "info")
        return out

    def rename_conversation(self, conversation, title):
        c = self.app.c
        if self.store is None or not conversation:
            return {c.status: status_html("Nothing to rename: send a message first.", "warn")}
        try:
            done = self.store.rename(str(conversation), str(title or ""))
        except sqlite3.Error as exc:
            return {c.status: status_html(html.escape(f"Not renamed: {exc}"), "error")}
        if not done:
            return {c.status: status_html("Type a title first.", "warn")}
        return {c.conv_list: self.conversation_list("", conversation), c.status: status_html("Renamed.", "ok")}

    def ask_delete(self, conversation):
        c = self.app.c
        if self.store is None or not conversation:
            return {c.status: status_html("No saved conversation is open.", "warn")}
        return {c.delete_row: gr.update(visible=True)}

    def cancel_delete(self):
        return {self.app.c.delete_row: gr.update(visible=False)}

    def delete_conversation(self, conversation, request: gr.Request | None = None):
        """Delete the open conversation (after the confirmation) and start a new chat."""
        c = self.app.c
        out = {c.delete_row: gr.update(visible=False)}
        if self.store is None or not conversation:
            return out
        try:
            self.store.delete(str(conversation))
        except sqlite3.Error as exc:
            out[c.status] = status_html(html.escape(f"Not deleted: {exc}"), "error")
            return out
        out.update(self.app.clear(request))
        out[c.status] = status_html("Deleted.", "info")
        return out


def _message_name(messages: list[dict], position: int) -> str:
    """"Answer" for the last message when it is one; else "Your message i" / "Answer i" (i counts that role)."""
    role = messages[position]["role"]
    if role == "assistant" and position == len(messages) - 1:
        return "Answer"
    number = sum(m["role"] == role for m in messages[:position + 1])
    return f"{'Answer' if role == 'assistant' else 'Your message'} {number}"


def _position(at) -> int | None:
    try:
        return int(at)
    except (TypeError, ValueError):
        return None
