"""The app on the real default pair: a local server driven by gradio_client, and a browser screenshot."""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import gradio_client
import pytest
import test_app_support as support
from test_app_server import CHATBOT, STATUS, TREE_PLOT, answer_text, chat_args

from app.views.conversation import safe_markdown
from app.serving.pair import make_engine
from app.serving.worker import Worker
from engine.tuning.tree_store import build_tree

pytestmark = pytest.mark.real_pair
PROMPT = "In two sentences, what is a hash map?"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CHROMIUM = os.environ.get("SEQUOIA_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]


@pytest.fixture(scope="module")
def server(real_pair):
    target, draft, tokenizer = real_pair
    worker = Worker.from_models(target, draft, tokenizer, "default-target", "default-draft")
    demo, url = support.start_server(worker, {"max_new_tokens": 40})
    yield worker, url
    demo.close()
    worker.close()


def test_greedy_chat_turn_equals_the_engine_alone(server, real_pair):
    worker, url = server
    target, draft, tokenizer = real_pair
    client = gradio_client.Client(url, verbose=False, download_files=False)
    job = client.submit(*chat_args(PROMPT, max_new=40, size=8, depth=4), api_name="/chat")
    final = job.result(timeout=600)
    text, tokens = support.reference_text(make_engine(target, draft, tokenizer), tokenizer,
                                          [{"role": "user", "content": PROMPT}], max_new_tokens=40,
                                          tree=build_tree(8, 4))
    assert answer_text(final[CHATBOT]) == safe_markdown(text)
    assert "hash" in text.lower()
    assert '"kind":"nodes"' in final[TREE_PLOT]["plot"]
    partial = {len(answer_text(out[CHATBOT])) for out in job.outputs()
               if isinstance(out[CHATBOT], list) and len(out[CHATBOT]) == 2}
    assert len(partial) >= 3, "the answer should stream in several updates"
    assert "Done" in final[STATUS]


@contextlib.contextmanager
def browser_page(width: int, height: int):
    """``(page, expect)``: a real chromium page of this viewport (skips when chromium is missing)."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (make browser installs it)")
    playwright = pytest.importorskip("playwright.sync_api")
    ARTIFACTS.mkdir(exist_ok=True)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": width, "height": height}), playwright.expect
        finally:
            browser.close()


def test_browser_screenshot_on_the_real_pair(server):
    with browser_page(1500, 1000) as (page, expect):
        page.goto(server[1])
        box = page.locator("#sc-msg textarea")
        box.fill("Write a Python function that reverses a string.")
        box.press("Enter")
        expect(page.locator(".js-plotly-plot .nodes, .js-plotly-plot text").first).to_be_visible(timeout=300_000)
        page.get_by_text("Done:", exact=False).first.wait_for(timeout=600_000)
        page.screenshot(path=str(ARTIFACTS / "real-pair-chat.png"), full_page=True)
        assert "def" in page.content()


def test_tree_in_the_first_viewport_of_a_small_laptop_on_the_real_pair(server):
    """1024 x 768, settings closed (the default below 1280 px): after a real answer the whole tree
    is in the first viewport, nothing scrolls sideways, and the header names the real models. The
    screenshot is the README's (assets/screenshot-1024.png is copied from it)."""
    with browser_page(1024, 768) as (page, expect):
        page.goto(server[1])
        page.wait_for_selector("#sc-msg textarea", timeout=60_000)
        expect(page.locator("#sc-header")).to_contain_text("Qwen2.5-Coder-1.5B-Instruct")
        expect(page.locator("#sc-header")).to_contain_text("Qwen2.5-Coder-0.5B-Instruct")
        box = page.locator("#sc-msg textarea")
        box.fill("In one sentence, what is a hash map?")
        box.press("Enter")
        expect(page.locator("#sc-status")).to_contain_text("Done", timeout=600_000)
        page.wait_for_timeout(500)
        tree = page.evaluate("""() => { window.scrollTo(0, 0);
            const r = document.querySelector('#sc-tree').getBoundingClientRect();
            return {top: r.top, bottom: r.bottom, height: innerHeight, width: innerWidth,
                    scrollWidth: document.scrollingElement.scrollWidth}; }""")
        page.screenshot(path=str(ARTIFACTS / "real-pair-1024x768.png"))
    assert 0 <= tree["top"] and tree["bottom"] <= tree["height"], tree
    assert tree["scrollWidth"] <= tree["width"], tree


SOAK_TURNS = 40 if os.environ.get("SEQUOIA_SOAK") == "1" else 15  # the full soak: SEQUOIA_SOAK=1 make test


def test_many_turns_in_one_conversation_keep_memory_flat(server):
    """A long session on the real pair: 15 turns in one conversation (40 with ``SEQUOIA_SOAK=1``).
    RSS after the last turn stays within 10% of RSS after turn 5, and the only KV caches alive
    between requests are the session's own conversation caches (target and draft), kept for the
    next turn (caches that earlier tests' engines still hold are left out). Every fifth turn
    speculates (the others use the target alone, which keeps the test short)."""
    import gc

    from test_hardening import rss_bytes
    from transformers import DynamicCache

    worker, url = server
    client = gradio_client.Client(url, verbose=False, download_files=False)
    gc.collect()
    earlier = [o for o in gc.get_objects() if type(o) is DynamicCache]  # other tests' engines hold theirs
    rss = {}
    for turn in range(1, SOAK_TURNS + 1):
        size = 4 if turn % 5 == 0 else 1
        final = client.predict(*chat_args(f"{turn}", max_new=2, size=size, depth=min(3, size)), api_name="/chat")
        assert "Done" in final[STATUS], (turn, final[STATUS])
        if turn in (5, SOAK_TURNS):
            gc.collect()
            rss[turn] = rss_bytes()
            kept = {id(runner.cache) for key in worker.kv_store.keys()
                    for runner in worker.kv_store.peek(key).runners.values()}
            born = {id(o) for o in gc.get_objects() if type(o) is DynamicCache} - {id(o) for o in earlier}
            assert kept and born <= kept, "a KV cache outlived its request"
    last = SOAK_TURNS
    assert len(final[CHATBOT]) == 2 * last
    assert rss[last] < 1.10 * rss[5], f"RSS {rss[5] / 2**30:.2f} GiB after turn 5, {rss[last] / 2**30:.2f} GiB after {last}"
    print(f"RSS after turn 5: {rss[5] / 2**30:.2f} GiB, after turn {last}: {rss[last] / 2**30:.2f} GiB")
