"""One generation's decoding, step by step: the caches and committed tokens of an answer, its
prefill, and each step's draft, verify, accept and compact (:class:`Decoding`).

A step asks its per-step policies what to do: whether the target decodes it alone, timed
(:class:`~engine.core.timed_alone.TimedAlone`), which copies from the context to verify beside the
draft's tree (:class:`~engine.core.copy_policy.CopyPolicy`), and whether drafting pays on this
answer (:class:`~engine.core.draft_gate.DraftGate`).
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.core.acceptance_evidence import RankCounts
from engine.core.copy_policy import CopyPolicy
from engine.core.draft_gate import DraftGate
from engine.core.logprobs import committed_logprobs
from engine.core.prefill_progress import PrefillWork, prefill_weight
from engine.core.prefix_cache import ConversationCache
from engine.core.records import PrefillProgress, StepRecord, StepTimings
from engine.core.runner import synchronize
from engine.core.sampling import choose_level_children, logits_to_probs, top_indices
from engine.core.settings import ROOT_ONLY, DecodeSettings, TreeDecision
from engine.core.timed_alone import TimedAlone
from engine.core.verify import (
    JudgedRecorder,
    TraceRecorder,
    WalkRecorder,
    verify_greedy,
    verify_stochastic,
    verify_topk,
)
from engine.errors import GenerationCancelled
from engine.trees.copies import CopyProposal, MergedTree, merge_copies
from engine.trees.tree import Tree


@dataclass(frozen=True)
class DecodeParams:
    """One generation's checked settings with what the engine made of them: the tree decision,
    the stop tokens, the room the context leaves for copies, and whether the draft gate runs."""

    settings: DecodeSettings
    decision: TreeDecision
    stop_token_ids: frozenset[int]
    room: int | None = None  # nodes the context holds beyond prompt + answer + ``tree`` (None: no limit)
    gated: bool = False      # the optimizer's pick: a step drafts only while drafting pays (DraftGate)

    @property
    def tree(self) -> Tree:
        return self.decision.tree

    @property
    def confidence(self) -> float:
        return self.decision.confidence

    @property
    def copies(self) -> bool:
        return self.settings.copying

    def __getattr__(self, name: str):  # temperature, top_p, seed, method, greedy, max_new_tokens, logprobs, trace
        return getattr(self.settings, name)



class Decoding:
    """Caches and committed tokens of one generation.

    Invariants between steps: the target cache holds ``seq[:-1]`` (the root ``seq[-1]`` is fed
    in the next verification); the draft cache holds ``seq[:draft_len]`` and catches up on the
    rest in the next step's first draft forward.
    """

    def __init__(self, engine, prompt: list[int], params: DecodeParams, cache: ConversationCache | None = None,
                 timed_alone: TimedAlone | None = None) -> None:
        """``engine``: the :class:`~engine.core.speculative.SpeculativeEngine` whose models, runners
        and profile the steps use; ``timed_alone``: the policy that gives some steps to the target alone."""
        self.engine, self.params, self.cache, self.timed_alone = engine, params, cache, timed_alone
        choice, tree = params.decision.choice, params.tree
        # the per-step policies this generation's steps ask (None: off)
        expected = choice.expected_tokens if choice is not None and choice.tree == tree else 1.0 + 0.5 * tree.depth
        self.copies = CopyPolicy(prompt, params.settings.prediction, tree, expected,
                                 engine.copy_memory if params.greedy else None) if params.copies else None
        self.gate = DraftGate(choice.expected_tokens, choice.step_time_s, engine.profile.token_time()) \
            if params.gated else None
        self.seq = prompt
        self.prompt_len = len(prompt)
        drafting = engine.draft is not None and params.tree.depth > 0
        if cache is not None:
            self.target_runner = cache.runner("target")
            self.draft_runner = cache.runner("draft") if drafting else None
        else:
            self.target_runner = engine.runner("target", self)
            self.draft_runner = engine.runner("draft", self) if drafting else None
        if self.draft_runner is not None:
            self.draft_runner.model = draft_for_prompt(engine.draft, prompt)
        self.target_len = 0
        self.draft_len = 0
        self.draft_reading = False  # a long prompt's draft reads it between the first steps (_catch_up_draft)
        self.reused_tokens = 0  # prompt tokens the conversation cache held
        self.steps = 0
        self.generator = torch.Generator(device=engine.device).manual_seed(params.seed)
        self.finished = False

    @property
    def generated(self) -> int:
        return len(self.seq) - self.prompt_len

    def defers_draft(self) -> bool:
        """Whether the prefill leaves the draft's reading to the first steps: it has more than
        ``engine.draft_deferral`` prompt tokens to read, its conversation cache's prefix aside."""
        if self.draft_runner is None:
            return False
        prompt = self.seq[:-1]
        held = self.cache.held("draft", prompt) if self.cache is not None else 0
        return len(prompt) - held > self.engine.draft_deferral

    def prefill(self, should_stop: Callable[[], bool] | None = None,
                on_prefill: Callable[[PrefillProgress], None] | None = None) -> float:
        """Run the prompt minus its last token through the target, then the draft, in chunks of
        ``engine.prefill_chunk`` tokens (the same caches as one forward), consulting ``should_stop``
        before each chunk (raises :class:`GenerationCancelled`) and telling ``on_prefill`` after
        each; returns seconds.

        With a conversation cache, each model starts after the prefix its cache already holds,
        and the cache's record grows chunk by chunk (a stopped prefill leaves it valid). A draft
        with more than ``engine.draft_deferral`` tokens to read is left for the steps
        (:meth:`_catch_up_draft`)."""
        start = time.perf_counter()
        prompt = self.seq[:-1]
        runners = [(role, runner) for role, runner in (("target", self.target_runner), ("draft", self.draft_runner))
                   if runner is not None]
        deferred = self.defers_draft()
        firsts = {role: self.cache.reuse(role, prompt) if self.cache is not None else 0 for role, _ in runners}
        self.reused_tokens = firsts.get("target", 0)
        if deferred:
            runners = runners[:1]
            self.draft_len, self.draft_reading = firsts["draft"], True
        work = PrefillWork(prompt_tokens=len(prompt), start=start,
                            todo={role: len(prompt) - firsts[role] for role, _ in runners},
                            weights={role: prefill_weight(self.engine, role) for role, _ in runners})
        with torch.inference_mode():
            for role, runner in runners:
                # a streamed (offloaded) model pays one pass over its weights per forward: fewer, longer chunks
                chunk = max(1, int(self.engine.prefill_chunk)) * (16 if _streamed(runner.model) else 1)
                for begin in range(firsts[role], len(prompt), chunk):
                    check_stop(should_stop)
                    runner.forward(prompt[begin:begin + chunk], start=begin, logits_to_keep=1, eager=True)
                    if self.cache is not None:
                        self.cache.record(role, prompt[:begin + chunk])
                    if on_prefill is not None:
                        on_prefill(work.after(role, min(begin + chunk, len(prompt)) - firsts[role]))
            self.target_len = len(prompt)
            if self.draft_runner is not None and not self.draft_reading:
                self.draft_len = len(prompt)
        return time.perf_counter() - start

    def step(self) -> StepRecord:
        for runner in (self.target_runner, self.draft_runner):
            if getattr(runner, "owner", self) is not self:
                raise RuntimeError("another generation started on this engine and took its preallocated caches: "
                                   "with static_cache, finish (or drop) one generation before starting the next")
        timings = StepTimings()
        prefix = len(self.seq) - 1  # position of the root
        with torch.inference_mode():
            start, read_from = time.perf_counter(), self.draft_len
            catching_up = self._catch_up_draft()
            t0 = time.perf_counter()
            timings.reading_s = t0 - start if self.draft_len != read_from else 0.0
            proposals, drafting = self._plan_copies()
            timed = self._times_alone()
            if timed:
                proposals, drafting = [], False
            drafting = drafting and not catching_up
            paused = drafting and not proposals and self.gate is not None and not self.gate.drafts()
            drafting = drafting and not paused
            model_tree, tokens, draft_probs, draft_dists = self._draft_tree(self.params.tree if drafting else ROOT_ONLY)
            merged = merge_copies(model_tree, tokens, proposals)
            tree, tokens = merged.tree, merged.tokens
            if proposals:
                draft_probs, draft_dists = _merged_draft_probs(merged, draft_probs, draft_dists)
            t1 = time.perf_counter()
            target_logits = self.target_runner.forward(tokens, start=prefix, tail=tree.ancestor_matrix,
                                                       positions=tree.position_ids(prefix))
            synchronize(self.engine.device)  # so that verify_s is the forward's own time on a GPU
            t2 = time.perf_counter()
            target_dists = logits_to_probs(target_logits, self.params.temperature, self.params.top_p)
            recorder = TraceRecorder() if self.params.trace else JudgedRecorder()
            accepted, bonus = self._verify(tree, tokens, target_logits, target_dists, draft_dists, recorder,
                                           merged.copied)
            used = recorder.used
            target_probs = _child_probs(tree, tokens, target_dists)
            if self.copies is not None:
                self.copies.learn(merged, proposals, accepted, drafting and model_tree.size > 1)
            self._compact(model_tree, prefix, accepted, merged)
            committed = self._commit([tokens[a] for a in accepted[1:]] + [bonus])
            self._record()
            self._gate(paused, drafting and not proposals and model_tree.size > 1, model_tree, len(committed))
            scored = [] if self.params.logprobs is None else \
                committed_logprobs(target_logits, accepted, committed, self.params.logprobs)
            t3 = time.perf_counter()
        timings.draft_s, timings.verify_s, timings.bookkeeping_s = t1 - t0, t2 - t1, t3 - t2
        if self.copies is not None and self.params.greedy:  # sampled answers' trees depend on no clock: a seed
            self.copies.clock.observe(tree.size, timings.verify_s,  # gives the same answer every time
                                      timings.draft_s if drafting and model_tree.size > 1 else None)
        record = StepRecord(index=self.steps, tokens=tokens, parents=list(tree.parents), ranks=list(tree.ranks),
                            draft_probs=draft_probs, target_probs=target_probs, accepted=accepted,
                            committed=committed, timings=timings, finish_reason=self.finish_reason,
                            method=self.params.method, greedy=self.params.greedy,
                            verifier_p=[used[n][0] if n in used else None for n in range(len(tokens))],
                            verifier_q=[used[n][1] if n in used else None for n in range(len(tokens))],
                            trace=recorder.events if self.params.trace else None,
                            sources=merged.sources if proposals else [],
                            copy_origins=merged.origin if proposals else [], token_logprobs=scored,
                            draft_behind=len(self.seq) - 1 - self.draft_len if catching_up else 0,
                            draft_paused=paused, timed_alone=timed)
        if self.cache is not None and self.params.greedy:  # what the conversation's next answers are priced by
            self.cache.observe(self.prompt_len, RankCounts.of_step(record, grown=self.params.confidence > 0))
        self.steps += 1
        return record

    def _times_alone(self) -> bool:
        """Whether the timed-alone policy gives this step to the target alone (a step that could
        draft or copy: the target alone decodes every step of ``autoregressive``)."""
        return self.timed_alone is not None and self.timed_alone.applies(self.steps) and \
            (self.params.tree.depth > 0 or self.params.copies)

    def _catch_up_draft(self) -> bool:
        """While the draft has a long prompt left to read (:meth:`prefill` left it): it reads up to
        ``engine.draft_catch_up`` more tokens before this step, except before the first step (whose
        token waits for the target alone). Whether it is still behind: then this step drafts no tree."""
        if not self.draft_reading:
            return False
        if self.steps > 0:
            end = min(self.draft_len + self.engine.draft_catch_up, len(self.seq) - 1)
            self.draft_runner.forward(self.seq[self.draft_len:end], start=self.draft_len, logits_to_keep=1, eager=True)
            synchronize(self.engine.device)  # so that reading_s is the read's own time on a GPU
            self.draft_len = end
        self.draft_reading = self.draft_len < len(self.seq) - 1
        return self.draft_reading

    def _gate(self, paused: bool, drafted: bool, model_tree: Tree, committed: int) -> None:
        """Tell the draft gate (tree="auto") how this step went: paused, or the draft's tree alone
        (copies aside) drafted ``model_tree`` and committed ``committed`` tokens."""
        if self.gate is None:
            return
        if paused:
            self.gate.pause()
        elif drafted:
            self.gate.observe(committed, model_tree, model_tree.size, self.engine.profile)

    def _plan_copies(self) -> tuple[list[CopyProposal], bool]:
        """This step's copied continuations (possibly none) and whether the draft model drafts too."""
        if self.copies is None:
            return [], True
        return self.copies.plan(self.seq, self.params.tree, self.params.room, self.params.stop_token_ids,
                                self.engine.copy_branches, self.engine.profile)

    # ----- drafting -----------------------------------------------------------------------
    def _draft_tree(self, tree: Tree) -> tuple[Tree, list[int], list[float], dict[int, torch.Tensor]]:
        """Expand ``tree`` level by level with the draft, growing below a node only while its path
        confidence (the product of the draft's q along the path, root = 1) reaches
        ``params.confidence``; a level none of whose nodes grows is not drafted at all.

        Nothing grows below a stop token either (an accepted one ends the answer).

        Returns the tree actually drafted (``tree`` itself when nothing was cut; a node keeps all
        its children or none), its node tokens, q(token | parent) per node, and the draft
        distribution ``[V]`` each node's children were drawn from (nodes with children only).
        The cut depends on the draft alone, never on the target, so verification stays exact.
        """
        tokens, probs, dists = [self.seq[-1]], [1.0], {}
        if tree.depth == 0:
            return tree, tokens, probs, dists
        runner, threshold = self.draft_runner, self.params.confidence
        # Catch-up: committed tokens the draft has not seen yet, the root last.
        level_logits = runner.forward(self.seq[self.draft_len:], start=self.draft_len, logits_to_keep=1)
        self.draft_len = len(self.seq)
        full_id, parents, confidence = [0], [-1], [1.0]  # per drafted node: its node in ``tree``, parent, path q

        def grows(node: int) -> bool:  # a stop token ends the answer: nothing below it could be used
            return bool(tree.children[full_id[node]]) and confidence[node] >= threshold and \
                (node == 0 or tokens[node] not in self.params.stop_token_ids)

        level = [0]  # the drafted nodes whose draft logits are ``level_logits``' rows
        while True:
            level_probs = logits_to_probs(level_logits, self.params.temperature, self.params.top_p)
            growing = [row for row, node in enumerate(level) if grows(node)]
            counts = [len(tree.children[full_id[level[row]]]) for row in growing]
            drawn = choose_level_children(level_probs, growing, counts, self.params.method, self.params.greedy,
                                          self.generator)
            rows, new_level = [], []
            for row, chosen in zip(growing, drawn):
                node = level[row]
                dists[node] = level_probs[row]
                for child, token in zip(tree.children[full_id[node]], chosen):
                    full_id.append(child)
                    parents.append(node)
                    tokens.append(token)
                    rows.append(row)
                    new_level.append(len(tokens) - 1)
            q = level_probs[rows, tokens[new_level[0]:]].tolist()  # one sync
            probs.extend(q)
            confidence.extend(confidence[parents[node]] * p for node, p in zip(new_level, q))
            level = new_level
            if not any(grows(node) for node in level):
                break  # nothing grows below this level: it is the last one
            drafted = _tree_of(tuple(parents))
            nodes = slice(level[0], level[-1] + 1)
            # the draft cache holds seq, then drafted nodes 1.. in order: this level goes after them
            level_logits = runner.forward(tokens[nodes], start=len(self.seq) + nodes.start - 1,
                                          tail=drafted.ancestor_matrix[nodes, 1:nodes.stop],
                                          positions=drafted.position_ids(len(self.seq) - 1, nodes=nodes))
        drafted = tree if len(parents) == tree.size else _tree_of(tuple(parents))
        return drafted, tokens, probs, dists

    def _verify(self, tree: Tree, tokens: list[int], target_logits: torch.Tensor, target_dists: torch.Tensor,
                draft_dists: dict[int, torch.Tensor], recorder: WalkRecorder,
                copied: frozenset[int] = frozenset()) -> tuple[list[int], int]:
        """Accepted path and bonus token, by the method's rule; ``recorder`` is told every decision."""
        if self.params.greedy:
            return verify_greedy(tree, tokens, [row[0] for row in top_indices(target_logits, 1)], recorder,
                                 target_dists, draft_dists)
        if self.params.method == "topk":
            return verify_topk(tree, tokens, target_dists, self.generator, recorder, draft_dists)
        return verify_stochastic(tree, tokens, target_dists, draft_dists,
                                 without_replacement=self.params.method != "specinfer", generator=self.generator,
                                 recorder=recorder, copied=copied)

    # ----- bookkeeping --------------------------------------------------------------------
    def _compact(self, model_tree: Tree, prefix: int, accepted: list[int], merged: MergedTree) -> None:
        """Keep prefix + accepted path in the target cache, and the accepted nodes the draft saw
        (``model_tree``'s nodes above its last level; copied nodes never went through the draft)."""
        self.target_runner.compact(prefix, accepted)
        self.target_len = prefix + len(accepted)
        if model_tree.depth > 0:
            drafted = [merged.model_node[a] for a in accepted[1:] if merged.model_node[a] > 0]
            seen_by_draft = [m - 1 for m in drafted if model_tree.depths[m] < model_tree.depth]
            self.draft_runner.compact(prefix + 1, seen_by_draft)
            self.draft_len = prefix + 1 + len(seen_by_draft)

    def _record(self) -> None:
        """Tell the conversation cache (if any) which committed tokens its slots now hold: the
        accepted path may run past a stop token, so at most ``seq`` itself."""
        if self.cache is None:
            return
        self.cache.record("target", self.seq[:min(self.target_len, len(self.seq))])
        if self.draft_runner is not None:
            self.cache.record("draft", self.seq[:min(self.draft_len, len(self.seq))])

    def _commit(self, candidates: list[int]) -> list[int]:
        """Append tokens up to the first stop token or the budget; sets ``finish_reason``."""
        committed = []
        self.finish_reason = None
        for token in candidates:
            committed.append(token)
            if token in self.params.stop_token_ids:
                self.finish_reason = "stop"
                break
            if self.generated + len(committed) >= self.params.max_new_tokens:
                self.finish_reason = "length"
                break
        self.seq = self.seq + committed
        self.finished = self.finish_reason is not None
        return committed


