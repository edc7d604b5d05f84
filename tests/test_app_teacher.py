"""The UI explains itself: labelled figures (measured / estimated / predicted), the method named and
explained, the real model names, auto's pick on the sliders, replay tied to the text, exported
steps imported back. Tiny models with the real tokenizer; handlers called directly."""
from __future__ import annotations

import json
import re
import time

import pytest
import test_app_support as support
from test_app_worker import fake_tuner

from app.page import answer_stream

from app.page import controls

from app.page import handlers

from app.page import ui
from app.views import text as ui_text
from app.views.conversation import export_conversation, highlight_html, import_steps
from app.serving.pair import make_engine
from app.serving.worker import Worker
from engine.core.settings import TreeSize, settings_from
from engine.tuning.planner import TreePlanner
from engine.core.records import StepRecord, StepTimings


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    yield from support.one_torch_thread()


@pytest.fixture()
def app():
    tokenizer = support.tokenizer()
    target, draft = support.tiny_pair()
    worker = Worker(make_engine(target, draft, tokenizer), tokenizer, {"target": "tiny-target", "draft": "tiny-draft"})
    demo = ui.build_demo(worker, tokenizer)
    yield demo.chat_app
    worker.close()


def step(index, committed, accepted=(0, 1), tokens=(10, 11, 12)) -> StepRecord:
    n = len(tokens)
    return StepRecord(index=index, tokens=list(tokens), parents=[-1] + [0] * (n - 1), ranks=[0] + list(range(1, n)),
                      draft_probs=[1.0] * n, target_probs=[1.0] * n, accepted=list(accepted), committed=list(committed),
                      timings=StepTimings(0.01, 0.02, 0.0))


# ----- naming things -------------------------------------------------------------------------
def test_the_embedded_pair_is_named_with_its_formats():
    info = {"target": "default-target", "draft": "default-draft", "device": "cpu", "dtype": "float32",
            "target_format": "none", "draft_format": "int4", "target_params": 1_540_000_000,
            "draft_params": 494_000_000}
    header = ui_text.header_html("Sequoia Chat", info)
    assert "Qwen2.5-Coder-1.5B-Instruct</b> (float32, from GGUF Q4_K_M)" in header
    assert "Qwen2.5-Coder-0.5B-Instruct</b> (int4, from GGUF Q4_K_M)" in header
    assert "default-target" not in header
    panel = ui_text.pair_markdown(info)
    assert "**Qwen2.5-Coder-1.5B-Instruct** (`default-target`)" in panel and "int4 weights" in panel
    assert ui_text.model_name("someone/other-model") == "someone/other-model"


def test_each_method_is_named_and_explained():
    planner = TreePlanner()

    def described(method: str) -> str:
        return ui_text.describe_decision(planner.decide(settings_from(tree=TreeSize(8, 4), method=method)))

    descriptions = {m: described(m) for m in ("sequoia", "specinfer", "topk")}
    assert len(set(descriptions.values())) == 3, descriptions  # no longer all "Sequoia DP tree: ..."
    assert all(d.startswith(m) for m, d in descriptions.items())
    assert described("autoregressive").startswith("autoregressive")
    assert "children sampled independently" in ui_text.method_help("specinfer", 0.7)
    assert "At T = 0 every method" in ui_text.method_help("topk", 0.0)
    assert "At T = 0" not in ui_text.method_help("autoregressive", 0.0)


def test_the_key_explains_the_symbols_and_each_accept_rule():
    key = ui_text.key_html()
    for words in ("␣", "↵", "solid", "dashed", "bonus", "measured", "estimated", "predicted"):
        assert words in key
    for method in ("sequoia", "specinfer", "chain", "topk", "autoregressive"):
        assert f"<b>{method}</b>:" in key


def test_the_key_and_method_help_are_in_the_page(app):
    assert "sc-method-help" in app.c.method_help.value
    assert app.c.msg.placeholder == "Ask something…"  # short: not clipped on a phone


