"""Free drafts copied from the context: an n-gram index over the conversation, and the merge of its
continuations into a step's token tree beside the draft model's nodes.

Answers of a coder model often repeat what the conversation already holds (a pasted file given back
with one change, a renamed function). A continuation copied from there costs no draft forward; the
target verifies it like any other branch. At T = 0 it is kept when it is the target's argmax; at
T > 0 it is a proposal with a point-mass q, tried before the draft model's children
(:func:`engine.core.verify.accept_child`), so the committed tokens still follow the target's law.

Why a hash of n-grams and not a suffix automaton: the index grows by one token at a time (O(1) per
token: one dict append), it holds several documents (the conversation and an expected output given
by the client) without rebuilding, and a lookup measures each candidate's true match length by
walking backwards from it, O(match length) per candidate. A suffix automaton finds the longest
match as fast but only its first occurrence (``firstpos``); here the most recent occurrence is
usually the one that continues right (the answer being written, the latest version of the code).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from engine.trees.tree import Tree

SOURCE_ROOT, SOURCE_DRAFT, SOURCE_COPY = "root", "draft", "copy"


@dataclass(frozen=True)
class CopyProposal:
    """A continuation found in the context: ``tokens`` followed ``match_len`` tokens equal to the
    current suffix, at ``position`` (the index of ``tokens[0]``) of ``document``."""

    tokens: tuple[int, ...]
    match_len: int
    document: int
    position: int


@dataclass
class ContextIndex:
    """Positions of every ``key_len``-gram in one or more token documents.

    Document 0 is the generation's own sequence (prompt, then the answer as it grows: :meth:`sync`);
    later documents are static texts added with :meth:`add_document` (an expected output). A
    lookup takes the current suffix of document 0, finds earlier places that end with the same
    ``key_len`` tokens, measures how far back each match goes (up to ``max_match``) and returns the
    continuations, longest match first, one per distinct first token.
    """

    key_len: int = 3
    max_match: int = 64
    candidates: int = 16  # most recent occurrences of a key looked at per lookup
    documents: list[list[int]] = field(default_factory=list)
    _positions: dict[tuple[int, ...], list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))
    _indexed: list[int] = field(default_factory=list)  # per document: n-grams indexed so far

    def __post_init__(self) -> None:
        if self.key_len < 1:
            raise ValueError("key_len must be >= 1")
        if not self.documents:
            self.documents.append([])
            self._indexed.append(0)

    def add_document(self, tokens: list[int]) -> int:
        """Index a static document (e.g. a client's expected output); returns its number."""
        self.documents.append(list(tokens))
        self._indexed.append(0)
        self._index(len(self.documents) - 1)
        return len(self.documents) - 1

    def sync(self, sequence: list[int]) -> None:
        """Make document 0 equal to ``sequence``, which only ever grows by appending."""
        own = self.documents[0]
        if len(sequence) < len(own) or sequence[:len(own)] != own:
            raise ValueError("the indexed sequence may only grow by appending")
        own.extend(sequence[len(own):])
        self._index(0)

    def _index(self, document: int) -> None:
        tokens, k = self.documents[document], self.key_len
        # an n-gram is indexed once a token follows it (the continuation is what we copy)
        for end in range(max(self._indexed[document], k), len(tokens)):
            self._positions[tuple(tokens[end - k:end])].append((document, end))
        self._indexed[document] = max(self._indexed[document], len(tokens))

    def lookup(self, max_tokens: int, branches: int = 1, stop_tokens: frozenset[int] = frozenset()) -> list[CopyProposal]:
        """Up to ``branches`` continuations of document 0's current suffix, each at most
        ``max_tokens`` long and cut after a stop token; longest match (then most recent) first,
        distinct first tokens."""
        own, k = self.documents[0], self.key_len
        if max_tokens < 1 or branches < 1 or len(own) < k:
            return []
        found: list[tuple[int, int, int, int]] = []  # (match length, recency, document, position)
        for recency, (document, position) in enumerate(reversed(self._positions.get(tuple(own[-k:]), ()))):
            if recency >= self.candidates:
                break
            if document == 0 and position >= len(own):
                continue
            found.append((self._match_length(document, position), -recency, document, position))
        found.sort(reverse=True)
        proposals, firsts = [], set()
        for match, _, document, position in found:
            source = self.documents[document]
            tokens = source[position:position + max_tokens]
            if document == 0:  # copying our own suffix onto itself would run into the unknown future
                tokens = tokens[:len(own) - position]
            tokens = _cut_after_stop(tokens, stop_tokens)
            if not tokens or tokens[0] in firsts:
                continue
            firsts.add(tokens[0])
            proposals.append(CopyProposal(tuple(tokens), match, document, position))
            if len(proposals) == branches:
                break
        return proposals

    def _match_length(self, document: int, position: int) -> int:
        """How many tokens before ``position`` in ``document`` equal the end of document 0."""
        own, source = self.documents[0], self.documents[document]
        length = 0
        while length < self.max_match and length < position and length < len(own) and \
                source[position - 1 - length] == own[-1 - length]:
            length += 1
        return length


def _cut_after_stop(tokens: list[int], stop_tokens: frozenset[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in stop_tokens:
            return tokens[:i + 1]
    return tokens


@dataclass(frozen=True)
class MergedTree:
    """A step's tree with copied branches merged beside the draft model's nodes.

    ``tree`` is canonical breadth-first; on each level the copied nodes come first, so at every
    node the copied children are tried before the draft's. ``sources[i]`` says where node i came
    from; ``model_node[i]`` is its index in the draft model's tree (-1 for copied nodes);
    ``origin[i]`` is ``(document, position)`` of a copied token, None otherwise; ``chains[b]``
    lists the nodes of proposal b's chain, root side first.
    """

    tree: Tree
    tokens: list[int]
    sources: list[str]
    model_node: list[int]
    origin: list[tuple[int, int] | None]
    chains: list[list[int]]

    @property
    def copied(self) -> frozenset[int]:
        return frozenset(i for i, s in enumerate(self.sources) if s == SOURCE_COPY)


def merge_copies(model_tree: Tree, model_tokens: list[int], proposals: list[CopyProposal]) -> MergedTree:
    """Hang each proposal's tokens as a chain below the root, first among the root's children.

    ``model_tree`` / ``model_tokens``: the draft model's tree (root only when nothing was drafted)
    and its node tokens. Level by level, the copied nodes (in proposal order) precede the model's,
    which keep their relative order, so the result is canonical and the draft cache's order of the
    model's nodes is unchanged.
    """
    if not proposals:
        size = model_tree.size
        return MergedTree(model_tree, list(model_tokens), [SOURCE_ROOT] + [SOURCE_DRAFT] * (size - 1),
                          list(range(size)), [None] * size, [])
    depth = max(model_tree.depth, max(len(p.tokens) for p in proposals))
    model_levels = model_tree.level_slices
    parents, tokens, sources, model_node, origin = [-1], [model_tokens[0]], [SOURCE_ROOT], [0], [None]
    new_index = {0: 0}  # model node -> merged node
    chains: list[list[int]] = [[] for _ in proposals]
    for level in range(1, depth + 1):
        for b, proposal in enumerate(proposals):
            if level <= len(proposal.tokens):
                parents.append(chains[b][-1] if chains[b] else 0)
                tokens.append(proposal.tokens[level - 1])
                sources.append(SOURCE_COPY)
                model_node.append(-1)
                origin.append((proposal.document, proposal.position + level - 1))
                chains[b].append(len(tokens) - 1)
        if level < len(model_levels):
            for node in range(model_levels[level].start, model_levels[level].stop):
                new_index[node] = len(tokens)
                parents.append(new_index[model_tree.parents[node]])
                tokens.append(model_tokens[node])
                sources.append(SOURCE_DRAFT)
                model_node.append(node)
                origin.append(None)
    return MergedTree(Tree(tuple(parents)), tokens, sources, model_node, origin, chains)
