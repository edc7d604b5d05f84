"""The decoding loop: draft a token tree level by level, verify it in one target forward, commit.

The engine knows nothing of text: it takes and returns token ids. ``tree=None`` (or a root-only
tree) is plain autoregressive decoding of the target through the same code path.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from engine.core.copy_policy import CopyStats, StepClock, plan_step
from engine.core.draft_gate import DraftGate
from engine.core.logprobs import check_logprobs, committed_logprobs
from engine.core.prefill_progress import PrefillWork, prefill_weight
from engine.core.prefix_cache import ConversationCache
from engine.core.records import GenerationResult, PrefillProgress, StepRecord, StepTimings
from engine.core.runner import DynamicRunner, StaticRunner, run_model, synchronize
from engine.core.sampling import choose_level_children, logits_to_probs, top_indices
from engine.core.verify import verify_greedy, verify_stochastic, verify_topk
from engine.errors import ContextOverflowError, GenerationCancelled, InvalidParameterError, VocabularyMismatchError
from engine.trees.copies import SOURCE_COPY, ContextIndex, CopyProposal, MergedTree, merge_copies
from engine.trees.tree import Tree

ROOT_ONLY = Tree.chain(0)
METHODS = ("sequoia", "specinfer", "chain", "topk", "autoregressive")
COPY_METHODS = ("sequoia", "specinfer", "topk")  # verifiers that take copied children (and T = 0)
MAX_COPY = 32        # copied tokens verified in one step at most
PREDICTION_LEAD = 8  # prompt tokens put before an expected output, so its start matches the prompt's end


@dataclass(frozen=True)
class DecodeParams:
    """Validated generation parameters."""

    max_new_tokens: int
    temperature: float
    top_p: float
    tree: Tree
    seed: int
    stop_token_ids: frozenset[int]
    method: str = "sequoia"
    trace: bool = False  # record every decision of the acceptance walk in StepRecord.trace
    confidence: float = 0.0  # grow the tree below a node only while the draft's q along its path reaches this
    copies: bool = False  # propose continuations copied from the context beside the draft's tree
    room: int | None = None  # nodes the context holds beyond prompt + answer + ``tree`` (None: no limit)
    logprobs: int | None = None  # report each committed token's logprob and this many alternatives (None: off)
    gated: bool = False  # the optimizer's pick (tree="auto"): a step drafts only while drafting pays (DraftGate)
    time_alone_every: int = 0  # step 2 and every n-th after it (n >= 2): the target alone, timed (0: never)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SpeculativeEngine:
    """Tree speculative decoding for a target/draft pair of HF causal LMs sharing a vocabulary."""

    prefill_chunk = 256  # prompt tokens per prefill forward; ``should_stop`` is consulted between chunks
    # A draft with more prompt tokens to read than this reads none before the first token: the
    # first token then waits for the target's prefill alone, and the draft reads ``draft_catch_up``
    # tokens before each later step until it is level (those steps verify copies or the root alone;
    # a prefill-sized read keeps its cost near the up-front prefill's, with few such steps).
    draft_deferral = 256
    draft_catch_up = 256
    copy_branches = 1    # distinct copied continuations a step verifies at most (each costs its rows)
    gate_drafts = True   # tree="auto" drafts only while the answer's own steps say it pays (core.draft_gate)

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module | None = None,
                 stop_token_ids: list[int] | None = None, tuner=None, static_cache: bool | None = None,
                 cuda_graphs: bool | None = None, max_cache_len: int | None = None) -> None:
        """``tuner``: an :class:`engine.tuning.optimizer.AutoTuner`, needed for ``tree="auto"``.

        ``static_cache`` preallocates both KV caches once (``max_cache_len`` slots, default the
        target's context capped at 8192) and reuses them for every generation; ``cuda_graphs``
        replays one CUDA graph per forward width. Both default to on for CUDA models, off on CPU.

        The engine never changes the models it is given: their weights and forward stay as
        they were. The CPU fast path (oneDNN-packed linears, :func:`engine.backends.kernels.prepare`) is a
        step the caller takes before, as :func:`engine.models.loading.load_pair` does."""
        for model in (target, draft):
            if model is not None:
                _refuse_sliding_window(model)
        self.target = target.eval()
        self.tuner = tuner
        self.last_tree_choice = None
        self.last_reused_tokens = 0  # prompt tokens the last generation took from a conversation cache
        self.last_draft_deferred = False  # whether the last generation's draft reads its prompt after the first token
        self.draft = draft.eval() if draft is not None else None
        self.vocab_size = _output_vocab(target)
        if draft is not None and _output_vocab(draft) != self.vocab_size:
            raise VocabularyMismatchError(
                f"the draft predicts {_output_vocab(draft)} tokens but the target {self.vocab_size}: "
                f"choose a draft from the same model family as the target")
        self.stop_token_ids = _stop_set(stop_token_ids) if stop_token_ids is not None else \
            frozenset(_default_stop_ids(target))
        self.max_context = int(getattr(target.config, "max_position_embeddings", 0) or 0)
        self.device = next(target.parameters()).device
        on_cuda = self.device.type == "cuda"
        self.static_cache = on_cuda if static_cache is None else bool(static_cache)
        self.cuda_graphs = self.static_cache and (on_cuda if cuda_graphs is None else bool(cuda_graphs))
        self.max_cache_len = int(max_cache_len or min(self.max_context or 8192, 8192))
        self._static_runners: dict[str, StaticRunner] = {}
        # acceptance of copied continuations and the draft tree's tokens per step, measured while
        # decoding (kept across generations: a conversation's later turns start from them)
        self.copy_stats = CopyStats()
        self.model_tokens: dict[tuple, float] = {}

    def runner(self, role: str, owner: object):
        """The runner of ``"target"`` or ``"draft"`` for one generation ``owner``: the engine's
        preallocated static runner (now owned by ``owner``) or a fresh dynamic one."""
        model = self.target if role == "target" else self.draft
        if not self.static_cache:
            return DynamicRunner(model)
        if role not in self._static_runners:
            self._static_runners[role] = StaticRunner(model, self.max_cache_len, self.cuda_graphs and graphable(model))
        runner = self._static_runners[role]
        runner.owner = owner
        return runner

    # ----- public API ---------------------------------------------------------------------
    def generate(self, input_ids: list[int], **kwargs) -> GenerationResult:
        """Decode up to ``max_new_tokens`` tokens; see :meth:`stream` for the arguments."""
        steps, tokens, prefill_s = [], [], 0.0
        stream = self.stream(input_ids, **kwargs)
        for step in stream:
            steps.append(step)
            tokens.extend(step.committed)
            prefill_s = self.last_prefill_s
        return GenerationResult(tokens=tokens, steps=steps, prompt_tokens=len(input_ids),
                                prefill_s=prefill_s + sum(s.timings.reading_s for s in steps),
                                finish_reason=steps[-1].finish_reason or "length")

    def stream(self, input_ids: list[int], max_new_tokens: int = 64, temperature: float = 0.0,
               top_p: float = 1.0, tree: Tree | str | None = None, seed: int = 0,
               stop_token_ids: list[int] | None = None, method: str = "sequoia",
               should_stop: Callable[[], bool] | None = None,
               cache: ConversationCache | None = None, trace: bool = False,
               confidence: float | None = None, copies: bool = False,
               prediction: list[int] | None = None, logprobs: int | None = None,
               on_prefill: Callable[[PrefillProgress], None] | None = None,
               time_alone_every: int = 0) -> Iterator[StepRecord]:
        """Yield one :class:`StepRecord` per draft/verify step until a stop token or the budget.

        ``input_ids``: the prompt (non-empty list of token ids). ``tree=None`` decodes with the
        target alone. ``temperature == 0`` is greedy and token-identical to the target's own
        greedy decoding; ``temperature > 0`` samples exactly from the target's distribution
        (after temperature and top-p) with the verifier of ``method``:

        - ``sequoia``: children drawn without replacement, residual verification with q renormalised;
        - ``specinfer``: children drawn i.i.d. (with replacement), q never renormalised;
        - ``chain``: classic speculative sampling (the tree must be a chain);
        - ``topk``: children are the draft's top-k, the target samples and matches;
        - ``autoregressive``: the target alone (the tree is ignored).

        ``tree="auto"`` lets the hardware-aware optimizer choose (needs ``tuner``). Parameters are
        validated here, before the first step, so bad input raises at call time.

        ``should_stop``: called before every prefill chunk (``prefill_chunk`` prompt tokens) and
        every step; when it returns true the iteration raises :class:`GenerationCancelled`, so a
        long prompt can be stopped within one chunk.

        ``cache``: a :class:`~engine.core.prefix_cache.ConversationCache` of this engine's models kept
        from earlier turns: the prompt's longest common prefix with the tokens it holds is not
        prefilled again (``last_reused_tokens`` says how many), and it holds this generation's
        tokens afterwards. Without it the engine's own caches are used and nothing is kept.

        ``trace``: each step's record carries every decision of the acceptance walk
        (:class:`~engine.core.records.VerifierEvent`: the child tried, the uniform drawn, the p and q it
        was judged on, the top tokens of p, q and the residual). It costs no model run and draws
        no randomness: the tokens are the same with it or without it. Off, nothing is recorded.

        ``confidence`` in [0, 1]: each step drafts below a node of ``tree`` only while the product
        of the draft's probabilities along its path reaches it, so confident stretches get deep
        trees and uncertain ones stop early (the tree in each record is the one drafted). It
        depends on the draft alone, so exactness is kept. ``None``: 0 (the whole tree every step),
        or the optimizer's threshold with ``tree="auto"``.

        ``copies``: each step also proposes continuations of the text copied from the context (the
        prompt and the answer so far: :mod:`engine.trees.copies`), verified as branches beside the
        draft's, and skips the draft model while a copy is expected to pay more
        (:func:`engine.core.copy_policy.plan_step`). ``prediction``: token ids of an expected
        output, copied from in the same way (it implies ``copies``). Neither changes the law of
        the output; both are ignored by ``chain`` and ``autoregressive``.

        ``on_prefill``: called with a :class:`~engine.core.records.PrefillProgress` after every
        prefill chunk (a long prompt's "reading your message" bar); it cannot change the output.

        ``logprobs`` in [0, 20]: each record's ``token_logprobs`` holds, per committed token, the
        target's log-probability of it and of its ``logprobs`` most likely alternatives, read from
        the verification row that predicted it as the log_softmax of the raw logits (temperature
        1, no top-p: what the model says, whatever the sampling settings; llama-server and vLLM
        report the same by default). It draws no randomness and changes no decision. ``None``:
        off, and nothing is computed.

        ``time_alone_every`` n >= 2: the second step and every n-th after it (indices 1, n + 1,
        2n + 1, ...: a short answer gets its share too) decode with the target alone (no draft, no
        copies; ``timed_alone`` in their records), so that an answer carries its own timing of the
        target alone, taken under whatever load it decoded under (a page drawing, another program),
        to measure its speed-up against. It changes what those steps verify, never the law of the
        output. 0 (the default): never.
        """
        check_time_alone_every(time_alone_every)
        params = self._validate(input_ids, max_new_tokens, temperature, top_p, tree, seed, stop_token_ids, method,
                                confidence)
        if prediction is not None and not (isinstance(prediction, (list, tuple)) and self._token_ids(prediction)):
            raise InvalidParameterError(f"prediction must be a list of token ids in [0, {self.vocab_size})")
        if (copies or prediction) and method in COPY_METHODS:
            params = dataclasses.replace(params, copies=True)
        if trace:
            params = dataclasses.replace(params, trace=True)
        if time_alone_every:
            params = dataclasses.replace(params, time_alone_every=time_alone_every)
        if logprobs is not None:
            params = dataclasses.replace(params, logprobs=check_logprobs(logprobs))
        if params.tree.depth > 0 and self.draft is None:
            raise InvalidParameterError("a tree with draft tokens needs a draft model: pass draft= or use tree=None")
        if cache is not None and not (isinstance(cache, ConversationCache) and cache.belongs_to(self.target, self.draft)):
            raise InvalidParameterError("cache must be a ConversationCache built for this engine's target and draft")
        self.last_reused_tokens = 0
        state = _DecodeState(self, list(input_ids), params, cache, prediction)
        self.last_draft_deferred = state.defers_draft()
        return self._steps(state, should_stop, on_prefill)

    def _steps(self, state: "_DecodeState", should_stop: Callable[[], bool] | None = None,
               on_prefill: Callable[[PrefillProgress], None] | None = None) -> Iterator[StepRecord]:
        self.last_prefill_s = state.prefill(should_stop, on_prefill)
        while not state.finished:
            _check_stop(should_stop)
            yield state.step()

    # ----- validation -----------------------------------------------------------------------
    def _token_ids(self, ids) -> bool:
        """Whether every item of ``ids`` is a token id of this engine's vocabulary."""
        return not any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids)

    def _validate(self, input_ids, max_new_tokens, temperature, top_p, tree, seed, stop_token_ids,
                  method: str = "sequoia", confidence: float | None = None) -> DecodeParams:
        if not isinstance(input_ids, (list, tuple)) or len(input_ids) == 0:
            raise InvalidParameterError("input_ids must be a non-empty list of token ids (the prompt is empty)")
        if not self._token_ids(input_ids):
            raise InvalidParameterError(f"input_ids must be integers in [0, {self.vocab_size})")
        check_params(max_new_tokens, temperature, top_p, seed, method)
        threshold = check_confidence(confidence)
        auto = isinstance(tree, str) and tree == "auto"
        if auto:
            tree = self._auto_tree(temperature, top_p, method)
            if confidence is None:
                threshold = self.last_tree_choice.confidence
        tree = tree if tree is not None and method != "autoregressive" else ROOT_ONLY
        if not isinstance(tree, Tree):
            raise InvalidParameterError(f"tree must be an engine.Tree or None, got {type(tree).__name__}")
        if method == "chain" and tree.size != tree.depth + 1:
            raise InvalidParameterError("method 'chain' needs a chain tree: use Tree.chain(depth)")
        needed = len(input_ids) + max_new_tokens + tree.size
        limit, what = (self.max_context, "the target's context") if self.max_context else (0, "")
        if self.static_cache and (not limit or self.max_cache_len < limit):
            limit, what = self.max_cache_len, "the static KV cache (max_cache_len)"
        if limit and needed > limit:
            raise ContextOverflowError(
                f"prompt ({len(input_ids)} tokens) + max_new_tokens ({max_new_tokens}) + tree ({tree.size}) "
                f"exceeds {what} of {limit} tokens: shorten the prompt or lower max_new_tokens")
        stops = _stop_set(stop_token_ids) if stop_token_ids is not None else self.stop_token_ids
        return DecodeParams(max_new_tokens, float(temperature), float(top_p), tree, seed, stops, method,
                            confidence=threshold, room=limit - needed if limit else None,
                            gated=auto and self.gate_drafts and tree.depth > 0)


    def _auto_tree(self, temperature: float, top_p: float, method: str) -> Tree:
        """The hardware-aware optimizer's tree for this setting that ``method`` verifies (kept in
        ``last_tree_choice``)."""
        if self.tuner is None:
            raise InvalidParameterError("tree='auto' needs a calibration and a hardware profile: build the engine "
                                        "with tuner=engine.tuning.optimizer.AutoTuner(...) (see python -m engine.cli.profile)")
        self.last_tree_choice = self.tuner.choose(temperature, top_p, method)
        return self.last_tree_choice.tree


class _DecodeState:
    """Caches and committed tokens of one generation.

    Invariants between steps: the target cache holds ``seq[:-1]`` (the root ``seq[-1]`` is fed
    in the next verification); the draft cache holds ``seq[:draft_len]`` and catches up on the
    rest in the next step's first draft forward.
    """

    def __init__(self, engine: SpeculativeEngine, prompt: list[int], params: DecodeParams,
                 cache: ConversationCache | None = None, prediction: list[int] | None = None) -> None:
        self.engine, self.params, self.cache = engine, params, cache
        self.index = ContextIndex() if params.copies else None
        self.clock = StepClock()  # this generation's measured step costs (its context length's)
        self.gate = None
        if params.gated:  # the pick this generation decodes with is the engine's last choice
            choice = engine.last_tree_choice
            self.gate = DraftGate(choice.expected_tokens, choice.step_time_s, engine.tuner.profile.token_time())
        if self.index is not None:
            self.index.sync(prompt)
            if prediction:
                self.index.add_document(list(prompt[-PREDICTION_LEAD:]) + list(prediction))
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
        self.engine.last_reused_tokens = firsts.get("target", 0)
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
                    _check_stop(should_stop)
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
            used: dict[int, tuple[float, float | None]] = {}
            trace = [] if self.params.trace else None
            accepted, bonus = self._verify(tree, tokens, target_logits, target_dists, draft_dists, used, trace,
                                           merged.copied)
            target_probs = _child_probs(tree, tokens, target_dists)
            self._learn(merged, proposals, accepted, drafting)
            self._compact(model_tree, prefix, accepted, merged)
            committed = self._commit([tokens[a] for a in accepted[1:]] + [bonus])
            self._record()
            self._gate(paused, drafting and not proposals and model_tree.size > 1, model_tree, len(committed))
            scored = [] if self.params.logprobs is None else \
                committed_logprobs(target_logits, accepted, committed, self.params.logprobs)
            t3 = time.perf_counter()
        timings.draft_s, timings.verify_s, timings.bookkeeping_s = t1 - t0, t2 - t1, t3 - t2
        if self.index is not None:
            self.clock.observe(tree.size, timings.verify_s, timings.draft_s if drafting and model_tree.size > 1 else None)
        record = StepRecord(index=self.steps, tokens=tokens, parents=list(tree.parents), ranks=list(tree.ranks),
                            draft_probs=draft_probs, target_probs=target_probs, accepted=accepted,
                            committed=committed, timings=timings, finish_reason=self.finish_reason,
                            method=self.params.method, greedy=self.params.greedy,
                            verifier_p=[used[n][0] if n in used else None for n in range(len(tokens))],
                            verifier_q=[used[n][1] if n in used else None for n in range(len(tokens))],
                            trace=trace, sources=merged.sources if proposals else [],
                            copy_origins=merged.origin if proposals else [], token_logprobs=scored,
                            draft_behind=len(self.seq) - 1 - self.draft_len if catching_up else 0,
                            draft_paused=paused, timed_alone=timed)
        self.steps += 1
        return record

    def _times_alone(self) -> bool:
        """Whether this step is one that ``time_alone_every`` gives to the target alone (a step
        that could draft or copy: the target alone decodes every step of ``autoregressive``)."""
        params = self.params
        every = params.time_alone_every
        return every > 1 and self.steps % every == 1 and (params.tree.depth > 0 or params.copies)

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
            self.gate.observe(committed, model_tree, model_tree.size, self.engine.tuner.profile)

    # ----- copies from the context ---------------------------------------------------------
    def _plan_copies(self) -> tuple[list[CopyProposal], bool]:
        """This step's copied continuations (possibly none) and whether the draft model drafts too."""
        tree = self.params.tree
        if self.index is None:
            return [], True
        self.index.sync(self.seq)
        branches = self.engine.copy_branches
        room = MAX_COPY if self.params.room is None else min(MAX_COPY, self.params.room // branches)
        proposals = self.index.lookup(room, branches, self.params.stop_token_ids) if room > 0 else []
        if not proposals:
            return [], True
        engine = self.engine
        plan = plan_step(engine.copy_stats, proposals[0].match_len, len(proposals[0].tokens), tree,
                         self._model_tokens(), getattr(engine.tuner, "profile", None), self.clock)
        if plan.copy_len == 0:
            return [], True
        return [dataclasses.replace(p, tokens=p.tokens[:plan.copy_len]) for p in proposals], plan.draft

    def _model_tokens(self) -> float:
        """Expected tokens per step of the draft's tree alone: measured on earlier steps, else the
        optimizer's prediction, else one per level half the time."""
        tree = self.params.tree
        key = (tree.parents, self.params.temperature, self.params.top_p)
        if key not in self.engine.model_tokens:
            choice = self.engine.last_tree_choice
            prior = choice.expected_tokens if choice is not None and choice.tree == tree else 1.0 + 0.5 * tree.depth
            self.engine.model_tokens[key] = prior
        return self.engine.model_tokens[key]

    def _learn(self, merged: MergedTree, proposals: list[CopyProposal], accepted: list[int], drafting: bool) -> None:
        """Count what the copies and the draft's tree gave this step (the verifier tries the
        copies first, in order, and stops at the first whose first token it keeps)."""
        kept = set(accepted)
        if proposals:
            for proposal, chain in zip(proposals, merged.chains):
                taken = sum(1 for node in chain if node in kept)
                self.engine.copy_stats.observe(proposal.match_len, len(chain), taken)
                if taken:
                    break
        if drafting and self.params.tree.depth > 0 and not any(merged.sources[a] == SOURCE_COPY for a in accepted):
            key = (self.params.tree.parents, self.params.temperature, self.params.top_p)
            drafted = sum(1 for a in accepted[1:] if merged.model_node[a] > 0)
            self.engine.model_tokens[key] = 0.9 * self._model_tokens() + 0.1 * (1 + drafted)

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
                draft_dists: dict[int, torch.Tensor], used: dict, trace: list | None = None,
                copied: frozenset[int] = frozenset()) -> tuple[list[int], int]:
        """Accepted path and bonus token; ``used`` gets what each tried child was judged on, ``trace``
        (when a list) every decision of the walk."""
        if self.params.greedy:
            return verify_greedy(tree, tokens, [row[0] for row in top_indices(target_logits, 1)], trace, target_dists,
                                 draft_dists)
        if self.params.method == "topk":
            return verify_topk(tree, tokens, target_dists, self.generator, used, trace, draft_dists)
        return verify_stochastic(tree, tokens, target_dists, draft_dists,
                                 without_replacement=self.params.method != "specinfer", generator=self.generator,
                                 used=used, trace=trace, copied=copied)

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


def forward(model, cache, token_ids: list[int], start: int, mask: torch.Tensor | None = None,
             positions: torch.Tensor | None = None, logits_to_keep: int = 0) -> torch.Tensor:
    """One forward of ``token_ids`` after ``start`` cached positions; float32 logits ``[q, V]``.

    Without ``mask`` the tokens are a causal chunk at positions ``start..start+q-1``; with it,
    ``mask [1, 1, q, cache_len + q]`` and ``positions [1, q]`` describe tree attention.
    """
    device = next(model.parameters()).device
    ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    if positions is None:
        positions = torch.arange(start, start + len(token_ids))[None]
    return run_model(model, cache, ids, positions.to(device),
                     None if mask is None else mask.to(device=device, dtype=model.dtype), logits_to_keep)


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


def _check_stop(should_stop: Callable[[], bool] | None) -> None:
    if should_stop is not None and should_stop():
        raise GenerationCancelled("generation stopped on request")


def _streamed(model: torch.nn.Module) -> bool:
    return getattr(model, "_layer_streamer", None) is not None


def graphable(model: torch.nn.Module) -> bool:
    """CUDA graphs need the whole model on one GPU and no host-side hooks: not for targets split
    with ``device_map`` or streamed from the host (those run eagerly)."""
    streamed = getattr(model, "_layer_streamer", None) is not None
    devices = set(getattr(model, "hf_device_map", {}).values())
    return not streamed and len(devices) <= 1


def check_params(max_new_tokens: int, temperature: float, top_p: float, seed: int, method: str) -> None:
    """Raise :class:`InvalidParameterError` for out-of-range scalar generation parameters."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InvalidParameterError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not _is_number(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise InvalidParameterError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise InvalidParameterError(f"top_p must be in (0, 1], got {top_p!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidParameterError(f"seed must be an integer, got {seed!r}")
    if method not in METHODS:
        raise InvalidParameterError(f"method must be one of {', '.join(METHODS)}, got {method!r}")


def check_confidence(confidence: float | None) -> float:
    """The growth threshold as a float in [0, 1] (``None``: 0); else :class:`InvalidParameterError`."""
    if confidence is None:
        return 0.0
    if not _is_number(confidence) or not 0.0 <= confidence <= 1.0:
        raise InvalidParameterError(f"confidence must be a number in [0, 1] (0 = the whole tree), got {confidence!r}")
    return float(confidence)


def check_time_alone_every(every) -> None:
    """Raise :class:`InvalidParameterError` unless ``every`` is 0 (never) or an integer >= 2."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 0 or every == 1:
        raise InvalidParameterError(f"time_alone_every must be 0 (never) or an integer >= 2, got {every!r}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _stop_set(stop_token_ids) -> frozenset[int]:
    if isinstance(stop_token_ids, (str, bytes)) or not hasattr(stop_token_ids, "__iter__") or \
            any(isinstance(t, bool) or not isinstance(t, int) for t in stop_token_ids):
        raise InvalidParameterError(f"stop_token_ids must be a list of token ids, got {stop_token_ids!r}")
    return frozenset(stop_token_ids)


def draft_for_prompt(draft: torch.nn.Module, prompt: list[int]) -> torch.nn.Module:
    """The model to draft ``prompt``'s answer with: ``draft``, or the one its ``draft_for_prompt``
    chooses (a draft whose head computes a sub-vocabulary drafts a prompt mostly outside it with
    the whole head: :mod:`engine.backends.draft_vocabulary`). Both share every layer, so their
    KV caches are interchangeable; the choice depends on the prompt alone, so exactness is kept."""
    choose = draft.__dict__.get("draft_for_prompt")
    return draft if choose is None else choose(prompt)


def _refuse_sliding_window(model: torch.nn.Module) -> None:
    """Tree verification keeps every prefix position; sliding-window caches drop them."""
    config = model.config
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise InvalidParameterError(
            f"{type(model).__name__} uses sliding-window attention, which tree verification does not support "
            f"yet: choose a model with full attention")


def _output_vocab(model: torch.nn.Module) -> int:
    head = model.get_output_embeddings()
    return int(getattr(head, "out_features", 0) or head.weight.shape[0])


def _default_stop_ids(model: torch.nn.Module) -> list[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
