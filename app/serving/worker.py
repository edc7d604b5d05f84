"""One background thread owns the engine; requests from every browser tab queue on it.

Each request is a :class:`Job` with its own event queue and cancel flag. The worker iterates
``engine.stream()`` and checks the flag after every step, and the engine consults it between the
prompt's prefill chunks, so Stop takes effect within one step or one chunk; a cancelled generator
is closed and dropped. An exception inside the engine ends that job with an ``error`` event and
the worker goes on serving the next one. Loading another model pair is a job too, so it never
swaps the models under a running generation, and a failed load keeps the previous pair. The load
itself runs on a thread of its own: Stop answers ``cancelled`` at once (a download cannot be
interrupted), and the orphaned load stops after the model in progress, its result discarded.

Events (``Event.kind``), in order:

- ``queued`` (data: jobs ahead of this one) while waiting;
- ``started`` (data: ``{"phase", "decision", "tokenizer", "pair_version", "prompt_tokens", "dropped",
  "draft_later"}``) when a decoding phase begins; ``decision``: the engine's
  :class:`~engine.core.settings.TreeDecision` (the tree, and the optimizer's choice under "auto");
  ``dropped``: the oldest messages left out of a conversation that did not fit the context;
  ``draft_later``: the draft reads the prompt between the first steps, not before the first token
  (the engine's decision, its conversation cache counted);
- ``prefill`` (data: a :class:`~engine.core.records.PrefillProgress`) after each chunk of the prompt's
  prefill;
- ``step`` (data: a :class:`~engine.core.records.StepRecord`; ``phase`` says which run);
- ``finished`` (data: ``{"phase", "steps", "tokens", "seconds", "decode_s", "prefill_s", "first_token_s",
  "reused_tokens", "finish_reason", "decision"}``) per phase;
- ``progress`` (data: a message) while loading models;
- exactly one terminal event: ``done`` (data: summary dict), ``cancelled`` or ``error`` (data: message).

Generation phases: ``main`` (the requested method and tree) and, in compare mode, ``compare``
(the same prompt decoded by the target alone, ``tree=None``).

Multi-turn reuse: the ``main`` phase of a job with a session (or a request's ``cache_key``) decodes
with that conversation's KV caches (:mod:`engine.core.prefix_cache`), kept between its turns in one
:class:`~engine.core.prefix_cache.CacheStore` (one conversation per key, least recently used evicted
under ``kv_cache_bytes``), so a turn that extends the conversation prefills only its new tokens;
an edit, a regenerate or an import reuses the longest common prefix. A model swap empties the
store. Engines with preallocated static caches (CUDA) do not keep conversations.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import re
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from app.views.conversation import ContextTooLong, fit_context
from app.serving.jobs import GenerationRequest, Job, LoadRequest, ProfileRequest, QueueFull, SessionBusy
from app.serving.measuring import Measurement
from app.serving.pair import default_loader, describe_pair, make_engine, validate_model_id
from engine.core.prefix_cache import DEFAULT_BUDGET_BYTES, CacheStore, ConversationCache
from engine.core.settings import DecodeSettings, TreeDecision, settings_from
from engine.core.timed_alone import TimedAlone
from engine.errors import EngineError, GenerationCancelled, ModelLoadError
from engine.models.loading import DTYPES, pair_name
from engine.tuning.acceptance import EMBEDDED_PAIR
from engine.tuning.planner import TreePlanner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerPolicy:
    """What UI requests may do. ``models_dir``: the only folder local models may be loaded from;
    ``allow_remote_code``: whether a request may ask for ``trust_remote_code``; ``draft_format``:
    how drafts loaded from the UI are quantised (``loader(..., draft_format=)``);
    ``draft_vocabulary``: the token ids such a draft's head computes
    (:func:`engine.models.loading.restrict_draft`); ``kv_cache_bytes``: the budget of
    conversation KV caches kept between turns (0: none kept)."""

    models_dir: Path | None = None
    allow_remote_code: bool = False
    draft_format: str = "auto"
    draft_vocabulary: int | str = "auto"
    kv_cache_bytes: int = DEFAULT_BUDGET_BYTES


@dataclass
class _Tally:
    """What one decoding run's records add up to."""

    steps: int = 0
    tokens: int = 0
    decode_s: float = 0.0
    reading_s: float = 0.0
    first_token_s: float | None = None
    finish_reason: str | None = None

    def add(self, record, start: float) -> None:
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter() - start
        self.steps += 1
        self.tokens += len(record.committed)
        self.decode_s += record.timings.total_s
        self.reading_s += record.timings.reading_s
        self.finish_reason = record.finish_reason or self.finish_reason