# ----- one trustworthy speed-up figure --------------------------------------------------------
def test_target_alone_rate_is_measured_per_pair_and_setting(app):
    assert app.baseline(0.0, 1.0) == (None, "")
    assert "not measured yet" in app.baseline_html(0.0, 1.0)
    app.worker.set_tuner(fake_tuner())
    try:
        rate, source = app.baseline(0.0, 1.0)
        assert source == "estimated" and rate == pytest.approx(100.0)  # 1 / target_time(1) of the profile
        assert "estimated" in app.baseline_html(0.0, 1.0)
        app.record_baseline(0.0, 1.0, {"tokens": 20, "decode_s": 10.0})
        assert app.baseline(0.0, 1.0) == (2.0, "measured")
        assert "measured on this machine" in app.baseline_html(0.0, 1.0)
        assert app.baseline(0.7, 0.9)[1] == "estimated"  # another setting is not measured yet
        app.worker.pair_version += 1  # another pair: its own measurement
        assert app.baseline(0.0, 1.0)[1] == "estimated"
    finally:
        app.worker.set_tuner(None)


def test_measure_button_decodes_the_target_alone_and_keeps_the_rate(app):
    updates = list(app.measure_baseline(0.0, 1.0, 0))
    assert "Measuring" in updates[0][app.c.baseline_info]
    rate, source = app.baseline(0.0, 1.0)
    assert source == "measured" and rate > 0
    assert f"{rate:.1f} tokens/s" in updates[-1][app.c.baseline_info]


def test_predicted_tokens_per_step_follow_temperature_and_top_p(app):
    greedy = app.tree_info("sequoia", 8, 4, False, 0.0, 1.0)
    sampled = app.tree_info("sequoia", 8, 4, False, 0.6, 1.0)
    assert "predicted" in greedy and "T=0," in greedy and "T=0.6," in sampled
    pick = lambda text: text.split("predicted ")[1].split(" tokens/step")[0]  # noqa: E731
    calib = (app.calibration(0.0, 1.0).vector, app.calibration(0.6, 1.0).vector)
    assert calib[0] != calib[1] and pick(greedy) != pick(sampled)


# ----- auto shows its choice ------------------------------------------------------------------
def test_auto_disables_the_sliders_and_names_its_pick(app):
    app.worker.set_tuner(fake_tuner())
    try:
        choice = app.worker.tuner.choose(0.0, 1.0, "sequoia")
        size, depth = app.auto_controls("sequoia", True, 0.0, 1.0)
        assert size["interactive"] is False and f"auto picks {choice.size}" in size["label"]
        assert depth["interactive"] is False and f"auto picks {choice.depth}" in depth["label"]
        assert "value" not in size  # the user's own values stay
        size, _ = app.auto_controls("sequoia", False, 0.0, 1.0)
        assert size["interactive"] is True and size["label"] == "Tree size"
    finally:
        app.worker.set_tuner(None)


