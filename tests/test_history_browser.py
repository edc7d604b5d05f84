"""Conversations that last, in a real browser (Debian's chromium driven by Playwright; tiny models,
in-process server, a store in a temporary folder): an answer appears in the sidebar's list, a
reload (F5) reopens it with its tree and replay, New chat empties the page, the list reopens it,
Delete asks first. Skips like tests/test_app_browser.py."""
from __future__ import annotations

import contextlib

import pytest
import test_app_support as support
from test_app_browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS

from app.serving.history import HistoryStore
from app.serving.pair import make_engine
from app.serving.worker import Worker

from playwright.sync_api import expect, sync_playwright  # noqa: E402 (test_app_browser skips without it)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    yield from support.one_torch_thread()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tokenizer = support.tokenizer()
    target, draft = support.tiny_pair()
    worker = Worker(make_engine(target, draft, tokenizer), tokenizer,
                    {"target": "tiny-random-qwen2", "draft": "tiny-random-qwen2-perturbed", "device": "cpu",
                     "dtype": "float32"})
    store = HistoryStore(tmp_path_factory.mktemp("history") / "conversations.sqlite3")
    demo, url = support.start_server(worker, {"max_new_tokens": 24, "history": store})
    yield store, url
    demo.close()
    worker.close()
    store.close()


@contextlib.contextmanager
def opened(url: str):
    """``(page, errors)``: Chromium at 1500×1000 on the app, its text box ready; the page's uncaught
    errors are collected in ``errors``."""
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_context(viewport={"width": 1500, "height": 1000}).new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        try:
            page.goto(url)
            page.wait_for_selector("#sc-msg textarea", timeout=60_000)
            yield page, errors
        finally:
            browser.close()


def test_a_conversation_survives_a_reload_and_comes_back_from_the_list(server):
    store, url = server
    with opened(url) as (page, errors):
        page.locator("#sc-msg textarea").fill("Tell me about oak trees")
        page.locator("#sc-send").click()
        expect(page.locator("#sc-status")).to_contain_text("Done", timeout=60_000)
        entry = page.locator("#sc-conv-list label", has_text="Tell me about oak trees")
        expect(entry).to_have_count(1, timeout=10_000)
        (cid, _, _), = store.list()
        answer = store.load(cid).messages[-1]["content"]

        page.reload()  # F5: the browser kept the open conversation's id
        page.wait_for_selector("#sc-msg textarea", timeout=60_000)
        expect(page.locator("#sc-chatbot")).to_contain_text("Tell me about oak trees", timeout=20_000)
        expect(page.locator("#sc-chatbot .bot").last).to_contain_text(answer.strip()[:10], timeout=20_000)
        expect(page.locator("#sc-step-slider")).to_be_visible(timeout=20_000)
        expect(page.locator("#sc-tree .js-plotly-plot")).to_have_count(1, timeout=20_000)

        page.locator("#sc-regen").click()  # the first answer stays, as a sibling
        expect(page.locator("#sc-sibling-text")).to_contain_text("Answer: 2 / 2", timeout=60_000)
        page.locator("#sc-prev-answer").click()
        expect(page.locator("#sc-sibling-text")).to_contain_text("Answer: 1 / 2", timeout=20_000)
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "browser-history.png"))
        expect(page.locator("#sc-chatbot .bot").last).to_contain_text(answer.strip()[:10], timeout=20_000)

        page.locator("#sc-new-chat").click()
        expect(page.locator("#sc-chatbot .bot")).to_have_count(0, timeout=10_000)
        page.locator("#sc-conv-list label", has_text="Tell me about oak trees").click()
        expect(page.locator("#sc-chatbot")).to_contain_text("Tell me about oak trees", timeout=20_000)
        expect(page.locator("#sc-conv-title input")).to_have_value("Tell me about oak trees", timeout=10_000)

        page.locator("#sc-conv-search input").fill("nothing matches this")
        expect(page.locator("#sc-conv-list label")).to_have_count(0, timeout=10_000)
        page.locator("#sc-conv-search input").fill("OAK")
        expect(page.locator("#sc-conv-list label")).to_have_count(1, timeout=10_000)

        page.locator("#sc-delete").click()
        expect(page.locator("#sc-delete-confirm")).to_be_visible(timeout=10_000)
        assert store.list()  # nothing deleted before the confirmation
        page.locator("#sc-delete-yes").click()
        expect(page.locator("#sc-chatbot .bot")).to_have_count(0, timeout=10_000)
        assert store.list() == []
        assert not errors, errors


def test_editing_a_message_in_the_page_answers_it_again(server):
    """The chat's own edit button on a user message: the page answers the edited message as a
    branch of the same conversation, ‹ 2 / 2 › at that message; ‹ brings back the message as it
    was with its answer, › the edited one."""
    store, url = server
    with opened(url) as (page, errors):
        page.locator("#sc-new-chat").click()
        expect(page.locator("#sc-status")).to_contain_text("New chat", timeout=20_000)
        page.locator("#sc-msg textarea").fill("Tell me about maple trees")
        page.locator("#sc-send").click()
        expect(page.locator("#sc-status")).to_contain_text("Done", timeout=60_000)
        before = len(store.list())
        user = page.locator("#sc-chatbot .user").first
        user.hover()
        page.locator("#sc-chatbot button[aria-label='Edit']").first.click()
        editor = page.locator("#sc-chatbot textarea").first
        editor.fill("Tell me about birch trees")
        page.locator("#sc-chatbot button[aria-label='Submit']").first.click()
        expect(page.locator("#sc-chatbot .user").first).to_contain_text("birch", timeout=20_000)
        expect(page.locator("#sc-status")).to_contain_text("Done", timeout=60_000)
        expect(page.locator("#sc-sibling-text")).to_contain_text("Your message 1: 2 / 2", timeout=10_000)
        assert len(store.list()) == before  # a branch of the same conversation, not a new one
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "browser-edit.png"))
        page.locator("#sc-prev-answer").click()
        expect(page.locator("#sc-chatbot .user").first).to_contain_text("maple", timeout=20_000)
        expect(page.locator("#sc-sibling-text")).to_contain_text("Your message 1: 1 / 2")
        page.locator("#sc-next-answer").click()
        expect(page.locator("#sc-chatbot .user").first).to_contain_text("birch", timeout=20_000)
        page.screenshot(path=str(ARTIFACTS / "browser-edit-switched.png"))
        assert not errors, errors
