"""What ``python -m app.bench_ui`` calls the time an answer's tokens showed on screen (the
benchmark itself drives Chromium and stays out of the suite; this checks its arithmetic)."""
from __future__ import annotations

from app.bench_ui import on_screen_timing


def test_the_last_token_shows_at_the_live_feeds_last_change_not_at_the_markdown_rerender():
    samples = [[100.0, "…", False], [900.0, "1. **Use", True], [1200.0, "1. **Use** names", True],
               [1200.5, "1. **Use** names", True], [1500.0, "1. **Use** names.", True],
               [2600.0, "1. Use names.", False]]  # Gradio's Markdown, after the charts
    shown = on_screen_timing(samples, "1. Use names.")
    assert (shown.first_ms, shown.last_ms, shown.updates) == (900.0, 1500.0, 3)
    assert shown.text == "1. **Use** names."  # the tokens as decoded, for counting them


def test_without_a_live_feed_every_change_counts():
    samples = [[100.0, "…", False], [700.0, "Hello", False], [900.0, "Hello there", False],
               [950.0, "Hello there", False]]
    shown = on_screen_timing(samples, "Hello there")
    assert (shown.first_ms, shown.last_ms, shown.updates, shown.text) == (700.0, 900.0, 2, "Hello there")


def test_nothing_visible_is_no_timing():
    shown = on_screen_timing([[100.0, "…", False], [200.0, "  ", False]], "")
    assert shown.first_ms is None and shown.last_ms is None and shown.updates == 0


def test_rounds_are_summed_up_prompt_by_prompt():
    from app.bench_ui import per_prompt

    runs = [{"prompt_index": i % 3, "rate": rate} for i, rate in enumerate([10.0, 20.0, 30.0, 12.0, 18.0, 36.0,
                                                                              11.0, 25.0, None])]
    assert per_prompt(runs, "rate") == [11.0, 20.0, 33.0]  # a missing rate is left out of its prompt's median
    assert per_prompt([{"rate": 1.0}, {"rate": 2.0}], "rate") == [1.0, 2.0]  # one run a prompt (the peer's rows)
