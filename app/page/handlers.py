"""The UI's event handlers (:class:`ChatApp`): each takes component values and returns or yields
component updates. Every request goes through the :class:`app.serving.worker.Worker`, which owns the models;
the layout (:mod:`app.page.ui`) wires the handlers to the components."""
from __future__ import annotations

import html
import os
import shutil
import tempfile
import threading
import time
import weakref
from pathlib import Path

import gradio as gr

from engine.core.settings import settings_from
from engine.errors import EngineError
from engine.tuning.acceptance import Calibration
from engine.tuning.optimizer import predict

from app.views import figures
from app.views.figures import MEASURED, MEASURED_AT_START
from app.page.answer_stream import Ask, Run, run_views, stream_answer
from app.page.controls import DEFAULTS, ChatControls, clamp, sampling
from app.views.conversation import (
    MAX_IMPORT_BYTES,
    ContextTooLong,
    clean_text,
    display_messages,
    export_conversation,
    fit_context,
    highlight_html,
    import_conversation,
    import_steps,
    longest_token_chars,
)
from app.page.conversations_view import ConversationsView
from app.page.explain_view import ExplainView
from app.page.live_feed import LiveFeeds
from app.views.text import (
    describe_choice,
    describe_decision,
    dropped_notice,
    header_html,
    method_help,
    pair_markdown,
    status_html,
)
from app.serving.jobs import GenerationRequest, Job, QueueFull, SessionBusy
from app.serving.worker import Worker

BASELINE_PROMPT = "Write a short paragraph about trees."  # what "Measure the target alone" decodes
BASELINE_TOKENS = 48
MAX_EXPECTED_CHARS = 400_000  # the edit mode's expected output


# ----- small pieces ------------------------------------------------------------------------------
def _finished_run(job: Job) -> dict | None:
    """The main run's summary of a finished job (its "finished" event), or None if it did not end well."""
    run = None
    for event in job.iter_events():
        if event.kind == "finished" and event.phase == "main":
            run = event.data
        elif event.kind in ("error", "cancelled"):
            return None
    return run


class TokenTexts:
    """Decoded text of single tokens, cached per tokenizer."""

    def __init__(self) -> None:
        self._cache: dict[int, dict[int, str]] = {}
        self._lock = threading.Lock()

    def texts(self, tokenizer, tokens) -> dict[int, str]:
        with self._lock:
            cache = self._cache.setdefault(id(tokenizer), {})
            for t in tokens:
                if t not in cache:
                    cache[t] = tokenizer.decode([t], skip_special_tokens=False)
            return {t: cache[t] for t in tokens}


