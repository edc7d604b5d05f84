"""The text of an answer's tokens as they come, decoded a few tokens at a time.

Decoding the whole answer at every step costs its length squared over a long answer. Past a point
where the text ends on a whole character, the text that follows is the same decoded from a few
tokens before that point as from the start: :class:`GrowingText` keeps such an anchor and decodes
from ``WINDOW`` tokens before it. The window lets a decoder's rules at its start (a leading space
dropped, a half character) fall on both decodes alike. Where the window's decode of the tokens up
to the anchor is not how the answer's text ends there, or the longer decode does not begin with
it, the decoder depends on more than a few tokens of context, and the whole prefix is decoded.
"""
from __future__ import annotations

WINDOW = 4
RAGGED = "\ufffd"  # what a character still being spelled by byte tokens decodes to, for now


class GrowingText:
    """The text of ``tokens`` (special tokens skipped) for a growing token list."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""
        self._anchor = (0, "")  # (tokens, their text): a prefix whose text ends on a whole character

    def extend(self, new: list[int], each: bool = False) -> list[tuple[int, bool]]:
        """Append ``new``; ``self.text`` is then the whole text. With ``each``: per new token, the
        length of the text up to it and whether that ends inside a character."""
        self.tokens.extend(new)
        first = len(self.tokens) - len(new)
        known, known_text = self._anchor
        begin = max(0, known - WINDOW)
        head = self._decode(self.tokens[begin:known])  # the same for every prefix of this step

        def text_at(n: int) -> str:
            tail = self._decode(self.tokens[begin:n])
            if not (tail.startswith(head) and known_text.endswith(head.lstrip(RAGGED))):
                return self._decode(self.tokens[:n])
            return known_text + tail[len(head):]

        ends = []
        if each:
            for n in range(first + 1, len(self.tokens)):
                text = text_at(n)
                ends.append((len(text), text.endswith(RAGGED)))
        self.text = text_at(len(self.tokens))
        if new and each:
            ends.append((len(self.text), self.text.endswith(RAGGED)))
        if not self.text.endswith(RAGGED):
            self._anchor = (len(self.tokens), self.text)
        return ends

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True) if tokens else ""
