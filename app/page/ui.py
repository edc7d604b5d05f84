"""The web UI's layout: ``build_demo(worker, tokenizer, options)`` returns the ``gr.Blocks`` app.

The chat streams the answer as the engine commits tokens; next to it the token tree of the
current step is drawn live (at most ``plot_interval`` apart), then a slider replays any step.
Every request goes through the :class:`app.serving.worker.Worker`, which owns the models.
"""
from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
from starlette.middleware import Middleware

from engine.core.settings import METHODS

from app.views import figures

from app.page import live_feed
from app.page.answer_stream import Run
from app.views.conversation import highlight_html
from app.web.cross_origin import CrossOriginMiddleware
from app.page.handlers import ChatApp
from app.web.host_guard import HostGuardMiddleware, allowed_hosts
from app.page.page_script import HeadScriptMiddleware
from app.web.private_events import NamedEventsMiddleware, callable_names
from app.web.server_limits import BodyLimitMiddleware, ServerLimits, check_served_with, serving_with
from app.views.text import header_html, key_html, method_help, pair_markdown
from app.serving.worker import Worker

CSS_PATH = Path(__file__).resolve().parents[2] / "assets" / "style.css"
# put first in every page's <head>, ahead of Gradio's modules: see each file
PAGE_SCRIPTS = [CSS_PATH.with_name("quiet_frames.js"), CSS_PATH.with_name("live_feed.js")]
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

PLACEHOLDER = ("**Sequoia Chat** — a small draft model proposes a *tree* of tokens, the big target model "
               "checks the whole tree in one pass, and the answer is exactly what the target alone would "
               "write. Ask something and watch the tree.\n\n*Enter sends · Shift+Enter adds a line.*")


