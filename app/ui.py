"""The web UI: ``build_demo(worker, tokenizer, options)`` returns the ``gr.Blocks`` app.

The chat streams the answer as the engine commits tokens; next to it the token tree of the
current step is drawn live (at most ``plot_interval`` apart), then a slider replays any step.
Every request goes through the :class:`app.worker.Worker`, which owns the models.
"""
from __future__ import annotations

import html
import os
import queue
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import gradio as gr

from engine.acceptance import EMBEDDED_PAIR, Calibration, calibration_for
from engine.errors import EngineError
from engine.models import pair_name
from engine.speculative import METHODS
from engine.tree import Tree
from engine.tree_store import build_tree

from . import figures
from .explain_view import ExplainView
from .conversation import (MAX_IMPORT_BYTES, ContextTooLong, clean_text, display_messages, export_conversation,
                           fit_context, highlight_html, import_conversation, import_steps)
from .worker import GenerationRequest, Job, SessionBusy, Worker

ASSETS = Path(__file__).resolve().parent.parent / "assets"
CSS_PATH = ASSETS / "style.css"

DEFAULTS = {
    "title": "Sequoia Chat",
    "system_prompt": "",
    "temperature": 0.0,
    "top_p": 1.0,
    "max_new_tokens": 256,
    "max_new_tokens_limit": 2048,
    "seed": 0,
    "method": "sequoia",
    "tree_size": 8,
    "depth": 4,
    "max_tree_size": 64,
    "max_depth": 16,
    "compare": False,
    "highlight": False,
    # the pair (as calibrations name it) whose acceptance calibrations shape DP trees and predictions
    "pair": EMBEDDED_PAIR,
    # show predicted tokens/step; also off whenever the pair in use has no calibration of its own
    "predict": True,
    "plot_interval": 0.2,   # seconds between live tree redraws (<= 5 per second)
    "text_interval": 0.05,  # seconds between text updates
}

METHOD_HELP = {
    "sequoia": "Sequoia: children sampled without replacement (its verifier)",
    "specinfer": "SpecInfer: children sampled independently",
    "chain": "chain: classic speculative decoding along one path of the given depth",
    "topk": "top-k: the draft's top children, the target samples and matches",
    "autoregressive": "the target alone, one token per step",
}

# how each method decides whether a drafted child is kept (temperature > 0)
ACCEPT_RULE = {
    "sequoia": "tries the children in rank order and keeps one with probability min(1, p/q); after a "
               "rejection p becomes the residual and q is renormalised without the rejected token",
    "specinfer": "like sequoia, but q is the draft's distribution as sampled (children drawn independently, "
                 "with replacement), so it is not renormalised",
    "chain": "one child per level: kept with probability min(1, p/q), the classic speculative sampling rule",
    "topk": "the target samples its own token; a child is kept if it is exactly that token",
    "autoregressive": "nothing is drafted: the target writes one token per step",
}

# the embedded pair, by the ids the loaders use
MODEL_NAMES = {"default-target": "Qwen2.5-Coder-1.5B-Instruct", "default-draft": "Qwen2.5-Coder-0.5B-Instruct"}
BASELINE_PROMPT = "Write a short paragraph about trees."  # what "Measure the target alone" decodes
BASELINE_TOKENS = 48
COLLAPSE_BELOW = 1280  # px: narrower windows start with the settings sidebar closed

# on load: open the settings sidebar only where there is room for it beside the tree and the chat
SIDEBAR_JS = f"""() => {{
  if (window.innerWidth < {COLLAPSE_BELOW}) return;
  const bar = document.querySelector('.sidebar');
  const button = bar && bar.querySelector('.toggle-button');
  if (button && !bar.classList.contains('open')) button.click();
}}"""
# presentation mode: large fonts, the tree and the answer only (CSS under body.sc-present); the
# sidebar closes
PRESENT_JS = """(on, run, highlight) => {
  document.body.classList.toggle('sc-present', !!on);
  const bar = document.querySelector('.sidebar');
  if (on && bar && bar.classList.contains('open')) { const b = bar.querySelector('.toggle-button'); if (b) b.click(); }
  return [on, run, highlight];
}"""

# a small tree: root on the left, three tokens, one accepted path (green)
LOGO = ("<svg class='sc-logo' width='26' height='26' viewBox='0 0 26 26' aria-hidden='true'>"
        "<path d='M4 13 L12 6 M4 13 L12 20 M12 6 L21 4 M12 6 L21 10' stroke='#94a3b8' stroke-width='1.6' fill='none'/>"
        "<path d='M4 13 L12 6 L21 4' stroke='#15803d' stroke-width='2.4' fill='none'/>"
        "<rect x='1' y='10' width='6' height='6' rx='1.5' fill='#334155'/>"
        "<rect x='9' y='3' width='6' height='6' rx='1.5' fill='#16a34a'/>"
        "<rect x='9' y='17' width='6' height='6' rx='1.5' fill='#f87171'/>"
        "<rect x='18' y='1' width='6' height='6' rx='1.5' fill='#16a34a'/>"
        "<rect x='18' y='7' width='6' height='6' rx='1.5' fill='#cbd5e1'/></svg>")

PLACEHOLDER = ("**Sequoia Chat** — a small draft model proposes a *tree* of tokens, the big target model "
               "checks the whole tree in one pass, and the answer is exactly what the target alone would "
               "write. Ask something and watch the tree.\n\n*Enter sends · Shift+Enter adds a line.*")


def model_name(model_id) -> str:
    """The real name of a model id (the embedded pair's ``default-target``/``default-draft``)."""
    model_id = str(model_id or "?")
    return MODEL_NAMES.get(model_id.split(" ")[0], model_id)


def model_format(info: dict, role: str) -> str:
    """How a model of the pair in use is stored, in words: dtype, int4/int8 packing, and for the
    embedded pair where the weights came from (GGUF Q4_K_M, dequantised)."""
    fmt = info.get(f"{role}_format", "none")
    if fmt == "q4k":
        return "int4: the GGUF Q4_K_M blocks as stored"
    words = [fmt] if fmt not in ("none", None) else [str(info.get("dtype", "?"))]
    if str(info.get(role, "")).startswith("default-"):
        words.append("from GGUF Q4_K_M")
    return ", ".join(words)


