"""When a draft may draft for a target: the rule, read from two GGUF files' tokenizer metadata.

Speculation is exact whatever the draft proposes, as long as a draft token id means the same
text to the target. So the two tokenizers must agree: the same tokenizer model and
pre-tokenizer, the same BOS/EOS/EOT ids, identical token texts over the ids both have, and
vocabularies (and output rows) that differ only by padding at the end, at most
:data:`MAX_PADDING` rows, as llama.cpp allows (Qwen2.5-7B's 152,064 output rows against
Qwen2.5-0.5B's 151,936). Ids the draft lacks get q = 0, so the target's law is kept.
"""
from __future__ import annotations

from typing import Any

from engine.errors import VocabularyMismatchError

MAX_PADDING = 128
SPECIAL_IDS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")


def check_pair(target: Any, draft: Any, target_name: str = "target", draft_name: str = "draft") -> None:
    """Refuse (:class:`VocabularyMismatchError`, one line naming what differs) a draft whose
    tokenizer does not agree with the target's. ``target``/``draft``: objects with ``metadata``
    (the files' GGUF metadata), ``tokens`` and ``vocab_rows`` (the token embedding's rows), as
    :class:`engine.models.gguf_direct.GGUFModelFile` has them."""
    t, d = target.metadata, draft.metadata
    for key, default in (("tokenizer.ggml.model", None), ("tokenizer.ggml.pre", "default")):
        if t.get(key, default) != d.get(key, default):
            raise VocabularyMismatchError(
                f"{draft_name} and {target_name} use different tokenizers ({key}: {d.get(key, default)!r} vs "
                f"{t.get(key, default)!r}): choose a draft whose tokenizer is the target's")
    for key in SPECIAL_IDS:
        if key in t and key in d and t[key] != d[key]:
            raise VocabularyMismatchError(f"{draft_name} and {target_name} differ in {key.rsplit('.', 1)[1]} "
                                          f"({d[key]} vs {t[key]})")
    target_tokens, draft_tokens = target.tokens, draft.tokens
    padding = max(abs(len(target_tokens) - len(draft_tokens)), abs(target.vocab_rows - draft.vocab_rows))
    if padding > MAX_PADDING:
        raise VocabularyMismatchError(
            f"{draft_name} has {len(draft_tokens)} tokens ({draft.vocab_rows} rows) and {target_name} "
            f"{len(target_tokens)} ({target.vocab_rows} rows): more than {MAX_PADDING} apart, not padding")
    first = first_difference(target_tokens, draft_tokens)
    if first is not None:
        raise VocabularyMismatchError(
            f"{draft_name} and {target_name} disagree at token {first}: {draft_tokens[first]!r} vs "
            f"{target_tokens[first]!r}: choose a draft from the target's family")


def first_difference(a: list[str], b: list[str]) -> int | None:
    """The first id below both lengths whose texts differ, or None."""
    shared = min(len(a), len(b))
    if a[:shared] == b[:shared]:
        return None
    return next(i for i in range(shared) if a[i] != b[i])