def build(app: ChatApp) -> gr.Blocks:
    """The page: settings sidebar, the tree and chart column, the chat column, and the events that
    connect them to ``app``'s handlers (``app.c`` holds the components the handlers update)."""
    o, worker = app.options, app.worker
    info = worker.info
    c = app.c = _Components()
    with gr.Blocks(title=o["title"], analytics_enabled=False, fill_width=True,
                   delete_cache=(3600, 3600)) as demo:
        c.history = gr.State([])
        c.run = gr.State(Run())
        c.header = gr.HTML(header_html(o["title"], info), elem_id="sc-header")
        # closed by default; opened on load in windows at least COLLAPSE_BELOW px wide (on a phone
        # it would cover the whole app)
        with gr.Sidebar(label="Settings", open=False, width=330, elem_id="sc-sidebar"):
            history_on = app.conversations.store is not None
            if history_on or app.conversations.note:
                _conversations(app, c)
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
                # on by default: the optimizer's pick is the fastest tree it knows for this machine
                c.auto = gr.Checkbox(o["auto"] and worker.tuner is not None, label="Auto (hardware-aware tree choice)",
                                     visible=worker.tuner is not None, elem_id="sc-auto")
                c.tree_info = gr.HTML(app.tree_info(o["method"], o["tree_size"], o["depth"], c.auto.value,
                                                     o["temperature"], o["top_p"]), elem_id="sc-tree-info")
            with gr.Accordion("Free drafts", open=False):
                c.copies = gr.Checkbox(o["copies"], label="Copy from the conversation", elem_id="sc-copies",
                                       info="Text the answer repeats from the chat is proposed as free branches "
                                            "beside the draft's (no draft-model cost); the answer stays the target's")
                c.expected = gr.Textbox("", label="Expected output (edit mode)", lines=3, max_lines=12,
                                        elem_id="sc-expected",
                                        placeholder="Paste what you expect the answer to be (the file you asked to "
                                                    "change): it is copied from as a free branch")
            with gr.Accordion("Display", open=True):
                c.compare = gr.Checkbox(o["compare"], label="Compare with the target alone",
                                        info="After each answer, decode the same prompt without the draft "
                                             "(also measures the target alone for the speed-up)")
                c.highlight = gr.Checkbox(o["highlight"], label="Colour draft vs. target tokens")
                c.baseline_info = gr.HTML(app.baseline_html(o["temperature"], o["top_p"]),
                                          elem_id="sc-baseline")
                c.measure_btn = gr.Button("Measure the target alone", size="sm", elem_id="sc-measure")
            if o.get("models_panel", True):  # launch.py: off beyond loopback unless --models-panel
                with gr.Accordion("Models", open=False):
                    c.models_info = gr.Markdown(pair_markdown(info), elem_id="sc-models-info")
                    c.target_id = gr.Textbox(info.get("target", ""), label="Target (HF id or local directory)")
                    c.draft_id = gr.Textbox(info.get("draft", ""), label="Draft (same vocabulary)")
                    with gr.Row():
                        c.dtype = gr.Dropdown(["float32", "bfloat16", "float16"],
                                              value=info.get("dtype", "float32"), label="dtype")
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
                # while an answer streams: the step's tree as inline SVG (the browser draws it in
                # microseconds, where a plotly figure costs its renderer a core); the plot after it.
                # Neither is ever hidden by Gradio: while the SVG has content, CSS folds the plot to
                # no height but keeps its width, so plotly always draws into a laid-out box
                c.live_tree = gr.HTML("", elem_id="sc-live-tree")
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
                                       feedback_options=None, layout="bubble", autoscroll=True, editable="user")
                if history_on:  # ‹ k / n ›: the siblings of a message (Regenerate and edits keep what they replace)
                    with gr.Row(visible=False, elem_id="sc-siblings") as c.sibling_row:
                        c.prev_answer = gr.Button("‹", size="sm", scale=0, min_width=36, elem_id="sc-prev-answer")
                        c.sibling_text = gr.HTML("", elem_id="sc-sibling-text")
                        c.next_answer = gr.Button("›", size="sm", scale=0, min_width=36, elem_id="sc-next-answer")
                        c.branch_at = gr.Dropdown([], value=None, show_label=False, container=False, scale=0,
                                                  min_width=190, visible=False, elem_id="sc-branch-at")
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
        app.explain.build()
        c.timer = gr.Timer(1.5, active=False)

        for box in (c.copies, c.expected):
            box.change(app.set_free_drafts, [c.copies, c.expected], None, api_visibility="private",
                       show_progress="hidden")
        settings = [c.system, c.temperature, c.top_p, c.max_new, c.seed, c.method, c.size, c.depth, c.auto,
                    c.compare, c.highlight, c.present_box]
        outputs = [c.chatbot, c.msg, c.history, c.run, c.tree_plot, c.slider, c.steps_plot, c.stats, c.status,
                   c.compare_md, c.highlight_view, c.export_btn, c.stop_btn, c.baseline_info, c.replay_row,
                   c.step_text, c.live_tree]  # the API's output order: new outputs go last
        if history_on:
            outputs += [c.conv_id, c.conv_list, c.sibling_row, c.sibling_text, c.conv_title, c.branch_at]
        chat_kwargs = dict(concurrency_limit=16, concurrency_id="chat", show_progress="hidden")
        # events after which the teaching tabs redraw (a new answer) or empty (a cleared chat)
        answered = [
            c.msg.submit(app.respond, [c.msg, c.history, c.run] + settings, outputs, api_name="chat", **chat_kwargs),
            c.send.click(app.respond, [c.msg, c.history, c.run] + settings, outputs, api_name="send", **chat_kwargs),
            c.regen.click(app.regenerate, [c.history, c.run] + settings, outputs, api_name="regenerate",
                          **chat_kwargs),
            c.chatbot.edit(app.edit_message, [c.history, c.run] + settings, outputs, api_visibility="private",
                           **chat_kwargs)]
        c.stop_btn.click(app.stop, None, None, api_name="stop", concurrency_limit=None,
                         show_progress="hidden")
        cleared_outputs = outputs
        cleared = [c.clear_btn.click(app.clear, None, cleared_outputs, api_name="clear", concurrency_limit=None,
                                     show_progress="hidden"),
                   c.chatbot.clear(app.clear, None, cleared_outputs, api_visibility="private", show_progress="hidden")]
        c.slider.input(app.show_step, [c.slider, c.run, c.highlight],
                       [c.tree_plot, c.steps_plot, c.step_text, c.highlight_view],
                       api_name="show_step", trigger_mode="always_last", show_progress="hidden",
                       concurrency_limit=4)
        c.play_btn.click(app.play, [c.run, c.slider, c.pace], [c.timer, c.play_btn, c.pause_btn],
                         api_visibility="private", show_progress="hidden")
        c.pause_btn.click(app.pause, None, [c.timer, c.play_btn, c.pause_btn], api_visibility="private",
                          show_progress="hidden")
        c.pace.change(lambda pace: gr.update(value=float(pace or 1.5)), c.pace, c.timer,
                      api_visibility="private", show_progress="hidden")
        c.timer.tick(app.tick, [c.slider, c.run, c.highlight],
                     [c.tree_plot, c.steps_plot, c.slider, c.step_text, c.highlight_view, c.timer, c.play_btn,
                      c.pause_btn], api_visibility="private", show_progress="hidden")
        c.highlight.change(app.toggle_highlight, [c.highlight, c.run], c.highlight_view,
                           api_visibility="private", show_progress="hidden")
        for control in (c.method, c.size, c.depth, c.auto, c.temperature, c.top_p):
            control.change(app.tree_info, [c.method, c.size, c.depth, c.auto, c.temperature, c.top_p],
                           c.tree_info, api_visibility="private", show_progress="hidden",
                           trigger_mode="always_last")
        for control in (c.method, c.auto, c.temperature, c.top_p):
            control.change(app.auto_controls, [c.method, c.auto, c.temperature, c.top_p], [c.size, c.depth],
                           api_visibility="private", show_progress="hidden", trigger_mode="always_last")
        for control in (c.method, c.temperature):
            control.change(app.method_changed, [c.method, c.temperature], c.method_help,
                           api_visibility="private", show_progress="hidden", trigger_mode="always_last")
        for control in (c.temperature, c.top_p):
            control.change(app.baseline_html, [c.temperature, c.top_p], c.baseline_info,
                           api_visibility="private", show_progress="hidden", trigger_mode="always_last")
        c.measure_btn.click(app.measure_baseline, [c.temperature, c.top_p, c.seed], c.baseline_info,
                            api_name="measure_baseline", concurrency_limit=1, show_progress="hidden")
        c.present_box.change(app.present, [c.present_box, c.run, c.highlight], [c.tree_plot, c.run],
                             js=PRESENT_JS, api_visibility="private", show_progress="hidden")
        c.system.blur(app.export_settings, [c.system, c.history], c.export_btn, api_visibility="private",
                      show_progress="hidden")
        answered.append(c.import_btn.upload(app.import_file, c.import_btn,
                                            [c.chatbot, c.history, c.system, c.run, c.status, c.export_btn, c.tree_plot,
                                             c.slider, c.steps_plot, c.stats, c.compare_md, c.highlight_view, c.replay_row,
                                             c.step_text] + ([c.conv_id, c.conv_list, c.sibling_row, c.sibling_text, c.branch_at]
                                                             if history_on else []),
                                            api_name="import_conversation"))
        if history_on:
            answered += _wire_conversations(app, c, demo, cleared_outputs, cleared)
        app.explain.wire(answered, cleared)
        if o.get("models_panel", True):  # private: only the page runs it (app.private_events)
            c.load_btn.click(app.load_pair, [c.target_id, c.draft_id, c.dtype, c.device, c.trust],
                             [c.models_status, c.models_info, c.header, c.auto], api_name="load_pair",
                             api_visibility="private", concurrency_limit=1)
        demo.load(None, None, None, js=SIDEBAR_JS)
    demo.chat_app = app
    return demo