# ----- the app ---------------------------------------------------------------------------------
class ChatApp:
    """Handlers of the UI; one instance per built demo, shared by every browser session."""

    def __init__(self, worker: Worker, tokenizer=None, options: dict | None = None) -> None:
        self.worker = worker
        if tokenizer is not None and getattr(worker, "tokenizer", None) is None:
            worker.tokenizer = tokenizer
        self.options = {**DEFAULTS, **(options or {})}
        self.texts = TokenTexts()
        self._export_dir: Path | None = None
        # target-alone decoding rates measured on this machine, per pair and (temperature, top-p)
        self.baselines: dict[tuple, tuple[float, str]] = {}  # (tokens/s, how it was measured)
        self._baselines_lock = threading.Lock()
        self._epochs: dict[str, int] = {}  # per session: conversations replaced by Clear or Import
        self._free_drafts: dict[str, tuple[bool, str]] = {}  # per session: copy from the chat, expected output
        self._free_drafts_lock = threading.Lock()
        self.explain = ExplainView(self)  # the teaching tabs under the chat
        self.feeds = LiveFeeds()  # served by launch (app.page.live_feed.mount): streaming answers' live records
        # the stored conversations (app.serving.history; its store None: history off) and their sidebar
        self.conversations = ConversationsView(self, self.options.get("history"), self.options.get("history_note"))
        if getattr(worker, "tokenizer", None) is not None:  # read once now (0.1 s), not before the first answer
            longest_token_chars(worker.tokenizer)

    # ----- free drafts: copies from the conversation and an expected output --------------------------
    def set_free_drafts(self, copies, expected, request: gr.Request | None = None) -> None:
        """This session's free-draft settings for its next answers: whether continuations already in the
        conversation are proposed, and an expected output (edit mode) to copy from."""
        session = getattr(request, "session_hash", None) or "local"
        with self._free_drafts_lock:
            self._free_drafts[session] = (bool(copies), str(expected or "")[:MAX_EXPECTED_CHARS])

    def free_drafts(self, session: str) -> tuple[bool, str | None]:
        with self._free_drafts_lock:
            copies, expected = self._free_drafts.get(session, (self.options["copies"], ""))
        return copies, expected.strip() and expected or None

    # ----- the target alone, measured once per pair and settings -----------------------------------
    def _baseline_key(self, temperature: float, top_p: float) -> tuple:
        info = self.worker.info or {}
        return (self.worker.pair_version, str(info.get("target")), str(info.get("draft")),
                round(float(temperature), 2), round(float(top_p), 2))

    def record_baseline(self, temperature: float, top_p: float, run: dict | None,
                        source: str = MEASURED) -> float | None:
        """Keep the target-alone rate of a finished run (a Compare run, an autoregressive answer or
        a "Measure" run, all while the page draws: ``MEASURED``; the launch's run before any page:
        ``MEASURED_AT_START``) for this pair and setting; returns it."""
        if not run or run.get("decode_s", 0) <= 0 or run.get("tokens", 0) <= 0:
            return None
        rate = run["tokens"] / run["decode_s"]
        with self._baselines_lock:
            self.baselines[self._baseline_key(temperature, top_p)] = (rate, source)
        return rate

    def baseline(self, temperature: float, top_p: float) -> tuple[float | None, str]:
        """``(tokens/s, source)`` of the target alone at this setting: measured on this pair when it
        was (``MEASURED``: Compare, autoregressive or Measure; ``MEASURED_AT_START``: at launch,
        before any page drew), else the device profile's estimate (``"estimated"``), else
        ``(None, "")``."""
        with self._baselines_lock:
            measured = self.baselines.get(self._baseline_key(temperature, top_p))
        if measured is not None:
            return measured
        if self.worker.tuner is not None:
            return 1.0 / self.worker.tuner.profile.token_time(), "estimated"
        return None, ""

    def baseline_html(self, temperature: float, top_p: float) -> str:
        temperature, top_p = sampling(temperature, top_p)
        rate, source = self.baseline(temperature, top_p)
        if rate is None:
            text = "Target alone: not measured yet (Compare, or Measure, measures it)."
        elif figures.is_measured(source):
            when = " at launch, before any page drew on the cores" if source == MEASURED_AT_START else ""
            text = (f"Target alone: <b>{rate:.1f} tokens/s</b>, measured on this machine{when} at T={temperature:g}, "
                    f"top-p {top_p:g}.")
        else:
            origin = self.worker.tuner.origin if self.worker.tuner is not None else ""
            whose = "measured on this machine" if origin == "this machine" else html.escape(origin)
            text = (f"Target alone: ≈{rate:.1f} tokens/s, <i>estimated</i> from the device profile ({whose}; "
                    f"Measure replaces it with a measurement of this setting).")
        return f"<div class='sc-baseline'>{text}</div>"

    @staticmethod
    def _baseline_request(temperature: float, top_p: float, seed: int = 0) -> GenerationRequest:
        """What "Measure the target alone" decodes: a short fixed prompt, no draft."""
        settings = settings_from(max_new_tokens=BASELINE_TOKENS, temperature=temperature, top_p=top_p, tree=None,
                                 seed=seed, method="autoregressive", copies=False)
        return GenerationRequest(system="", messages=[{"role": "user", "content": BASELINE_PROMPT}],
                                 settings=settings, keep_cache=False)  # the chat's cache stays

    def measure_baseline_now(self, temperature: float = 0.0, top_p: float = 1.0) -> float | None:
        """Decode the fixed prompt with the target alone now (blocking, queued behind the worker's
        other jobs) and keep its rate, so the stats line compares with a measurement of this
        machine rather than the profile's estimate; the rate, or None if it did not finish."""
        job = self.worker.submit(self._baseline_request(temperature, top_p), session="startup-baseline")
        return self.record_baseline(temperature, top_p, _finished_run(job), MEASURED_AT_START)

    def measure_baseline(self, temperature, top_p, seed, request: gr.Request | None = None):
        """Decode a short fixed prompt with the target alone and keep its rate for this setting."""
        c = self.c
        temperature, top_p = sampling(temperature, top_p)
        session = getattr(request, "session_hash", None) or "local"
        req = self._baseline_request(temperature, top_p, int(clamp(seed, 0, 2**31 - 1, int)))
        try:
            job = self.worker.submit(req, session=session)
        except SessionBusy:
            yield {c.baseline_info: self.baseline_html(temperature, top_p)
                   + status_html("An answer is still running: measure after it.", "warn")}
            return
        yield {c.baseline_info: status_html(f"Measuring the target alone ({BASELINE_TOKENS} tokens)…", "info")}
        finished = _finished_run(job)
        if finished is None:
            yield {c.baseline_info: self.baseline_html(temperature, top_p)
                   + status_html("The measurement was stopped or failed.", "warn")}
            return
        self.record_baseline(temperature, top_p, finished)
        yield {c.baseline_info: self.baseline_html(temperature, top_p)}

    def calibration(self, temperature: float, top_p: float) -> Calibration:
        """The acceptance calibration of the pair in use nearest to (temperature, top_p): what trees
        are built for and predictions use: the worker's planner's, the one its trees are decided with)."""
        return self.worker.planner.calibration(temperature, top_p)

    # ----- chat ------------------------------------------------------------------------------
    def respond(self, message, history, run, system, temperature, top_p, max_new, seed, method, size, depth,
                auto, compare, highlight, present=False, request: gr.Request | None = None):
        message = clean_text(message or "").strip()
        if not message:
            gr.Info("Type a message first: empty messages are not sent.")
            yield {self.c.status: status_html("Empty message ignored: type something first.", "warn")}
            return
        history = list(history or []) + [{"role": "user", "content": message}]
        controls = ChatControls.read((system, temperature, top_p, max_new, seed, method, size, depth, auto, compare,
                                      highlight, present), self.options)
        yield from self._answer(history, message, controls, request)

    def regenerate(self, history, run, system, temperature, top_p, max_new, seed, method, size, depth, auto,
                   compare, highlight, present=False, request: gr.Request | None = None):
        history = list(history or [])
        while history and history[-1]["role"] == "assistant":
            history.pop()
        if not history:
            gr.Info("Nothing to regenerate yet.")
            yield {self.c.status: status_html("Nothing to regenerate yet.", "warn")}
            return
        controls = ChatControls.read((system, temperature, top_p, max_new, seed, method, size, depth, auto, compare,
                                      highlight, present), self.options)
        yield from self._answer(history, "", controls, request)

    def edit_message(self, history, run, system, temperature, top_p, max_new, seed, method, size, depth, auto,
                     compare, highlight, present=False, edit: gr.EditData = None, request: gr.Request | None = None):
        """One of the user's messages edited in the chat: the conversation from there is answered
        again, as a branch beside what followed it (‹ › steps between them)."""
        history = list(history or [])
        index = edit.index[0] if isinstance(getattr(edit, "index", None), (list, tuple)) else getattr(edit, "index", -1)
        value = getattr(edit, "value", "")
        if isinstance(value, list):  # text parts
            value = "".join(part.get("text", "") for part in value if isinstance(part, dict))
        message = clean_text(str(value or "")).strip()
        if not isinstance(index, int) or not 0 <= index < len(history) or history[index]["role"] != "user" or not message:
            yield {self.c.status: status_html("Only your own messages can be edited, and not to nothing.", "warn"),
                   self.c.chatbot: display_messages(history)}
            return
        history = history[:index] + [{"role": "user", "content": message}]
        controls = ChatControls.read((system, temperature, top_p, max_new, seed, method, size, depth, auto, compare,
                                      highlight, present), self.options)
        yield from self._answer(history, message, controls, request)

    def _answer(self, history, message: str, controls: ChatControls, request):
        """Send ``history`` (whose last turn is the user's ``message``, "" when regenerating) with
        the settings ``controls`` name, and stream the answer's updates."""
        c, worker = self.c, self.worker
        session = getattr(request, "session_hash", None) or "local"
        copies, expected = self.free_drafts(session)
        try:
            settings = controls.settings(worker.tuner is not None, copies, self.explain.wants_trace(session))
            decision = worker.decide(settings)
        except EngineError as exc:
            yield {c.status: status_html(f"Bad tree settings: {html.escape(str(exc))}", "error")}
            return
        try:  # an early refusal only: the worker tokenises the conversation again when the job runs
            _, dropped = fit_context(worker.tokenizer, controls.system, history, worker.context_limit(settings))
        except ContextTooLong as exc:
            gr.Warning(str(exc))
            yield {c.status: status_html(html.escape(f"Not sent: {exc}"), "error")}
            return
        notices = [dropped_notice(dropped, worker.engine.max_context)] if dropped else []
        request_ = GenerationRequest(system=controls.system, messages=list(history), settings=settings,
                                     compare=controls.compare, prediction=expected,
                                     time_alone_every=int(self.options["time_alone_every"]))
        try:
            job = worker.submit(request_, session=session)  # refused while this session has a job
        except SessionBusy:
            gr.Warning("An answer is still streaming: your message waits in the box. Press Stop, or send it "
                       "when the answer is done.")
            yield {c.status: status_html("Not sent: an answer is still streaming. Your message stays in the box; "
                                         "send it when the answer is done, or press Stop first.", "warn")}
            return
        except QueueFull as exc:
            gr.Warning(f"Not sent: {exc}.")
            yield {c.status: status_html(html.escape(f"Not sent: {exc} (about {exc.retry_after} s). Your message "
                                                     "stays in the box."), "warn")}
            return
        epoch = self._epoch(session)
        ask = Ask(history, message, controls, settings, decision, notices)
        try:
            for update in self._stream(job, ask):
                if self._epoch(session) != epoch:
                    return  # Clear or Import replaced this conversation: the answer's updates would undo it
                if c.run in update and self.conversations.store is not None:  # the answer's last update
                    self.conversations.keep(session, ask, update)
                yield update
        finally:
            if not job.finished:
                job.cancel()  # the browser went away or the event was cancelled

    def _stream(self, job: Job, ask: Ask):
        """The answer's updates: through the live feed while the page reads it (then Gradio gets only
        the first and last updates), through Gradio's updates otherwise."""
        feed = self.feeds.open()
        try:
            yield from stream_answer(self, feed, job, ask)
        finally:
            feed.close()

    def export_file(self, system, history, settings=None, run: Run | None = None):
        if not history:
            return gr.update(value=None, interactive=False)
        for old in self.export_dir.glob("*.json"):  # files of earlier turns: served already, prune them
            try:
                if time.time() - old.stat().st_mtime > 3600:
                    old.unlink()
            except OSError:
                pass
        handle, name = tempfile.mkstemp(prefix=f"sequoia-chat-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".json",
                                        dir=self.export_dir)  # a fresh name, however many export at once
        os.close(handle)
        path = Path(name)
        steps = run.steps if isinstance(run, Run) and run.steps else None
        texts = run.texts if steps else None
        path.write_text(export_conversation(system, history, settings, steps, texts), encoding="utf-8")
        return gr.update(value=str(path), interactive=True)

    @property
    def export_dir(self) -> Path:
        """This app's folder of exported conversations: made on the first export, removed with the app."""
        if self._export_dir is None:
            self._export_dir = Path(tempfile.mkdtemp(prefix="sequoia-chat-export-"))
            weakref.finalize(self, shutil.rmtree, self._export_dir, ignore_errors=True)
        return self._export_dir

    # ----- other handlers ---------------------------------------------------------------------
    def stop(self, request: gr.Request | None = None) -> None:
        """Cancel this tab's request; its stream ends within one step and says so itself (writing
        the status from here could land after that final word)."""
        session = getattr(request, "session_hash", None) or "local"
        if not self.worker.cancel_session(session):
            gr.Info("Nothing is running.")

    def _epoch(self, session: str, bump: bool = False) -> int:
        """How many times ``session``'s conversation was replaced (Clear, Import); ``bump`` counts one more."""
        with self._baselines_lock:
            self._epochs[session] = self._epochs.get(session, 0) + bump
            return self._epochs[session]

    def clear(self, request: gr.Request | None = None):
        session = getattr(request, "session_hash", None) or "local"
        self._epoch(session, bump=True)
        self.worker.cancel_session(session)
        c = self.c
        return {**self.conversations.closed(session), c.chatbot: [], c.history: [], c.run: Run(), c.msg: "",
                c.tree_plot: figures.placeholder_figure("The token tree of each step appears here."),
                c.live_tree: "",
                c.slider: gr.update(visible=False), c.steps_plot: figures.placeholder_figure(
                    "Per-step chart appears as tokens are committed", 220),
                c.stats: "", c.status: status_html("Cleared.", "info"),
                c.compare_md: gr.update(value="", visible=False),
                c.highlight_view: gr.update(value=highlight_html(self.worker.tokenizer, [])),
                c.export_btn: gr.update(value=None, interactive=False), c.stop_btn: gr.update(interactive=False),
                c.replay_row: gr.update(visible=False), c.step_text: ""}

    def show_step(self, step_no, run: Run, highlight):
        if not isinstance(run, Run) or not run.steps:
            return {}
        index = int(clamp(step_no, 1, len(run.steps), int)) - 1
        views = run_views(self, run, index, highlight)
        c = self.c
        return {k: views[k] for k in (c.tree_plot, c.steps_plot, c.step_text, c.highlight_view)}

    def toggle_highlight(self, highlight, run: Run):
        steps = run.steps if isinstance(run, Run) else []
        return gr.update(value=highlight_html(self.worker.tokenizer, steps), visible=bool(highlight))

    def tree_info(self, method, size, depth, auto, temperature, top_p):
        controls = ChatControls.read((None, temperature, top_p, None, None, method, size, depth, auto), self.options)
        tuner = self.worker.tuner
        try:
            decision = self.worker.decide(controls.settings(tuner is not None))
        except EngineError as exc:
            return f"<div class='sc-tree-info sc-error'>{html.escape(str(exc))}</div>"
        temperature, top_p = controls.temperature, controls.top_p
        if decision.choice is not None:
            label = tuner.calibration(temperature, top_p).label()
            profile = ("profile measured on this machine" if tuner.measured_here else
                       f"profile: {tuner.origin} (this machine is measured at the first start)")
            return (f"<div class='sc-tree-info'>auto (hardware-aware optimizer): "
                    f"{describe_choice(decision.choice, markup=True)}"
                    f"<br><span class='sc-calibration'>{html.escape(label)} · {html.escape(profile)}</span></div>")
        calibration = self.calibration(temperature, top_p)
        tree = decision.tree if decision.drafts else None
        extra = ""
        if tree is not None and self.options["predict"] and not calibration.borrowed:
            extra = f" · predicted {tree.expected_tokens(calibration.vector):.2f} tokens/step"
        method, size, depth = controls.method, controls.size, controls.depth
        note = ""
        if method != "chain" and method != "autoregressive" and depth > size - 1 and size > 1:
            note = f" (depth capped at size − 1 = {size - 1})"
        elif tree is not None and method != "chain" and tree.depth < depth:
            note = (f" (you asked for depth {depth}: the DP tree stops at {tree.depth}, deeper nodes are "
                    f"predicted to be accepted less often than wider ones)")
        label = f"<br><span class='sc-calibration'>{html.escape(calibration.label())}</span>" if tree is not None else ""
        versus = ""
        if tree is not None and tuner is not None and method != "autoregressive":
            mine = predict(tree, tuner.calibration(temperature, top_p).vector, tuner.profile).predicted_speedup
            pick = self.worker.decide(settings_from(temperature=temperature, top_p=top_p, method=method)).choice
            where = "here" if tuner.measured_here else f"({html.escape(tuner.origin)})"
            slower = mine < pick.predicted_speedup
            versus = (f"<br><span class='{'sc-warn' if mine < 1 else 'sc-calibration'}'>This tree: predicted "
                      f"{mine:.2f}× the target alone {where}"
                      + (f"; auto picks {html.escape(describe_choice(pick))}" if slower else "") + "</span>")
        return (f"<div class='sc-tree-info'>{html.escape(describe_decision(decision))}{note}{extra}{versus}"
                f"{label}</div>")

    def auto_controls(self, method, auto, temperature, top_p):
        """Size and depth sliders under Auto: disabled, their labels naming the optimizer's pick (the
        user's values stay, for when Auto is turned off)."""
        controls = ChatControls.read((None, temperature, top_p, None, None, method, None, None, auto), self.options)
        choice = self.worker.decide(controls.settings(self.worker.tuner is not None)).choice
        if choice is not None:
            grown = f", grown while the draft is ≥ {choice.confidence:g} sure" if choice.confidence > 0 else ""
            return (gr.update(interactive=False, label=f"Tree size: auto picks {choice.size}{grown} (slider ignored)"),
                    gr.update(interactive=False, label=f"Tree depth: auto picks {choice.depth}{grown} (slider ignored)"))
        off = method == "autoregressive"
        return (gr.update(interactive=not off, label="Tree size" + (" (unused: no draft)" if off else "")),
                gr.update(interactive=not off, label="Tree depth" + (" (unused: no draft)" if off else "")))

    def method_changed(self, method, temperature):
        return method_help(method, temperature)

    def play(self, run, step_no, pace):
        """Start replaying from the shown step (from step 1 when the last one is shown)."""
        if not isinstance(run, Run) or len(run.steps) < 2:
            return gr.update(active=False), gr.update(), gr.update()
        return gr.update(active=True, value=float(pace or 1.5)), gr.update(visible=False), gr.update(visible=True)

    def pause(self):
        return gr.update(active=False), gr.update(visible=True), gr.update(visible=False)

    def tick(self, step_no, run, highlight):
        """One replay tick: the next step, or the end of playing after the last."""
        c = self.c
        if not isinstance(run, Run) or not run.steps:
            return {c.timer: gr.update(active=False)}
        index = int(clamp(step_no, 1, len(run.steps), int))  # 1-based shown step -> next 0-based index
        if index >= len(run.steps):
            index = 0  # pressed Play on the last step: start over
        views = run_views(self, run, index, highlight)
        out = {k: views[k] for k in (c.tree_plot, c.steps_plot, c.slider, c.step_text, c.highlight_view)}
        if index == len(run.steps) - 1:
            out.update({c.timer: gr.update(active=False), c.play_btn: gr.update(visible=True),
                        c.pause_btn: gr.update(visible=False)})
        return out

    def present(self, on, run, highlight):
        """Presentation mode: the page switches with CSS (in the browser); the tree is redrawn larger."""
        c = self.c
        if not isinstance(run, Run) or not run.steps:
            return {}
        run.scale = 1.4 if on else 1.0
        index = len(run.steps) - 1
        return {c.tree_plot: run_views(self, run, index, highlight)[c.tree_plot], c.run: run}

    def export_settings(self, system, history):
        return self.export_file(system, history)

    def import_file(self, file, request: gr.Request | None = None):
        c = self.c
        if file is None:
            return {c.status: status_html("No file chosen.", "warn")}
        path = file if isinstance(file, str) else getattr(file, "name", None) or getattr(file, "path", None)
        try:
            size = os.path.getsize(path)
            if size > MAX_IMPORT_BYTES:
                raise ValueError(f"the file is {size / 1e6:.1f} MB; conversations up to "
                                 f"{MAX_IMPORT_BYTES / 1e6:.0f} MB can be imported")
            with open(path, "rb") as f:
                data = f.read()
            system, history = import_conversation(data)
            steps, texts = import_steps(data)
        except (OSError, ValueError) as exc:
            gr.Warning(f"Import failed: {exc}")
            return {c.status: status_html(html.escape(f"Import failed: {exc}"), "error")}
        session = getattr(request, "session_hash", None) or "local"
        self._epoch(session, bump=True)
        self.worker.cancel_session(session)
        out = {c.chatbot: display_messages(history), c.history: history, c.system: system, c.run: Run(),
               c.status: status_html(f"Imported {len(history)} messages.", "ok"),
               c.export_btn: self.export_file(system, history),
               **{k: v for k, v in self.clear(request).items()
                  if k in (c.tree_plot, c.slider, c.steps_plot, c.stats, c.compare_md, c.highlight_view)}}
        if self.conversations.store is not None:  # a new conversation: stored with its next answer
            out.update({c.conv_id: "", c.conv_list: self.conversations.conversation_list(),
                        **self.conversations.branches(None)})
        if steps:  # the export carried the last answer's steps: its trees and chart come back too
            run = Run(steps=steps, texts=texts)
            out.update(run_views(self, run, len(steps) - 1, True))
            out[c.run] = run
            out[c.export_btn] = self.export_file(system, history, None, run)
            out[c.status] = status_html(f"Imported {len(history)} messages and the last answer's "
                                        f"{len(steps)} steps: replay them with the slider.", "ok")
        return out

    def load_pair(self, target, draft, dtype, device, trust_remote_code):
        c = self.c
        job = self.worker.load_models(target, draft, dtype, device, bool(trust_remote_code))
        position = job.position()
        if position:
            yield {c.models_status: status_html(f"Queued behind {position} request(s)…", "info")}
        for event in job.iter_events():
            if event.kind == "progress":
                yield {c.models_status: status_html(html.escape(event.data), "info")}
            elif event.kind == "done":
                info = self.worker.info
                gr.Info(f"Loaded {info.get('target')} with draft {info.get('draft')}.")
                yield {c.models_status: status_html("Loaded. New answers use this pair.", "ok"),
                       c.models_info: pair_markdown(info), c.header: header_html(self.options["title"], info),
                       c.auto: gr.update(visible=self.worker.tuner is not None, value=False)}
            elif event.kind in ("error", "cancelled"):
                message = event.data if event.kind == "error" else "cancelled"
                gr.Warning(f"Could not load the pair: {message}")
                yield {c.models_status: status_html(
                    f"Could not load the pair: {html.escape(str(message))}<br>The previous pair "
                    f"({html.escape(str(self.worker.info.get('target')))}) is still in use.", "error")}
