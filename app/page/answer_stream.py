"""One answer on screen: a worker job's events turned into the chat's updates as they come
(through the live feed while the page reads it, else Gradio's own updates, both paced), and the
views of a finished run: its tree, replay slider, per-step chart, stats, comparison with the
target alone and highlighted text. The handlers (:mod:`app.page.handlers`) start the job and hand
over; these functions read the app's components, options and worker through it."""
from __future__ import annotations

import functools
import html
import queue
import time
from dataclasses import dataclass, field

import gradio as gr

from engine.core.draft_gate import priced_speedup
from engine.core.records import PrefillProgress
from engine.core.settings import DecodeSettings, TreeDecision

from app.views import figures

from app.views import tree_figures
from app.page.controls import ChatControls
from app.views.conversation import display_messages, highlight_html
from app.page.live_feed import Feed
from app.views.text import describe_choice, describe_decision, dropped_notice, format_seconds, status_html, step_text_html
from app.serving.jobs import Job

clock = time.perf_counter  # what live updates are paced by (looked up at each use: a test's clock counts steps)


@dataclass
class Run:
    """What a finished (or running) answer leaves behind for replay."""

    steps: list = field(default_factory=list)
    texts: dict = field(default_factory=dict)
    tree_desc: str = ""
    expected: float | None = None
    predicted: float | None = None
    baseline: float | None = None
    baseline_source: str = figures.MEASURED  # of ``baseline``: see ``figures.BASELINE_WORDS``
    priced: float | None = None         # its speedup as the device profile prices its steps
    acceptance: str = ""                # which acceptance predicted ``expected`` (PricedBy.label)
    scale: float = 1.0                  # figure font scale (presentation mode)
    main: dict | None = None
    compare: dict | None = None
    identical: bool | None = None


@dataclass(frozen=True)
class Ask:
    """One question as the chat sent it: the conversation (its last turn the user's ``message``,
    "" when regenerating), the controls it was sent with, the settings they make, the tree the
    engine decides for them and the notices to show (turns dropped from the context)."""

    history: list
    message: str
    controls: ChatControls
    settings: DecodeSettings
    decision: TreeDecision
    notices: list

    def export_settings(self) -> dict:
        """The settings an export records."""
        c = self.controls
        return dict(temperature=c.temperature, top_p=c.top_p, max_new_tokens=c.max_new, seed=c.seed,
                    method=c.method, tree=describe_decision(self.decision))


def text_record(text: str, sent: str) -> dict:
    """A live-feed record that takes the page from ``sent`` to ``text``: the delta when ``text``
    extends it, else the whole text (a character completed by a later byte token)."""
    return {"text": text[len(sent):]} if text.startswith(sent) else {"reset": text}


def prefill_text(progress: PrefillProgress) -> str:
    """The status line's HTML while a long prompt is read: a bar, the tokens and the time left."""
    eta = progress.eta_s
    left = "" if eta is None or progress.fraction >= 1.0 else \
        f", about {eta:.0f} s left" if eta < 90 else f", about {eta / 60:.0f} min left"
    return (f'<progress class="sc-prefill" value="{progress.fraction:.3f}" max="1"></progress> '
            f"Reading your message: {progress.done:,} / {progress.total:,} tokens{left}")