def _conversations(app: ChatApp, c) -> None:
    """The sidebar's conversations: the list (newest first), search, New chat, Rename, Delete (confirmed);
    with history off, the one line saying why."""
    with gr.Accordion("Conversations", open=True, elem_id="sc-conversations"):
        if app.conversations.store is None:
            gr.Markdown(app.conversations.note, elem_id="sc-history-off")
            return
        # the open conversation's id, kept by the browser: a reload (F5) or a restart reopens it
        c.conv_id = gr.BrowserState("", storage_key="sequoia-chat-conversation")
        c.new_chat = gr.Button("+ New chat", size="sm", elem_id="sc-new-chat")
        c.conv_search = gr.Textbox(placeholder="Search titles and text", show_label=False, container=False,
                                   max_lines=1, elem_id="sc-conv-search")
        c.conv_list = gr.Radio([], value=None, show_label=False, container=False, elem_id="sc-conv-list")
        with gr.Row():
            c.conv_title = gr.Textbox(placeholder="Title of the open conversation", show_label=False,
                                      container=False, max_lines=1, scale=3, min_width=120,
                                      elem_id="sc-conv-title")
            c.rename_btn = gr.Button("Rename", size="sm", scale=1, min_width=60, elem_id="sc-rename")
            c.delete_btn = gr.Button("Delete", size="sm", scale=1, min_width=60, elem_id="sc-delete",
                                     variant="stop")
        with gr.Row(visible=False, elem_id="sc-delete-confirm") as c.delete_row:
            gr.Markdown("Delete this conversation for good?")
            c.delete_yes = gr.Button("Delete", size="sm", variant="stop", elem_id="sc-delete-yes")
            c.delete_no = gr.Button("Cancel", size="sm", elem_id="sc-delete-no")