def method_help(method: str, temperature: float = 1.0) -> str:
    """One line under the Method dropdown: the method and, at T = 0, that every method is greedy."""
    line = METHOD_HELP.get(method, "")
    if method != "autoregressive" and float(temperature or 0) == 0:
        line += ". At T = 0 every method keeps exactly the drafts that match the target's argmax."
    return f"<div class='sc-method-help'>{html.escape(line)}</div>"


def key_html() -> str:
    """The "What am I looking at?" key of the tree, the chart and the accept rules."""
    rules = "".join(f"<li><b>{m}</b>: {html.escape(r)}</li>" for m, r in ACCEPT_RULE.items())
    chip = "<span class='sc-chip sc-chip-{}'>{}</span>".format
    return (
        "<div class='sc-key'>"
        "<p>Each <b>step</b>, the small <b>draft</b> model proposes a tree of tokens; the large <b>target</b> "
        "model checks all of them in one forward pass. The answer is exactly what the target alone would write.</p>"
        "<ul>"
        f"<li>{chip('root', 'root')} the last committed token: the tree grows from it, left to right.</li>"
        f"<li>{chip('accepted', 'accepted')} drafts the target kept: they join the answer (green path).</li>"
        f"<li>{chip('rejected', 'rejected')} drafts the target looked at and refused · "
        f"{chip('unreached', 'never reached')} drafts under a refused token (never checked).</li>"
        f"<li>{chip('bonus', 'bonus')} the target's own next token after the accepted path: every step "
        f"commits at least this one. {chip('unused', 'not used')} accepted, but the answer had already ended.</li>"
        "<li><b>␣</b> is a space and <b>↵</b> a line break inside a token; <b>⇥</b> a tab.</li>"
        "<li>Edges: <b>solid</b> = the draft's first choice among siblings, <b>dashed</b> = its second, "
        "<b>dotted</b> = third or later. Hover a node for the draft's q, the target's p and the verdict.</li>"
        "<li>Numbers are <b>measured</b> (this answer, or the target alone run on this machine), "
        "<b>estimated</b> (the target alone, from the device profile) or <b>predicted</b> "
        "(from the acceptance calibration).</li>"
        "</ul><p><b>Accept rule</b> (temperature &gt; 0; at T = 0 a draft is kept iff it is the target's argmax):</p>"
        f"<ul>{rules}</ul></div>")


def describe_choice(choice, markup: bool = False) -> str:
    """The optimizer's pick in words; a one-node pick means drafting does not pay on this device."""
    bold = (lambda t: f"<b>{t}</b>") if markup else (lambda t: t)
    if choice.size == 1:
        return (f"{bold('the target alone')}: on this device's profile no tree is predicted to beat plain "
                f"decoding (verification of a few tokens costs several single-token forwards)")
    return (f"{bold(f'{choice.size} nodes, depth {choice.depth}')} · predicted {choice.expected_tokens:.2f} "
            f"tokens/step · predicted {bold(f'{choice.predicted_speedup:.2f}×')} the target alone")


# ----- small pieces ------------------------------------------------------------------------------
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


@lru_cache(maxsize=64)
def _calibration(pair: str, temperature: float, top_p: float) -> Calibration:
    return calibration_for(pair, temperature, top_p)


@lru_cache(maxsize=256)
def _cached_tree(size: int, depth: int, acceptance: tuple[float, ...]) -> Tree | None:
    return build_tree(size, depth, list(acceptance))


def resolve_tree(method: str, size: int, depth: int, acceptance) -> tuple[Tree | None, str]:
    """The tree for the controls and a short description. Raises EngineError on bad values."""
    size = int(max(1, size))
    depth = int(max(1, depth))
    if method == "autoregressive" or size == 1 and method != "chain":
        return None, "autoregressive: the target alone, 1 token per step, no draft"
    if method == "chain":
        return Tree.chain(depth), f"chain: {depth} draft tokens in a row ({depth + 1} nodes)"
    depth = min(depth, size - 1)
    tree = _cached_tree(size, depth, tuple(acceptance))
    kind = "a chain" if tree.size == tree.depth + 1 else "a DP-shaped tree"
    return tree, f"{method} on {kind}: {tree.size} nodes, depth {tree.depth}"


def dropped_notice(dropped: int, context: int) -> str:
    """What the status says when the oldest messages did not fit the context ("" for none)."""
    if not dropped:
        return ""
    return (f"The {dropped} oldest message{'s' if dropped > 1 else ''} did not fit the {context}-token context "
            f"and {'were' if dropped > 1 else 'was'} left out of the prompt (the system prompt is kept).")


def _clamp(value, low, high, cast=float):
    try:
        value = cast(value)
    except (TypeError, ValueError):
        value = low
    return max(low, min(high, value))


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.0f} K"


def pair_markdown(info: dict) -> str:
    if not info:
        return "No models loaded."
    return (f"- **target** {_named(info.get('target'))} ({_params(info.get('target_params', 0))} parameters"
            f"{_weights(info.get('target_format', 'none'))})\n"
            f"- **draft** {_named(info.get('draft'))} ({_params(info.get('draft_params', 0))} parameters"
            f"{_weights(info.get('draft_format', 'none'))})\n"
            f"- **device** `{info.get('device', '?')}` · **dtype** `{info.get('dtype', '?')}` · "
            f"**context** {info.get('max_context', 0) or '?'} tokens")


def _named(model_id) -> str:
    name = model_name(model_id)
    return f"**{name}** (`{model_id}`)" if name != str(model_id) else f"`{model_id}`"


def _weights(fmt: str) -> str:
    return "" if fmt == "none" else f", {fmt} weights"


def header_html(title: str, info: dict) -> str:
    pair = (f"<b>{html.escape(model_name(info.get('target')))}</b> ({html.escape(model_format(info, 'target'))})"
            f" ← draft <b>{html.escape(model_name(info.get('draft')))}</b> ({html.escape(model_format(info, 'draft'))})"
            f" · {html.escape(str(info.get('device', '?')))}") if info else ""
    return (f"<div class='sc-header'><div class='sc-brand'>{LOGO}"
            f"<span class='sc-title'>{html.escape(title)}</span>"
            f"<span class='sc-sub'>tree speculative decoding, shown live</span></div>"
            f"<div class='sc-pair' title='target ← draft · device'>{pair}</div></div>")