@functools.lru_cache(maxsize=512)
def _tree_of(parents: tuple[int, ...]) -> Tree:
    """The tree of a breadth-first parent array, built once (its masks are cached on it)."""
    return Tree(parents)


def _merged_draft_probs(merged: MergedTree, probs: list[float], dists: dict[int, torch.Tensor]
                        ) -> tuple[list[float], dict[int, torch.Tensor]]:
    """The draft's q per merged node (1.0 for copied ones: their point-mass q) and its distributions
    ``[V]`` keyed by merged node."""
    where = {m: i for i, m in enumerate(merged.model_node) if m >= 0}
    return ([probs[m] if m >= 0 else 1.0 for m in merged.model_node],
            {where[m]: d for m, d in dists.items()})


def _child_probs(tree: Tree, tokens: list[int], parent_probs: torch.Tensor) -> list[float]:
    """``parent_probs[parent(i), tokens[i]]`` for every node; 1.0 for the root."""
    if tree.size == 1:
        return [1.0]
    parents = torch.tensor(tree.parents[1:])
    children = torch.tensor(tokens[1:])
    return [1.0] + parent_probs[parents, children].tolist()


def check_stop(should_stop: Callable[[], bool] | None) -> None:
    if should_stop is not None and should_stop():
        raise GenerationCancelled("generation stopped on request")


def _streamed(model: torch.nn.Module) -> bool:
    return getattr(model, "_layer_streamer", None) is not None


def draft_for_prompt(draft: torch.nn.Module, prompt: list[int]) -> torch.nn.Module:
    """The model to draft ``prompt``'s answer with: ``draft``, or the one its ``draft_for_prompt``
    chooses (a draft whose head computes a sub-vocabulary drafts a prompt mostly outside it with
    the whole head: :mod:`engine.backends.draft_vocabulary`). Both share every layer, so their
    KV caches are interchangeable; the choice depends on the prompt alone, so exactness is kept."""
    choose = draft.__dict__.get("draft_for_prompt")
    return draft if choose is None else choose(prompt)
