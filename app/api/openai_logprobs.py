"""Log-probabilities in the OpenAI API's shapes (``logprobs`` / ``top_logprobs``), from the
target's own scores that the engine puts in each step record (:mod:`engine.core.logprobs`: the
log_softmax of the raw logits, whatever the sampling settings).

An entry is released with the text it spells: :class:`LogprobTrail` follows the answer's text
(:class:`app.api.openai_api.Answer`), which holds back the start of a possible stop string and a
character still being spelled by byte tokens, and cuts at a stop string. A token is released once
all of its text has been sent, so the released tokens' text is always a prefix of the text sent;
a token cut (in whole or in part) by a stop string never is, nor the stop token that ends an
answer. Special tokens elsewhere (no text of their own in the answer) go with the text before them.

Each token is named by its text decoded alone (``tokenizer.decode([id])``) and its ``bytes``: for
a byte-level BPE vocabulary the raw bytes it stands for (part of a character, possibly), else
the UTF-8 bytes of its text.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

NOT_FINITE = -9999.0  # OpenAI's logprob for "very unlikely"; JSON has no -inf


@dataclass
class Scored:
    """One answer token, ready for either shape: its text, bytes and logprob, its alternatives
    ``(text, bytes, logprob)`` and where its text starts and ends in the answer (characters)."""

    text: str
    raw: bytes
    logprob: float
    top: list[tuple[str, bytes, float]] = field(default_factory=list)
    start: int = 0
    end: int = 0


class TokenTexts:
    """The text and bytes of each token of one tokenizer, remembered once looked up."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = _byte_level(tokenizer)
        self.added = {int(i): str(t) for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
        self._known: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token: int) -> tuple[str, bytes]:
        known = self._known.get(token)
        if known is None:
            text = self.tokenizer.decode([token])
            known = self._known[token] = (text, self._bytes(token, text))
        return known

    def _bytes(self, token: int, text: str) -> bytes:
        if token in self.added or not self.byte_level:
            return (self.added.get(token) or text).encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token)
        decoder = _byte_decoder()
        if not isinstance(piece, str) or any(c not in decoder for c in piece):
            return text.encode("utf-8")
        return bytes(decoder[c] for c in piece)


_texts: "weakref.WeakKeyDictionary[object, TokenTexts]" = weakref.WeakKeyDictionary()


def token_texts(tokenizer) -> TokenTexts:
    """The :class:`TokenTexts` of ``tokenizer`` (one per tokenizer, kept while it lives)."""
    try:
        texts = _texts.get(tokenizer)
    except TypeError:  # not weakly referenceable: a fresh one
        return TokenTexts(tokenizer)
    if texts is None:
        texts = _texts[tokenizer] = TokenTexts(tokenizer)
    return texts


class LogprobTrail:
    """The answer's scored tokens, released as their text is sent (see the module docstring)."""

    def __init__(self) -> None:
        self.pending: list[Scored] = []
        self.released: list[Scored] = []
        self.taken = 0
        self.end = 0  # where the last token's text ends in the answer
        self.open = False  # the last token ended inside a character (its text ends in U+FFFD)

    def extend(self, tokenizer, record, text: str, ends: list[tuple[int, bool]]) -> None:
        """Score ``record``'s committed tokens, the answer's last ones: its text so far (cut by no
        stop string) is ``text``, and ``ends`` says, per committed token, how long the answer's
        text is up to it and whether that ends inside a character
        (:meth:`app.api.growing_text.GrowingText.extend`)."""
        texts = token_texts(tokenizer)
        for i, (scored, (length, ragged)) in enumerate(zip(record.token_logprobs, ends)):
            name, raw = texts(scored.token)
            inside = self.open and bool(raw) and 0x80 <= raw[0] < 0xC0  # it goes on spelling a character
            start = max(0, self.end - 1) if inside else self.end
            self.end, self.open = max(self.end, min(length, len(text))), ragged
            if record.finish_reason == "stop" and i == len(ends) - 1:
                continue  # the stop token that ended the answer: no text, not shown
            top = [(*texts(t), _finite(v)) for t, v in scored.top]
            self.pending.append(Scored(name, raw, _finite(scored.logprob), top, start, self.end))

    def release(self, sent: int) -> None:
        """Release the tokens whose text ends within the first ``sent`` characters."""
        done = 0
        while done < len(self.pending) and self.pending[done].end <= sent:
            done += 1
        self.released.extend(self.pending[:done])
        del self.pending[:done]

    def take(self) -> list[Scored]:
        """The tokens released since the last call."""
        new = self.released[self.taken:]
        self.taken = len(self.released)
        return new


def chat_logprobs(entries: list[Scored]) -> dict:
    """A chat choice's ``logprobs``: ``{"content": [...], "refusal": None}``."""
    return {"content": [_chat_entry(e) for e in entries], "refusal": None}


def _chat_entry(entry: Scored) -> dict:
    return {"token": entry.text, "logprob": entry.logprob, "bytes": list(entry.raw),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(b)} for t, b, v in entry.top]}


def legacy_logprobs(entries: list[Scored]) -> dict:
    """A text completion choice's ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs``
    (per token, the alternatives and the chosen token, by text) and ``text_offset`` (where each
    token's text starts in the completion, in characters)."""
    tops = []
    for entry in entries:
        top = {t: v for t, _, v in entry.top}
        top.setdefault(entry.text, entry.logprob)
        tops.append(top)
    return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops, "text_offset": [e.start for e in entries]}


def _finite(value: float) -> float:
    return float(value) if math.isfinite(value) else NOT_FINITE


def _byte_level(tokenizer) -> bool:
    """Whether ``tokenizer`` spells bytes with GPT-2's byte-level alphabet (Qwen, Llama 3, GPT-2)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


_BYTE_DECODER: dict[str, int] = {}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet read back: character -> the byte it stands for."""
    if not _BYTE_DECODER:
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        shifted = 0
        for byte in range(256):
            if byte in printable:
                _BYTE_DECODER[chr(byte)] = byte
            else:
                _BYTE_DECODER[chr(256 + shifted)] = byte
                shifted += 1
    return _BYTE_DECODER