def status_html(text: str, kind: str = "info") -> str:
    return f"<div class='sc-status sc-{kind}'>{text}</div>" if text else ""


def step_text_html(tokenizer, steps, index: int) -> str:
    """Under the replay slider: the end of the answer up to step ``index`` with the tokens that step
    committed marked, so the replayed tree is tied to the text it wrote."""
    if not steps or index is None or not 0 <= index < len(steps):
        return ""
    before = [t for s in steps[:index] for t in s.committed]
    now = list(steps[index].committed)
    context = tokenizer.decode(before, skip_special_tokens=True)[-90:] if before else ""
    written = tokenizer.decode(now, skip_special_tokens=False) if now else ""
    return (f"<div class='sc-step-text' title='the answer so far; the marked text is what this step committed'>"
            f"<span class='sc-step-label'>Step {index + 1} wrote:</span> "
            f"<span class='sc-step-before'>{'…' if len(before) else ''}{html.escape(context)}</span>"
            f"<mark class='sc-step-now'>{html.escape(figures.visible_token(written, 80)) if written else '∅'}</mark></div>")


@dataclass
class Run:
    """What a finished (or running) answer leaves behind for replay."""

    steps: list = field(default_factory=list)
    texts: dict = field(default_factory=dict)
    tree_desc: str = ""
    expected: float | None = None
    predicted: float | None = None
    baseline: float | None = None
    baseline_source: str = "measured"   # of ``baseline``: "measured" or "estimated" (device profile)
    scale: float = 1.0                  # figure font scale (presentation mode)
    main: dict | None = None
    compare: dict | None = None
    identical: bool | None = None


