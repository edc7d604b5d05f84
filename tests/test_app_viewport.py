"""The tree in view on every screen: the app in a real browser at a desktop, a small laptop and a
phone size (chromium driven by Playwright; tiny models, in-process server).

At each size, after an answer: the tree's box lies within the first viewport (nothing scrolled),
the page does not scroll sideways, and the settings sidebar starts closed below 1280 px. At
1440 x 960 the Compare result sits next to the tree, also in the first viewport. Screenshots of
each go to test-artifacts/viewport-<w>x<h>.png for a person to look at. At 1440 the Compare result
and the draft/target colouring start in the first viewport too.
"""
from __future__ import annotations

import pytest
import test_app_support as support
from playwright.sync_api import expect, sync_playwright  # noqa: E402
from test_app_browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS  # skips the module without chromium

SIZES = [(1440, 960), (1024, 768), (390, 844)]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    yield from support.one_torch_thread()


@pytest.fixture(scope="module")
def url():
    from app.serving.pair import make_engine
    from app.serving.worker import Worker
    tokenizer = support.tokenizer()
    target, draft = support.tiny_pair()
    engine = make_engine(target, draft, tokenizer)
    worker = Worker(engine, tokenizer, {"target": "tiny-random-qwen2", "draft": "tiny-random-qwen2-perturbed",
                                        "device": "cpu", "dtype": "float32", "target_params": 10_000_000,
                                        "draft_params": 10_000_000, "max_context": 4096})
    demo, address = support.start_server(worker, {"max_new_tokens": 24})
    yield address
    demo.close()
    worker.close()


@pytest.fixture(scope="module")
def browser():
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def ask(page, message: str) -> None:
    """Send ``message`` from the message box and wait until the answer is done."""
    page.fill("#sc-msg textarea", message)
    page.keyboard.press("Enter")
    expect(page.locator("#sc-status")).to_contain_text("Done", timeout=120_000)


def box_in_first_viewport(page, selector) -> dict:
    return page.evaluate("""(sel) => {
        window.scrollTo(0, 0);
        const r = document.querySelector(sel).getBoundingClientRect();
        return {top: r.top, bottom: r.bottom, left: r.left, right: r.right,
                width: window.innerWidth, height: window.innerHeight,
                scrollWidth: document.scrollingElement.scrollWidth};
    }""", selector)


