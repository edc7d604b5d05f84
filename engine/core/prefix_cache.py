"""KV caches kept between the turns of a conversation, and a byte-bounded LRU store of them.

A :class:`ConversationCache` owns one dynamic KV cache per model (target, draft) and records which
tokens the first slots of each hold. Passed to :meth:`SpeculativeEngine.stream` (``cache=``), it
lets the next prompt reuse the longest common prefix of those tokens and prefill only the rest;
the engine keeps the record up to date as it decodes, so the cache is valid whenever the
generation stops (done, cancelled or failed).

It also keeps what its greedy answers' steps said about acceptance (:class:`RankCounts`, by the
length of the prompt each answered): the next greedy answer's tree is priced by the counts of the
answers whose prompts its own still holds (:meth:`ConversationCache.evidence_for`), not those of a
branch left behind.

Exactness is unchanged: a reused slot holds the keys and values the engine itself computed for
that token at that position, the very ones it would have attended to had the generation gone on.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from engine.core.acceptance_evidence import RankCounts
from engine.core.kv_cache import truncate
from engine.core.runner import DynamicRunner

DEFAULT_BUDGET_BYTES = 1 << 30  # 1 GiB of cached keys and values across all conversations


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ConversationCache:
    """The target's and the draft's KV caches of one conversation, with the tokens they hold.

    Invariant: the first ``len(tokens[role])`` slots of ``runners[role]`` hold the keys and values
    of those tokens (slots after them, if any, are stale and cut before reuse).
    """

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module | None = None) -> None:
        self.models = {"target": target, "draft": draft}
        self.runners: dict[str, DynamicRunner] = {}
        self.tokens: dict[str, list[int]] = {"target": [], "draft": []}
        self.reused: dict[str, int] = {"target": 0, "draft": 0}  # of the last prompt
        self.evidence: list[tuple[int, RankCounts]] = []  # (its answer's prompt tokens, a step's counts)

    def belongs_to(self, target: torch.nn.Module, draft: torch.nn.Module | None) -> bool:
        """Whether this cache was built for exactly these models."""
        return self.models["target"] is target and self.models["draft"] is draft

    def runner(self, role: str) -> DynamicRunner:
        """The runner of ``role``, created empty the first time."""
        if role not in self.runners:
            self.runners[role] = DynamicRunner(self.models[role])
        return self.runners[role]

    def observe(self, start: int, counts: RankCounts) -> None:
        """A greedy step of the answer to a ``start``-token prompt counted ``counts``."""
        if counts:
            self.evidence.append((start, counts))

    def evidence_for(self, prompt: list[int]) -> RankCounts:
        """The counts of the kept answers whose prompts ``prompt`` still holds (an edit or a branch
        drops those after it, here too); an answer's own text need not come back token for token."""
        held = self.held("target", prompt)
        self.evidence = [(start, counts) for start, counts in self.evidence if start <= held + 1]
        return RankCounts.total(counts for _, counts in self.evidence)

    def held(self, role: str, prompt: list[int]) -> int:
        """How many leading tokens of ``prompt`` the cache of ``role`` holds (nothing is changed)."""
        return common_prefix(self.tokens[role], prompt)

    def reuse(self, role: str, prompt: list[int]) -> int:
        """Keep the longest prefix of ``prompt`` the cache of ``role`` already holds (the rest of the
        cache is cut); how many tokens that is."""
        runner = self.runner(role)
        keep = self.held(role, prompt)
        if keep == 0:
            runner.reset()
        else:
            truncate(runner.cache, keep)
        self.tokens[role] = list(prompt[:keep])
        self.reused[role] = keep
        return keep

    def record(self, role: str, tokens: list[int]) -> None:
        """The first ``len(tokens)`` slots of ``role`` now hold ``tokens``."""
        self.tokens[role] = list(tokens)

    def nbytes(self) -> int:
        """Bytes held by the keys and values of both caches (each storage counted once)."""
        seen: set[int] = set()
        total = 0
        for runner in self.runners.values():
            for layer in runner.cache.layers:
                for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                    if not isinstance(tensor, torch.Tensor):
                        continue
                    storage = tensor.untyped_storage()
                    if storage.data_ptr() not in seen:
                        seen.add(storage.data_ptr())
                        total += storage.nbytes()
        return total

    def __len__(self) -> int:
        return len(self.tokens["target"])


class CacheStore:
    """At most one :class:`ConversationCache` per key (a chat session), evicted least recently used
    so that all of them together stay within ``budget_bytes``. Thread-safe.

    A cache is *taken out* while a generation uses it and *put back* after, so two requests never
    share one, and its size is measured when it comes back."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the KV cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self._entries: OrderedDict[str, tuple[ConversationCache, int]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, key: str) -> ConversationCache | None:
        """Remove and return the cache of ``key`` (None when there is none)."""
        with self._lock:
            entry = self._entries.pop(key, None)
        return entry[0] if entry else None

    def put(self, key: str, cache: ConversationCache) -> list[str]:
        """Store ``cache`` as the most recent; evict the least recently used until the budget holds.
        A cache larger than the whole budget is not kept. Returns the evicted keys."""
        size = cache.nbytes()
        evicted = []
        with self._lock:
            self._entries.pop(key, None)
            if size > self.budget_bytes:
                return [key]
            self._entries[key] = (cache, size)
            while self._bytes() > self.budget_bytes:
                old, _ = self._entries.popitem(last=False)
                evicted.append(old)
        return evicted

    def peek(self, key: str) -> ConversationCache | None:
        """The cache of ``key`` left in place (None when there is none)."""
        with self._lock:
            entry = self._entries.get(key)
        return entry[0] if entry else None

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def keys(self) -> list[str]:
        """Keys, least recently used first."""
        with self._lock:
            return list(self._entries)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes()

    def _bytes(self) -> int:
        return sum(size for _, size in self._entries.values())