# ----- the app ---------------------------------------------------------------------------------
class ChatApp:
    """Handlers of the UI; one instance per built demo, shared by every browser session."""

    def __init__(self, worker: Worker, tokenizer=None, options: dict | None = None) -> None:
        self.worker = worker
        if tokenizer is not None and getattr(worker, "tokenizer", None) is None:
            worker.tokenizer = tokenizer
        self.options = {**DEFAULTS, **(options or {})}
        self.texts = TokenTexts()
        self.export_dir = Path(tempfile.mkdtemp(prefix="sequoia-chat-export-"))
        # target-alone decoding rates measured on this machine, per pair and (temperature, top-p)
        self.baselines: dict[tuple, float] = {}
        self._baselines_lock = threading.Lock()
        self.explain = ExplainView(self)  # the teaching tabs under the chat

    # ----- the target alone, measured once per pair and settings -----------------------------------
    def _baseline_key(self, temperature: float, top_p: float) -> tuple:
        info = self.worker.info or {}
        return (self.worker.pair_version, str(info.get("target")), str(info.get("draft")),
                round(float(temperature), 2), round(float(top_p), 2))

    def record_baseline(self, temperature: float, top_p: float, run: dict | None) -> float | None:
        """Keep the target-alone rate of a finished run (a Compare run, an autoregressive answer or
        a "Measure" run) for this pair and setting; returns it."""
        if not run or run.get("decode_s", 0) <= 0 or run.get("tokens", 0) <= 0:
            return None
        rate = run["tokens"] / run["decode_s"]
        with self._baselines_lock:
            self.baselines[self._baseline_key(temperature, top_p)] = rate
        return rate

    def baseline(self, temperature: float, top_p: float) -> tuple[float | None, str]:
        """``(tokens/s, "measured" | "estimated")`` of the target alone at this setting: measured on
        this pair when it was (Compare, autoregressive or Measure), else the device profile's estimate,
        else ``(None, "")``."""
        with self._baselines_lock:
            rate = self.baselines.get(self._baseline_key(temperature, top_p))
        if rate is not None:
            return rate, "measured"
        if self.worker.tuner is not None:
            return 1.0 / self.worker.tuner.profile.target_time(1), "estimated"
        return None, ""

    def baseline_html(self, temperature: float, top_p: float) -> str:
        temperature, top_p = _clamp(temperature, 0.0, 2.0), _clamp(top_p, 0.01, 1.0)
        rate, source = self.baseline(temperature, top_p)
        if rate is None:
            text = "Target alone: not measured yet (Compare, or Measure, measures it)."
        elif source == "measured":
            text = f"Target alone: <b>{rate:.1f} tokens/s</b>, measured on this machine at T={temperature:g}, top-p {top_p:g}."
        else:
            text = (f"Target alone: ≈{rate:.1f} tokens/s, <i>estimated</i> from the device profile "
                    f"(Measure replaces it with a measurement).")
        return f"<div class='sc-baseline'>{text}</div>"

    def measure_baseline(self, temperature, top_p, seed, request: gr.Request | None = None):
        """Decode a short fixed prompt with the target alone and keep its rate for this setting."""
        c = self.c
        temperature, top_p = _clamp(temperature, 0.0, 2.0), _clamp(top_p, 0.01, 1.0)
        session = getattr(request, "session_hash", None) or "local"
        req = GenerationRequest(system="", messages=[{"role": "user", "content": BASELINE_PROMPT}],
                                max_new_tokens=BASELINE_TOKENS, temperature=temperature, top_p=top_p, tree=None,
                                seed=int(_clamp(seed, 0, 2**31 - 1, int)), method="autoregressive")
        try:
            job = self.worker.submit(req, session=session)
        except SessionBusy:
            yield {c.baseline_info: self.baseline_html(temperature, top_p)
                   + status_html("An answer is still running: measure after it.", "warn")}
            return
        yield {c.baseline_info: status_html(f"Measuring the target alone ({BASELINE_TOKENS} tokens)…", "info")}
        finished = None
        for event in job.iter_events():
            if event.kind == "finished":
                finished = event.data
            elif event.kind in ("error", "cancelled"):
                yield {c.baseline_info: self.baseline_html(temperature, top_p)
                       + status_html(f"Measurement {event.kind}.", "warn")}
                return
            elif event.kind == "done":
                break
        self.record_baseline(temperature, top_p, finished)
        yield {c.baseline_info: self.baseline_html(temperature, top_p)}

    def calibration(self, temperature: float, top_p: float) -> Calibration:
        """The acceptance calibration of the pair in use nearest to (temperature, top_p): what trees
        are built for and predictions use (:func:`engine.acceptance.calibration_for`)."""
        pair = self.options["pair"]
        if self.worker.pair_version:  # swapped in the Models panel since launch
            info = self.worker.info
            pair = pair_name(str(info.get("target")), str(info.get("draft")), self.worker.engine.draft,
                             self.worker.engine.target)
        return _calibration(pair, round(float(temperature), 3), round(float(top_p), 3))

    # ----- chat ------------------------------------------------------------------------------
    def respond(self, message, history, run, system, temperature, top_p, max_new, seed, method, size, depth,
                auto, compare, highlight, present=False, request: gr.Request | None = None):
        message = clean_text(message or "").strip()
        if not message:
            gr.Info("Type a message first: empty messages are not sent.")
            yield {self.c.status: status_html("Empty message ignored: type something first.", "warn")}
            return
        history = list(history or []) + [{"role": "user", "content": message}]
        yield from self._answer(history, message, run, system, temperature, top_p, max_new, seed, method, size,
                                depth, auto, compare, highlight, present, request)

    def regenerate(self, history, run, system, temperature, top_p, max_new, seed, method, size, depth, auto,
                   compare, highlight, present=False, request: gr.Request | None = None):
        history = list(history or [])
        while history and history[-1]["role"] == "assistant":
            history.pop()
        if not history:
            gr.Info("Nothing to regenerate yet.")
            yield {self.c.status: status_html("Nothing to regenerate yet.", "warn")}
            return
        yield from self._answer(history, "", run, system, temperature, top_p, max_new, seed, method, size, depth,
                                auto, compare, highlight, present, request)

    def _answer(self, history, message, run, system, temperature, top_p, max_new, seed, method, size, depth,
                auto, compare, highlight, present, request):
        c, o = self.c, self.options
        session = getattr(request, "session_hash", None) or "local"
        temperature = _clamp(temperature, 0.0, 2.0)
        top_p = _clamp(top_p, 0.01, 1.0)
        max_new = int(_clamp(max_new, 1, o["max_new_tokens_limit"], int))
        seed = int(_clamp(seed, 0, 2**31 - 1, int))
        method = method if method in METHODS else "sequoia"
        worker, engine = self.worker, self.worker.engine
        choice = None
        try:
            if auto and worker.tuner is not None and method != "autoregressive":
                choice = worker.tuner.choose(temperature, top_p, method)
                tree, tree_desc = "auto", f"{method}, auto: {choice.size} nodes, depth {choice.depth}"
                tree_size = choice.size
            else:
                tree, tree_desc = resolve_tree(method, size, depth, self.calibration(temperature, top_p).vector)
                tree_size = tree.size if tree is not None else 1
                if method == "chain" and tree is None:
                    method = "sequoia"
        except EngineError as exc:
            yield {c.status: status_html(f"Bad tree settings: {html.escape(str(exc))}", "error")}
            return
        limit = (engine.max_context - max_new - tree_size) if getattr(engine, "max_context", 0) else None
        try:  # an early refusal only: the worker tokenises the conversation again when the job runs
            _, dropped = fit_context(worker.tokenizer, system, history, limit)
        except ContextTooLong as exc:
            gr.Warning(str(exc))
            yield {c.status: status_html(html.escape(f"Not sent: {exc}"), "error")}
            return
        notices = [dropped_notice(dropped, engine.max_context)] if dropped else []
        request_ = GenerationRequest(system=system, messages=list(history), max_new_tokens=max_new,
                                     temperature=temperature, top_p=top_p, tree=tree, seed=seed, method=method,
                                     compare=bool(compare), trace=self.explain.wants_trace(session))
        try:
            job = worker.submit(request_, session=session)  # refused while this session has a job
        except SessionBusy:
            gr.Warning("An answer is still streaming: your message waits in the box. Press Stop, or send it "
                       "when the answer is done.")
            yield {c.status: status_html("Not sent: an answer is still streaming. Your message stays in the box; "
                                         "send it when the answer is done, or press Stop first.", "warn")}
            return
        try:
            yield from self._stream(job, history, message, system, choice, tree_desc, tree, highlight, notices,
                                    dict(temperature=temperature, top_p=top_p, max_new_tokens=max_new, seed=seed,
                                         method=method, tree=tree_desc), 1.4 if present else 1.0)
        finally:
            if not job.finished:
                job.cancel()  # the browser went away or the event was cancelled

    def _stream(self, job: Job, history, message, system, choice, tree_desc, tree, highlight, notices, settings,
                scale=1.0):
        c, o = self.c, self.options
        run = Run(tree_desc=tree_desc, scale=scale)
        method = settings["method"]
        who = "the target alone" if tree is None or method == "autoregressive" else method
        history = history + [{"role": "assistant", "content": ""}]
        answer = history[-1]
        tokens: list[int] = []
        compare_tokens: list[int] = []
        compare_steps: list = []
        tokenizer = self.worker.tokenizer
        calibration = self.calibration(settings["temperature"], settings["top_p"])
        predict = o["predict"] and not calibration.borrowed
        notice = " ".join(notices)
        phase = "main"
        last_text = last_plot = 0.0
        dirty_text = dirty_plot = False
        position = job.position()
        queued = f"Waiting for the engine: {position} request{'s' if position != 1 else ''} ahead of yours." \
            if position else "Starting: preparing the prompt for the engine…"

        def status(text, kind="info"):
            return status_html(html.escape(notice) + ("<br>" if notice and text else "") + text,
                               "warn" if notice and kind == "info" else kind)

        yield {c.chatbot: display_messages(history[:-1] + [{"role": "assistant", "content": "…"}]),
               c.msg: "", c.history: history[:-1],
               c.tree_plot: figures.placeholder_figure("Waiting for the first step…"),
               c.slider: gr.update(visible=False), c.compare_md: gr.update(value="", visible=False),
               c.steps_plot: figures.placeholder_figure("Per-step chart appears as tokens are committed", 220),
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
                        notice = dropped_notice(data["dropped"], getattr(self.worker.engine, "max_context", 0))
                    if phase == "main":
                        n = data.get("prompt_tokens")
                        readers = "the target reads" if who == "the target alone" else "the target and the draft read"
                        yield {c.status: status(f"Prefill: {readers} the {n if n is not None else ''}-token prompt "
                                                f"before the first step ({html.escape(who)})…")}
                    if phase == "main":
                        tc = data.get("tree_choice")
                        if tc is not None:
                            run.predicted = tc.predicted_speedup
                            run.expected = tc.expected_tokens
                            run.tree_desc = f"{method}, auto: " + describe_choice(tc)
                        elif predict and isinstance(data.get("tree"), Tree):
                            run.expected = data["tree"].expected_tokens(calibration.vector)
                elif kind == "step" and event.phase == "main":
                    run.steps.append(data)
                    tokens.extend(data.committed)
                    run.texts.update(self.texts.texts(tokenizer, data.tokens + data.committed))
                    dirty_text = dirty_plot = True
                elif kind == "step":
                    compare_tokens.extend(data.committed)
                    compare_steps.append(data)
                    dirty_text = True
                elif kind == "finished":
                    if event.phase == "main":
                        run.main = data
                    else:
                        run.compare = data
                elif kind in ("done", "cancelled", "error"):
                    terminal = event
            now = time.perf_counter()
            if terminal is None and dirty_text and now - last_text >= o["text_interval"]:
                update = {}
                answer["content"] = tokenizer.decode(tokens, skip_special_tokens=True)
                if phase == "main":
                    update[c.chatbot] = display_messages(history)
                    last = run.steps[-1] if run.steps else None
                    update[c.status] = status(
                        f"Decoding with {html.escape(who)} · step {len(run.steps)} · {len(tokens)} tokens"
                        + (f" · last step accepted {last.accepted_draft_tokens} of {last.tree_size - 1} drafts"
                           if last is not None and last.tree_size > 1 else ""))
                else:
                    update[c.status] = status(f"Answer done. Now the target alone, for comparison: "
                                              f"{len(compare_tokens)} tokens…")
                    update[c.compare_md] = gr.update(value=figures.race_html(run.steps, compare_steps, len(tokens)),
                                                     visible=True)
                if dirty_plot and run.steps and now - last_plot >= o["plot_interval"]:
                    update[c.tree_plot] = figures.tree_figure(run.steps[-1], run.texts, scale=run.scale)
                    update[c.steps_plot] = figures.steps_figure(run.steps, None, run.expected)
                    update[c.stats] = figures.stats_line(run.steps, expected_tokens=run.expected)
                    last_plot, dirty_plot = now, False
                last_text, dirty_text = now, False
                yield update

        # ----- the end of the answer ------------------------------------------------------------
        answer["content"] = tokenizer.decode(tokens, skip_special_tokens=True)
        update = {}
        kind = "ok"
        temperature, top_p = settings["temperature"], settings["top_p"]
        if terminal.kind == "done":  # a run of the target alone is a measurement of it, for this setting
            self.record_baseline(temperature, top_p, run.compare)
            if tree is None or method == "autoregressive":
                self.record_baseline(temperature, top_p, run.main)
        run.baseline, run.baseline_source = self.baseline(temperature, top_p)
        if terminal.kind == "done":
            if run.compare is not None:
                run.identical = compare_tokens == tokens
            reason = (run.main or {}).get("finish_reason")
            text = f"Done: {len(tokens)} tokens in {len(run.steps)} steps" + (
                " (reached max new tokens)." if reason == "length" else ".")
            if run.tree_desc:
                text += f" {html.escape(run.tree_desc[0].upper() + run.tree_desc[1:])}."
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
        update.update(self._run_views(run, len(run.steps) - 1 if run.steps else None, highlight, tokenizer))
        update[c.export_btn] = self._export_file(system, history, settings, run)
        update[c.stop_btn] = gr.update(interactive=False)
        update[c.baseline_info] = self.baseline_html(temperature, top_p)
        yield update

    def _run_views(self, run: Run, index: int | None, highlight: bool, tokenizer=None) -> dict:
        """Tree, slider, chart, stats, comparison and highlight views of a run."""
        c = self.c
        out = {}
        if index is None or not run.steps:
            out[c.tree_plot] = figures.placeholder_figure("No steps: the answer was stopped before the first one.")
            out[c.slider] = gr.update(visible=False)
            out[c.replay_row] = gr.update(visible=False)
            out[c.step_text] = ""
            out[c.steps_plot] = figures.placeholder_figure("No steps yet", 220)
            out[c.stats] = ""
        else:
            out[c.tree_plot] = figures.tree_figure(run.steps[index], run.texts, scale=run.scale)
            out[c.slider] = gr.update(visible=len(run.steps) > 1, minimum=1, maximum=max(2, len(run.steps)),
                                      value=index + 1, step=1, interactive=True,
                                      label=f"Replay a step (1–{len(run.steps)})")
            out[c.replay_row] = gr.update(visible=len(run.steps) > 1)
            out[c.step_text] = step_text_html(tokenizer or self.worker.tokenizer, run.steps, index)
            out[c.steps_plot] = figures.steps_figure(run.steps, run.baseline, run.expected, run.predicted,
                                                     highlight=run.steps[index].index,
                                                     baseline_source=run.baseline_source)
            out[c.stats] = figures.stats_line(run.steps, run.baseline, run.baseline_source, run.expected)
        out[c.compare_md] = gr.update(value=self._compare_markdown(run), visible=run.compare is not None)
        tokenizer = tokenizer or self.worker.tokenizer
        out[c.highlight_view] = gr.update(value=highlight_html(tokenizer, run.steps, current=index),
                                          visible=bool(highlight))
        return out

    @staticmethod
    def _compare_markdown(run: Run) -> str:
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
                f"<tr><td>wall time (prefill included)</td><td>{_fmt_s(m['seconds'])}</td><td>{_fmt_s(a['seconds'])}</td></tr>"
                f"<tr><td>decoding</td><td>{rate(m):.1f} tokens/s</td><td>{rate(a):.1f} tokens/s</td></tr>"
                f"<tr><td>tokens / steps</td><td>{m['tokens']} / {m['steps']}</td><td>{a['tokens']} / {a['steps']}</td></tr>"
                f"</table></div>")

    def _export_file(self, system, history, settings=None, run: Run | None = None):
        if not history:
            return gr.update(value=None, interactive=False)
        for old in self.export_dir.glob("*.json"):  # files of earlier turns: served already, prune them
            try:
                if time.time() - old.stat().st_mtime > 3600:
                    old.unlink()
            except OSError:
                pass
        path = self.export_dir / f"sequoia-chat-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{id(history) % 10000}.json"
        steps = run.steps if isinstance(run, Run) and run.steps else None
        texts = run.texts if steps else None
        path.write_text(export_conversation(system, history, settings, steps, texts), encoding="utf-8")
        return gr.update(value=str(path), interactive=True)

    # ----- other handlers ---------------------------------------------------------------------
    def stop(self, request: gr.Request | None = None) -> None:
        """Cancel this tab's request; its stream ends within one step and says so itself (writing
        the status from here could land after that final word)."""
        session = getattr(request, "session_hash", None) or "local"
        if not self.worker.cancel_session(session):
            gr.Info("Nothing is running.")

    def clear(self, request: gr.Request | None = None):
        session = getattr(request, "session_hash", None) or "local"
        self.worker.cancel_session(session)
        c = self.c
        return {c.chatbot: [], c.history: [], c.run: Run(), c.msg: "",
                c.tree_plot: figures.placeholder_figure("The token tree of each step appears here."),
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
        index = int(_clamp(step_no, 1, len(run.steps), int)) - 1
        views = self._run_views(run, index, highlight)
        c = self.c
        return {k: views[k] for k in (c.tree_plot, c.steps_plot, c.step_text, c.highlight_view)}

    def toggle_highlight(self, highlight, run: Run):
        steps = run.steps if isinstance(run, Run) else []
        return gr.update(value=highlight_html(self.worker.tokenizer, steps), visible=bool(highlight))

    def tree_info(self, method, size, depth, auto, temperature, top_p):
        temperature, top_p = _clamp(temperature, 0.0, 2.0), _clamp(top_p, 0.01, 1.0)
        if auto and self.worker.tuner is not None and method != "autoregressive":
            choice = self.worker.tuner.choose(temperature, top_p, method)
            label = self.worker.tuner.calibration(temperature, top_p).label()
            return (f"<div class='sc-tree-info'>auto (hardware-aware optimizer): {describe_choice(choice, markup=True)}"
                    f"<br><span class='sc-calibration'>{html.escape(label)}</span></div>")
        calibration = self.calibration(temperature, top_p)
        try:
            tree, desc = resolve_tree(method, size, depth, calibration.vector)
        except EngineError as exc:
            return f"<div class='sc-tree-info sc-error'>{html.escape(str(exc))}</div>"
        extra = ""
        if tree is not None and self.options["predict"] and not calibration.borrowed:
            extra = f" · predicted {tree.expected_tokens(calibration.vector):.2f} tokens/step"
        note = ""
        if method != "chain" and method != "autoregressive" and int(depth) > int(size) - 1 and int(size) > 1:
            note = f" (depth capped at size − 1 = {int(size) - 1})"
        elif tree is not None and method != "chain" and tree.depth < int(depth):
            note = (f" (you asked for depth {int(depth)}: the DP tree stops at {tree.depth}, deeper nodes are "
                    f"predicted to be accepted less often than wider ones)")
        label = f"<br><span class='sc-calibration'>{html.escape(calibration.label())}</span>" if tree is not None else ""
        return f"<div class='sc-tree-info'>{html.escape(desc)}{note}{extra}{label}</div>"

    def auto_controls(self, method, auto, temperature, top_p):
        """Size and depth sliders under Auto: disabled, their labels naming the optimizer's pick (the
        user's values stay, for when Auto is turned off)."""
        temperature, top_p = _clamp(temperature, 0.0, 2.0), _clamp(top_p, 0.01, 1.0)
        if auto and self.worker.tuner is not None and method != "autoregressive":
            choice = self.worker.tuner.choose(temperature, top_p, method)
            return (gr.update(interactive=False, label=f"Tree size: auto picks {choice.size} (slider ignored)"),
                    gr.update(interactive=False, label=f"Tree depth: auto picks {choice.depth} (slider ignored)"))
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
        index = int(_clamp(step_no, 1, len(run.steps), int))  # 1-based shown step -> next 0-based index
        if index >= len(run.steps):
            index = 0  # pressed Play on the last step: start over
        views = self._run_views(run, index, highlight)
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
        return {c.tree_plot: self._run_views(run, index, highlight)[c.tree_plot], c.run: run}

    def export_settings(self, system, history):
        return self._export_file(system, history)

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
        self.worker.cancel_session(session)
        out = {c.chatbot: display_messages(history), c.history: history, c.system: system, c.run: Run(),
               c.status: status_html(f"Imported {len(history)} messages.", "ok"),
               c.export_btn: self._export_file(system, history),
               **{k: v for k, v in self.clear(request).items()
                  if k in (c.tree_plot, c.slider, c.steps_plot, c.stats, c.compare_md, c.highlight_view)}}
        if steps:  # the export carried the last answer's steps: its trees and chart come back too
            run = Run(steps=steps, texts=texts)
            out.update(self._run_views(run, len(steps) - 1, True))
            out[c.run] = run
            out[c.export_btn] = self._export_file(system, history, None, run)
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

    # ----- layout ----------------------------------------------------------------------------
    def build(self) -> gr.Blocks:
        o, worker = self.options, self.worker
        info = worker.info
        c = self.c = _Components()
        with gr.Blocks(title=o["title"], analytics_enabled=False, fill_width=True,
                       delete_cache=(3600, 3600)) as demo:
            c.history = gr.State([])
            c.run = gr.State(Run())
            c.header = gr.HTML(header_html(o["title"], info), elem_id="sc-header")
            # closed by default; opened on load in windows at least COLLAPSE_BELOW px wide (on a phone
            # it would cover the whole app)
            with gr.Sidebar(label="Settings", open=False, width=330, elem_id="sc-sidebar"):
                gr.Markdown("### Settings", elem_classes=["sc-side-title"])
                c.system = gr.Textbox(o["system_prompt"], label="System prompt", lines=3, max_lines=10,
                                      placeholder="Optional: how the assistant should behave",
                                      elem_id="sc-system")
                with gr.Accordion("Decoding", open=True):
                    c.temperature = gr.Slider(0.0, 2.0, value=o["temperature"], step=0.05, label="Temperature",
                                              info="0 = greedy")
                    c.top_p = gr.Slider(0.05, 1.0, value=o["top_p"], step=0.01, label="Top-p")
                    c.max_new = gr.Slider(1, o["max_new_tokens_limit"], value=o["max_new_tokens"], step=1,
                                          label="Max new tokens")
                    c.seed = gr.Number(o["seed"], label="Seed", precision=0, minimum=0, maximum=2**31 - 1)
                with gr.Accordion("Speculation", open=True):
                    c.method = gr.Dropdown(list(METHODS), value=o["method"], label="Method",
                                           info="Verifier used when temperature > 0", elem_id="sc-method")
                    c.method_help = gr.HTML(method_help(o["method"], o["temperature"]), elem_id="sc-method-help")
                    c.size = gr.Slider(1, o["max_tree_size"], value=o["tree_size"], step=1, label="Tree size",
                                       info="Nodes per step, root included", elem_id="sc-size")
                    c.depth = gr.Slider(1, o["max_depth"], value=o["depth"], step=1, label="Tree depth",
                                        info="Longest draft path", elem_id="sc-depth")
                    c.auto = gr.Checkbox(False, label="Auto (hardware-aware tree choice)",
                                         visible=worker.tuner is not None, elem_id="sc-auto")
                    c.tree_info = gr.HTML(self.tree_info(o["method"], o["tree_size"], o["depth"], False,
                                                         o["temperature"], o["top_p"]), elem_id="sc-tree-info")
                with gr.Accordion("Display", open=True):
                    c.compare = gr.Checkbox(o["compare"], label="Compare with the target alone",
                                            info="After each answer, decode the same prompt without the draft "
                                                 "(also measures the target alone for the speed-up)")
                    c.highlight = gr.Checkbox(o["highlight"], label="Colour draft vs. target tokens")
                    c.baseline_info = gr.HTML(self.baseline_html(o["temperature"], o["top_p"]),
                                              elem_id="sc-baseline")
                    c.measure_btn = gr.Button("Measure the target alone", size="sm", elem_id="sc-measure")
                with gr.Accordion("Models", open=False):
                    c.models_info = gr.Markdown(pair_markdown(info), elem_id="sc-models-info")
                    c.target_id = gr.Textbox(info.get("target", ""), label="Target (HF id or local directory)")
                    c.draft_id = gr.Textbox(info.get("draft", ""), label="Draft (same vocabulary)")
                    with gr.Row():
                        c.dtype = gr.Dropdown(["float32", "bfloat16", "float16"], value=info.get("dtype", "float32"),
                                              label="dtype")
                        c.device = gr.Textbox(info.get("device", "cpu"), label="device")
                    c.trust = gr.Checkbox(False, label="Trust remote code (runs the repository's own code)",
                                          visible=worker.allow_remote_code)
                    c.load_btn = gr.Button("Load pair", variant="secondary", size="sm")
                    c.models_status = gr.HTML("", elem_id="sc-models-status")
            with gr.Row(equal_height=False, elem_id="sc-main"):
                # the tree column comes first in the page: beside the chat on wide screens, above it on
                # narrow ones (CSS puts it on the right when there is room)
                with gr.Column(scale=6, min_width=300, elem_id="sc-viz-col"):
                    c.tree_plot = gr.Plot(figures.placeholder_figure("The token tree of each step appears here."),
                                          show_label=False, elem_id="sc-tree")
                    with gr.Row(elem_id="sc-replay", visible=False) as c.replay_row:
                        c.play_btn = gr.Button("▶ Play", size="sm", elem_id="sc-play", scale=0, min_width=80)
                        c.pause_btn = gr.Button("⏸ Pause", size="sm", elem_id="sc-pause", visible=False, scale=0,
                                                min_width=80)
                        c.pace = gr.Dropdown([("fast (0.6 s/step)", 0.6), ("normal (1.5 s/step)", 1.5),
                                              ("slow (3 s/step)", 3.0)], value=1.5, show_label=False,
                                             container=False, elem_id="sc-pace", scale=1, min_width=140)
                    c.slider = gr.Slider(1, 2, value=1, step=1, label="Replay a step", visible=False,
                                         elem_id="sc-step-slider")
                    c.step_text = gr.HTML("", elem_id="sc-step-text")
                    c.compare_md = gr.HTML("", visible=False, elem_id="sc-compare")
                    c.stats = gr.Markdown("", elem_id="sc-stats")
                    with gr.Accordion("What am I looking at?", open=False, elem_id="sc-key"):
                        gr.HTML(key_html())
                    c.steps_plot = gr.Plot(figures.placeholder_figure(
                        "Per-step chart appears as tokens are committed", 220), show_label=False, elem_id="sc-steps")
                with gr.Column(scale=5, min_width=300, elem_id="sc-chat-col"):
                    c.chatbot = gr.Chatbot(label="Chat", height=380, buttons=["copy", "copy_all"],
                                           placeholder=PLACEHOLDER, elem_id="sc-chatbot", show_label=False,
                                           feedback_options=None, layout="bubble", autoscroll=True)
                    with gr.Row(elem_id="sc-input-row"):
                        c.msg = gr.Textbox(placeholder="Ask something…", show_label=False, lines=1, max_lines=8,
                                           scale=8, autofocus=True, elem_id="sc-msg", container=False,
                                           min_width=120)
                        c.send = gr.Button("Send", variant="primary", scale=0, min_width=70, elem_id="sc-send")
                        c.stop_btn = gr.Button("Stop", variant="secondary", scale=0, min_width=70,
                                               elem_id="sc-stop", interactive=False)
                    with gr.Row(elem_id="sc-actions"):
                        c.regen = gr.Button("↻ Regenerate", size="sm", elem_id="sc-regen")
                        c.clear_btn = gr.Button("Clear", size="sm", elem_id="sc-clear")
                        c.export_btn = gr.DownloadButton("Export", size="sm", interactive=False,
                                                         elem_id="sc-export")
                        c.import_btn = gr.UploadButton("Import", size="sm", file_types=[".json"],
                                                       type="filepath", elem_id="sc-import")
                        c.present_box = gr.Checkbox(False, label="Presentation mode", elem_id="sc-present",
                                                    container=False, min_width=0)
                    c.status = gr.HTML("", elem_id="sc-status")
                    c.highlight_view = gr.HTML(highlight_html(worker.tokenizer, []), visible=bool(o["highlight"]),
                                               elem_id="sc-highlight")
            self.explain.build()
            c.timer = gr.Timer(1.5, active=False)

            settings = [c.system, c.temperature, c.top_p, c.max_new, c.seed, c.method, c.size, c.depth, c.auto,
                        c.compare, c.highlight, c.present_box]
            outputs = [c.chatbot, c.msg, c.history, c.run, c.tree_plot, c.slider, c.steps_plot, c.stats, c.status,
                       c.compare_md, c.highlight_view, c.export_btn, c.stop_btn, c.baseline_info, c.replay_row,
                       c.step_text]
            chat_kwargs = dict(concurrency_limit=16, concurrency_id="chat", show_progress="hidden")
            answered = [
                c.msg.submit(self.respond, [c.msg, c.history, c.run] + settings, outputs, api_name="chat", **chat_kwargs),
                c.send.click(self.respond, [c.msg, c.history, c.run] + settings, outputs, api_name="send", **chat_kwargs)]
            answered.append(c.regen.click(self.regenerate, [c.history, c.run] + settings, outputs, api_name="regenerate",
                          **chat_kwargs))
            c.stop_btn.click(self.stop, None, None, api_name="stop", concurrency_limit=None,
                             show_progress="hidden")
            cleared = [c.clear_btn.click(self.clear, None, outputs, api_name="clear", concurrency_limit=None,
                                         show_progress="hidden"),
                       c.chatbot.clear(self.clear, None, outputs, api_visibility="private", show_progress="hidden")]
            c.slider.input(self.show_step, [c.slider, c.run, c.highlight],
                           [c.tree_plot, c.steps_plot, c.step_text, c.highlight_view],
                           api_name="show_step", trigger_mode="always_last", show_progress="hidden",
                           concurrency_limit=4)
            c.play_btn.click(self.play, [c.run, c.slider, c.pace], [c.timer, c.play_btn, c.pause_btn],
                             api_visibility="private", show_progress="hidden")
            c.pause_btn.click(self.pause, None, [c.timer, c.play_btn, c.pause_btn], api_visibility="private",
                              show_progress="hidden")
            c.pace.change(lambda pace: gr.update(value=float(pace or 1.5)), c.pace, c.timer,
                          api_visibility="private", show_progress="hidden")
            c.timer.tick(self.tick, [c.slider, c.run, c.highlight],
                         [c.tree_plot, c.steps_plot, c.slider, c.step_text, c.highlight_view, c.timer, c.play_btn,
                          c.pause_btn], api_visibility="private", show_progress="hidden")
            c.highlight.change(self.toggle_highlight, [c.highlight, c.run], c.highlight_view,
                               api_visibility="private", show_progress="hidden")
            for control in (c.method, c.size, c.depth, c.auto, c.temperature, c.top_p):
                control.change(self.tree_info, [c.method, c.size, c.depth, c.auto, c.temperature, c.top_p],
                               c.tree_info, api_visibility="private", show_progress="hidden",
                               trigger_mode="always_last")
            for control in (c.method, c.auto, c.temperature, c.top_p):
                control.change(self.auto_controls, [c.method, c.auto, c.temperature, c.top_p], [c.size, c.depth],
                               api_visibility="private", show_progress="hidden", trigger_mode="always_last")
            for control in (c.method, c.temperature):
                control.change(self.method_changed, [c.method, c.temperature], c.method_help,
                               api_visibility="private", show_progress="hidden", trigger_mode="always_last")
            for control in (c.temperature, c.top_p):
                control.change(self.baseline_html, [c.temperature, c.top_p], c.baseline_info,
                               api_visibility="private", show_progress="hidden", trigger_mode="always_last")
            c.measure_btn.click(self.measure_baseline, [c.temperature, c.top_p, c.seed], c.baseline_info,
                                api_name="measure_baseline", concurrency_limit=1, show_progress="hidden")
            c.present_box.change(self.present, [c.present_box, c.run, c.highlight], [c.tree_plot, c.run],
                                 js=PRESENT_JS, api_visibility="private", show_progress="hidden")
            c.system.blur(self.export_settings, [c.system, c.history], c.export_btn, api_visibility="private",
                          show_progress="hidden")
            answered.append(c.import_btn.upload(self.import_file, c.import_btn,
                                [c.chatbot, c.history, c.system, c.run, c.status, c.export_btn, c.tree_plot,
                                 c.slider, c.steps_plot, c.stats, c.compare_md, c.highlight_view, c.replay_row,
                                 c.step_text],
                                api_name="import_conversation"))
            self.explain.wire(answered, cleared)
            c.load_btn.click(self.load_pair, [c.target_id, c.draft_id, c.dtype, c.device, c.trust],
                             [c.models_status, c.models_info, c.header, c.auto], api_name="load_pair",
                             concurrency_limit=1)
            demo.load(None, None, None, js=SIDEBAR_JS)
        demo.chat_app = self
        return demo


class _Components:
    """Attribute bag of the components a handler reads or writes."""


def build_demo(worker: Worker, tokenizer=None, options: dict | None = None) -> gr.Blocks:
    """The Gradio app around ``worker`` (which owns the models). ``options`` override :data:`DEFAULTS`."""
    return ChatApp(worker, tokenizer, options).build()


def theme() -> gr.themes.Base:
    local = [gr.themes.Font("Inter"), gr.themes.Font("ui-sans-serif"), gr.themes.Font("system-ui"),
             gr.themes.Font("Segoe UI"), gr.themes.Font("sans-serif")]
    mono = [gr.themes.Font("JetBrains Mono"), gr.themes.Font("ui-monospace"), gr.themes.Font("Menlo"),
            gr.themes.Font("Consolas"), gr.themes.Font("monospace")]
    return gr.themes.Default(primary_hue="emerald", secondary_hue="violet", neutral_hue="slate", font=local,
                             font_mono=mono, radius_size="md")


def launch(demo: gr.Blocks, server_name: str = "127.0.0.1", server_port: int | None = None, share: bool = False,
           inbrowser: bool = False, prevent_thread_lock: bool = False, quiet: bool = False, **kwargs):
    """``demo.launch`` with the app's theme, CSS, queue and upload limits."""
    demo.queue(default_concurrency_limit=4)
    return demo.launch(server_name=server_name, server_port=server_port, share=share, inbrowser=inbrowser,
                       prevent_thread_lock=prevent_thread_lock, quiet=quiet, theme=theme(),
                       css_paths=[CSS_PATH] if CSS_PATH.exists() else None, max_file_size="5mb",
                       show_error=True, run_history=False, footer_links=["api", "settings"], **kwargs)
