"""A draft whose output head covers a sub-vocabulary: the tokens a draft is likely to need.

The embedded draft's head (151,936 x 896) is about a quarter of the bytes a draft level reads,
yet most of its rows are tokens that English text and code never use. :class:`SubVocabularyHead`
computes the logits of the kept rows only, through the same kernel and blocks (bit for bit the
full head's values there), and gives every other token -inf: the draft's distribution q is 0
outside.

Verification stays exact for any q. Greedy: the target alone picks every token. Sampling: a
token the draft cannot propose is reached through the residual max(p - q, 0), which is p itself
there. Only acceptance can drop, by how often the target's token lies outside the kept ids.

The restricted draft is a new model object sharing every weight of the one it came from, which
is left as it was (the loader may hand that object out again, even as a target). It keeps that
model as the one to draft with when a prompt is mostly written in tokens it cannot propose (a
chat in Chinese, Russian, ...): ``draft_for_prompt`` in its ``__dict__``, which the engine calls
once a generation (a choice made from the prompt alone, so exactness is kept).
"""
from __future__ import annotations

import copy
import weakref
from collections.abc import Iterable

import torch

from engine.backends.kquant import TILE, KQuantLinear, select_outputs

FREQUENT_IDS = 32768  # the embedded draft keeps these first ids (BPE merge order: the most frequent)
WHOLE_BELOW = 0.9  # a prompt with a smaller share of kept tokens is drafted with the whole head
CHOOSER = "draft_for_prompt"  # where a restricted draft keeps its per-prompt choice (the engine looks there)
# GPT-2's byte-level BPE writes byte b as a printable character: 33..126 as themselves, the
# others from U+0100 on (0..32 as U+0100..U+0120, 127 as U+0121). ASCII text is these characters.
_ASCII_BYTE_CHARACTERS = frozenset([chr(b) for b in range(33, 127)] + [chr(0x100 + b) for b in range(34)])


def ascii_token_ids(vocabulary: dict[str, int]) -> list[int]:
    """Ids of a byte-level BPE ``vocabulary`` (token string -> id, as ``get_vocab`` gives) whose
    text is ASCII: English, code, numbers and punctuation."""
    return [i for token, i in vocabulary.items() if _ASCII_BYTE_CHARACTERS.issuperset(token)]