@dataclass
class AnswerState:
    """What one answer's events add up to so far: a pure reduction (no Gradio, no clock) that
    :func:`stream_answer` renders. ``who``: what decodes, in words; ``vector``: the calibration
    the expected tokens a step are predicted from (None: no prediction)."""

    run: Run
    who: str
    tokenizer: object
    notice: str = ""
    vector: tuple | None = None
    phase: str = "main"
    tokens: list = field(default_factory=list)
    compare_tokens: list = field(default_factory=list)
    compare_steps: list = field(default_factory=list)
    terminal: object | None = None  # the job's last event
    dirty_text: bool = False
    dirty_plot: bool = False
    whole: bool = False  # the main run finished: its text is complete

    def apply(self, event, texts, max_context: int) -> str | None:
        """Fold one of the job's events in (``texts``: the app's token texts, for the tree's
        labels); the status (HTML) it calls for now, if any."""
        kind, data, run = event.kind, event.data, self.run
        if kind == "started":
            self.phase = event.phase
            self.tokenizer = data.get("tokenizer") or self.tokenizer
            if event.phase == "main":
                return self._started(data, max_context)
        elif kind == "prefill" and event.phase == "main":
            return prefill_text(data)
        elif kind == "step" and event.phase == "main":
            run.steps.append(data)
            self.tokens.extend(data.committed)
            run.texts.update(texts.texts(self.tokenizer, data.tokens + data.committed))
            self.dirty_text = self.dirty_plot = True
        elif kind == "step":
            self.compare_tokens.extend(data.committed)
            self.compare_steps.append(data)
            self.dirty_text = True
        elif kind == "finished" and event.phase == "main":
            run.main, self.whole = data, True
        elif kind == "finished":
            run.compare = data
        elif kind in ("done", "cancelled", "error"):
            self.terminal = event
        return None

    def _started(self, data: dict, max_context: int) -> str:
        if data.get("dropped") is not None:  # as the worker fitted it
            self.notice = dropped_notice(data["dropped"], max_context)
        decision, run = data["decision"], self.run
        priced = decision.priced_by
        if decision.choice is not None:
            run.predicted = decision.choice.predicted_speedup
            run.expected = decision.choice.expected_tokens
            run.tree_desc = f"{decision.method}, auto: " + describe_choice(decision.choice)
        elif self.vector is not None and decision.drafts:
            run.expected = decision.tree.expected_tokens(priced.vector if priced is not None else self.vector)
        run.acceptance = priced.label() if priced is not None and run.expected is not None else ""
        n, alone = data.get("prompt_tokens"), self.who == "the target alone"
        deferred = bool(data.get("draft_later"))
        readers = "the target reads" if alone or deferred else "the target and the draft read"
        later = "; the draft reads it between the first steps" if deferred and not alone else ""
        return (f"Prefill: {readers} the {n if n is not None else ''}-token prompt before the first step{later} "
                f"({html.escape(self.who)})…")

    def text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def decoding_status(self) -> str:
        last = self.run.steps[-1] if self.run.steps else None
        return (f"Decoding with {html.escape(self.who)} · step {len(self.run.steps)} · {len(self.tokens)} tokens"
                + (f" · last step accepted {last.accepted_draft_tokens} of {last.tree_size - 1} drafts"
                   if last is not None and last.tree_size > 1 else "")
                + (f" · the draft is still reading your message ({last.draft_behind:,} tokens to go): "
                   "until then the target checks its own next token"
                   if last is not None and last.draft_behind else "")
                + (" · drafting paused: this answer keeps too few drafts to pay, so the target writes alone "
                   "(a step now and then still drafts, to see if that changes)"
                   if last is not None and last.draft_paused else ""))


def _waiting(position: int | None) -> str:
    return (f"Waiting for the engine: {position} request{'s' if position != 1 else ''} ahead of yours."
            if position else "Starting: preparing the prompt for the engine…")


def _events(job: Job) -> list:
    """The job's next events: one within a quarter second (none: []), then what is already there,
    so a burst of fast steps makes one update."""
    try:
        events = [job.events.get(timeout=0.25)]
    except queue.Empty:
        return []
    while True:
        try:
            events.append(job.events.get_nowait())
        except queue.Empty:
            return events


class _Pacer:
    """When the text and the plots last went to the page."""

    def __init__(self) -> None:
        self.text = self.plot = 0.0

    def plots_due(self, state: AnswerState, now: float, interval: float) -> bool:
        if state.dirty_plot and state.run.steps and now - self.plot >= interval:
            self.plot, state.dirty_plot = now, False
            return True
        return False


def stream_answer(app, feed: Feed, job: Job, ask: Ask):
    """The updates of one answer as ``job``'s events come, for ``app`` (a :class:`app.page.handlers.ChatApp`):
    status, text, live tree and stats while it decodes (through ``feed`` while the page reads it),
    then the finished run's views, its export and the target-alone rate (:func:`finish_answer`)."""
    c, o, controls = app.c, app.options, ask.controls
    calibration = app.calibration(controls.temperature, controls.top_p)
    state = AnswerState(Run(tree_desc=describe_decision(ask.decision), scale=1.4 if controls.present else 1.0),
                        ask.decision.method if ask.decision.drafts else "the target alone", app.worker.tokenizer,
                        " ".join(ask.notices), calibration.vector if o["predict"] and not calibration.borrowed else None)
    history = ask.history + [{"role": "assistant", "content": ""}]
    status = functools.partial(_status, state)
    fed = _FedText(feed)
    position = job.position()
    yield {c.chatbot: display_messages(history[:-1] + [{"role": "assistant", "content": "…"}]),
           c.msg: "", c.history: history[:-1],
           c.live_tree: tree_figures.live_placeholder("Waiting for the first step…", feed=feed.token),
           c.slider: gr.update(visible=False), c.compare_md: gr.update(value="", visible=False),
           c.stats: "", c.status: status(_waiting(position)), c.stop_btn: gr.update(interactive=True),
           c.replay_row: gr.update(visible=False), c.step_text: ""}
    pacer = _Pacer()
    max_context = getattr(app.worker.engine, "max_context", 0)
    while state.terminal is None:
        events = _events(job)
        if not events:
            now_position = job.position()
            if now_position and now_position != position:
                position = now_position
                yield {c.status: status(_waiting(position))}
            continue
        for event in events:
            said = state.apply(event, app.texts, max_context)
            if said is not None:
                yield {c.status: status(said)}
            if event.kind == "finished" and event.phase == "main" and feed.subscribed:
                fed.level(state.text())  # the answer is whole: its last tokens show now, not after Compare's run
        update = _live_update(app, state, feed, fed, pacer, history)
        if update:
            yield update
    yield finish_answer(app, ask, state, fed, history)


