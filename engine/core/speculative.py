"""The decoding loop: draft a token tree level by level, verify it in one target forward, commit.

The engine knows nothing of text: it takes and returns token ids. What to decode with is one
:class:`~engine.core.settings.DecodeSettings`; the tree comes from the one decision,
:func:`~engine.core.settings.decide_tree`, and :meth:`SpeculativeEngine.stream` hands back a
:class:`Generation` that says what it decoded with and yields one record a step.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch

from engine.core.acceptance_evidence import RankCounts
from engine.core.copy_policy import CopyMemory
from engine.core.prefix_cache import ConversationCache
from engine.core.records import GenerationResult, PrefillProgress, StepRecord
from engine.core.runner import DynamicRunner, StaticRunner, run_model
from engine.core.settings import DecodeSettings, Planner, TreeDecision, decide_tree, settings_from
from engine.core.step import DecodeParams, Decoding, check_stop
from engine.core.timed_alone import TimedAlone
from engine.errors import ContextOverflowError, InvalidParameterError, VocabularyMismatchError
from engine.trees.tree import Tree



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
                 stop_token_ids: list[int] | None = None, planner: Planner | None = None,
                 static_cache: bool | None = None, cuda_graphs: bool | None = None,
                 max_cache_len: int | None = None) -> None:
        """``planner``: an :class:`engine.tuning.planner.TreePlanner` (the pair's calibration and this
        machine's profile), needed for trees named by size or ``"auto"``.

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
        self.planner = planner
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
        self.copy_memory = CopyMemory()  # what greedy answers learnt about copies (sampled ones start afresh)

    @property
    def profile(self):
        """The hardware profile that prices steps (the planner's; None without one)."""
        return getattr(self.planner, "profile", None)

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
    def generate(self, input_ids: list[int], settings: DecodeSettings | None = None, **options) -> GenerationResult:
        """Decode a whole answer; the arguments are :meth:`stream`'s."""
        return self.stream(input_ids, settings, **options).collect()

    def stream(self, input_ids: list[int], settings: DecodeSettings | None = None, *,
               should_stop: Callable[[], bool] | None = None, cache: ConversationCache | None = None,
               on_prefill: Callable[[PrefillProgress], None] | None = None,
               timed_alone: TimedAlone | None = None, **setting_values) -> "Generation":
        """A :class:`Generation` of ``input_ids`` (a non-empty list of token ids), checked now so bad
        input raises at call time: iterate it for one :class:`StepRecord` per step.

        ``settings``: a :class:`~engine.core.settings.DecodeSettings` (default: the app's defaults);
        keyword arguments named as its fields (``max_new_tokens=64, temperature=0, tree="auto"``)
        are shorthand that change it. ``temperature == 0`` is greedy and token-identical to the
        target's own greedy decoding; ``temperature > 0`` samples exactly from the target's
        distribution (after temperature and top-p) with the verifier of ``method``:

        - ``sequoia``: children drawn without replacement, residual verification with q renormalised;
        - ``specinfer``: children drawn i.i.d. (with replacement), q never renormalised;
        - ``chain``: classic speculative sampling (the tree must be a chain);
        - ``topk``: children are the draft's top-k, the target samples and matches;
        - ``autoregressive``: the target alone (the tree is ignored).

        The tree is :func:`~engine.core.settings.decide_tree`'s for ``settings`` and this engine's
        planner. Copies from the context (``copies``, ``prediction``), the draft's growth by
        ``confidence``, ``logprobs`` and the verifier's ``trace`` change what is recorded or how
        fast it goes, never the tokens or their law.

        ``should_stop``: called before every prefill chunk (``prefill_chunk`` prompt tokens) and
        every step; when it returns true the iteration raises :class:`GenerationCancelled`, so a
        long prompt can be stopped within one chunk.

        ``cache``: a :class:`~engine.core.prefix_cache.ConversationCache` of this engine's models kept
        from earlier turns: the prompt's longest common prefix with the tokens it holds is not
        prefilled again (the generation's ``reused_tokens`` says how many), and it holds this
        generation's tokens afterwards. Without it the engine's own caches are used and nothing is kept.

        ``on_prefill``: called with a :class:`~engine.core.records.PrefillProgress` after every
        prefill chunk (a long prompt's "reading your message" bar); it cannot change the output.

        ``timed_alone``: a :class:`~engine.core.timed_alone.TimedAlone` policy that gives some steps
        to the target alone, timed (``timed_alone`` in their records), so that an answer carries its
        own measure of the target alone under whatever load it decoded under. It changes what
        those steps verify, never the law of the output.
        """
        if timed_alone is not None and not isinstance(timed_alone, TimedAlone):
            raise InvalidParameterError(f"timed_alone must be a TimedAlone policy or None, got {timed_alone!r}")
        if cache is not None and not (isinstance(cache, ConversationCache) and cache.belongs_to(self.target, self.draft)):
            raise InvalidParameterError("cache must be a ConversationCache built for this engine's target and draft")
        params = self._prepare(input_ids, settings_from(settings, **setting_values), cache)
        return Generation(Decoding(self, list(input_ids), params, cache, timed_alone), should_stop, on_prefill)

    # ----- validation -----------------------------------------------------------------------
    def _token_ids(self, ids) -> bool:
        """Whether every item of ``ids`` is a token id of this engine's vocabulary."""
        return not any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids)

    def decide(self, settings: DecodeSettings, evidence: RankCounts | None = None) -> TreeDecision:
        """The tree ``settings`` decode with on this engine: :func:`~engine.core.settings.decide_tree`
        with its planner (a size or ``"auto"`` without a draft: the target alone); ``evidence``: a
        conversation's own acceptance counts (a conversation cache's, for greedy answers)."""
        if self.draft is None and settings.tree is not None and not isinstance(settings.tree, Tree):
            settings = dataclasses.replace(settings, tree=None)
        return decide_tree(settings, self.planner, evidence)

    def _prepare(self, input_ids, settings: DecodeSettings, cache: ConversationCache | None = None) -> DecodeParams:
        """The generation's parameters: the prompt and prediction checked against this vocabulary,
        the tree decided (a greedy answer's by its conversation's acceptance too, where ``cache``
        kept some and the tree it picks fits the context), the context's room checked."""
        if not isinstance(input_ids, (list, tuple)) or len(input_ids) == 0:
            raise InvalidParameterError("input_ids must be a non-empty list of token ids (the prompt is empty)")
        if not self._token_ids(input_ids):
            raise InvalidParameterError(f"input_ids must be integers in [0, {self.vocab_size})")
        if settings.prediction is not None and not self._token_ids(settings.prediction):
            raise InvalidParameterError(f"prediction must be a list of token ids in [0, {self.vocab_size})")
        decision = self.decide(settings)
        limit, what = (self.max_context, "the target's context") if self.max_context else (0, "")
        if self.static_cache and (not limit or self.max_cache_len < limit):
            limit, what = self.max_cache_len, "the static KV cache (max_cache_len)"
        evidence = cache.evidence_for(list(input_ids)) if cache is not None and settings.greedy else None
        if evidence:
            followed = self.decide(settings, evidence)
            if not limit or len(input_ids) + settings.max_new_tokens + followed.tree.size <= limit:
                decision = followed
        tree = decision.tree
        if tree.depth > 0 and self.draft is None:
            raise InvalidParameterError("a tree with draft tokens needs a draft model: pass draft= or use tree=None")
        needed = len(input_ids) + settings.max_new_tokens + tree.size
        if limit and needed > limit:
            raise ContextOverflowError(
                f"prompt ({len(input_ids)} tokens) + max_new_tokens ({settings.max_new_tokens}) + tree ({tree.size}) "
                f"exceeds {what} of {limit} tokens: shorten the prompt or lower max_new_tokens")
        stops = settings.stop_token_ids if settings.stop_token_ids is not None else self.stop_token_ids
        return DecodeParams(settings, decision, stops, room=limit - needed if limit else None,
                            gated=decision.auto and self.gate_drafts and tree.depth > 0)


