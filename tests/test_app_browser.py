"""The app in a real browser (Debian's chromium driven by Playwright; tiny models, in-process server).

Skips when chromium or Playwright is missing (`make browser` installs both). Screenshots go to
test-artifacts/ for a person to look at.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import test_app_support as support

from app.serving.pair import make_engine
from app.serving.worker import Worker

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CHROMIUM = os.environ.get("SEQUOIA_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]

if CHROMIUM is None:
    pytest.skip("chromium is not installed (make browser installs it)", allow_module_level=True)
try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:
    pytest.skip("Playwright for Python is not installed (make browser installs it)", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    yield from support.one_torch_thread()


@pytest.fixture(scope="module")
def server():
    tokenizer = support.tokenizer()
    target, draft = support.tiny_pair()
    engine = support.SlowEngine(make_engine(target, draft, tokenizer), delay=0.03)
    worker = Worker(engine, tokenizer, {"target": "tiny-random-qwen2", "draft": "tiny-random-qwen2-perturbed",
                                        "device": "cpu", "dtype": "float32", "target_params": 10_000_000,
                                        "draft_params": 10_000_000, "max_context": 4096})
    demo, url = support.start_server(worker, {"max_new_tokens": 64, "system_prompt": "You are concise."})
    yield worker, url
    demo.close()
    worker.close()


@pytest.fixture(scope="module")
def page(server):
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1500, "height": 1000})
        page = context.new_page()
        errors = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(server[1])
        page.wait_for_selector("#sc-msg textarea", timeout=60_000)
        page.errors = errors
        yield page
        context.close()
        browser.close()


def shot(page, name):
    page.screenshot(path=str(ARTIFACTS / f"browser-{name}.png"), full_page=True)


def bot_text(page) -> str:
    bots = page.locator("#sc-chatbot .bot")
    return bots.last.inner_text() if bots.count() else ""


def test_chat_tree_replay_and_stop(server, page):
    worker, _ = server
    page.get_by_label("Compare with the target alone").check()
    page.get_by_label("Colour draft vs. target tokens").check()
    worker.engine.delay = 0.15  # slow enough that the checks below see the answer while it streams
    page.fill("#sc-msg textarea", "Explain <b>speculative</b> decoding & trees")
    page.keyboard.press("Enter")

    # streamed text over the live feed, and a live tree (inline SVG while the answer streams) with nodes
    page.wait_for_function("() => { const t = document.querySelector('#sc-chatbot .sc-live-text'); "
                           "return t && t.innerText.trim().length > 3; }", timeout=90_000)
    page.wait_for_function("() => document.querySelectorAll('#sc-live-tree g.sc-node').length >= 3", timeout=90_000)
    shot(page, "1-streaming")
    assert page.locator("#sc-chatbot .sc-live-text").count() == 1
    worker.engine.delay = 0.03
    user = page.locator("#sc-chatbot .user").last.inner_text()
    assert "<b>speculative</b> decoding & trees" in user  # shown as typed, not as HTML

    # while the target alone decodes for comparison, Compare is a live race beside the tree
    expect(page.locator("#sc-compare")).to_contain_text("Race, measured live", timeout=60_000)
    expect(page.locator("#sc-status")).to_contain_text("Done", timeout=60_000)
    expect(page.locator("#sc-compare")).to_contain_text("target alone", timeout=10_000)
    expect(page.locator("#sc-chatbot .sc-live-text")).to_have_count(0)  # Gradio's final Markdown took over
    expect(page.locator("#sc-highlight .tok-draft").first).to_be_visible()
    expect(page.locator("#sc-stats")).to_contain_text("tokens/step")
    title = page.locator("#sc-tree .gtitle").text_content()
    assert title.startswith("Step ") and "drafted" in title
    shot(page, "2-done")

    # replay step 1 with the slider's number box
    box = page.locator("#sc-step-slider input[type=number]")
    box.fill("1")
    box.press("Enter")
    expect(page.locator("#sc-tree .gtitle")).to_contain_text("Step 1:", timeout=10_000)
    # hovering a node shows q, p and how the verifier judged it (greedy here: the argmax match)
    node = page.locator("#sc-tree .scatterlayer .trace .points path").nth(1)
    node.hover(force=True)
    page.wait_for_timeout(300)
    hover = page.locator("#sc-tree .hoverlayer").text_content()
    shot(page, "3-replay-step-1")
    assert "root" in hover or ("target p =" in hover and ("argmax" in hover or "p/q" in hover)), hover

    # a long answer, stopped
    page.get_by_label("Compare with the target alone").uncheck()
    page.get_by_label("number input for Max new tokens").fill("2000")
    page.get_by_label("number input for Max new tokens").press("Enter")
    worker.engine.delay = 0.06
    page.fill("#sc-msg textarea", "Now tell me a very long story")
    page.click("#sc-send")
    expect(page.locator("#sc-status")).to_contain_text("Decoding", timeout=30_000)
    page.wait_for_timeout(800)
    page.click("#sc-stop")
    assert support.wait_until(lambda: worker.busy == 0, 5), "the engine kept decoding after Stop"
    expect(page.locator("#sc-status")).to_contain_text("Stopped after", timeout=15_000)
    worker.engine.delay = 0.03
    expect(page.locator("#sc-chatbot .bot").last).to_contain_text("stopped")
    shot(page, "4-stopped")
    assert not page.errors, page.errors


def test_empty_message_and_clear(server, page):
    assert support.wait_until(lambda: server[0].busy == 0, 60), "the previous answer is still decoding"
    page.fill("#sc-msg textarea", "   ")
    page.keyboard.press("Enter")
    expect(page.locator("#sc-status")).to_contain_text("Empty message ignored", timeout=10_000)
    page.click("#sc-clear")
    expect(page.locator("#sc-status")).to_contain_text("Cleared", timeout=10_000)
    assert page.locator("#sc-chatbot .bot").count() == 0
    shot(page, "5-cleared")


MARKDOWN_ANSWER = """Here is a function:

```python
def reverse(items: list) -> list:
\treturn items[::-1]  # works for a < b too
LONG = ["a very long line of code that would run far beyond the edge of the chat bubble", 1, 2, 3, 4, 5, 6, 7, 8]
```

Use it like `reverse([1, 2])`. Tags such as <div> & entities show as text, **bold** is bold:

| n | reversed |
|---|---|
| 3 | [3, 2, 1] |
"""


def test_imported_conversation_renders_markdown_and_code(server, page, tmp_path):
    import json
    path = tmp_path / "conversation.json"
    path.write_text(json.dumps({"system": "Be brief.", "messages": [
        {"role": "user", "content": "How do I reverse a list <quickly>?"},
        {"role": "assistant", "content": MARKDOWN_ANSWER}]}))
    page.locator("#sc-import input[type=file], input[type=file]").first.set_input_files(str(path))
    expect(page.locator("#sc-status")).to_contain_text("Imported 2 messages", timeout=10_000)
    bot = page.locator("#sc-chatbot .bot").last
    expect(bot.locator("pre code")).to_contain_text("return items[::-1]")
    expect(bot.locator("table")).to_be_visible()
    assert "<div> & entities" in bot.inner_text()
    assert "<quickly>" in page.locator("#sc-chatbot .user").last.inner_text()
    assert page.locator("#sc-system textarea").input_value() == "Be brief."
    # a long code line wraps inside the bubble instead of hiding past its edge
    assert bot.locator("pre").first.evaluate("p => p.scrollWidth <= p.clientWidth + 1")
    shot(page, "6-imported-markdown")


COUNT_FRAMES_JS = """window.scFrames = 0; const request = window.requestAnimationFrame.bind(window);
window.requestAnimationFrame = (callback) => { window.scFrames += 1; return request(callback); };"""


def test_an_idle_page_requests_few_frames(server, page):
    """Gradio's status trackers request an animation frame at every vsync while the page is idle (a
    tenth of a core on these machines, taken from decoding). ``assets/quiet_frames.js``, put at the
    top of the page's <head> by the server, delays theirs to 4 a second."""
    context = page.context.browser.new_context(viewport={"width": 1500, "height": 1000})
    try:
        context.add_init_script(COUNT_FRAMES_JS)  # runs before the page's scripts: counts what reaches the browser
        idle = context.new_page()
        idle.goto(server[1])
        idle.wait_for_selector("#sc-msg textarea", timeout=60_000)
        idle.wait_for_timeout(3000)
        read = "() => [window.scFrames, window.scQuietFrames ? window.scQuietFrames.slowed : -1]"
        frames0, slowed0 = idle.evaluate(read)
        idle.wait_for_timeout(4000)
        frames1, slowed1 = idle.evaluate(read)
    finally:
        context.close()
    assert slowed0 >= 0, "quiet_frames.js did not run before Gradio's modules"
    slowed, frames = slowed1 - slowed0, frames1 - frames0
    assert slowed > 0  # the trackers' loops are there, and go through the gate
    assert frames < 4 * 25, (frames, slowed)  # unthrottled: 90 a second here (16 with the gate)


def test_the_roofline_panel_moves_the_pick(server, page):
    """Why this tree's roofline panel on the bundled int4 CPU profile: the draft-cost slider re-runs the
    optimizer and the chart's pick moves (screenshot: test-artifacts/roofline.png)."""
    from test_explain import Q4K, tuner_for

    assert support.wait_until(lambda: server[0].busy == 0, 60), "the previous answer is still decoding"
    server[0].set_tuner(tuner_for(Q4K))
    try:
        panel = page.locator("#sc-roofline")
        panel.scroll_into_view_if_needed()
        box = page.locator("#sc-roof-draft input[type=number]")
        box.fill("0.25")
        box.press("Enter")
        expect(page.locator("#sc-roof-text")).to_contain_text("every draft level ×0.25", timeout=20_000)
        expect(page.locator("#sc-roof-plot .js-plotly-plot")).to_be_visible(timeout=20_000)
        expect(page.locator("#sc-roof-s text", has_text="pick").first).to_be_visible(timeout=20_000)
        page.wait_for_timeout(500)
        panel.screenshot(path=str(ARTIFACTS / "roofline.png"))
    finally:
        server[0].set_tuner(None)