def _status(state: AnswerState, text: str, kind: str = "info") -> str:
    notice = state.notice
    return status_html(html.escape(notice) + ("<br>" if notice and text else "") + text,
                       "warn" if notice and kind == "info" else kind)


class _FedText:
    """The answer's text as the live feed has sent it."""

    def __init__(self, feed: Feed) -> None:
        self.feed, self.sent = feed, ""

    def record(self, text: str) -> dict:
        record, self.sent = text_record(text, self.sent), text
        return record

    def level(self, text: str) -> None:
        """Bring the page's text level with ``text`` (the answer so far), if it is behind."""
        if text != self.sent:
            self.feed.put(**self.record(text))


def _live_update(app, state: AnswerState, feed: Feed, fed: _FedText, pacer: _Pacer, history: list) -> dict | None:
    """What goes to the page now, paced: a live-feed record while the page reads the feed (then
    Gradio gets nothing), else Gradio's update; None when nothing is due."""
    c, o, run, now = app.c, app.options, state.run, clock()
    if state.terminal is not None or not state.dirty_text:
        return None
    if state.phase == "main" and feed.subscribed:
        if now - pacer.text >= o["feed_interval"]:
            record = fed.record(state.text())
            record["status"] = _status(state, state.decoding_status())
            if pacer.plots_due(state, now, o["feed_tree_interval"]):
                record["tree"] = tree_figures.tree_svg(run.steps[-1], run.texts, scale=1.25 * run.scale)
                line = figures.stats_line(run.steps, expected_tokens=run.expected, acceptance=run.acceptance)
                record["stats"] = figures.markdown_html(line)
            feed.put(**record)
            pacer.text, state.dirty_text = now, False
        return None
    # Compare's race is drawn at the plots' pace: its target alone should pay the page what an answer does
    if now - pacer.text < (o["text_interval"] if state.phase == "main" else o["plot_interval"]):
        return None
    update = {}
    history[-1]["content"] = state.text()
    if state.phase == "main":
        update[c.chatbot] = display_messages(history)
        update[c.status] = _status(state, state.decoding_status())
    else:
        update[c.status] = _status(state, f"Answer done. Now the target alone, for comparison: "
                                          f"{len(state.compare_tokens)} tokens…")
        update[c.compare_md] = gr.update(value=figures.race_html(run.steps, state.compare_steps, len(state.tokens)),
                                         visible=True)
    if pacer.plots_due(state, now, o["plot_interval"]):
        update[c.live_tree] = tree_figures.tree_svg(run.steps[-1], run.texts, scale=1.25 * run.scale)
        update[c.stats] = figures.stats_line(run.steps, expected_tokens=run.expected, acceptance=run.acceptance)
    pacer.text, state.dirty_text = now, False
    return update


def _verdict(state: AnswerState, answer: dict) -> tuple[str, str]:
    """The status line's text and kind once the answer ended (notes a stopped or failed answer)."""
    run, tokens, terminal = state.run, state.tokens, state.terminal
    if terminal.kind == "done":
        reason = (run.main or {}).get("finish_reason")
        text = f"Done: {len(tokens)} tokens in {len(run.steps)} steps" + (
            " (reached max new tokens)." if reason == "length" else ".")
        if run.tree_desc:
            text += f" {html.escape(run.tree_desc[0].upper() + run.tree_desc[1:])}."
        return text, "ok"
    if terminal.kind == "cancelled" and run.main is not None:  # Stop during Compare: the answer was whole
        return (f"Done: {len(tokens)} tokens in {len(run.steps)} steps. The comparison with the target "
                f"alone was stopped."), "warn"
    if terminal.kind == "cancelled":
        answer["note"] = "stopped"
        return f"Stopped after {len(run.steps)} steps ({len(tokens)} tokens).", "warn"
    if tokens:
        answer["note"] = f"error: {terminal.data}"
    return f"The engine failed: {html.escape(str(terminal.data))}", "error"