def _inner(engine):
    """The engine itself, through a test's wrapper."""
    return getattr(engine, "_engine", engine)

MAX_WAITING = 32      # jobs waiting behind the running one, all clients together
API_WAITING = 24      # of which API calls may hold at most these: the rest are the page's, never locked out
MAX_PER_CLIENT = 4    # one running and three waiting per client (an API caller's address, an IPv6 /64)
RETRY_PER_JOB_S = 15  # what a waiting answer is guessed to take, for Retry-After


# ----- the worker --------------------------------------------------------------------------
class Worker:
    """Owns the engine on one daemon thread; serves jobs first come, first served."""

    def __init__(self, engine, tokenizer, info: dict | None = None, loader: Callable | None = None,
                 planner: TreePlanner | None = None, name: str = "sequoia-engine",
                 policy: WorkerPolicy | None = None) -> None:
        """``planner``: the pair's :class:`~engine.tuning.planner.TreePlanner` (default: the engine's,
        else one with the embedded pair's calibration and no profile); the engine decides its trees
        with it too. ``policy``: what UI requests may load and the conversation caches' budget."""
        self.engine = engine
        policy = policy or WorkerPolicy()
        self.kv_store = CacheStore(policy.kv_cache_bytes)
        self.draft_format, self.draft_vocabulary = policy.draft_format, policy.draft_vocabulary
        self.models_dir = policy.models_dir
        self.allow_remote_code = policy.allow_remote_code
        self.tokenizer = tokenizer
        self.info = dict(info or {})
        self.planner = planner or getattr(_inner(engine), "planner", None) or TreePlanner(EMBEDDED_PAIR)
        _inner(engine).planner = self.planner
        self.loader = loader or default_loader
        self.baseline_tokens_per_s: float | None = None  # last measured target-alone rate, this pair
        self.pair_version = 0                            # bumped on every successful model swap
        self._orphan: threading.Thread | None = None     # a stopped model load still running
        self._pending: deque[Job] = deque()
        self._current: Job | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @classmethod
    def from_models(cls, target, draft, tokenizer, target_name: str = "target", draft_name: str = "draft",
                    planner: TreePlanner | None = None, loader: Callable | None = None, **policy) -> "Worker":
        """``policy``: :class:`WorkerPolicy`'s fields."""
        engine = make_engine(target, draft, tokenizer, planner)
        return cls(engine, tokenizer, describe_pair(target, draft, target_name, draft_name), loader, planner,
                   policy=WorkerPolicy(**policy))

    @property
    def tuner(self):
        """The optimizer of the pair in use (an :class:`engine.tuning.optimizer.AutoTuner`), None
        where this machine has no profile of it: then ``tree="auto"`` is the planner's default tree."""
        return self.planner.tuner

    def set_tuner(self, tuner) -> None:
        """Give the pair in use this optimizer (or none): a new planner, for the engine too."""
        self.planner = TreePlanner(self.planner.pair, tuner)
        _inner(self.engine).planner = self.planner

    def decide(self, settings: DecodeSettings) -> TreeDecision:
        """The tree ``settings`` decode with on the pair in use: the engine's own decision."""
        return _inner(self.engine).decide(settings)

    # ----- submitting --------------------------------------------------------------------
    def submit(self, request: GenerationRequest, session: str | None = None, client: str | None = None) -> Job:
        """Queue a generation. With ``session``, refused (:class:`SessionBusy`) while that session has
        a job waiting or running; with ``client`` (an API call), refused (:class:`QueueFull`) while that
        client has ``MAX_PER_CLIENT`` or API calls hold ``API_WAITING`` of the waiting places (the rest
        stay the page's); any job is refused when ``MAX_WAITING`` wait. Checks and registration
        are one locked step."""
        return self._enqueue(Job(request, session, client))

    def load_models(self, target: str, draft: str, dtype: str = "float32", device: str = "cpu",
                    trust_remote_code: bool = False, session: str | None = None) -> Job:
        return self._enqueue(Job(LoadRequest(target, draft, dtype, device, trust_remote_code), session))

    def measure_machine(self, reference_tokens_per_s: float | None = None, quiet_cores: float | None = None,
                        checked: bool = False, attempts: int = 3, retry_after_s: float = 120.0) -> Job:
        """Queue a measurement of this machine's profile of the pair in use (about a minute on 2
        cores); when it succeeds, ``tree="auto"`` and the target-alone estimate use it, and it is
        kept in the user cache for later starts. It is measured in short slices
        (:class:`engine.tuning.profile.QuickProfiler`), each queued behind the jobs that arrived
        meanwhile, so an answer waits a slice (a few seconds), not the minute. With
        ``quiet_cores``, a slice waits (re-queued every few seconds, 60 s at most in all) while the
        machine's other work keeps more cores than that busy. ``checked`` (the app's launch): the
        profile is refused when :func:`engine.tuning.profile.refusals` finds its repeats spread,
        its curves falling with n, or its target alone off ``reference_tokens_per_s`` (the
        launch's measured rate): the
        profile in use stays, a ``progress`` event says why, and it is measured again after
        ``retry_after_s``, ``attempts`` times in all. The returned job ends with ``done`` (the
        profile), ``error`` or ``cancelled``; its slices are jobs of their own."""
        tracker = Job(ProfileRequest())
        tracker.worker = self
        measurement = Measurement(tracker, max(1, attempts), retry_after_s, reference_tokens_per_s, quiet_cores, checked)
        self._enqueue(measurement.slice_job())
        return tracker

    def requeue(self, job: Job, still_wanted: Callable[[], bool]) -> bool:
        """Put ``job`` (a measurement's next slice) at the end of the queue, past the caps, while
        ``still_wanted()`` and the worker is open; whether it was queued."""
        with self._cond:
            if self._closed or not still_wanted():
                return False
            job.worker = self
            self._pending.append(job)
            self._cond.notify_all()
            return True

    def _enqueue(self, job: Job) -> Job:
        job.worker = self
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine worker has been closed")
            if job.session is not None and any(
                    j.session == job.session and not j.finished for j in [*self._pending, self._current] if j):
                raise SessionBusy("an answer is still streaming in this session: wait for it or press Stop")
            queued = [j for j in [self._current, *self._pending] if j is not None and not j.finished]
            api_waiting = sum(1 for j in self._pending if j.client is not None)
            if len(self._pending) >= MAX_WAITING or (job.client is not None and api_waiting >= API_WAITING):
                raise QueueFull(f"the server is busy: {len(self._pending)} requests are waiting; try again later",
                                RETRY_PER_JOB_S * len(queued))
            mine = [j for j in queued if job.client is not None and j.client == job.client]
            if len(mine) >= MAX_PER_CLIENT:
                raise QueueFull(f"you have {len(mine)} requests waiting or running (at most {MAX_PER_CLIENT}): "
                                f"wait for one to finish", RETRY_PER_JOB_S * len(mine))
            self._pending.append(job)
            ahead = len(self._pending) - 1 + (self._current is not None)
            self._cond.notify_all()
        if ahead:
            job._emit("queued", ahead)
        return job

    def _drop_pending(self, job: Job) -> None:
        """A job cancelled while still waiting never runs."""
        with self._cond:
            try:
                self._pending.remove(job)
            except ValueError:
                return
        job._emit("cancelled")

    def cancel_session(self, session: str) -> int:
        """Cancel every running or waiting job of ``session``; how many."""
        with self._cond:
            jobs = [j for j in list(self._pending) + [self._current] if j is not None and j.session == session]
        for job in jobs:
            job.cancel()
        return len(jobs)

    def position(self, job: Job) -> int | None:
        with self._cond:
            if job is self._current:
                return 0
            try:
                return self._pending.index(job) + (self._current is not None)
            except ValueError:
                return None

    @property
    def busy(self) -> int:
        """Jobs running or waiting."""
        with self._cond:
            return len(self._pending) + (self._current is not None)

    def close(self, timeout: float = 5.0) -> None:
        """Cancel everything and stop the thread."""
        with self._cond:
            self._closed = True
            jobs = list(self._pending) + ([self._current] if self._current else [])
            self._cond.notify_all()
        for job in jobs:
            job.cancel()
        self._thread.join(timeout)

    # ----- serving -----------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._pending.popleft()
                self._current = job
            try:
                if job.cancelled:
                    job._emit("cancelled")
                elif job.kind == "load":
                    self._serve_load(job)
                elif job.kind == "profile":
                    self._serve_profile(job)
                else:
                    self._serve_generate(job)
            except Exception as exc:  # noqa: BLE001 - the worker must survive anything a job does
                log.exception("job %s failed", job.id)
                job._emit("error", _message(exc))
            finally:
                if not job.finished:
                    job._emit("error", "the request ended without a result")
                with self._cond:
                    self._current = None

    def _serve_profile(self, job: Job) -> None:
        """A slice of a measurement of this machine (:mod:`app.serving.measuring`); a profile job
        queued on its own is measured in one go."""
        measurement = getattr(job, "measurement", None) or Measurement(job)
        measurement.serve(self, job)

    def _serve_generate(self, job: Job) -> None:
        request: GenerationRequest = job.request
        try:
            prompt = self._prompt(request)
            settings = self._settings(request)
        except ContextTooLong as exc:
            job._emit("error", f"Not sent: {exc}")
            return
        except EngineError as exc:
            job._emit("error", _message(exc))
            return
        key = (request.cache_key or job.session) if request.keep_cache else None
        cache = self._take_cache(key)
        timed = TimedAlone(request.time_alone_every) if request.time_alone_every else None
        try:
            main = self._decode(job, "main", settings, prompt, cache, timed)
        finally:
            if cache is not None:  # valid however the decoding ended (its record follows the engine)
                self.kv_store.put(key, cache)
        if main is None:
            return
        summary = {"main": main, "compare": None}
        if not main["decision"].drafts and not settings.copying:
            self._record_baseline(main)
        if request.compare and main["steps"]:
            alone = dataclasses.replace(settings, tree=None, copies=False, prediction=None, trace=False, logprobs=None)
            compare = self._decode(job, "compare", alone, prompt)
            if compare is None:
                return
            self._record_baseline(compare)
            summary["compare"] = compare
        summary["baseline_tokens_per_s"] = self.baseline_tokens_per_s
        job._emit("done", summary)

    def _settings(self, request: GenerationRequest) -> DecodeSettings:
        """The request's settings with its expected answer tokenised by the pair in use."""
        if not request.prediction:
            return request.settings
        ids = self.tokenizer.encode(request.prediction, add_special_tokens=False)
        return settings_from(request.settings, prediction=ids or None)

    def _prompt(self, request: GenerationRequest) -> tuple[list[int], int]:
        """``(input_ids, messages dropped)``: a conversation is tokenised now, with the pair in use."""
        if request.messages is None:
            return request.input_ids, 0
        return fit_context(self.tokenizer, request.system, request.messages, self.context_limit(request.settings))

    def context_limit(self, settings: DecodeSettings) -> int | None:
        """Prompt tokens an answer decoded with ``settings`` may use with the pair in use: the
        context minus its max new tokens and its tree's size (None: the model states no context)."""
        context = int(getattr(self.engine, "max_context", 0) or 0)
        return context - settings.max_new_tokens - self.decide(settings).tree.size if context else None

    def _take_cache(self, key: str | None) -> ConversationCache | None:
        """The conversation cache of ``key`` for the pair in use (a new, empty one when there is
        none); None when nothing is to be kept (no key, no budget, a static-cache engine)."""
        engine = self.engine
        if key is None or self.kv_store.budget_bytes <= 0 or getattr(engine, "static_cache", False):
            return None
        cache = self.kv_store.take(key)
        if cache is None or not cache.belongs_to(engine.target, engine.draft):
            cache = ConversationCache(engine.target, engine.draft)
        return cache

    def forget(self, key: str) -> bool:
        """Drop the conversation cache of ``key`` (a session or cache key); whether there was one."""
        return self.kv_store.take(key) is not None

    def _decode(self, job: Job, phase: str, settings: DecodeSettings, prompt: tuple[list[int], int],
                cache: ConversationCache | None = None, timed: TimedAlone | None = None) -> dict | None:
        """One decoding run; its ``finished`` data, or None when it was cancelled or failed."""
        input_ids, dropped = prompt
        start = time.perf_counter()
        try:
            generation = self.engine.stream(input_ids, settings, should_stop=lambda: job.cancelled, cache=cache,
                                            on_prefill=lambda progress: job._emit("prefill", progress, phase),
                                            timed_alone=timed)
        except Exception as exc:  # noqa: BLE001 - bad parameters become an error event
            job._emit("error", _message(exc))
            return None
        job._emit("started", {"phase": phase, "decision": generation.decision, "tokenizer": self.tokenizer,
                              "pair_version": self.pair_version, "prompt_tokens": len(input_ids),
                              "dropped": dropped, "draft_later": generation.draft_deferred}, phase)
        tally = _Tally()
        try:
            for record in generation:
                tally.add(record, start)
                job._emit("step", record, phase)
                if job.cancelled:
                    break
        except GenerationCancelled:
            pass  # stopped during the prefill (or between steps): reported below
        except Exception as exc:  # noqa: BLE001 - an engine failure mid-answer ends this job only
            log.exception("engine failed during job %s", job.id)
            job._emit("error", _message(exc))
            return None
        finally:
            generation.close()
        if job.cancelled:
            job._emit("cancelled")
            return None
        result = {"phase": phase, "steps": tally.steps, "tokens": tally.tokens,
                  "seconds": time.perf_counter() - start, "decode_s": tally.decode_s,
                  "prefill_s": generation.prefill_s + tally.reading_s, "first_token_s": tally.first_token_s,
                  "reused_tokens": generation.reused_tokens, "finish_reason": tally.finish_reason or "length",
                  "decision": generation.decision}
        job._emit("finished", result, phase)
        return result

    def _record_baseline(self, run: dict) -> None:
        if run["decode_s"] > 0 and run["tokens"] > 0:
            self.baseline_tokens_per_s = run["tokens"] / run["decode_s"]

    def _serve_load(self, job: Job) -> None:
        request: LoadRequest = job.request
        if request.dtype not in DTYPES:
            raise ModelLoadError(f"dtype must be one of {', '.join(DTYPES)}, got {request.dtype!r}")
        device = (request.device or "cpu").strip()
        if device != "cpu" and not (re.fullmatch(r"cuda(:\d+)?", device) and torch.cuda.is_available()):
            raise ModelLoadError(f"device '{device}' is not available here: use cpu"
                                 + (" or cuda" if torch.cuda.is_available() else ""))
        if request.trust_remote_code and not self.allow_remote_code:
            raise ModelLoadError("loading a repository that runs its own code from the Models panel is disabled: "
                                 "start the app with --models-panel-remote-code to allow it")
        target_id = validate_model_id(request.target, "target", self.models_dir)
        draft_id = validate_model_id(request.draft, "draft", self.models_dir)
        if not self._wait_for_orphan(job):
            job._emit("cancelled")
            return
        job._emit("progress", f"loading target {target_id} …")
        box: dict = {}
        done = threading.Event()

        def load() -> None:
            torch.set_grad_enabled(False)
            try:
                loaded = self._load_pair(job, target_id, draft_id, DTYPES[request.dtype], device,
                                         request.trust_remote_code)
                if loaded is not None and not job.cancelled:
                    box["loaded"] = loaded
                del loaded  # a cancelled job's result goes with this thread
            except Exception as exc:  # noqa: BLE001 - a failed load keeps the previous pair
                _release(exc, f"loading {target_id} + {draft_id} failed")
                box["error"] = _message(exc)
            finally:
                done.set()
                if job.cancelled:  # an orphaned result: free it (and its reference cycles) now
                    box.clear()
                    gc.collect()

        thread = threading.Thread(target=load, name=f"load-{job.id}", daemon=True)
        thread.start()
        while not done.wait(0.05):
            if job.cancelled:  # the load runs on, orphaned: it stops after the model in progress
                self._orphan = thread
                job._emit("cancelled")
                return
        if "error" in box:
            job._emit("error", box["error"])
            return
        loaded = box.pop("loaded", None)
        if loaded is None or job.cancelled:
            job._emit("cancelled")
            return
        self.engine, self.tokenizer = loaded["engine"], loaded["tokenizer"]
        self.info = describe_pair(loaded["target"], loaded["draft"], target_id, draft_id)
        # a profile belongs to the pair it was measured on; the calibration is the new pair's (or borrowed)
        self.planner = TreePlanner(pair_name(target_id, draft_id, loaded["draft"], loaded["target"]))
        self.engine.planner = self.planner
        self.kv_store.clear()  # caches of the old pair's models: never reused, freed with it
        self.baseline_tokens_per_s = None
        self.pair_version += 1
        if self.loader is default_loader:  # the loader's memo now holds this pair, and only it
            from engine.models.loading import keep_pair
            keep_pair((loaded["target"], loaded["tokenizer"]), (loaded["draft"], loaded["draft_tokenizer"]))
        job._emit("done", {"info": dict(self.info)})

    def _wait_for_orphan(self, job: Job) -> bool:
        """Let a stopped load that still runs finish before starting another (at most one pair in
        flight beside the one in use); False when ``job`` is cancelled meanwhile."""
        orphan = self._orphan
        if orphan is None or not orphan.is_alive():
            self._orphan = None
            return True
        job._emit("progress", "waiting for a stopped load to finish …")
        while orphan.is_alive():
            if job.cancelled:
                return False
            orphan.join(0.05)
        self._orphan = None
        return True

    def _load_pair(self, job: Job, target_id: str, draft_id: str, dtype: torch.dtype, device: str,
                   trust_remote_code: bool) -> dict | None:
        """Target, draft (same vocabulary) and their engine; None when the job was cancelled meanwhile.
        Nothing of a failed or cancelled attempt outlives this call (the caller clears the traceback)."""
        target, tokenizer = self.loader(target_id, dtype, device, trust_remote_code)
        if job.cancelled:
            return None
        job._emit("progress", f"loading draft {draft_id} …")
        draft, draft_tokenizer = self.loader(draft_id, dtype, device, trust_remote_code,
                                             draft_format=self.draft_format)
        from engine.models.loading import check_same_vocabulary, restrict_draft
        check_same_vocabulary(tokenizer, draft_tokenizer, target_id, draft_id)
        draft = restrict_draft(draft, draft_id, draft_tokenizer, self.draft_vocabulary)
        if job.cancelled:
            return None
        job._emit("progress", "building the engine …")
        engine = make_engine(target, draft, tokenizer)
        return {"engine": engine, "target": target, "draft": draft, "tokenizer": tokenizer,
                "draft_tokenizer": draft_tokenizer}


def _release(exc: BaseException, what: str) -> None:
    """Log a failure, then clear the frames of its traceback: they hold the models a failed load had
    loaded so far (a target of several GiB), and the exception may be kept (a log handler keeping
    records, a debugger). The traceback is logged as text for the same reason."""
    if isinstance(exc, EngineError):
        log.warning("%s: %s", what, exc)
    else:
        log.error("%s:\n%s", what, "".join(traceback.format_exception(exc)).rstrip())
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def _message(exc: BaseException) -> str:
    if isinstance(exc, EngineError):
        return str(exc)
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
