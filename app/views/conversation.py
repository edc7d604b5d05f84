"""Conversation logic with no UI in it: context fitting, safe Markdown, token pieces, the
draft/bonus highlight view, and conversation export/import."""
from __future__ import annotations

import contextlib
import html
import json
import re
import time
import weakref
from collections.abc import Sequence
from html.parser import HTMLParser

from engine.core.records import StepRecord
from engine.models.prompts import encode_chat

ROLES = ("user", "assistant")
MAX_IMPORT_BYTES = 1_000_000
MAX_IMPORT_MESSAGES = 1000
MAX_MESSAGE_CHARS = 200_000
EXPORT_FORMAT = "sequoia-chat/conversation"


# ----- context -----------------------------------------------------------------------------
class ContextTooLong(ValueError):
    """Even the newest message alone does not fit the model's context."""


def clean_text(text: str) -> str:
    """``text`` with lone UTF-16 surrogates (which JSON can carry but UTF-8 cannot encode, so the
    tokenizer would fail on them) replaced by U+FFFD; everything else is kept as typed."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def chat_messages(system: str | None, history: Sequence[dict]) -> list[dict]:
    """Template input: the system prompt (when given) then the turns, role and content only."""
    out = [{"role": "system", "content": clean_text(system.strip())}] if system and system.strip() else []
    return out + [{"role": m["role"], "content": clean_text(m["content"])} for m in history]


def longest_token_chars(tokenizer) -> int | None:
    """The most characters one token of ``tokenizer`` can stand for (the longest vocabulary entry;
    byte-level entries spell a byte a character, so decoded text is never longer), or None."""
    try:
        return _LONGEST[tokenizer]
    except (KeyError, TypeError):
        vocab = getattr(tokenizer, "get_vocab", None)
        longest = max((len(t) for t in vocab()), default=None) if vocab else None
    with contextlib.suppress(TypeError):  # a tokenizer that cannot be weakly referenced is asked each time
        _LONGEST[tokenizer] = longest
    return longest


_LONGEST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fit_context(tokenizer, system: str | None, history: Sequence[dict], limit: int | None) -> tuple[list[int], int]:
    """Token ids of the conversation (chat template applied to all of it) within ``limit`` tokens.

    The oldest turns are dropped first (a user message with the replies after it); the system
    prompt and the newest user message always stay. Returns ``(input_ids, messages_dropped)``.
    Dropping more turns never lengthens the prompt, so the fewest turns to drop are found by
    bisection: O(log turns) renders of the template, not one per dropped turn. ``limit`` None is
    no limit; 0 or less is no room at all (ContextTooLong).
    """
    if limit is not None and limit <= 0:
        raise ContextTooLong(f"max new tokens and the tree fill the model's context: no room is left for the "
                             f"conversation ({limit} tokens): lower max new tokens")
    history = list(history)
    newest = next((m for m in reversed(history) if m["role"] == "user"), None)
    widest = longest_token_chars(tokenizer)
    if limit is not None and widest and newest is not None and \
            (len(system or "") + len(newest["content"])) > widest * limit:
        raise ContextTooLong(  # refused from its length alone, before the template renders megabytes
            f"the message is {len(newest['content']):,} characters: even at {widest} characters a token it is "
            f"more than the {limit} tokens that fit: shorten it or lower max new tokens")
    ids = encode_chat(tokenizer, chat_messages(system, history))
    if limit is None or len(ids) <= limit:
        return ids, 0
    cuts = [i for i, m in enumerate(history) if m["role"] == "user"][1:]  # drop everything before one of them
    fitting, low, high = None, 0, len(cuts) - 1
    while low <= high:
        middle = (low + high) // 2
        kept = encode_chat(tokenizer, chat_messages(system, history[cuts[middle]:]))
        if len(kept) <= limit:
            fitting, high = (kept, cuts[middle]), middle - 1
        else:
            ids, low = kept, middle + 1
    if fitting is None:
        raise ContextTooLong(
            f"the message is {len(ids)} tokens with the chat template, more than the {limit} that fit "
            f"(the context minus max new tokens and the tree): shorten it or lower max new tokens")
    return fitting


# ----- Markdown -----------------------------------------------------------------------------
_CODE = re.compile(r"(```.*?(?:```|\Z)|~~~.*?(?:~~~|\Z)|`[^`\n]*`)", re.DOTALL)


def safe_markdown(text: str) -> str:
    """Markdown with raw HTML neutralised outside code: ``<`` shows as text instead of becoming a tag.

    Code fences and inline code are left alone (Markdown already shows them verbatim); an
    unclosed fence (a streaming answer) counts as code to the end.
    """
    parts = _CODE.split(text)
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return "".join(parts)


def display_messages(history: Sequence[dict]) -> list[dict]:
    """Chatbot messages: safe Markdown, plus an italic note (stopped, error) where there is one.

    The text goes in as a text part: a bare string would be passed through ``inspect.cleandoc``
    by the Chatbot, which turns tabs into spaces and strips indentation.
    """
    out = []
    for m in history:
        content = safe_markdown(m["content"])
        if m.get("note"):
            content = (content + "\n\n" if content else "") + f"*{html.escape(m['note'])}*"
        out.append({"role": m["role"], "content": [{"type": "text", "text": content}]})
    return out


# ----- token pieces and the highlight view --------------------------------------------------
def token_pieces(tokenizer, tokens: Sequence[int]) -> list[str]:
    """The text each token adds; ``"".join(pieces)`` is the decoded text (special tokens skipped).

    Each token is decoded after a couple of tokens of context (so tokenizers that drop a leading
    space at the start of a decode behave), which keeps the cost linear. A character split over
    several byte tokens is credited to the token that completes it.
    """
    tokens = list(tokens)

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    pieces: list[str] = []
    group = 0  # first token whose text has not been emitted yet
    for i in range(len(tokens)):
        ctx = max(0, group - 2)
        before = decode(tokens[ctx:group])
        upto = decode(tokens[ctx:i + 1])
        if upto.endswith("\ufffd") and i - group < 4 and i < len(tokens) - 1:
            pieces.append("")  # an incomplete character: wait for the token that finishes it
            continue
        pieces.append(upto[len(before):] if upto.startswith(before) else upto)
        group = i + 1
    text = decode(tokens)
    if "".join(pieces) != text:  # never seen, but the joined text must be the answer itself
        pieces = [""] * len(tokens)
        if tokens:
            pieces[-1] = text
    return pieces


def token_origins(steps: Sequence[StepRecord]) -> list[tuple[int, str]]:
    """``(token, "draft" | "bonus")`` for every committed token: accepted drafts, then the target's token."""
    out = []
    for step in steps:
        drafts = step.accepted_draft_tokens
        for k, token in enumerate(step.committed):
            out.append((token, "draft" if k < drafts else "bonus"))
    return out


