"""One answer on screen: a worker job's events turned into the chat's updates as they come
(through the live feed while the page reads it, else Gradio's own updates, both paced), and the
views of a finished run: its tree, replay slider, per-step chart, stats, comparison with the
target alone and highlighted text. The handlers (:mod:`app.handlers`) start the job and hand
over; these functions read the app's components, options and worker through it."""
from __future__ import annotations

import html
import queue
import time
from dataclasses import dataclass, field

import gradio as gr

from engine.core.draft_gate import priced_speedup
from engine.core.records import PrefillProgress
from engine.trees.tree import Tree

from . import figures, tree_figures
from .conversation import display_messages, highlight_html
from .live_feed import Feed
from .text import describe_choice, dropped_notice, format_seconds, status_html, step_text_html
from .jobs import Job

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
    scale: float = 1.0                  # figure font scale (presentation mode)
    main: dict | None = None
    compare: dict | None = None
    identical: bool | None = None


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


def stream_answer(app, feed: Feed, job: Job, history, message, system, choice, tree_desc, tree, highlight, notices,
                  settings, scale=1.0):
    """The updates of one answer as ``job``'s events come, for ``app`` (a :class:`app.handlers.ChatApp`):
    status, text, live tree and stats while it decodes (through ``feed`` while the page reads it),
    then the finished run's views, its export and the target-alone rate."""
    c, o = app.c, app.options
    run = Run(tree_desc=tree_desc, scale=scale)
    method = settings["method"]
    who = "the target alone" if tree is None or method == "autoregressive" else method
    history = history + [{"role": "assistant", "content": ""}]
    answer = history[-1]
    tokens: list[int] = []
    compare_tokens: list[int] = []
    compare_steps: list = []
    tokenizer = app.worker.tokenizer
    calibration = app.calibration(settings["temperature"], settings["top_p"])
    predict = o["predict"] and not calibration.borrowed
    notice = " ".join(notices)
    phase = "main"
    last_text = last_plot = 0.0
    dirty_text = dirty_plot = False
    fed_text = ""  # the answer's text as the feed has sent it
    position = job.position()
    queued = f"Waiting for the engine: {position} request{'s' if position != 1 else ''} ahead of yours." \
        if position else "Starting: preparing the prompt for the engine…"

    def feed_level(text: str) -> None:
        """Bring the page's text level with ``text`` (the answer so far), if it is behind."""
        nonlocal fed_text
        if text != fed_text:
            feed.put(**text_record(text, fed_text))
            fed_text = text

    def status(text, kind="info"):
        return status_html(html.escape(notice) + ("<br>" if notice and text else "") + text,
                           "warn" if notice and kind == "info" else kind)

    def decoding_status():
        last = run.steps[-1] if run.steps else None
        return status(f"Decoding with {html.escape(who)} · step {len(run.steps)} · {len(tokens)} tokens"
                      + (f" · last step accepted {last.accepted_draft_tokens} of {last.tree_size - 1} drafts"
                         if last is not None and last.tree_size > 1 else "")
                      + (f" · the draft is still reading your message ({last.draft_behind:,} tokens to go): "
                         "until then the target checks its own next token"
                         if last is not None and last.draft_behind else "")
                      + (" · drafting paused: this answer keeps too few drafts to pay, so the target writes alone "
                         "(a step now and then still drafts, to see if that changes)"
                         if last is not None and last.draft_paused else ""))

    yield {c.chatbot: display_messages(history[:-1] + [{"role": "assistant", "content": "…"}]),
           c.msg: "", c.history: history[:-1],
           c.live_tree: tree_figures.live_placeholder("Waiting for the first step…", feed=feed.token),
           c.slider: gr.update(visible=False), c.compare_md: gr.update(value="", visible=False),
           c.stats: "", c.status: status(queued), c.stop_btn: gr.update(interactive=True),
           c.replay_row: gr.update(visible=False), c.step_text: ""}
    terminal = None
    while terminal is None:
        try:
            events = [job.events.get(timeout=0.25)]
        except queue.Empty:
            now_position = job.position()
            if now_position and now_position != position:
                position = now_position
                yield {c.status: status(f"Waiting for the engine: {position} request"
                                        f"{'s' if position != 1 else ''} ahead of yours.")}
            continue
        while True:  # drain what is already there: one UI update for a burst of fast steps
            try:
                events.append(job.events.get_nowait())
            except queue.Empty:
                break
        for event in events:
            kind, data = event.kind, event.data
            if kind == "started":
                phase = event.phase
                tokenizer = data.get("tokenizer") or tokenizer
                if event.phase == "main" and data.get("dropped") is not None:  # as the worker fitted it
                    notice = dropped_notice(data["dropped"], getattr(app.worker.engine, "max_context", 0))
                if phase == "main":
                    n = data.get("prompt_tokens")
                    deferred = bool(data.get("draft_later"))
                    readers = "the target reads" if who == "the target alone" or deferred \
                        else "the target and the draft read"
                    later = "; the draft reads it between the first steps" if deferred and who != "the target alone" \
                        else ""
                    yield {c.status: status(f"Prefill: {readers} the {n if n is not None else ''}-token prompt "
                                            f"before the first step{later} ({html.escape(who)})…")}
                if phase == "main":
                    tc = data.get("tree_choice")
                    if tc is not None:
                        run.predicted = tc.predicted_speedup
                        run.expected = tc.expected_tokens
                        run.tree_desc = f"{method}, auto: " + describe_choice(tc)
                    elif predict and isinstance(data.get("tree"), Tree):
                        run.expected = data["tree"].expected_tokens(calibration.vector)
            elif kind == "prefill" and event.phase == "main":
                yield {c.status: status(prefill_text(data))}
            elif kind == "step" and event.phase == "main":
                run.steps.append(data)
                tokens.extend(data.committed)
                run.texts.update(app.texts.texts(tokenizer, data.tokens + data.committed))
                dirty_text = dirty_plot = True
            elif kind == "step":
                compare_tokens.extend(data.committed)
                compare_steps.append(data)
                dirty_text = True
            elif kind == "finished":
                if event.phase == "main":
                    run.main = data
                    if feed.subscribed:  # the answer is whole: its last tokens show now, not after Compare's run
                        feed_level(tokenizer.decode(tokens, skip_special_tokens=True))
                else:
                    run.compare = data
            elif kind in ("done", "cancelled", "error"):
                terminal = event
        now = clock()
        if terminal is None and dirty_text and phase == "main" and feed.subscribed:
            if now - last_text >= o["feed_interval"]:
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                record, fed_text = text_record(text, fed_text), text
                record["status"] = decoding_status()
                if dirty_plot and run.steps and now - last_plot >= o["feed_tree_interval"]:
                    record["tree"] = tree_figures.tree_svg(run.steps[-1], run.texts, scale=1.25 * run.scale)
                    record["stats"] = figures.markdown_html(figures.stats_line(run.steps, expected_tokens=run.expected))
                    last_plot, dirty_plot = now, False
                feed.put(**record)
                last_text, dirty_text = now, False
            continue
        # Compare's race is drawn at the plots' pace: its target alone should pay the page what an answer does
        pace = o["text_interval"] if phase == "main" else o["plot_interval"]
        if terminal is None and dirty_text and now - last_text >= pace:
            update = {}
            answer["content"] = tokenizer.decode(tokens, skip_special_tokens=True)
            if phase == "main":
                update[c.chatbot] = display_messages(history)
                update[c.status] = decoding_status()
            else:
                update[c.status] = status(f"Answer done. Now the target alone, for comparison: "
                                          f"{len(compare_tokens)} tokens…")
                update[c.compare_md] = gr.update(value=figures.race_html(run.steps, compare_steps, len(tokens)),
                                                 visible=True)
            if dirty_plot and run.steps and now - last_plot >= o["plot_interval"]:
                update[c.live_tree] = tree_figures.tree_svg(run.steps[-1], run.texts, scale=1.25 * run.scale)
                update[c.stats] = figures.stats_line(run.steps, expected_tokens=run.expected)
                last_plot, dirty_plot = now, False
            last_text, dirty_text = now, False
            yield update

    # ----- the end of the answer ------------------------------------------------------------
    answer["content"] = tokenizer.decode(tokens, skip_special_tokens=True)
    if feed.subscribed and fed_text:  # the steps since the last record
        feed_level(answer["content"])
    feed.close()
    update = {}
    kind = "ok"
    temperature, top_p = settings["temperature"], settings["top_p"]
    if terminal.kind == "done":  # a run of the target alone is a measurement of it, for this setting
        app.record_baseline(temperature, top_p, run.compare)
        if tree is None or method == "autoregressive":
            app.record_baseline(temperature, top_p, run.main)
    run.baseline, run.baseline_source = app.baseline(temperature, top_p)
    tuner = app.worker.tuner
    run.priced = priced_speedup(run.steps, tuner.profile) if tuner is not None and run.steps else None
    if terminal.kind == "done":
        if run.compare is not None:
            run.identical = compare_tokens == tokens
        reason = (run.main or {}).get("finish_reason")
        text = f"Done: {len(tokens)} tokens in {len(run.steps)} steps" + (
            " (reached max new tokens)." if reason == "length" else ".")
        if run.tree_desc:
            text += f" {html.escape(run.tree_desc[0].upper() + run.tree_desc[1:])}."
    elif terminal.kind == "cancelled" and run.main is not None:  # Stop during Compare: the answer was whole
        text, kind = (f"Done: {len(tokens)} tokens in {len(run.steps)} steps. The comparison with the target "
                      f"alone was stopped."), "warn"
    elif terminal.kind == "cancelled":
        answer["note"] = "stopped"
        text, kind = f"Stopped after {len(run.steps)} steps ({len(tokens)} tokens).", "warn"
    else:
        error = str(terminal.data)
        gr.Warning(f"The engine failed: {error}")
        kind = "error"
        text = f"The engine failed: {html.escape(error)}"
        if not tokens:
            history = history[:-2] if message else history[:-1]
            update[c.msg] = message
            text += " Your message is back in the box."
        else:
            answer["note"] = f"error: {error}"
    if history and history[-1] is answer and not tokens and terminal.kind == "cancelled":
        history = history[:-1]  # stopped before the first token: no empty answer left behind
    update.update({c.chatbot: display_messages(history), c.history: history, c.run: run,
                   c.status: status(text, kind)})
    update.update(run_views(app, run, len(run.steps) - 1 if run.steps else None, highlight, tokenizer))
    update[c.export_btn] = app.export_file(system, history, settings, run)
    update[c.stop_btn] = gr.update(interactive=False)
    update[c.baseline_info] = app.baseline_html(temperature, top_p)
    update[c.live_tree] = ""  # the live SVG gives way to the plotly tree (laid out, under it, all along)
    yield update


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
        out[c.stats] = figures.stats_line(run.steps, run.baseline, run.baseline_source, run.expected, run.priced)
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