def test_the_colouring_panel_renders_markdown_not_its_source():
    tok = support.tokenizer()
    ids = tok.encode("Use **bold** for <b>this</b> & `code`:\n\n```python\nx = 1\n```\n")
    steps = [step(i, ids[i * 3:(i + 1) * 3], accepted=(0, 1) if i % 2 else (0,)) for i in range((len(ids) + 2) // 3)]
    panel = highlight_html(tok, steps)
    assert "<strong>" in panel and "**" not in panel  # rendered, not the source
    assert "<pre><code" in panel and "```" not in panel
    assert "&lt;b&gt;" in panel and "<b>this" not in panel  # HTML in the answer stays text
    visible = re.sub(r"<[^>]+>", "", panel.split("hl-md'>")[1])
    assert "bold" in visible and "x = 1" in visible.replace('</span><span class="tok tok-draft">', "")
    assert 'class="tok tok-draft"' in panel and 'class="tok tok-bonus"' in panel


# ----- replay tied to the text ----------------------------------------------------------------
def test_replayed_step_is_marked_in_the_answer():
    tok = support.tokenizer()
    hello, world = tok.encode("Hello"), tok.encode(" world")
    steps = [step(0, hello), step(1, world)]
    marked = highlight_html(tok, steps, current=1)
    assert re.findall(r'tok-current">([^<]*)<', marked) == [" world"]
    assert "tok-current" not in highlight_html(tok, steps)
    text = ui_text.step_text_html(tok, steps, 1)
    assert "Step 2 wrote:" in text and "Hello" in text and "<mark class='sc-step-now'>␣world</mark>" in text


def test_play_advances_the_replay_and_stops_after_the_last_step(app):
    run = answer_stream.Run(steps=[step(i, [20 + i]) for i in range(3)], texts={})
    c = app.c
    timer, _, _ = app.play(run, 1, 0.6)
    assert timer["active"] is True and timer["value"] == 0.6
    out = app.tick(1, run, False)  # showing step 1: the next is step 2
    assert out[c.slider]["value"] == 2 and c.timer not in out
    out = app.tick(2, run, False)
    assert out[c.slider]["value"] == 3 and out[c.timer]["active"] is False  # the last step ends playing


def test_exported_steps_come_back_on_import():
    steps = [step(0, [11, 12], accepted=(0, 1)), step(1, [13])]
    data = export_conversation("sys", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                               None, steps, {11: "a", 12: "b"})
    back, texts = import_steps(data)
    assert back == steps and texts == {11: "a", 12: "b"}
    assert import_steps(json.dumps({"messages": []})) == ([], {})
    bad = json.loads(data)
    bad["steps"][0]["accepted"] = [0, 9]
    with pytest.raises(ValueError, match="could not be read"):
        import_steps(json.dumps(bad))


def test_a_depth_the_tree_does_not_reach_is_reported(app):
    capped = app.tree_info("sequoia", 4, 8, False, 0.0, 1.0)
    assert "depth capped at size − 1 = 3" in capped
    tree = app.worker.decide(settings_from(tree=TreeSize(32, 16))).tree
    assert tree.depth < 16  # the greedy calibration makes 32 nodes wider than 16 deep
    assert f"the DP tree stops at {tree.depth}" in app.tree_info("sequoia", 32, 16, False, 0.0, 1.0)
    assert "stops at" not in app.tree_info("chain", 32, 16, False, 0.0, 1.0)


def test_a_message_sent_during_an_answer_is_refused_with_a_message(app):
    from app.serving.jobs import GenerationRequest
    from engine.core.settings import DecodeSettings

    blocker = app.worker.submit(GenerationRequest(settings=DecodeSettings(max_new_tokens=2000, tree=None,
                                                                          method="autoregressive"),
                                                  system="", messages=[{"role": "user", "content": "long"}]),
                                session="local")
    try:
        updates = list(app.respond("second question", [], answer_stream.Run(), "", 0.0, 1.0, 8, 0, "sequoia", 8, 4, False,
                                   False, False))
    finally:
        blocker.cancel()
    assert len(updates) == 1 and app.c.msg not in updates[0]  # the text stays in the box
    assert "Not sent: an answer is still streaming" in updates[0][app.c.status]


def test_live_updates_keep_their_intervals_and_few_cores_get_fewer(monkeypatch):
    """While an answer streams, the chat text is sent at most every ``text_interval`` seconds and
    the live tree (inline SVG; the plotly figures come after the answer) every ``plot_interval``;
    on up to 4 cores (where the browser draws on the cores
    that decode) those are 0.25 s and 1 s (the page's live feed 0.3 s and 0.5 s), on larger machines
    0.05 s and 0.2 s (0.1 s and 0.25 s). Counted, not
    timed: the updates are paced by a clock that advances 0.05 s with each decoding step, so a
    loaded machine cannot move the counts."""
    assert controls.live_update_intervals(2) == {"text_interval": 0.25, "plot_interval": 1.0,
                                                 "feed_interval": 0.3, "feed_tree_interval": 0.5}
    assert controls.live_update_intervals(16) == {"text_interval": 0.05, "plot_interval": 0.2,
                                                  "feed_interval": 0.1, "feed_tree_interval": 0.25}
    assert {k: controls.DEFAULTS[k] for k in controls.live_update_intervals()} == controls.live_update_intervals()
    tokenizer = support.tokenizer()
    target, draft = support.tiny_pair()
    engine = support.SlowEngine(make_engine(target, draft, tokenizer), delay=0.01)
    readings = [0.0]  # the clock's last reading: the time the update just yielded was decided at

    def paced() -> float:
        readings.append(engine.steps_run * 0.05)
        return readings[-1]

    monkeypatch.setattr(answer_stream, "clock", paced)
    worker = Worker(engine, tokenizer, {})
    chat = ui.build_demo(worker, tokenizer, {"text_interval": 0.1, "plot_interval": 0.5}).chat_app
    try:
        stamps = [(readings[-1], update) for update in
                  chat.respond("Hello there", [], answer_stream.Run(), "", 0.0, 1.0, 120, 0, "chain", 2, 1, False, False, False)]
    finally:
        worker.close()
    c = chat.c
    live = [(t, u) for t, u in stamps[1:-1] if c.chatbot in u]  # between the first frame and the final one
    texts, plots = [t for t, _ in live], [t for t, u in live if c.live_tree in u]
    assert not any(c.tree_plot in u or c.steps_plot in u for _, u in live), "no plotly figure while streaming"
    assert all(u[c.live_tree].startswith('<div class="sc-live-tree">') and "<svg" in u[c.live_tree]
               for _, u in live if c.live_tree in u)
    steps = engine.steps_run
    assert steps >= 40 and len(texts) >= 5 and len(plots) >= 2, (steps, len(texts), len(plots))
    assert len(texts) <= steps * 0.05 / 0.1 + 1 and len(plots) <= steps * 0.05 / 0.5 + 1, (steps, len(texts), len(plots))
    assert min(b - a for a, b in zip(texts, texts[1:])) >= 0.1 - 1e-9
    assert min(b - a for a, b in zip(plots, plots[1:])) >= 0.5 - 1e-9


def test_a_page_reading_the_live_feed_gets_the_answer_there_and_gradio_only_the_first_and_last_update(monkeypatch):
    """Once a page reads an answer's live feed, the answer streams as records (text deltas whose
    concatenation is the final text, the step's tree SVG and stats at most every
    ``feed_tree_interval``, the status line), Gradio gets no update between the first and the last,
    and the feed ends before the last. Paced by a step-counting clock, as above."""
    tokenizer = support.tokenizer()
    target, draft = support.tiny_pair()
    engine = support.SlowEngine(make_engine(target, draft, tokenizer), delay=0.01)
    monkeypatch.setattr(answer_stream, "clock", lambda: engine.steps_run * 0.05)
    worker = Worker(engine, tokenizer, {})
    chat = ui.build_demo(worker, tokenizer, {"feed_interval": 0.1, "feed_tree_interval": 0.5}).chat_app
    opened = []
    open_feed = chat.feeds.open

    def open_read_feed():  # as live_feed.js does once the first update shows the token
        feed = open_feed()
        feed.subscribers += 1
        opened.append(feed)
        return feed

    monkeypatch.setattr(chat.feeds, "open", open_read_feed)
    try:
        updates = list(chat.respond("Hello there", [], answer_stream.Run(), "", 0.0, 1.0, 120, 0, "chain", 2, 1, False,
                                    False, False))
    finally:
        worker.close()
    c, (feed,) = chat.c, opened
    assert f'data-sc-feed="{feed.token}"' in updates[0][c.live_tree]
    assert not any(c.chatbot in u for u in updates[1:-1]), "Gradio's chat updates while the page reads the feed"
    records = [json.loads(r) for r in feed.records]
    assert records[-1] == {"end": True} and feed.closed_at is not None
    text = ""
    for record in records[:-1]:
        text = record["reset"] if "reset" in record else text + record["text"]
    assert all("Decoding with chain" in r["status"] for r in records[:-2])  # the last text may come with the end
    final = updates[-1][c.history][-1]["content"]
    assert text == final and len(records) >= 5, (len(records), text, final)
    trees = [r for r in records if "tree" in r]
    assert trees and all("<svg" in r["tree"] and "tokens/step" in r["stats"] for r in trees)
    assert len(trees) <= engine.steps_run * 0.05 / 0.5 + 1


@pytest.mark.parametrize("method", ["sequoia", "autoregressive"])
def test_the_status_says_what_is_happening_and_names_the_method(app, method):
    updates = list(app.respond("Hello there", [], answer_stream.Run(), "", 0.0, 1.0, 6, 0, method, 8, 4, False, False, False))
    statuses = [u[app.c.status] for u in updates if app.c.status in u]
    prefill = [s for s in statuses if "Prefill:" in s]
    assert prefill and "-token prompt" in prefill[0]
    if method == "autoregressive":
        assert "the target reads" in prefill[0] and "Autoregressive: the target alone" in statuses[-1]
        assert "bonus" not in str(updates[-1][app.c.stats]) and "drafted" not in updates[-1][app.c.stats]
    else:
        assert "the target and the draft read" in prefill[0] and "Sequoia on a" in statuses[-1]
    assert updates[0][app.c.stop_btn]["interactive"] is True and updates[-1][app.c.stop_btn]["interactive"] is False


def test_a_long_prompt_shows_how_much_of_it_has_been_read(app):
    """The prefill reports after each chunk: a bar, "Reading your message: n / N tokens" and the
    time left, before the first step's status."""
    app.worker.engine.prefill_chunk = 8
    message = " ".join(["word"] * 60)
    updates = list(app.respond(message, [], answer_stream.Run(), "", 0.0, 1.0, 4, 0, "sequoia", 4, 2, False, False, False))
    statuses = [u[app.c.status] for u in updates if app.c.status in u]
    reading = [s for s in statuses if "Reading your message" in s]
    assert len(reading) >= 4 and all('<progress class="sc-prefill"' in s for s in reading)
    counts = [tuple(int(n.replace(",", "")) for n in re.search(r"([\d,]+) / ([\d,]+) tokens", s).groups())
              for s in reading]
    total = counts[0][1]
    assert total >= 60 and [done for done, _ in counts] == sorted(done for done, _ in counts)
    assert counts[-1][0] == total and "s left" in reading[0]
    assert statuses.index(reading[-1]) < max(i for i, s in enumerate(statuses) if "Decoding with" in s or "Sequoia" in s)


def test_a_long_prompts_draft_reading_between_steps_is_said(app, monkeypatch):
    """Past ``draft_deferral`` tokens the prefill status says the draft reads the prompt later, and
    the steps taken meanwhile say how much it has left. The next turn's status follows the engine's
    decision, not the prompt's length: its draft has only the new tokens to read."""
    engine = app.worker.engine
    monkeypatch.setattr(engine, "draft_deferral", 20)
    monkeypatch.setattr(engine, "draft_catch_up", 8)
    message = " ".join(["word"] * 60)
    updates = list(app.respond(message, [], answer_stream.Run(), "", 0.0, 1.0, 12, 0, "sequoia", 4, 2, False, False,
                               False))
    statuses = [u[app.c.status] for u in updates if app.c.status in u]
    assert any("the target reads the" in s and "the draft reads it between the first steps" in s for s in statuses)
    behind = [s for s in statuses if "the draft is still reading your message" in s]
    assert behind and "tokens to go" in behind[0]
    stats = [u[app.c.stats] for u in updates if app.c.stats in u]
    assert "of the draft reading your message between the first steps" in stats[-1]
    # the next turn: the conversation's cache holds the long message, the draft reads the rest up front
    monkeypatch.setattr(engine, "draft_deferral", 60)
    history = updates[-1][app.c.history]
    updates = list(app.respond("And then?", history, answer_stream.Run(), "", 0.0, 1.0, 4, 0, "sequoia", 4, 2, False,
                               False, False))
    prefill = [u[app.c.status] for u in updates if app.c.status in u and "Prefill:" in u[app.c.status]]
    assert prefill and "the target and the draft read" in prefill[0] and "between the first steps" not in prefill[0]


def test_the_int4_target_is_named_by_what_it_stores():
    from app.views.text import model_format

    assert model_format({"target": "default-target", "target_format": "q4k"}, "target") == \
        "int4: the GGUF Q4_K_M blocks as stored"


def test_a_baseline_measured_at_start_is_kept(app):
    app.baselines.clear()
    assert app.baseline(0.0, 1.0)[1] != "measured"
    rate = app.measure_baseline_now(0.0, 1.0)
    assert rate and rate > 0 and app.baseline(0.0, 1.0) == (rate, "measured at launch")
    assert "measured on this machine at launch, before any page drew" in app.baseline_html(0.0, 1.0)
    assert not app.baseline(0.7, 1.0)[1].startswith("measured")  # only the setting it measured
    app.record_baseline(0.0, 1.0, {"tokens": 30, "decode_s": 3.0})  # a Compare or Measure run, in the page
    assert app.baseline(0.0, 1.0) == (10.0, "measured")


def test_exports_in_the_same_second_never_share_a_file_and_the_folder_goes_with_the_app(app):
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    paths = {app.export_settings("", history)["value"] for _ in range(50)}
    assert len(paths) == 50  # id(history) % 10000 made them collide
    import gc

    fresh = handlers.ChatApp(app.worker)
    folder = fresh.export_dir
    assert folder.is_dir()
    del fresh
    gc.collect()
    assert not folder.exists()


def test_the_vocabularys_longest_entry_is_read_when_the_app_starts_not_before_the_first_answer(app):
    from app.views import conversation

    conversation._LONGEST.pop(app.worker.tokenizer, None)
    handlers.ChatApp(app.worker)
    assert app.worker.tokenizer in conversation._LONGEST  # the first answer's fit_context finds it there


@pytest.mark.parametrize("replace", ["clear", "import"])
def test_clear_or_import_during_an_answer_is_not_undone_by_it(app, replace, tmp_path):
    """The answer's last update carried the old conversation and put it back after Clear/Import."""
    c = app.c
    answer = app.respond("Write a long story", [], answer_stream.Run(), "", 0.0, 1.0, 400, 0, "sequoia", 8, 4, False,
                         False, False)
    next(answer)
    next(answer)  # streaming now
    if replace == "clear":
        app.clear()
    else:
        exported = tmp_path / "chat.json"
        exported.write_text(export_conversation("", [{"role": "user", "content": "imported"},
                                                     {"role": "assistant", "content": "yes"}], None, None, None))
        assert "Imported 2 messages" in app.import_file(str(exported))[c.status]
    later = list(answer)
    assert all(c.chatbot not in update and c.history not in update for update in later), \
        "the answer's updates wrote the old conversation back"


def test_stop_during_compare_keeps_the_whole_answer_unmarked(app):
    """The answer had ended; only the target-alone run for the comparison was stopped."""
    c = app.c
    app.worker.engine = support.SlowEngine(app.worker.engine, 0.02)  # the comparison lasts seconds
    updates = app.respond("Write a haiku about trees", [], answer_stream.Run(), "", 0.0, 1.0, 200, 0, "sequoia", 8, 4,
                          False, True, False)  # Compare on
    stopped = False
    last = None
    for update in updates:
        last = update
        status = str(update.get(c.status, ""))
        if not stopped and "Now the target alone, for comparison" in status:
            assert app.worker.cancel_session("local") == 1
            stopped = True
    assert stopped, "the comparison phase never started"
    answer = last[c.history][-1]
    assert answer["role"] == "assistant" and "note" not in answer and answer["content"]
    assert "comparison with the target alone was stopped" in last[c.status]


def test_with_compare_the_whole_answer_is_on_the_page_before_the_target_alone_runs(monkeypatch):
    """The live feed carries the answer's last tokens when the answer ends, not once Compare's run of
    the target alone (seconds later on a real pair) is over; and Compare's race is redrawn at the
    plots' pace, not the text's (a Gradio update a quarter second cost the target alone 12% of its
    speed in Chromium on 2 cores, so the race was not fair). Paced by a step-counting clock."""
    tokenizer = support.tokenizer()
    target, draft = support.tiny_pair()
    engine = support.SlowEngine(make_engine(target, draft, tokenizer), delay=0.01)
    monkeypatch.setattr(answer_stream, "clock", lambda: engine.steps_run * 0.05)
    worker = Worker(engine, tokenizer, {})
    chat = ui.build_demo(worker, tokenizer, {"feed_interval": 0.1, "feed_tree_interval": 0.5, "text_interval": 0.1,
                                             "plot_interval": 0.5}).chat_app
    opened = []
    open_feed = chat.feeds.open

    def open_read_feed():
        feed = open_feed()
        feed.subscribers += 1
        opened.append(feed)
        return feed

    monkeypatch.setattr(chat.feeds, "open", open_read_feed)
    shown_when_comparing, races = None, []
    try:
        for update in chat.respond("Hello there", [], answer_stream.Run(), "", 0.0, 1.0, 120, 0, "chain", 2, 1,
                                   False, True, False):
            race = update.get(chat.c.compare_md)
            if isinstance(race, dict) and race.get("visible") and "sc-race" in str(race.get("value")):
                races.append(answer_stream.clock())
                if shown_when_comparing is None:
                    text = ""
                    for record in map(json.loads, opened[0].records):
                        text = record["reset"] if "reset" in record else text + record.get("text", "")
                    shown_when_comparing = text
    finally:
        worker.close()
    final = update[chat.c.history][-1]["content"]
    assert shown_when_comparing is not None, "Compare's race was never shown"
    assert len(final) > 20 and shown_when_comparing == final
    assert len(races) >= 3 and min(b - a for a, b in zip(races, races[1:])) >= 0.5 - 1e-9, races