def highlight_html(tokenizer, steps: Sequence[StepRecord], current: int | None = None) -> str:
    """The answer as HTML, rendered as Markdown (bold, code blocks, tables...) with every character
    coloured by where its token came from: accepted from the draft, or the target's own token.
    ``current``: index of a step (the one replayed) whose tokens are also marked ``tok-current``."""
    origins = token_origins(steps)
    if not origins:
        return "<div class='hl-empty'>The answer will appear here with its tokens coloured.</div>"
    owner = [i for i, step in enumerate(steps) for _ in step.committed]
    pieces = token_pieces(tokenizer, [t for t, _ in origins])
    text, chars = "", []  # chars[k]: (origin, step, token) of text[k]
    for (token, origin), piece, step in zip(origins, pieces, owner):
        text += piece
        chars += [(origin, step, token)] * len(piece)
    drafted = sum(1 for _, o in origins if o == "draft")
    legend = (f"<div class='hl-legend'><span class='tok tok-draft'>from the draft</span> {drafted} tokens · "
              f"<span class='tok tok-bonus'>from the target</span> {len(origins) - drafted} tokens</div>")
    return f"{legend}<div class='hl-text hl-md'>{_coloured_markdown(text, chars, current)}</div>"


class _Colourer(HTMLParser):
    """Re-emits rendered Markdown with each run of text wrapped in a span of its source characters'
    origin. Rendered text is matched against the source in order (Markdown only drops syntax
    characters), so each visible character finds the source character it came from."""

    def __init__(self, source: str, chars: list, current: int | None) -> None:
        super().__init__(convert_charrefs=True)
        self.source, self.chars, self.current = source, chars, current
        self.pos = 0
        self.out: list[str] = []

    def handle_starttag(self, tag, attrs):
        safe = "".join(f' {k}="{html.escape(v or "", quote=True)}"' for k, v in attrs if k in ("class", "align"))
        self.out.append(f"<{tag}{safe}>")

    def handle_startendtag(self, tag, attrs):
        self.out.append(f"<{tag}>")

    def handle_endtag(self, tag):
        self.out.append(f"</{tag}>")

    def handle_data(self, data):
        run, key = [], None
        for ch in data:
            found = self.source.find(ch, self.pos)
            if found == -1 or found - self.pos > 200:  # not from the source (e.g. a list marker)
                info = None
            else:
                info, self.pos = self.chars[found], found + 1
            k = (info[0], info[1] == self.current) if info else None
            if k != key and run:
                self._emit(key, run)
                run = []
            key = k
            run.append(ch)
        if run:
            self._emit(key, run)

    def _emit(self, key, run):
        text = html.escape("".join(run), quote=False)
        if key is None:
            self.out.append(text)
        else:
            origin, now = key
            self.out.append(f'<span class="tok tok-{origin}{" tok-current" if now else ""}">{text}</span>')


