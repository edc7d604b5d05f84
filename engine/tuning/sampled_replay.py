"""Exact sampled replay: tokens/step of any tree and verification method at T > 0, cheaply.

A verification step only looks at the nodes on the path it accepts: at each of them it draws
the node's children from q (the draft after that node) and tests them against p (the target
after that node); the rest of the tree never changes the outcome. So a step can be simulated
lazily, running the models only at the contexts the walk reaches, and every tree shape, size,
method and temperature simulated from one root context shares those evaluations: logits are
memoised by token path in a trie that grows inside both KV caches (tree attention after the
root's prefix), and temperature/top-p are applied per simulation. Each simulated step has
exactly the law of an engine step from that context; the cost no longer grows with tree size.
"""
from __future__ import annotations

import copy
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import torch

from engine.core.kv_cache import truncate
from engine.core.sampling import choose_children, logits_to_probs
from engine.core.speculative import forward
from engine.core.verify import accept_child, match_child
from engine.trees.tree import Tree, additive_mask

Path = tuple[int, ...]


@dataclass(frozen=True)
class Setting:
    """One simulated configuration: a tree shape verified by ``method`` at a sampling setting."""

    tree: Tree
    method: str            # sequoia | specinfer | chain | topk
    temperature: float     # > 0
    top_p: float = 1.0


class ContextOracle:
    """Target and draft logits ``[V]`` after ``root context + path`` for any token path.

    The caches hold the ``root_pos`` tokens before the root; evaluated paths are appended to
    them as trie nodes, each seeing the prefix, its ancestors and itself.
    """

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module, target_cache, draft_cache,
                 root_pos: int, root_token: int) -> None:
        self.models = (target, draft)
        self.caches = (target_cache, draft_cache)
        self.root_pos, self.root_token = root_pos, root_token
        self.index: dict[Path, int] = {}         # path -> trie slot
        self.lineage: list[list[int]] = []       # slot -> slots of its ancestors and itself
        self.logits: dict[Path, tuple[torch.Tensor, torch.Tensor]] = {}
        self._probs: dict[tuple[Path, float, float], tuple[torch.Tensor, torch.Tensor]] = {}
        self.forwards = 0

    def probs(self, path: Path, temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(p, q)`` after ``path`` at this sampling setting (memoised; the path must be evaluated)."""
        key = (path, temperature, top_p)
        if key not in self._probs:
            self._probs[key] = tuple(logits_to_probs(x, temperature, top_p) for x in self.logits[path])
        return self._probs[key]

    def evaluate(self, paths: Sequence[Path]) -> None:
        """Run both models once over every path not seen yet (their parents first)."""
        new = sorted({p for p in paths if p not in self.index}, key=len)
        if not new:
            return
        for path in new:
            parent = self.lineage[self.index[path[:-1]]] if path else []
            self.index[path] = len(self.lineage)
            self.lineage.append(parent + [len(self.lineage)])
        first = len(self.lineage) - len(new)
        columns = self.root_pos + len(self.lineage)
        tail = torch.zeros(len(new), len(self.lineage), dtype=torch.bool)  # slot j: the j-th evaluated path
        for row, path in enumerate(new):
            tail[row, self.lineage[self.index[path]]] = True
        mask = additive_mask(tail, self.root_pos + first, columns, torch.float32)
        positions = torch.tensor([[self.root_pos + len(p) for p in new]])
        tokens = [p[-1] if p else self.root_token for p in new]
        outputs = [forward(model, cache, tokens, start=self.root_pos + first, mask=mask,
                           positions=positions) for model, cache in zip(self.models, self.caches)]
        self.forwards += 1
        for row, path in enumerate(new):
            self.logits[path] = (outputs[0][row], outputs[1][row])


def simulate_step(setting: Setting, generator: torch.Generator) -> Generator[Path, tuple[torch.Tensor, torch.Tensor],
                                                                              tuple[int, ...]]:
    """One engine step as a coroutine: yields the token path whose ``(p, q)`` (target and draft
    distributions ``[V]`` at the setting's temperature/top-p) it needs next; returns the ranks of
    the accepted nodes, root excluded (the step commits them plus the bonus token)."""
    tree, method = setting.tree, setting.method
    node, path, ranks = 0, (), ()
    while True:
        p, q = yield path
        kids = tree.children[node]
        children = choose_children(q, len(kids), method, False, generator) if kids else []
        if method == "topk":
            choice, _ = match_child(p, children, generator)
        else:
            choice, _ = accept_child(p, q, children, method != "specinfer", generator)
        if choice is None:
            return ranks
        node, path, ranks = kids[choice], path + (children[choice],), ranks + (choice + 1,)


def replay_root(oracle: ContextOracle, settings: Sequence[Setting],
                seeds: Sequence[int]) -> list[list[tuple[int, ...]]]:
    """Accepted ranks of one step from the oracle's root, per setting and seed, all simulated in
    lockstep so that each round of model evaluations serves every walk still running."""
    results: list[list[tuple[int, ...]]] = [[()] * len(seeds) for _ in settings]
    running = {}
    for i, setting in enumerate(settings):
        for j, seed in enumerate(seeds):
            walk = simulate_step(setting, torch.Generator().manual_seed(seed))
            running[(i, j)] = (walk, next(walk))
    while running:
        oracle.evaluate([request for _, request in running.values()])
        for key, (walk, request) in list(running.items()):
            setting = settings[key[0]]
            try:
                running[key] = (walk, walk.send(oracle.probs(request, setting.temperature, setting.top_p)))
            except StopIteration as done:
                results[key[0]][key[1]] = done.value
                del running[key]
    return results


def replay_sequence(target: torch.nn.Module, draft: torch.nn.Module, sequence: list[int],
                    root_positions: Sequence[int], settings: Sequence[Setting],
                    seeds: Sequence[int]) -> list[list[tuple[int, ...]]]:
    """Simulate one step from each root (the context ``sequence[:r + 1]``, ``r`` in
    ``root_positions``) for every setting and seed; returns the accepted ranks per step, indexed
    ``[setting][root * len(seeds) + seed]``. Both models read ``sequence`` once; each root starts
    from a copy of that cache."""
    from transformers import DynamicCache

    caches = []
    with torch.inference_mode():
        for model in (target, draft):
            cache = DynamicCache(config=model.config)
            forward(model, cache, sequence[:max(root_positions)], start=0, logits_to_keep=1)
            caches.append(cache)
        out: list[list[tuple[int, ...]]] = [[] for _ in settings]
        for root in root_positions:
            root_caches = []
            for cache in caches:
                root_cache = copy.copy(cache)
                root_cache.layers = [copy.copy(layer) for layer in cache.layers]
                truncate(root_cache, root)
                root_caches.append(root_cache)
            oracle = ContextOracle(target, draft, *root_caches, root_pos=root, root_token=sequence[root])
            for i, walks in enumerate(replay_root(oracle, settings, [s * 7919 + root for s in seeds])):
                out[i].extend(walks)
    return out


def rank_histogram(walks: Sequence[tuple[int, ...]], k: int) -> list[int]:
    """``counts[r - 1]``: steps whose first accepted child had rank ``r`` (of one-level K-child walks)."""
    counts = [0] * k
    for ranks in walks:
        if ranks:
            counts[ranks[0] - 1] += 1
    return counts
