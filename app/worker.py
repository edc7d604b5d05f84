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
- ``started`` (data: ``{"phase", "tree", "tree_choice", "tokenizer", "pair_version", "prompt_tokens",
  "dropped", "draft_later"}``) when a decoding phase begins; ``dropped``: the oldest messages left out
  of a conversation that did not fit the context; ``draft_later``: the draft reads the prompt between
  the first steps, not before the first token (the engine's decision, its conversation cache counted);
- ``prefill`` (data: a :class:`~engine.core.records.PrefillProgress`) after each chunk of the prompt's
  prefill;
- ``step`` (data: a :class:`~engine.core.records.StepRecord`; ``phase`` says which run);
- ``finished`` (data: ``{"phase", "steps", "tokens", "seconds", "prefill_s", "first_token_s",
  "reused_tokens", "finish_reason"}``) per phase;
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

import gc
import logging
import queue
import re
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch

from app.conversation import ContextTooLong, fit_context
from app.jobs import GenerationRequest, Job, LoadRequest, ProfileRequest, QueueFull, SessionBusy
from app.pair import default_loader, describe_pair, make_engine, validate_model_id
from engine.backends.quantize import draft_format
from engine.core.prefix_cache import DEFAULT_BUDGET_BYTES, CacheStore, ConversationCache
from engine.errors import EngineError, GenerationCancelled, ModelLoadError
from engine.models.loading import DTYPES

log = logging.getLogger(__name__)

MAX_WAITING = 32      # jobs waiting behind the running one, all clients together
MAX_PER_CLIENT = 4    # one running and three waiting per client (an API caller's address)
RETRY_PER_JOB_S = 15  # what a waiting answer is guessed to take, for Retry-After


# ----- the worker --------------------------------------------------------------------------
class Worker:
    """Owns the engine on one daemon thread; serves jobs first come, first served."""

    def __init__(self, engine, tokenizer, info: dict | None = None,
                 loader: Callable | None = None, tuner=None, name: str = "sequoia-engine",
                 models_dir: Path | None = None, allow_remote_code: bool = False,
                 draft_format: str = "auto", kv_cache_bytes: int = DEFAULT_BUDGET_BYTES,
                 draft_vocabulary: int | str = "auto") -> None:
        """``models_dir``: the only folder local models may be loaded from by UI requests;
        ``allow_remote_code``: whether a request may ask for ``trust_remote_code``;
        ``draft_format``: how drafts loaded from the UI are quantised (``loader(..., draft_format=)``);
        ``kv_cache_bytes``: the budget of conversation KV caches kept between turns (0: none kept);
        ``draft_vocabulary``: the token ids such a draft's head computes
        (:func:`engine.models.loading.restrict_draft`)."""
        self.engine = engine
        self.kv_store = CacheStore(kv_cache_bytes)
        self.draft_format, self.draft_vocabulary = draft_format, draft_vocabulary
        self.models_dir = models_dir
        self.allow_remote_code = allow_remote_code
        self.tokenizer = tokenizer
        self.info = dict(info or {})
        self.tuner = tuner if tuner is not None else getattr(engine, "tuner", None)
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
                    tuner=None, loader: Callable | None = None, **options) -> "Worker":
        """``options``: ``models_dir``, ``allow_remote_code``, ``draft_format``, ``kv_cache_bytes``,
        ``draft_vocabulary`` (see ``__init__``)."""
        engine = make_engine(target, draft, tokenizer, tuner)
        return cls(engine, tokenizer, describe_pair(target, draft, target_name, draft_name), loader, tuner, **options)

    def set_tuner(self, tuner) -> None:
        """Enable ``tree="auto"`` (an :class:`engine.tuning.optimizer.AutoTuner` for the current pair) or disable it."""
        self.tuner = tuner
        target = getattr(self.engine, "_engine", self.engine)  # through test wrappers
        target.tuner = tuner

    # ----- submitting --------------------------------------------------------------------
    def submit(self, request: GenerationRequest, session: str | None = None, client: str | None = None) -> Job:
        """Queue a generation. With ``session``, refused (:class:`SessionBusy`) while that session has
        a job waiting or running; with ``client``, refused (:class:`QueueFull`) while that client has
        ``MAX_PER_CLIENT``; any job is refused when ``MAX_WAITING`` wait. Checks and registration
        are one locked step."""
        return self._enqueue(Job(request, session, client))

    def load_models(self, target: str, draft: str, dtype: str = "float32", device: str = "cpu",
                    trust_remote_code: bool = False, session: str | None = None) -> Job:
        return self._enqueue(Job(LoadRequest(target, draft, dtype, device, trust_remote_code), session))

    def measure_machine(self) -> Job:
        """Queue a measurement of this machine's profile of the pair in use (about a minute on 2
        cores; answers queued meanwhile wait, as behind any job); when it succeeds, ``tree="auto"``
        and the target-alone estimate use it, and it is kept in the user cache for later starts."""
        return self._enqueue(Job(ProfileRequest()))

    def _enqueue(self, job: Job) -> Job:
        job.worker = self
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine worker has been closed")
            if job.session is not None and any(
                    j.session == job.session and not j.finished for j in [*self._pending, self._current] if j):
                raise SessionBusy("an answer is still streaming in this session: wait for it or press Stop")
            queued = [j for j in [self._current, *self._pending] if j is not None and not j.finished]
            if len(self._pending) >= MAX_WAITING:
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
        import dataclasses

        from engine.user_cache import cache_dir
        from engine.tuning.profile import profile_path, quick_profile

        tuner = self.tuner
        if tuner is None:
            job._emit("error", "no optimizer for this pair: nothing to measure for")
            return
        engine = getattr(self.engine, "_engine", self.engine)
        job._emit("progress", "measuring this machine's forward times (about a minute)")
        profile = quick_profile(engine.target, engine.draft, self.tokenizer, tuner.pair or tuner.profile.pair)
        path = profile_path(cache_dir() / "profiles", profile.device, profile.pair, profile.dtype)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(profile.to_json())
        except OSError as exc:
            log.warning("could not keep this machine's profile (%s): it is measured again at the next start", exc)
        if self.tuner is tuner:  # not replaced meanwhile (a model swap drops it)
            self.set_tuner(dataclasses.replace(tuner, profile=profile, origin="this machine"))
        job._emit("done", profile)

    def _serve_generate(self, job: Job) -> None:
        request: GenerationRequest = job.request
        try:
            prompt = self._prompt(request)
        except ContextTooLong as exc:
            job._emit("error", f"Not sent: {exc}")
            return
        key = (request.cache_key or job.session) if request.keep_cache else None
        cache = self._take_cache(key)
        try:
            main = self._decode(job, "main", request.tree, request.method, prompt, cache)
        finally:
            if cache is not None:  # valid however the decoding ended (its record follows the engine)
                self.kv_store.put(key, cache)
        if main is None:
            return
        summary = {"main": main, "compare": None}
        if request.tree is None or request.method == "autoregressive":
            self._record_baseline(main)
        if request.compare and main["steps"]:
            compare = self._decode(job, "compare", None, request.method, prompt)
            if compare is None:
                return
            self._record_baseline(compare)
            summary["compare"] = compare
        summary["baseline_tokens_per_s"] = self.baseline_tokens_per_s
        job._emit("done", summary)

    def _prompt(self, request: GenerationRequest) -> tuple[list[int], int]:
        """``(input_ids, messages dropped)``: a conversation is tokenised now, with the pair in use."""
        if request.messages is None:
            return request.input_ids, 0
        return fit_context(self.tokenizer, request.system, request.messages, self.context_limit(request))

    def context_limit(self, request: GenerationRequest) -> int | None:
        """Prompt tokens ``request`` may use with the pair in use: the context minus its max new
        tokens and its tree's size (None: the model states no context)."""
        tree = request.tree
        if request.method == "autoregressive" or tree is None:
            size = 1
        elif isinstance(tree, str) and tree == "auto":
            size = self.tuner.choose(request.temperature, request.top_p).size if self.tuner is not None else 1
        else:
            size = getattr(tree, "size", 1)
        context = int(getattr(self.engine, "max_context", 0) or 0)
        return context - request.max_new_tokens - size if context else None

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

    def _decode(self, job: Job, phase: str, tree, method: str, prompt: tuple[list[int], int],
                cache: ConversationCache | None = None) -> dict | None:
        """One decoding run; its ``finished`` data, or None when it was cancelled or failed."""
        request: GenerationRequest = job.request
        engine = self.engine
        input_ids, dropped = prompt
        start = time.perf_counter()
        first_token_s = None
        extra = {"cache": cache} if cache is not None else {}
        if phase == "main":  # the target alone, in Compare or Measure, never copies
            extra.update(trace=request.trace, copies=request.copies)
            if request.logprobs is not None:  # asked for only: an engine without the option still serves the rest
                extra["logprobs"] = request.logprobs
            if request.time_alone_every:
                extra["time_alone_every"] = request.time_alone_every
            if request.prediction:
                extra["prediction"] = self.tokenizer.encode(request.prediction, add_special_tokens=False)
        try:
            stream = engine.stream(input_ids, max_new_tokens=request.max_new_tokens,
                                   temperature=request.temperature, top_p=request.top_p, tree=tree,
                                   seed=request.seed, method=method, should_stop=lambda: job.cancelled,
                                   on_prefill=lambda progress: job._emit("prefill", progress, phase), **extra)
        except Exception as exc:  # noqa: BLE001 - bad parameters become an error event
            job._emit("error", _message(exc))
            return None
        choice = getattr(engine, "last_tree_choice", None) if tree == "auto" else None
        job._emit("started", {"phase": phase, "tree": choice.tree if choice else tree, "tree_choice": choice,
                              "tokenizer": self.tokenizer, "pair_version": self.pair_version,
                              "prompt_tokens": len(input_ids), "dropped": dropped,
                              "draft_later": bool(getattr(engine, "last_draft_deferred", False))}, phase)
        steps, tokens = 0, 0
        finish_reason = None
        decode_s = reading_s = 0.0
        try:
            for record in stream:
                if first_token_s is None:
                    first_token_s = time.perf_counter() - start
                steps += 1
                tokens += len(record.committed)
                decode_s += record.timings.total_s
                reading_s += record.timings.reading_s
                finish_reason = record.finish_reason or finish_reason
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
            close = getattr(stream, "close", None)
            if close is not None:
                close()
        if job.cancelled:
            job._emit("cancelled")
            return None
        result = {"phase": phase, "steps": steps, "tokens": tokens, "seconds": time.perf_counter() - start,
                  "decode_s": decode_s, "prefill_s": getattr(engine, "last_prefill_s", 0.0) + reading_s,
                  "first_token_s": first_token_s, "reused_tokens": getattr(engine, "last_reused_tokens", 0),
                  "finish_reason": finish_reason or "length",
                  "tree_choice": choice}
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
        self.tuner = None  # a calibration belongs to the pair it was measured on
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
