"""Measuring this machine's profile between answers (:meth:`app.serving.worker.Worker.measure_machine`).

The measurement runs as short slices (:class:`engine.tuning.profile.QuickProfiler`), each a job
queued behind whatever arrived meanwhile, so an answer waits a slice, not the minute. A slice may
wait while the machine's other work keeps the cores busy; the finished profile may be refused
(:func:`engine.tuning.profile.refusals`) and measured again later. One :class:`Measurement` holds a
run's state; its ``tracker`` job is what the caller waits on."""
from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass

from app.serving.jobs import Job, ProfileRequest

log = logging.getLogger(__name__)


@dataclass
class Measurement:
    """One measurement of this machine: its ``tracker`` job, the profiler in progress, the optimizer
    it measures for, and its policy (``attempts``, ``retry_after_s``, the launch's ``reference``
    rate, ``quiet_cores``, whether the profile is ``checked``)."""

    tracker: Job
    attempts: int = 1
    retry_after_s: float = 0.0
    reference: float | None = None
    quiet_cores: float | None = None
    checked: bool = False
    profiler: object | None = None
    tuner: object | None = None
    attempt: int = 1
    waited_s: float = 0.0

    def slice_job(self) -> Job:
        """A job that measures the next slice."""
        job = Job(ProfileRequest())
        job.measurement = self
        return job

    def serve(self, worker, job: Job) -> None:
        """Measure one slice (all of it when ``job`` is the tracker itself: a profile job queued
        without a measurement), then queue the next one, or finish."""
        from engine.tuning.profile import QUIET_RETRY_S, QUIET_WAIT_S, QuickProfiler, others_busy

        if self.tracker.cancelled:
            self._end(job, "cancelled")
            return
        tuner = worker.tuner
        if tuner is None or (self.tuner is not None and tuner is not self.tuner):
            self.profiler = None  # the models changed: what was measured is of the others
            self._end(job, "error", "no optimizer for this pair: nothing to measure for" if tuner is None
                      else "the models changed while this machine was measured")
            return
        if self.profiler is None:
            engine = getattr(worker.engine, "_engine", worker.engine)
            self.tuner = tuner
            self.profiler = QuickProfiler(engine.target, engine.draft, worker.tokenizer,
                                          tuner.pair or tuner.profile.pair)
            self.tracker._emit("progress", "measuring this machine's forward times (about a minute, between answers)")
        one_go = job is self.tracker
        while True:
            timed = self.profiler.rounds is not None  # the first slice reads the prefix: nothing timed
            if timed and self.quiet_cores is not None and self.waited_s < QUIET_WAIT_S and not one_go:
                if others_busy() > self.quiet_cores:
                    self.waited_s += QUIET_RETRY_S
                    self._next(worker, job, QUIET_RETRY_S)
                    return
            self.profiler.measure_slice()
            if self.profiler.done:
                break
            if not one_go:
                self._next(worker, job)
                return
        profile = self.profiler.profile()
        self.profiler = None
        self._finish(worker, job, profile)

    def _finish(self, worker, job: Job, profile) -> None:
        """Keep ``profile`` (in the user cache and for the optimizer), or refuse it and try again later."""
        from engine.tuning.profile import profile_path, refusals
        from engine.user_cache import cache_dir

        tuner = self.tuner
        reasons = refusals(profile, self.reference) if self.checked else []
        if reasons:
            again = self.attempt < self.attempts
            line = (f"This machine's profile was refused ({'; '.join(reasons)}): the optimizer keeps "
                    f"{tuner.profile_words}" + (f"; measuring again in {self.retry_after_s / 60:.0f} min "
                                         f"(attempt {self.attempt + 1} of {self.attempts})." if again else "."))
            self.tracker._emit("progress", line)  # launch.report_measurement prints it
            if again and job is not self.tracker:
                self.attempt += 1
                self.waited_s = 0.0
                self._next(worker, job, self.retry_after_s)
                return
            self._end(job, "error", f"refused: {'; '.join(reasons)}")
            return
        path = profile_path(cache_dir() / "profiles", profile.device, profile.pair, profile.dtype)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(profile.to_json())
        except OSError as exc:
            log.warning("could not keep this machine's profile (%s): it is measured again at the next start", exc)
        if worker.tuner is tuner:  # not replaced meanwhile (a model swap drops it)
            worker.set_tuner(dataclasses.replace(tuner, profile=profile, origin="this machine"))
        self._end(job, "done", profile)

    def _end(self, job: Job, kind: str, data=None) -> None:
        if not self.tracker.finished:
            self.tracker._emit(kind, data)
        if job is not self.tracker and not job.finished:
            job._emit("done")

    def _next(self, worker, job: Job, after_s: float = 0.0) -> None:
        """Queue the next slice (after ``after_s``), behind whatever arrived meanwhile; ``job``'s
        slice is done."""
        following = self.slice_job()

        def put() -> None:
            if not worker.requeue(following, lambda: not self.tracker.cancelled):
                self._end(following, "cancelled")
        if after_s > 0:
            timer = threading.Timer(after_s, put)
            timer.daemon = True
            timer.start()
        else:
            put()
        if job is not self.tracker:
            job._emit("done")