class SubVocabularyHead(torch.nn.Module):
    """``x [..., in] -> logits [..., V]``: ``full``'s logits at ``kept`` (the same blocks through
    the same kernel: the same bits), -inf elsewhere. ``full`` is kept as ``.full``."""

    def __init__(self, full: KQuantLinear, kept: torch.Tensor, out_features: int | None = None) -> None:
        super().__init__()
        self.full, self.in_features = full, full.in_features
        self.out_features = full.out_features if out_features is None else out_features  # a target's rows
        self.register_buffer("kept", kept, persistent=False)  # [K] sorted distinct token ids
        rows = torch.cat([kept, kept[:1].expand(-kept.numel() % TILE)])  # whole tiles: a repeat computed, dropped
        bias = full._parameters.get("bias")
        self.part = KQuantLinear(full.kind, select_outputs(full.kind, full.packed(), full.out_features, rows),
                                 full.in_features, rows.numel(), None if bias is None else bias.detach()[rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.full((*x.shape[:-1], self.out_features), float("-inf"), dtype=torch.float32)
        return logits.index_copy_(-1, self.kept, self.part(x)[..., : self.kept.numel()])

    def extra_repr(self) -> str:
        return f"{self.kept.numel()} of {self.out_features} tokens"


def with_draft_vocabulary(draft: torch.nn.Module, kept: Iterable[int], out_features: int | None = None) -> torch.nn.Module:
    """``draft`` (a k-quant model, :mod:`engine.backends.kquant`) with a :class:`SubVocabularyHead`
    over the token ids ``kept`` (ids outside the vocabulary are ignored): a new model object
    sharing every other module and weight; ``draft`` itself is not changed. Its whole head again
    when ``kept`` covers the vocabulary. ``out_features``: the logits' width when it is not the
    draft's own (a target with more or fewer padding rows: ids past the draft's rows get -inf, q = 0).
    Raises ValueError for a head the kernels do not hold."""
    head = draft.get_output_embeddings()
    full = head.full if isinstance(head, SubVocabularyHead) else head
    if type(full) is not KQuantLinear:
        raise ValueError("a draft vocabulary needs a k-quant draft (--draft-format q4k); "
                         f"this draft's head is {type(full).__name__}")
    width = full.out_features if out_features is None else out_features
    ids = torch.tensor(sorted({i for i in kept if 0 <= i < min(full.out_features, width)}), dtype=torch.int64)
    if ids.numel() == 0:
        raise ValueError("a draft vocabulary must keep at least one token id")
    whole = ids.numel() == full.out_features
    new_head = full if whole and width == full.out_features else SubVocabularyHead(full, ids, width)
    restricted = copy.copy(draft)
    restricted._modules = dict(draft._modules)  # its own table of submodules: the head is its own
    restricted.lm_head = new_head
    lean = draft.__dict__.get("lean_forward")
    if lean is not None:
        own = copy.copy(lean)
        own._native, own._final_norm, own._tables = lean._native, lean._final_norm, lean._tables  # shared
        own.lm_head = new_head
        restricted.__dict__["lean_forward"] = own
    previous = restricted.__dict__.pop(CHOOSER, None)  # ``draft`` was restricted already: its whole model
    if new_head is not full and not whole and width == full.out_features:  # the whole head must give the same width
        restricted.__dict__[CHOOSER] = _PromptChoice(restricted, previous.whole if previous else draft, ids)
    return restricted


class _PromptChoice:
    """``(prompt ids) -> model``: the restricted draft, or the whole-vocabulary one when under
    :data:`WHOLE_BELOW` of the prompt's tokens are kept ids. Holds the restricted draft weakly
    (it holds this object)."""

    def __init__(self, restricted: torch.nn.Module, whole: torch.nn.Module, kept: torch.Tensor) -> None:
        self.restricted, self.whole = weakref.ref(restricted), whole
        self.is_kept = torch.zeros(whole.get_output_embeddings().out_features, dtype=torch.bool)
        self.is_kept[kept] = True

    def __deepcopy__(self, memo: dict) -> "_PromptChoice":
        """The choice of a deep copy of the restricted draft: the copy (copied before its state, so
        already in ``memo``) and a copy of the whole model, never the originals."""
        twin = _PromptChoice.__new__(_PromptChoice)
        memo[id(self)] = twin
        twin.restricted = weakref.ref(copy.deepcopy(self.restricted(), memo))
        twin.whole = copy.deepcopy(self.whole, memo)
        twin.is_kept = self.is_kept.clone()
        return twin

    def __call__(self, prompt: list[int]) -> torch.nn.Module:
        kept = self.is_kept[torch.tensor(prompt, dtype=torch.int64)].float().mean().item() if prompt else 1.0
        return self.restricted() if kept >= WHOLE_BELOW else self.whole


class IdsWithin(torch.nn.Module):
    """A draft's input embedding that reads an id past its ``rows`` (a target's padding id, which
    the target committed) as the last row: the draft only guesses after it, so exactness holds."""

    def __init__(self, inner: torch.nn.Module, rows: int) -> None:
        super().__init__()
        self.inner, self.rows = inner, rows
        self.num_embeddings, self.embedding_dim = inner.num_embeddings, inner.embedding_dim

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids.clamp(max=self.rows - 1))


def read_ids_within(draft: torch.nn.Module, rows: int) -> None:
    """Give ``draft`` (and its lean forward, which holds the embedding itself) :class:`IdsWithin`;
    ids within ``rows`` read as before, so models sharing the embedding are unchanged."""
    embedding = draft.get_input_embeddings()
    if isinstance(embedding, IdsWithin):
        return
    draft.set_input_embeddings(IdsWithin(embedding, rows))
    lean = draft.__dict__.get("lean_forward")
    if lean is not None:
        lean.embed = draft.get_input_embeddings()


def kept_count(draft: torch.nn.Module) -> int:
    """How many token ids ``draft``'s head computes (the whole vocabulary unless restricted)."""
    head = draft.get_output_embeddings()
    return head.kept.numel() if isinstance(head, SubVocabularyHead) else int(head.out_features)