@pytest.mark.parametrize("width,height", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_tree_is_in_the_first_viewport(url, browser, width, height):
    phone = width < 600
    context = browser.new_context(viewport={"width": width, "height": height}, is_mobile=phone, has_touch=phone,
                                  device_scale_factor=2 if phone else 1)
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        page.goto(url)
        page.wait_for_selector("#sc-msg textarea", timeout=60_000)
        page.wait_for_timeout(500)  # the load handler opens the sidebar where there is room
        sidebar_open = page.evaluate("() => document.querySelector('.sidebar').classList.contains('open')")
        assert sidebar_open == (width >= 1280), f"sidebar open={sidebar_open} at {width} px"
        if width >= 1280:
            page.get_by_label("Compare with the target alone").check()
            page.get_by_label("Colour draft vs. target tokens").check()
        ask(page, "What is a hash map?")
        expect(page.locator("#sc-tree .gtitle")).to_contain_text("Step", timeout=10_000)
        page.wait_for_timeout(300)

        tree = box_in_first_viewport(page, "#sc-tree")
        page.screenshot(path=str(ARTIFACTS / f"viewport-{width}x{height}.png"))
        assert tree["scrollWidth"] <= tree["width"], f"horizontal scrolling at {width} px: {tree}"
        assert tree["top"] >= 0 and tree["bottom"] <= tree["height"], f"the tree is not in the first viewport: {tree}"
        assert tree["left"] >= 0 and tree["right"] <= tree["width"], tree
        # the tree's title is not cut: its text ends inside the plot
        title = page.evaluate("""() => { const t = document.querySelector('#sc-tree .gtitle').getBoundingClientRect();
            const p = document.querySelector('#sc-tree').getBoundingClientRect(); return [t.right, p.right]; }""")
        assert title[0] <= title[1] + 1, f"the tree title is cut at {width} px: {title}"
        if width >= 1280:
            compare = box_in_first_viewport(page, "#sc-compare")
            assert compare["bottom"] <= compare["height"], f"the Compare result needs scrolling: {compare}"
            colours = box_in_first_viewport(page, "#sc-highlight .hl-text")
            assert colours["top"] < colours["height"] - 40, f"the draft/target colouring starts below the fold: {colours}"
        assert not errors, errors
    finally:
        context.close()


def test_presentation_mode_shows_the_tree_and_the_answer_large(url, browser):
    context = browser.new_context(viewport={"width": 1024, "height": 768})
    page = context.new_page()
    try:
        page.goto(url)
        page.wait_for_selector("#sc-msg textarea", timeout=60_000)
        ask(page, "Explain trees")
        # "Done" arrives with the final figure, but plotly draws it after the update is applied
        page.wait_for_selector("#sc-tree g.annotation text", timeout=30_000)
        size = lambda: page.evaluate(  # noqa: E731
            "() => parseFloat(getComputedStyle(document.querySelector('#sc-tree g.annotation text')).fontSize)")
        before = size()
        page.get_by_label("Presentation mode").check()
        page.wait_for_function(f"() => {{ const t = document.querySelector('#sc-tree g.annotation text'); "
                               f"return t && parseFloat(getComputedStyle(t).fontSize) > {before}; }}", timeout=10_000)
        assert page.evaluate("() => document.body.classList.contains('sc-present')")
        for hidden in ("#sc-steps", "#sc-stats", "#sc-regen", "#sc-key"):
            assert not page.locator(hidden).is_visible(), hidden
        font = page.evaluate("() => parseFloat(getComputedStyle(document.querySelector('#sc-chatbot .bot .message-content') || document.querySelector('#sc-chatbot .bot')).fontSize)")
        assert font >= 20, font  # the answer is readable from the back of the room
        tree = box_in_first_viewport(page, "#sc-tree")
        page.screenshot(path=str(ARTIFACTS / "viewport-presentation-1024x768.png"))
        assert tree["bottom"] <= tree["height"] and tree["scrollWidth"] <= tree["width"], tree
        page.get_by_label("Presentation mode").uncheck()  # the way back stays on the page
        page.wait_for_function("() => !document.body.classList.contains('sc-present')", timeout=10_000)
        assert page.locator("#sc-steps").is_visible()
    finally:
        context.close()


def test_on_a_phone_the_chat_comes_right_after_the_tree(url, browser):
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    page = context.new_page()
    try:
        page.goto(url)
        page.wait_for_selector("#sc-msg textarea", timeout=60_000)
        parts = "['#sc-tree', '#sc-chatbot', '#sc-msg', '#sc-steps']"  # mounted one by one, under load in any order
        page.wait_for_function(f"() => {parts}.every(s => document.querySelector(s))", timeout=60_000)
        tops = page.evaluate(f"() => {parts}.map(s => document.querySelector(s).getBoundingClientRect().top)")
        assert tops[0] < tops[1] < tops[2] < tops[3], tops  # tree, chat, message box, then the chart
        assert page.evaluate("() => document.scrollingElement.scrollWidth <= innerWidth")
    finally:
        context.close()


def settled_value(box, quiet_ms: int = 800, limit_ms: int = 10_000) -> str:
    """``box``'s value once it has not changed for ``quiet_ms`` (longer than a fast tick): a
    replay tick already in flight when Pause was clicked may still land; what follows must not."""
    value, waited = box.input_value(), 0
    while waited < limit_ms:
        box.page.wait_for_timeout(quiet_ms)
        waited += quiet_ms
        latest = box.input_value()
        if latest == value:
            return value
        value = latest
    raise AssertionError(f"the step slider kept moving for {limit_ms} ms after Pause")


def test_play_replays_the_steps_and_pause_stops(url, browser):
    context = browser.new_context(viewport={"width": 1024, "height": 768})
    page = context.new_page()
    try:
        page.goto(url)
        page.wait_for_selector("#sc-msg textarea", timeout=60_000)
        ask(page, "Play it back")
        page.locator("#sc-pace").click()
        page.get_by_role("option", name="fast (0.6 s/step)").click()
        page.click("#sc-play")  # from the last step: starts over at step 1
        expect(page.locator("#sc-step-text")).to_contain_text("Step 1 wrote:", timeout=15_000)
        expect(page.locator("#sc-step-text")).to_contain_text("Step 3 wrote:", timeout=15_000)
        page.click("#sc-pause")
        expect(page.locator("#sc-play")).to_be_visible()  # the pause was handled
        shown = settled_value(page.locator("#sc-step-slider input[type=number]"))
        page.wait_for_timeout(1500)  # two fast ticks' worth: nothing moves while paused
        assert page.locator("#sc-step-slider input[type=number]").input_value() == shown
        expect(page.locator("#sc-play")).to_be_visible()
    finally:
        context.close()