def _wire_conversations(app: ChatApp, c, demo: gr.Blocks, cleared_outputs: list, cleared: list) -> list:
    """The sidebar's events (all private: only the page calls them); the events that open a run."""
    quiet = dict(api_visibility="private", show_progress="hidden")
    views = app.conversations
    opened = cleared_outputs + [c.system]
    events = [c.conv_list.input(views.open_conversation, c.conv_list, opened, concurrency_limit=4, **quiet),
              demo.load(views.restore, c.conv_id, opened, **quiet)]
    cleared.append(c.new_chat.click(views.new_chat, None, cleared_outputs, **quiet))
    events.append(c.prev_answer.click(views.previous_answer, [c.conv_id, c.branch_at], opened, **quiet))
    events.append(c.next_answer.click(views.next_answer, [c.conv_id, c.branch_at], opened, **quiet))
    c.branch_at.input(views.choose_branch, [c.conv_id, c.branch_at], [c.sibling_row, c.sibling_text, c.branch_at],
                      **quiet)
    c.conv_search.change(views.search_conversations, [c.conv_search, c.conv_id], c.conv_list,
                         trigger_mode="always_last", **quiet)
    c.rename_btn.click(views.rename_conversation, [c.conv_id, c.conv_title], [c.conv_list, c.status], **quiet)
    c.conv_title.submit(views.rename_conversation, [c.conv_id, c.conv_title], [c.conv_list, c.status], **quiet)
    c.delete_btn.click(views.ask_delete, c.conv_id, [c.delete_row, c.status], **quiet)
    c.delete_no.click(views.cancel_delete, None, c.delete_row, **quiet)
    cleared.append(c.delete_yes.click(views.delete_conversation, c.conv_id, cleared_outputs + [c.delete_row],
                                      **quiet))
    return events


class _Components:
    """Attribute bag of the components a handler reads or writes."""


def build_demo(worker: Worker, tokenizer=None, options: dict | None = None) -> gr.Blocks:
    """The Gradio app around ``worker`` (which owns the models). ``options`` override :data:`DEFAULTS`."""
    return build(ChatApp(worker, tokenizer, options))


def theme() -> gr.themes.Base:
    local = [gr.themes.Font("Inter"), gr.themes.Font("ui-sans-serif"), gr.themes.Font("system-ui"),
             gr.themes.Font("Segoe UI"), gr.themes.Font("sans-serif")]
    mono = [gr.themes.Font("JetBrains Mono"), gr.themes.Font("ui-monospace"), gr.themes.Font("Menlo"),
            gr.themes.Font("Consolas"), gr.themes.Font("monospace")]
    return gr.themes.Default(primary_hue="emerald", secondary_hue="violet", neutral_hue="slate", font=local,
                             font_mono=mono, radius_size="md")


QUEUE_POLL_S = 0.02  # Gradio's queue polls for work every 1 ms when free (and 10 ms for progress)