class Generation(Iterator[StepRecord]):
    """One answer being decoded: iterate it for one :class:`StepRecord` a step (the prompt is read
    before the first). What it decodes with: ``settings``, ``decision`` (the tree, and the
    optimizer's choice under ``"auto"``). How its prompt was read, once the first record came:
    ``prefill_s`` (seconds), ``reused_tokens`` (prompt tokens a conversation cache held);
    ``draft_deferred``: the draft reads a long prompt between the first steps."""

    def __init__(self, state: "Decoding", should_stop: Callable[[], bool] | None,
                 on_prefill: Callable[[PrefillProgress], None] | None) -> None:
        self._state = state
        self.settings, self.decision = state.params.settings, state.params.decision
        self.draft_deferred = state.defers_draft()
        self.prefill_s = 0.0
        self._steps = self._run(should_stop, on_prefill)

    @property
    def reused_tokens(self) -> int:
        return self._state.reused_tokens

    def _run(self, should_stop, on_prefill) -> Iterator[StepRecord]:
        self.prefill_s = self._state.prefill(should_stop, on_prefill)
        while not self._state.finished:
            check_stop(should_stop)
            yield self._state.step()

    def __next__(self) -> StepRecord:
        return next(self._steps)

    def collect(self) -> GenerationResult:
        """Decode the rest of the answer; the whole of it (its prompt reading counts the draft's
        reads between steps too)."""
        steps = list(self)
        return GenerationResult(tokens=[t for s in steps for t in s.committed], steps=steps,
                                prompt_tokens=self._state.prompt_len,
                                prefill_s=self.prefill_s + sum(s.timings.reading_s for s in steps),
                                finish_reason=steps[-1].finish_reason or "length",
                                reused_tokens=self.reused_tokens, decision=self.decision)

    def close(self) -> None:
        self._steps.close()



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


def graphable(model: torch.nn.Module) -> bool:
    """CUDA graphs need the whole model on one GPU and no host-side hooks: not for targets split
    with ``device_map`` or streamed from the host (those run eagerly)."""
    streamed = getattr(model, "_layer_streamer", None) is not None
    devices = set(getattr(model, "hf_device_map", {}).values())
    return not streamed and len(devices) <= 1


def _stop_set(stop_token_ids) -> frozenset[int]:
    if isinstance(stop_token_ids, (str, bytes)) or not hasattr(stop_token_ids, "__iter__") or \
            any(isinstance(t, bool) or not isinstance(t, int) for t in stop_token_ids):
        raise InvalidParameterError(f"stop_token_ids must be a list of token ids, got {stop_token_ids!r}")
    return frozenset(stop_token_ids)


def _refuse_sliding_window(model: torch.nn.Module) -> None:
    """Tree verification keeps every prefix position and applies a window by the mask, for models
    that say which layers slide (``layer_types``, as Gemma 3's); a window without them is refused."""
    config = model.config
    if getattr(config, "use_sliding_window", False) and "sliding_attention" not in (getattr(config, "layer_types", None) or []):
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
