"""What ``python -m bench.ui`` calls the time an answer's tokens showed on screen (the
benchmark itself drives Chromium and stays out of the suite; this checks its arithmetic)."""
from __future__ import annotations

from bench.ui import on_screen_timing


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
    from bench.ui import per_prompt

    runs = [{"prompt_index": i % 3, "rate": rate} for i, rate in enumerate([10.0, 20.0, 30.0, 12.0, 18.0, 36.0,
                                                                              11.0, 25.0, None])]
    assert per_prompt(runs, "rate") == [11.0, 20.0, 33.0]  # a missing rate is left out of its prompt's median
    assert per_prompt([{"rate": 1.0}, {"rate": 2.0}], "rate") == [1.0, 2.0]  # one run a prompt (the peer's rows)


def _as_shown(markup: str) -> str:
    """Roughly what ``innerText`` reads of the app's HTML and Markdown: bold marks and inline tags
    vanish, table cells and rows become tabs and newlines."""
    import re

    markup = re.sub(r"</?b>|\*\*", "", markup)
    return re.sub(r"</t[dh]>", "\t", re.sub(r"</tr>|</div>", "\n", re.sub(r"<(?!/t[dhr]>|/div>)[^>]+>", "", markup)))


def test_the_page_speedups_are_read_as_the_app_writes_them():
    """The bench reads the stats line's headline and Compare's verdict from the text the app itself
    makes (figures.stats_line, answer_stream.compare_markdown), not from a copy of its wording."""
    from app.views import figures
    from app.page.answer_stream import Run, compare_markdown
    from bench.ui import page_speedups
    from test_figures import steps

    below = figures.stats_line(steps(), baseline_tokens_per_s=40.0, baseline_source=figures.MEASURED_AT_START,
                               expected_tokens=3.5, priced_speedup=1.04)
    run = Run(main={"tokens": 48, "decode_s": 2.6, "seconds": 3.1, "steps": 23},
              compare={"tokens": 48, "decode_s": 3.0, "seconds": 3.5, "steps": 48}, identical=True)
    said = page_speedups(_as_shown(figures.markdown_html(below)), _as_shown(compare_markdown(run)))
    assert said["stats_line_speedup"] == 0.83  # the headline, not the profile-priced 1.04x after it
    assert said["compare_speedup"] == 1.15 and said["compare_tokens_per_s"] == 18.5
    assert said["compare_target_alone_tokens_per_s"] == 16.0
    assert page_speedups("No steps yet.", "") == {"stats_line_speedup": None, "compare_speedup": None,
                                                  "compare_tokens_per_s": None,
                                                  "compare_target_alone_tokens_per_s": None}