def quiet_queue(demo: gr.Blocks) -> None:
    """Slows the polling loops of Gradio's queue from 1 kHz to 50 Hz: on two cores, their wake-ups
    cost ~8% of a core at all times, taken from the decoding threads. A job then starts up to 20 ms
    later, against a prefill of about a second."""
    queue = demo._queue
    queue.sleep_when_free = max(queue.sleep_when_free, QUEUE_POLL_S)
    queue.progress_update_sleep_when_free = max(queue.progress_update_sleep_when_free, 0.1)


def without_gradio_cors(app) -> None:
    """Takes Gradio's CORS middleware out of ``app`` (it answers foreign Origins with credentials
    on some Hosts): :class:`CrossOriginMiddleware` is the policy. The stack is rebuilt on the next
    request."""
    kept = [m for m in app.user_middleware if m.cls.__name__ != "CustomCORSMiddleware"]
    if len(kept) == len(app.user_middleware):
        raise RuntimeError("Gradio's CORS middleware was not found: check app.web.cross_origin against this Gradio")
    app.user_middleware = kept
    app.middleware_stack = None


@dataclass(frozen=True)
class Guards:
    """Who may reach the server and what each request may cost: Host names beside the loopback ones
    and ``server_name`` (``extra_hosts``; ``*`` turns the allowlist off), the key every client gives
    (``api_key``), the web origins that may call ``/v1`` (``cors_origins``), and the read timeouts,
    connections, body and queue sizes (``limits``, :mod:`app.web.server_limits`)."""

    extra_hosts: Sequence[str] = ()
    api_key: str | None = None
    cors_origins: frozenset[str] = frozenset()
    limits: ServerLimits | None = None


def launch(demo: gr.Blocks, server_name: str = "127.0.0.1", server_port: int | None = None,
           guards: Guards = Guards(), **options):
    """``demo.launch`` with the app's theme, CSS, queue, upload limits, page scripts and live feed,
    behind a Host allowlist and the cross-origin policy of :mod:`app.web.cross_origin`, as ``guards``
    say. With an API key, the page asks for it (any user name, the key as the password); only the
    page itself may run private events (:mod:`app.web.private_events`). ``options``: Gradio's own
    (``share``, ``inbrowser``, ``quiet``, ``prevent_thread_lock``, ...)."""
    limits, api_key, kwargs = guards.limits or ServerLimits(), guards.api_key, dict(options)
    share, prevent_thread_lock = kwargs.pop("share", False), kwargs.pop("prevent_thread_lock", False)
    demo.queue(default_concurrency_limit=4, max_size=limits.queue_size)
    quiet_queue(demo)
    if api_key is not None:
        kwargs.update(auth=lambda _user, password: secrets.compare_digest(password.encode(), api_key.encode()),
                      auth_message="This server needs its API key: any user name, the key as the password.")
    # a share link arrives with the tunnel's Host name: it is public by design
    guard = Middleware(HostGuardMiddleware, allowed=None if share else allowed_hosts(server_name, guards.extra_hosts))
    cross_origin = Middleware(CrossOriginMiddleware, api_origins=frozenset(guards.cors_origins))
    early = Middleware(HeadScriptMiddleware, script="\n".join(path.read_text() for path in PAGE_SCRIPTS))
    body_limit = Middleware(BodyLimitMiddleware, max_bytes=limits.max_body_bytes)
    named = Middleware(NamedEventsMiddleware, allowed=callable_names(demo))
    with serving_with(limits):
        launched = demo.launch(server_name=server_name, server_port=server_port, share=share,
                               prevent_thread_lock=True, theme=theme(),
                               css_paths=[CSS_PATH] if CSS_PATH.exists() else None, max_file_size="5mb",
                               show_error=True, run_history=False, footer_links=["api", "settings"],
                               app_kwargs={"middleware": [guard, body_limit, named, cross_origin, early]}, **kwargs)
    check_served_with(demo.server, limits)
    without_gradio_cors(launched[0])
    live_feed.mount(launched[0], demo.chat_app.feeds)
    if not prevent_thread_lock:
        demo.block_thread()
    return launched
