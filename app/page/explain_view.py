"""The teaching panel under the chat: three tabs built from data the app already has.

- **Why this tree**: the DP table G(n, d) for the acceptance calibration in use, the hardware
  profile, the predicted speedup S(n, d) with the optimizer's pick and the user's setting marked,
  and one line on why the pick wins; under them this machine's limits (:mod:`engine.tuning.roofline`:
  the bandwidth floor and compute roof against the profile and the last answer's steps) with two
  what-if sliders that re-run the optimizer. Follows the temperature, top-p, method, size, depth and
  auto controls; no model runs (the tables are cached, :mod:`engine.tuning.explain`).
- **Step through the verifier**: the last answer's steps, decision by decision (Prev / Next or the
  sliders): p and q, the uniform r against min(1, p/q), the residual after a rejection, in a
  sentence. Needs the verifier's trace, which the engine records only when asked: the app asks
  while "Record the verifier's walk" is ticked (opening the tab ticks it) for the next answers.
- **Acceptance per position**: per depth, accepted / reached over every answer of the
  conversation since Clear, against the calibration's prediction.

:class:`ExplainView` owns the components and is given the app it serves (its options, worker,
calibrations and token texts); :class:`app.page.handlers.ChatApp` holds one and :func:`app.page.ui.build`
lays it out under its main row and wires it to its controls. What the controls mean comes from
:mod:`app.page.controls`, below both.
"""
from __future__ import annotations

import html
import threading

import gradio as gr

from engine.core.settings import settings_from
from engine.errors import EngineError
from engine.trees.tree import Tree
from engine.tuning import explain
from engine.tuning import roofline as rl
from engine.tuning.acceptance import nearest_setting
from engine.tuning.optimizer import predict

from app.views import explain_figures as xf
from app.views import explain_text
from app.views import figures
from app.views import roofline_figures as rf
from app.page.controls import ChatControls, sampling


def _walk_position(run, step_no, event_no) -> tuple[int, int]:
    steps = run.steps if run is not None and getattr(run, "steps", None) else []
    if not steps:
        return 0, 0
    step = int(max(1, min(len(steps), int(step_no or len(steps))))) - 1
    events = steps[step].trace or []
    event = int(max(1, min(max(len(events), 1), int(event_no or 1)))) - 1
    return step, event


