"""The three teaching tabs in a real browser (chromium via Playwright) on a real local server with the
real default pair and its bundled CPU profile and calibrations: "Why this tree" follows the size and
temperature controls; after a short sampled answer (the verifier's trace on), the step-through walks
decision by decision; the acceptance-per-position chart shows the conversation. Screenshots go to
test-artifacts/explain-*.png for a person to look at."""
from __future__ import annotations

import pytest
import test_app_support as support
from test_app_real import ARTIFACTS, browser_page

from app.serving.worker import Worker
from engine.models.loading import pair_name
from engine.models.prompts import ASSETS
from engine.tuning.calibrate import find_acceptance
from engine.tuning.optimizer import AutoTuner
from engine.tuning.planner import TreePlanner
from engine.tuning.profile import HardwareProfile
from engine.tuning.roofline import _ms

pytestmark = pytest.mark.real_pair


@pytest.fixture(scope="module")
def server(real_pair):
    target, draft, tokenizer = real_pair
    # The views explain a bundled pair's numbers (the float target with the int4 draft, measured on an
    # AVX-512 VNNI CPU) whatever draft this machine loads (fastest_format), so the test is the same on all.
    pair = "default-target+default-draft@int4"
    profile = ASSETS / "profiles" / "cpu-x86_64-avx512vnni-2threads__default-target_default-draft_int4__float32.json"
    tuner = AutoTuner(HardwareProfile.from_json(profile.read_text()), find_acceptance(pair), pair=pair)
    assert tuner.profile.pair == pair  # the bundled profile of exactly this pair
    worker = Worker.from_models(target, draft, tokenizer, "default-target", "default-draft",
                                planner=TreePlanner(pair, tuner))
    demo, url = support.start_server(worker, {"max_new_tokens": 16})
    yield worker, url
    demo.close()
    worker.close()


def set_slider(page, label: str, value) -> None:
    box = page.locator(f"input[aria-label='number input for {label}']")
    box.fill(str(value))
    box.press("Enter")


def shot(page, name: str) -> None:
    page.locator("#sc-explain").scroll_into_view_if_needed()
    page.wait_for_timeout(400)
    page.locator("#sc-explain").screenshot(path=str(ARTIFACTS / name))


def test_the_teaching_tabs_on_the_real_pair(server):
    worker, url = server
    with browser_page(1440, 1000) as (page, expect):
        errors = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(url)
        page.wait_for_selector("#sc-msg textarea", timeout=60_000)
        why = page.locator("#sc-why-text")
        # the embedded pair's T = 0 calibration on this profile: the pick is the 8-node, depth-4 default
        expect(why).to_contain_text("Your setting is the optimizer's pick: 8 nodes, depth 4", timeout=30_000)
        # the heatmaps draw after the text arrives: on 2 busy cores (make test's other worker) that can take seconds
        expect(page.locator("#sc-why-g .js-plotly-plot")).to_be_visible(timeout=30_000)
        page.get_by_label("Auto (hardware-aware tree choice)").uncheck()  # on by default; a manual tree is one click away
        set_slider(page, "Tree size", 16)
        expect(why).to_contain_text("over your 16 nodes, depth 4", timeout=30_000)
        set_slider(page, "Temperature", 0.6)
        expect(why).to_contain_text("calibrated at T=0.6", timeout=30_000)
        assert page.locator("#sc-why-s text", has_text="you").count() >= 1  # the user's cell is marked
        assert page.locator("#sc-why-s text", has_text="pick").count() >= 1
        expect(why).to_contain_text("bundled with the app: assets/profiles/")
        shot(page, "explain-why.png")
        # this machine's limits against the profile: the sentence quotes the profile's own t_T(1) and t_D(1)
        profile = worker.tuner.profile
        roof = page.locator("#sc-roof-text")
        page.locator("#sc-roofline").scroll_into_view_if_needed()
        expect(roof).to_contain_text(f"t_T(1) measures {_ms(profile.target_time(1))}", timeout=60_000)
        expect(roof).to_contain_text(f"The draft's level costs {_ms(profile.draft_time(1))}")
        expect(page.locator("#sc-roof-plot .js-plotly-plot")).to_be_visible(timeout=30_000)
        page.wait_for_timeout(400)
        page.locator("#sc-roofline").screenshot(path=str(ARTIFACTS / "roofline-real-pair.png"))

        page.get_by_role("tab", name="Step through the verifier").click()
        expect(page.get_by_label("Record the verifier's walk", exact=False)).to_be_checked(timeout=10_000)
        page.fill("#sc-msg textarea", "Count from one to ten in words, separated by commas.")
        page.keyboard.press("Enter")
        expect(page.locator("#sc-status")).to_contain_text("Done", timeout=600_000)
        text, head = page.locator("#sc-walk-text"), page.locator("#sc-walk-text .sc-walk-head")
        expect(head).to_contain_text("decision 1 of", timeout=30_000)
        expect(page.locator("#sc-walk-step")).to_be_visible()  # 16 tokens take several steps
        steps = int(page.locator("#sc-walk-step input[type=number]").input_value())
        assert steps >= 2 and head.inner_text().lower().startswith(f"step {steps}, decision 1 of")
        assert "r = " in text.inner_text() or "bonus token" in text.inner_text()
        page.click("#sc-walk-prev")  # from the last step's first decision back to the step before's last
        expect(head).to_contain_text(f"Step {steps - 1}, decision", ignore_case=True, timeout=15_000)
        before = head.inner_text()
        page.click("#sc-walk-next")
        expect(head).to_contain_text(f"Step {steps}, decision 1 of", ignore_case=True, timeout=15_000)
        page.click("#sc-walk-next")
        expect(head).to_contain_text(f"Step {steps}, decision 2 of", ignore_case=True, timeout=15_000)
        assert before != head.inner_text()
        expect(page.locator("#sc-walk-bars .js-plotly-plot")).to_be_visible()
        # a rejection with its residual, when this answer had one, for the screenshot
        for step in range(1, steps + 1):
            page.locator("#sc-walk-step input[type=number]").fill(str(step))
            page.locator("#sc-walk-step input[type=number]").press("Enter")
            expect(head).to_contain_text(f"Step {step}, decision 1 of", ignore_case=True, timeout=15_000)
            if "is rejected" in text.inner_text():
                break
        shot(page, "explain-walk.png")

        page.get_by_role("tab", name="Acceptance per position").click()
        expect(page.locator("#sc-acc-text")).to_contain_text("accepted / reached", timeout=10_000)
        expect(page.locator("#sc-acc-text")).to_contain_text("Over 1 answer")
        assert page.locator("#sc-acc-plot g.trace.bars").count() >= 1
        shot(page, "explain-acceptance.png")
        assert not errors, errors