def _coloured_markdown(text: str, chars: list, current: int | None) -> str:
    from markdown_it import MarkdownIt

    rendered = MarkdownIt("commonmark", {"html": False}).enable("table").render(text)
    colourer = _Colourer(text, chars, current)
    colourer.feed(rendered)
    colourer.close()
    return "".join(colourer.out)


# ----- export / import ----------------------------------------------------------------------
def export_conversation(system: str | None, history: Sequence[dict], settings: dict | None = None,
                        steps: Sequence[StepRecord] | None = None, token_texts: dict | None = None) -> str:
    """JSON text of the conversation (the settings are informative; import ignores them). ``steps``
    (the last answer's step records) and the text of their tokens are included when given, so an
    import can replay that answer's trees and chart (:func:`import_steps`)."""
    out = {"format": EXPORT_FORMAT, "version": 1, "exported_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "system": system or "",
           "messages": [{"role": m["role"], "content": m["content"]} for m in history],
           "settings": settings or {}}
    if steps:
        out["steps"] = [step.to_dict() for step in steps]
        out["token_texts"] = {str(k): v for k, v in (token_texts or {}).items()}
    return json.dumps(out, ensure_ascii=False, indent=2)


def import_steps(data: bytes | str) -> tuple[list[StepRecord], dict[int, str]]:
    """The step records (and token texts) an export carried, for replay; ``([], {})`` when it has none.
    Raises ValueError when steps are present but malformed."""
    if isinstance(data, bytes):
        data = data.decode("utf-8")
    raw = json.loads(data)
    if not isinstance(raw, dict) or not raw.get("steps"):
        return [], {}
    from dataclasses import fields

    from engine.core.records import StepTimings
    names = {f.name for f in fields(StepRecord)}
    steps = []
    try:
        for i, d in enumerate(raw["steps"]):
            if not isinstance(d, dict) or set(d) - names:
                raise ValueError(f"step {i + 1} has unknown fields")
            d = dict(d)
            d["timings"] = StepTimings(**(d.get("timings") or {}))
            step = StepRecord(**d)
            n = len(step.tokens)
            if not (len(step.parents) == len(step.ranks) == len(step.draft_probs) == len(step.target_probs) == n) \
                    or not step.accepted or any(not 0 <= a < n for a in step.accepted):
                raise ValueError(f"step {i + 1} is inconsistent")
            steps.append(step)
        texts = {int(k): str(v) for k, v in (raw.get("token_texts") or {}).items()}
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the exported steps could not be read ({exc})") from None
    return steps, texts


def import_conversation(data: bytes | str) -> tuple[str, list[dict]]:
    """``(system, history)`` from exported JSON (or a plain list of role/content messages).

    Raises ValueError with a one-line reason for anything else: not JSON, too large, wrong
    shape, unknown roles, non-text content.
    """
    if isinstance(data, str):
        data = data.encode("utf-8")
    if len(data) > MAX_IMPORT_BYTES:
        raise ValueError(f"the file is {len(data) / 1e6:.1f} MB; conversations up to "
                         f"{MAX_IMPORT_BYTES / 1e6:.0f} MB can be imported")
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a JSON file ({exc.__class__.__name__}): export a conversation first and "
                         f"import that file") from None
    system = ""
    if isinstance(raw, dict):
        if "messages" not in raw:
            raise ValueError("the JSON has no 'messages' list")
        system = raw.get("system") or ""
        messages = raw["messages"]
    else:
        messages = raw
    if not isinstance(system, str):
        raise ValueError("'system' must be a string")
    if not isinstance(messages, list):
        raise ValueError("'messages' must be a list of {role, content} objects")
    if len(messages) > MAX_IMPORT_MESSAGES:
        raise ValueError(f"{len(messages)} messages; at most {MAX_IMPORT_MESSAGES} can be imported")
    history = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content", "metadata", "options"} or \
                "role" not in m or "content" not in m:
            raise ValueError(f"message {i + 1} must be an object with 'role' and 'content'")
        role, content = m["role"], m["content"]
        if role == "system" and i == 0 and isinstance(content, str):
            system = content
            continue
        if role not in ROLES:
            raise ValueError(f"message {i + 1} has role {role!r}; only 'user' and 'assistant' (and a first "
                             f"'system') are allowed")
        if not isinstance(content, str):
            raise ValueError(f"message {i + 1}: content must be text")
        if len(content) > MAX_MESSAGE_CHARS:
            raise ValueError(f"message {i + 1} is longer than {MAX_MESSAGE_CHARS} characters")
        history.append({"role": role, "content": clean_text(content)})
    return clean_text(system), history