class ExplainView:
    """Components and handlers of the three teaching tabs (one per built demo)."""

    def __init__(self, app) -> None:
        self.app = app
        self._tracing: set[str] = set()
        self._lock = threading.Lock()

    # ----- the trace flag, per browser session ----------------------------------------------------
    def wants_trace(self, session: str | None) -> bool:
        """Whether answers of ``session`` should carry the verifier's trace."""
        with self._lock:
            return (session or "local") in self._tracing

    def set_trace(self, on, request: gr.Request | None = None) -> None:
        session = getattr(request, "session_hash", None) or "local"
        with self._lock:
            (self._tracing.add if on else self._tracing.discard)(session)

    # ----- why this tree ----------------------------------------------------------------------------
    def why(self, method, size, depth, auto, temperature, top_p):
        """``(text, G figure, S figure, profile figure)`` for the controls as they are."""
        o = self.app.options
        controls = ChatControls.read((None, temperature, top_p, None, None, method, size, depth, auto), o)
        temperature, top_p, size, depth = controls.temperature, controls.top_p, controls.size, controls.depth
        worker = self.app.worker
        calibration = self.app.calibration(temperature, top_p)
        vector = calibration.vector
        tuner = worker.tuner
        profile = tuner.profile if tuner is not None else None
        chains = method == "chain"
        try:  # what Auto runs (the optimizer's pick, for sequoia when the method drafts nothing), and your tree
            pick = worker.decide(settings_from(temperature=temperature, top_p=top_p,
                                               method="sequoia" if method == "autoregressive" else method)).choice
            decision = worker.decide(controls.settings(tuner is not None))
        except EngineError as exc:
            return (f"<div class='sc-why-text sc-error'>{html.escape(str(exc))}</div>",) + (gr.update(),) * 3
        auto_on = decision.auto
        tree = decision.tree if decision.drafts else None
        mine_tree = tree if tree is not None else Tree.chain(0)
        yours = (mine_tree.size, max(1, mine_tree.depth if chains or auto_on else min(depth, max(size - 1, 1))))
        max_size = max(o["max_tree_size"], pick.size if pick is not None else 1)
        tables = explain.tables(vector, profile, max_size, o["max_depth"], chains)
        where = (pick.size, max(pick.depth, 1)) if pick is not None else None
        if where == yours:
            yours = None  # one marker, "pick"
        g_fig = xf.expected_heatmap(tables, where, yours, calibration.label().removeprefix("acceptance: "))
        s_fig = xf.speedup_heatmap(tables, where, yours)
        lines = []
        if profile is not None:
            mine = pick if auto_on else predict(mine_tree, vector, profile)
            lines.append(f"<div class='sc-why-line'>{html.escape(explain_text.explain_choice(pick, mine, profile))}</div>")
            best = tables.best()
            if best is not None and best["speedup"] > pick.predicted_speedup * 1.001:
                lines.append(f"<div class='sc-why-note'>The table's best cell, n = {best['size']}, d = {best['depth']} "
                             f"({best['speedup']:.2f}×), is a size the optimizer does not try: it tries every size "
                             f"up to 16, then about 8 per octave.</div>")
            if method == "autoregressive":
                lines.append("<div class='sc-why-note'>Method autoregressive: the pick shown is what sequoia "
                             "would draft.</div>")
            if calibration.borrowed:
                lines.append("<div class='sc-why-note'>This pair has no calibration of its own: G uses the embedded "
                             "pair's, so these predictions are only indicative.</div>")
            prof = xf.profile_figure(profile)
            caption = xf.profile_caption(profile, explain_text.profile_source(profile))
        else:
            g = mine_tree.expected_tokens(vector)
            lines.append(f"<div class='sc-why-line'>No hardware profile for this pair on this device, so no speedup "
                         f"is predicted and there is no optimizer pick: your tree expects {g:.2f} tokens per step "
                         f"(G), whatever a step costs here. <code>python -m engine.cli.profile</code> measures a "
                         f"profile.</div>")
            prof = figures.placeholder_figure("No hardware profile for this pair and device.", 300)
            caption = ""
        label = html.escape(calibration.label())
        text = (f"<div class='sc-why'>{''.join(lines)}<div class='sc-why-note'>{label} · vector p₁…p₄ = "
                f"{', '.join(f'{p:.2f}' for p in vector[:4])}…</div>{caption}</div>")
        return text, g_fig, s_fig, prof

    # ----- this machine's limits -------------------------------------------------------------------
    def _roofline(self):
        """The :class:`~engine.tuning.roofline.Roofline` of the pair in use (the machine's limits are
        measured the first time, about a second, then kept for the process), None without models."""
        engine = self.app.worker.engine
        engine = getattr(engine, "_engine", engine)
        target = getattr(engine, "target", None)
        if target is None:
            return None
        tuner = self.app.worker.tuner
        return rl.roofline_of(rl.machine_limits(), tuner.profile if tuner is not None else None, target,
                              getattr(engine, "draft", None))

    def roofline(self, draft_scale, target_scale, run, method, temperature, top_p):
        """``(roofline figure, what-if S figure, sentence HTML)``: the machine's limits, the profile, the
        last answer's steps and the optimizer's pick with every draft level ``draft_scale`` times as
        dear and the target ``target_scale`` times as large."""
        temperature, top_p = sampling(temperature, top_p)
        scales = (float(draft_scale or 1.0), float(target_scale or 1.0))
        roofline = self._roofline()
        if roofline is None:
            return (figures.placeholder_figure("No models loaded.", 400),
                    figures.placeholder_figure("No models loaded.", 340), "")
        steps = run.steps if run is not None and getattr(run, "steps", None) else []
        tuner = self.app.worker.tuner
        if roofline.profile is None or tuner is None:
            s_fig = figures.placeholder_figure("No hardware profile for this pair and device: no speedup to "
                                               "predict, no pick to move.", 340)
            return rf.roofline_figure(roofline, None, steps), s_fig, rf.roofline_html(None, roofline, scales)
        vector = self.app.calibration(temperature, top_p).vector
        confidence = tuner.confidence.get(nearest_setting(tuner.acceptance, temperature, top_p))
        grid = (tuner.max_size or max(roofline.profile.target), tuner.max_depth)
        what = rl.what_if(roofline, vector, scales[0], scales[1], grid, method == "chain", confidence)
        pick = what.pick
        scaled = what.roofline
        chart = rf.roofline_figure(scaled, (pick.size, scaled.profile.target_time(pick.size)),
                                   steps if scales == (1.0, 1.0) else ())
        title = ("S(n, d) on this machine" if scales == (1.0, 1.0) else
                 f"S(n, d) if a draft level cost ×{scales[0]:g} and the target were ×{scales[1]:g}")
        s_fig = xf.speedup_heatmap(what.tables, (pick.size, max(pick.depth, 1)), None, title,
                                   "pick" if scales == (1.0, 1.0) else "what-if pick")
        return chart, s_fig, rf.roofline_html(what, scaled, scales)

    def target_size_label(self) -> str:
        """The target-size slider's label: the target's size in the weights of its matrices."""
        roofline = self._roofline()
        if roofline is None or not roofline.target_macs:
            return "What if the target were × as large"
        billions = roofline.target_macs / 1e9
        return (f"What if the target were × as large (this one: {billions:.2f}B weights in its matrices; "
                f"7B ≈ ×{7 / billions:.1f})" if billions >= 0.1 else "What if the target were × as large")

    # ----- step-through ------------------------------------------------------------------------------
    def walk(self, run, step_no, event_no):
        """``(step slider, event slider, sentence HTML, tree figure, bars figure)`` at one decision."""
        steps = run.steps if run is not None and getattr(run, "steps", None) else []
        if not steps:
            return (gr.update(visible=False), gr.update(visible=False),
                    "<div class='sc-walk-text'>Send a message: its steps can then be walked through here.</div>",
                    figures.placeholder_figure("The tree of the chosen step appears here.", 300),
                    figures.placeholder_figure("p and q of the decision appear here.", 300))
        s, e = _walk_position(run, step_no, event_no)
        step = steps[s]
        texts = self._texts(run, step)
        step_slider = gr.update(visible=len(steps) > 1, minimum=1, maximum=max(2, len(steps)), value=s + 1,
                                label=f"Step of the last answer (1–{len(steps)})")
        events = step.trace or []
        if not events:
            return (step_slider, gr.update(visible=False),
                    "<div class='sc-walk-text sc-walk-missing'>This answer was decoded without the verifier's "
                    "trace. Tick <b>Record the verifier's walk</b> (above) and send a message or press "
                    "Regenerate: the next answer's steps can then be walked through decision by decision.</div>",
                    xf.focus_tree(step, texts, None), figures.placeholder_figure("No trace for this step.", 300))
        event = events[e]
        event_slider = gr.update(visible=len(events) > 1, minimum=1, maximum=max(2, len(events)), value=e + 1,
                                 label=f"Decision of step {s + 1} (1–{len(events)})")
        after = xf._earlier_rejections(events, event)
        sentence = xf.event_sentence(step, event, texts)
        head = (f"<div class='sc-walk-head'>Step {s + 1}, decision {e + 1} of {len(events)} · "
                f"{'greedy (T = 0)' if step.greedy else html.escape(step.method)}</div>")
        note = ("<div class='sc-why-note'>Bars: each distribution's 8 most likely tokens at this moment (no bar: "
                "outside that distribution's top 8); the judged token is outlined. Tree: the walk stands on the black "
                "chip and judges the amber one.</div>")
        text = (f"<div class='sc-walk-text'>{head}<div class='sc-walk-sentence'>{sentence}</div>"
                f"{xf.acceptance_gauge(event)}{note}</div>")
        bars = xf.event_figure(event, texts, after_rejection=after and event.rule == "sample",
                               renormalised_q=after and step.method != "specinfer" and event.rule == "sample")
        return step_slider, event_slider, text, xf.focus_tree(step, texts, event), bars

    def walk_step(self, run, step_no):
        """The step slider moved: its first decision."""
        return self.walk(run, step_no, 1)

    def move(self, run, step_no, event_no, delta: int):
        """Prev / Next decision; past either end of a step, on to the neighbouring step."""
        steps = run.steps if run is not None and getattr(run, "steps", None) else []
        if not steps:
            return self.walk(run, step_no, event_no)
        s, e = _walk_position(run, step_no, event_no)
        count = len(steps[s].trace or [])
        e += delta
        if e >= count and s + 1 < len(steps):
            s, e = s + 1, 0
        elif e < 0 and s > 0:
            s = s - 1
            e = max(len(steps[s].trace or []) - 1, 0)
        return self.walk(run, s + 1, max(e, 0) + 1)

    def _texts(self, run, step) -> dict[int, str]:
        tokens = set(step.tokens) | set(step.committed)
        for event in step.trace or []:
            tokens.add(event.token)
            if event.target_token is not None:
                tokens.add(event.target_token)
            for group in (event.top_p, event.top_q, event.residual or []):
                tokens.update(t for t, _ in group)
        known = dict(run.texts or {})
        missing = [t for t in tokens if t not in known]
        tokenizer = self.app.worker.tokenizer
        if missing and tokenizer is not None:
            known.update(self.app.texts.texts(tokenizer, missing))
        return known

    # ----- acceptance per position --------------------------------------------------------------------
    def acceptance(self, conversation, temperature, top_p):
        """``(figure, definitions HTML)`` over every answer of the conversation."""
        steps = [s for answer in (conversation or []) for s in answer]
        calibration = self.app.calibration(*sampling(temperature, top_p))
        vector = None if calibration.borrowed else calibration.vector
        rows = xf.acceptance_by_depth(steps, vector)
        tokens = sum(len(s.committed) for s in steps)
        fig = xf.acceptance_figure(rows, calibration.label().removeprefix("acceptance: ") if vector else "",
                                   tokens / len(steps) if steps else None)
        answers = len(conversation or [])
        note = (f"Over {answers} answer{'s' if answers != 1 else ''} ({len(steps)} steps) of this conversation "
                f"since Clear. ") if steps else ""
        return fig, f"<div class='sc-acc-text'>{note}{xf.ACCEPTANCE_DEFINITIONS}</div>"

    def after_answer(self, run, conversation, temperature, top_p):
        """After an answer (or an import): add its steps to the conversation, show its last step's walk
        and the acceptance chart."""
        conversation = list(conversation or [])
        steps = run.steps if run is not None and getattr(run, "steps", None) else []
        if steps and not any(answer is steps or answer == steps for answer in conversation[-1:]):
            conversation.append(steps)
        walk = self.walk(run, len(steps), 1)
        fig, text = self.acceptance(conversation, temperature, top_p)
        return (conversation, *walk, fig, text)

    def cleared(self, temperature, top_p):
        fig, text = self.acceptance([], temperature, top_p)
        return ([], *self.walk(None, 1, 1), fig, text)

    # ----- layout and wiring --------------------------------------------------------------------------
    def build(self) -> None:
        """The tabs, placed where the caller is in its layout."""
        o = self.app.options
        c = self.c = type("ExplainComponents", (), {})()
        why = self.why(o["method"], o["tree_size"], o["depth"], False, o["temperature"], o["top_p"])
        with gr.Tabs(elem_id="sc-explain"):
            with gr.Tab("Why this tree", id="why", elem_id="sc-why-tab"):
                c.why_text = gr.HTML(why[0], elem_id="sc-why-text")
                with gr.Row(equal_height=False):
                    c.g_plot = gr.Plot(why[1], show_label=False, elem_id="sc-why-g", min_width=320)
                    c.s_plot = gr.Plot(why[2], show_label=False, elem_id="sc-why-s", min_width=320)
                c.profile_plot = gr.Plot(why[3], show_label=False, elem_id="sc-why-profile")
                self._build_roofline(c)
            with gr.Tab("Step through the verifier", id="walk", elem_id="sc-walk-tab") as c.walk_tab:
                c.trace_box = gr.Checkbox(False, label="Record the verifier's walk (for the next answers; costs no "
                                                       "model run)", elem_id="sc-trace")
                with gr.Row(equal_height=True):
                    c.prev_btn = gr.Button("◀ Prev", size="sm", scale=0, min_width=80, elem_id="sc-walk-prev")
                    c.next_btn = gr.Button("Next ▶", size="sm", scale=0, min_width=80, elem_id="sc-walk-next")
                    c.step_slider = gr.Slider(1, 2, value=1, step=1, visible=False, label="Step",
                                              elem_id="sc-walk-step", scale=2)
                    c.event_slider = gr.Slider(1, 2, value=1, step=1, visible=False, label="Decision",
                                               elem_id="sc-walk-event", scale=2)
                empty = self.walk(None, 1, 1)
                c.walk_text = gr.HTML(empty[2], elem_id="sc-walk-text")
                with gr.Row(equal_height=False):
                    c.walk_tree = gr.Plot(empty[3], show_label=False, elem_id="sc-walk-tree", min_width=320)
                    c.walk_bars = gr.Plot(empty[4], show_label=False, elem_id="sc-walk-bars", min_width=320)
            with gr.Tab("Acceptance per position", id="acceptance", elem_id="sc-acc-tab"):
                fig, text = self.acceptance([], o["temperature"], o["top_p"])
                c.acc_plot = gr.Plot(fig, show_label=False, elem_id="sc-acc-plot")
                c.acc_text = gr.HTML(text, elem_id="sc-acc-text")
            c.conversation = gr.State([])

    def _build_roofline(self, c) -> None:
        """The roofline panel: the what-if sliders, the chart and S(n, d) under them, the sentence."""
        o = self.app.options
        with gr.Column(elem_id="sc-roofline"):
            gr.HTML("<div class='sc-why-note'><b>This machine's limits.</b> A forward streams all its weights "
                    "once (the bandwidth floor) and computes every row (the compute roof): where the measured "
                    "curves sit against them decides how big a tree pays. Move the sliders to see the pick move.</div>")
            with gr.Row(equal_height=True):
                c.draft_scale = gr.Slider(0.25, 2.0, value=1.0, step=0.05, elem_id="sc-roof-draft",
                                          label="What if a draft level cost × as much")
                c.target_scale = gr.Slider(0.25, 5.0, value=1.0, step=0.05, elem_id="sc-roof-target",
                                           label=self.target_size_label())
            chart, s_fig, text = self.roofline(1.0, 1.0, None, o["method"], o["temperature"], o["top_p"])
            with gr.Row(equal_height=False):
                c.roof_plot = gr.Plot(chart, show_label=False, elem_id="sc-roof-plot", min_width=320)
                c.roof_s_plot = gr.Plot(s_fig, show_label=False, elem_id="sc-roof-s", min_width=320)
            c.roof_text = gr.HTML(text, elem_id="sc-roof-text")

    def wire(self, answered: list, cleared: list) -> None:
        """Event hooks: the controls redraw "why"; ``answered`` (events that end with a new run in
        the app's ``run`` state) refresh the walk and the acceptance chart; ``cleared`` resets them."""
        a, c = self.app.c, self.c
        quiet = dict(api_visibility="private", show_progress="hidden")
        controls = [a.method, a.size, a.depth, a.auto, a.temperature, a.top_p]
        for control in controls:
            control.change(self.why, controls, [c.why_text, c.g_plot, c.s_plot, c.profile_plot],
                           trigger_mode="always_last", **quiet)
        roof_in = [c.draft_scale, c.target_scale, a.run, a.method, a.temperature, a.top_p]
        roof_out = [c.roof_plot, c.roof_s_plot, c.roof_text]
        for control in (c.draft_scale, c.target_scale):
            control.input(self.roofline, roof_in, roof_out, trigger_mode="always_last", **quiet)
        for control in (a.method, a.temperature, a.top_p):
            control.change(self.roofline, roof_in, roof_out, trigger_mode="always_last", **quiet)
        walk_out = [c.step_slider, c.event_slider, c.walk_text, c.walk_tree, c.walk_bars]
        after_out = [c.conversation, *walk_out, c.acc_plot, c.acc_text]
        for event in answered:
            event.then(self.after_answer, [a.run, c.conversation, a.temperature, a.top_p], after_out, **quiet)
            event.then(self.roofline, roof_in, roof_out, **quiet)
        for event in cleared:
            event.then(self.cleared, [a.temperature, a.top_p], after_out, **quiet)
        c.trace_box.change(self.set_trace, c.trace_box, None, **quiet)
        c.walk_tab.select(lambda: True, None, c.trace_box, **quiet)
        c.step_slider.input(self.walk_step, [a.run, c.step_slider], walk_out, trigger_mode="always_last", **quiet)
        c.event_slider.input(self.walk, [a.run, c.step_slider, c.event_slider], walk_out,
                             trigger_mode="always_last", **quiet)
        c.prev_btn.click(lambda run, s, e: self.move(run, s, e, -1), [a.run, c.step_slider, c.event_slider],
                         walk_out, **quiet)
        c.next_btn.click(lambda run, s, e: self.move(run, s, e, +1), [a.run, c.step_slider, c.event_slider],
                         walk_out, **quiet)
        for control in (a.temperature, a.top_p):
            control.change(self.acceptance, [c.conversation, a.temperature, a.top_p], [c.acc_plot, c.acc_text],
                           trigger_mode="always_last", **quiet)