def finish_answer(app, ask: Ask, state: AnswerState, fed: _FedText, history: list) -> dict:
    """The updates once the job ended: the whole answer, its status, the finished run's views, its
    export and the target-alone rate (a run of the target alone measures it, for this setting)."""
    c, controls, run, answer = app.c, ask.controls, state.run, history[-1]
    answer["content"] = state.text()
    if fed.feed.subscribed and fed.sent:  # the steps since the last record
        fed.level(answer["content"])
    fed.feed.close()
    temperature, top_p = controls.temperature, controls.top_p
    if state.terminal.kind == "done":
        app.record_baseline(temperature, top_p, run.compare)
        if not ask.decision.drafts and not ask.settings.copying:
            app.record_baseline(temperature, top_p, run.main)
        if run.compare is not None:
            run.identical = state.compare_tokens == state.tokens
    run.baseline, run.baseline_source = app.baseline(temperature, top_p)
    tuner = app.worker.tuner
    run.priced = priced_speedup(run.steps, tuner.profile) if tuner is not None and run.steps else None
    text, kind = _verdict(state, answer)
    update = {}
    if kind == "error":
        gr.Warning(f"The engine failed: {state.terminal.data}")
        if not state.tokens:
            history = history[:-2] if ask.message else history[:-1]
            update[c.msg] = ask.message
            text += " Your message is back in the box."
    if history and history[-1] is answer and not state.tokens and state.terminal.kind == "cancelled":
        history = history[:-1]  # stopped before the first token: no empty answer left behind
    update.update({c.chatbot: display_messages(history), c.history: history, c.run: run,
                   c.status: _status(state, text, kind)})
    update.update(run_views(app, run, len(run.steps) - 1 if run.steps else None, controls.highlight,
                            state.tokenizer))
    update[c.export_btn] = app.export_file(controls.system, history, ask.export_settings(), run)
    update[c.stop_btn] = gr.update(interactive=False)
    update[c.baseline_info] = app.baseline_html(temperature, top_p)
    update[c.live_tree] = ""  # the live SVG gives way to the plotly tree (laid out, under it, all along)
    return update


def run_views(app, run: Run, index: int | None, highlight: bool, tokenizer=None) -> dict:
    """Tree, slider, chart, stats, comparison and highlight views of a run."""
    c = app.c
    out = {}
    if index is None or not run.steps:
        out[c.tree_plot] = figures.placeholder_figure("No steps: the answer was stopped before the first one.")
        out[c.slider] = gr.update(visible=False)
        out[c.replay_row] = gr.update(visible=False)
        out[c.step_text] = ""
        out[c.steps_plot] = figures.placeholder_figure("No steps yet", 220)
        out[c.stats] = ""
    else:
        out[c.tree_plot] = tree_figures.tree_figure(run.steps[index], run.texts, scale=run.scale)
        out[c.slider] = gr.update(visible=len(run.steps) > 1, minimum=1, maximum=max(2, len(run.steps)),
                                  value=index + 1, step=1, interactive=True,
                                  label=f"Replay a step (1–{len(run.steps)})")
        out[c.replay_row] = gr.update(visible=len(run.steps) > 1)
        out[c.step_text] = step_text_html(tokenizer or app.worker.tokenizer, run.steps, index)
        out[c.steps_plot] = figures.steps_figure(run.steps, run.baseline, run.expected, run.predicted,
                                                 highlight=run.steps[index].index,
                                                 baseline_source=run.baseline_source)
        out[c.stats] = figures.stats_line(run.steps, run.baseline, run.baseline_source, run.expected, run.priced,
                                          run.acceptance)
    out[c.compare_md] = gr.update(value=compare_markdown(run), visible=run.compare is not None)
    tokenizer = tokenizer or app.worker.tokenizer
    out[c.highlight_view] = gr.update(value=highlight_html(tokenizer, run.steps, current=index),
                                      visible=bool(highlight))
    return out

def compare_markdown(run: Run) -> str:
    if run.compare is None or run.main is None:
        return ""
    m, a = run.main, run.compare

    def rate(r):
        return r["tokens"] / r["decode_s"] if r["decode_s"] > 0 else 0.0

    speed = rate(m) / rate(a) if rate(a) > 0 else 0.0
    same = ("identical tokens ✓" if run.identical else "different tokens (expected when sampling: "
            "both follow the target's distribution)" if run.identical is False else "")
    return (f"<div class='sc-compare'><div class='sc-compare-head'>Compare, measured just now: speculative "
            f"<b>{speed:.2f}×</b> the target alone's decoding speed · {same}</div>"
            f"<table><tr><th></th><th>speculative</th><th>target alone</th></tr>"
            f"<tr><td>wall time (prefill included)</td><td>{format_seconds(m['seconds'])}</td><td>{format_seconds(a['seconds'])}</td></tr>"
            f"<tr><td>decoding</td><td>{rate(m):.1f} tokens/s</td><td>{rate(a):.1f} tokens/s</td></tr>"
            f"<tr><td>tokens / steps</td><td>{m['tokens']} / {m['steps']}</td><td>{a['tokens']} / {a['steps']}</td></tr>"
            f"</table></div>")
