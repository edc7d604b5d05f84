"""app.views.figures and app.conversation: pure functions, tested on hand-made step records."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest

from app.views import figures

from app.views import tree_figures
from app.views.conversation import (
    ContextTooLong,
    chat_messages,
    display_messages,
    export_conversation,
    fit_context,
    import_conversation,
    safe_markdown,
    token_origins,
)
from engine.core.records import StepRecord, StepTimings
from engine.models.prompts import encode_chat

#        0 (root)
#       /        \
#   1 (r1)      2 (r2)
#   /    \          \
# 3 (r1) 4 (r2)     5 (r1)
#  |
# 6 (r1)
PARENTS = [-1, 0, 0, 1, 1, 2, 3]
RANKS = [0, 1, 2, 1, 2, 1, 1]
TOKENS = [100, 101, 102, 103, 104, 105, 106]
TEXTS = {100: "root", 101: " the", 102: "<b>&", 103: "\n  ", 104: "tree", 105: "x" * 40, 106: "\t", 107: "!"}


# what a sequoia verifier judged on the default path 0 -> 1 -> 4: node 1 (p 0.7, q 0.6) kept; node 3
# (p 0.2, q 0.5) rejected; node 4 judged on the residual p and renormalised q, kept; 2, 5, 6 never tried
USED_P = [None, 0.7, None, 0.2, 0.55, None, None]
USED_Q = [None, 0.6, None, 0.5, 0.4, None, None]


def make_step(accepted=(0, 1, 4), committed=(101, 104, 107), index=2, finish_reason=None, method="sequoia",
              greedy=False) -> StepRecord:
    return StepRecord(index=index, tokens=list(TOKENS), parents=list(PARENTS), ranks=list(RANKS),
                      draft_probs=[1.0, 0.6, 0.3, 0.5, 0.2, 0.9, 0.4],
                      target_probs=[1.0, 0.7, 0.1, 0.2, 0.6, 0.5, 0.0],
                      accepted=list(accepted), committed=list(committed),
                      timings=StepTimings(draft_s=0.02, verify_s=0.05, bookkeeping_s=0.01),
                      finish_reason=finish_reason, method=method, greedy=greedy,
                      verifier_p=[None] * 7 if greedy else list(USED_P),
                      verifier_q=[None] * 7 if greedy else list(USED_Q))


def traces(fig, kind):
    return [t for t in fig.data if t.meta and t.meta.get("kind") == kind]


def node_points(fig) -> dict[int, str]:
    """node index -> status, from the hover-marker traces."""
    out = {}
    for trace in traces(fig, "nodes"):
        for node in trace.customdata:
            out[int(node)] = trace.meta["status"]
    return out


# ----- statuses ------------------------------------------------------------------------------
def test_statuses_distinguish_rejected_from_never_reached():
    assert tree_figures.node_statuses(make_step()) == ["root", "accepted", "rejected", "rejected", "accepted",
                                                  "unreached", "unreached"]


def test_only_root_accepted_makes_its_children_rejected_and_the_rest_unreached():
    step = make_step(accepted=(0,), committed=(107,))
    assert tree_figures.node_statuses(step) == ["root", "rejected", "rejected", "unreached", "unreached", "unreached",
                                           "unreached"]


def test_bonus_token_present_unless_the_step_was_cut_short():
    assert tree_figures.bonus_token(make_step()) == 107
    assert tree_figures.bonus_token(make_step(committed=(101, 104), finish_reason="length")) is None


# ----- tree figure ---------------------------------------------------------------------------
def test_tree_figure_has_one_marker_per_node_and_the_bonus():
    fig = tree_figures.tree_figure(make_step(), TEXTS)
    assert node_points(fig) == dict(enumerate(tree_figures.node_statuses(make_step())))
    bonus = traces(fig, "bonus")
    assert len(bonus) == 1 and len(bonus[0].x) == 1
    assert len(fig.layout.annotations) == len(TOKENS) + 1  # one label per node + the bonus


def test_accepted_path_edges_and_labels_are_green():
    fig = tree_figures.tree_figure(make_step(), TEXTS)
    green = figures.COLOURS["accepted"][0]
    accepted_edges = [t for t in traces(fig, "edges") if t.meta["accepted"]]
    assert accepted_edges and all(t.line.color == green for t in accepted_edges)
    # segments 0->1 and 1->4, each "parent, child, None"
    assert sum(len(t.x) for t in accepted_edges) == 6
    other_edges = [t for t in traces(fig, "edges") if not t.meta["accepted"] and not t.meta.get("bonus")]
    assert all(t.line.color != green for t in other_edges)
    statuses = tree_figures.node_statuses(make_step())
    for node, annotation in enumerate(fig.layout.annotations[:len(TOKENS)]):
        assert annotation.bordercolor == figures.COLOURS[statuses[node]][0]


def test_edges_are_styled_by_rank():
    fig = tree_figures.tree_figure(make_step(), TEXTS)
    dashes = {t.meta["dash"] for t in traces(fig, "edges") if not t.meta.get("bonus")}
    assert dashes == {"solid", "dash"}  # ranks 1 and 2 only in this tree


def test_labels_are_escaped_and_whitespace_is_visible():
    fig = tree_figures.tree_figure(make_step(), TEXTS)
    labels = [a.text for a in fig.layout.annotations]
    assert "&lt;b&gt;&amp;" in labels
    assert "↵␣␣" in labels and "⇥" in labels and "␣the" in labels
    assert not any("<b>" in label for label in labels)
    long_label = next(label for label in labels if label.startswith("xxx"))
    assert long_label.endswith("…") and len(long_label) <= 14
    hovers = [h for t in traces(fig, "nodes") for h in t.text]
    assert any(h.startswith("<b>&lt;b&gt;&amp;</b>") for h in hovers)  # the token escaped inside our bold
    assert not any("<b><b>" in h for h in hovers)


def hovers(step: StepRecord) -> dict[int, str]:
    fig = tree_figures.tree_figure(step, TEXTS)
    return {int(n): h for t in traces(fig, "nodes") for n, h in zip(t.customdata, t.text)}


def test_hover_shows_the_probabilities_the_verifier_used():
    by_node = hovers(make_step())
    assert "draft q = 0.600" in by_node[1] and "target p = 0.700" in by_node[1] and "rank 1" in by_node[1]
    assert "judged on p = 0.700, q = 0.600" in by_node[1] and "min(1, p/q) = 1.00" in by_node[1]
    assert "min(1, p/q) = 0.40" in by_node[3]
    # a later sibling: the residual p and the renormalised q, not its raw p / q (0.6 / 0.2 -> 1.00)
    assert "residual p = 0.550" in by_node[4] and "renormalised q = 0.400" in by_node[4]
    assert "min(1, p/q) = 1.00" in by_node[4] and "rank 2" in by_node[4]
    assert "not tried" in by_node[2] and "min(1, p/q)" not in by_node[2]
    assert "root" in by_node[0]


def test_hover_names_each_methods_rule():
    assert "renormalised" not in hovers(make_step(method="specinfer"))[4]  # specinfer never renormalises q
    topk = hovers(make_step(method="topk"))
    assert "target's own sample is this token, p = 0.700" in topk[1] and "min(1, p/q)" not in topk[1]
    greedy = hovers(make_step(greedy=True))
    assert "argmax match" in greedy[1] and "argmax match" in greedy[4]
    assert "not the target's argmax" in greedy[3] and "min(1, p/q)" not in greedy[3]


def test_only_committed_drafts_count_as_accepted():
    """A stop token inside the accepted path: the drafts after it and the bonus are not used."""
    step = make_step(accepted=(0, 1, 3, 6), committed=(101, 103), finish_reason="stop")
    assert step.accepted_draft_tokens == 2 and not step.used_bonus
    assert tree_figures.bonus_token(step) is None
    fig = tree_figures.tree_figure(step, TEXTS)
    # the verifier accepted 3 drafts; the stop token was the 2nd, so only 2 were used
    assert "accepted 3 of 6" in fig.layout.title.text and "2 used — answer ended" in fig.layout.title.text
    assert node_points(fig)[6] == "unused" and node_points(fig)[3] == "accepted"
    budget = make_step(accepted=(0, 1, 3, 6), committed=(101,), finish_reason="length")
    assert "1 used — budget reached" in tree_figures.tree_figure(budget, TEXTS).layout.title.text
    full = make_step(accepted=(0, 1, 3, 6), committed=(101, 103, 106, 107))
    assert full.accepted_draft_tokens == 3 and full.used_bonus


def test_layout_puts_depth_on_x_and_parents_between_children():
    xs, ys = tree_figures.tree_layout(PARENTS)
    assert xs == [0, 1, 1, 2, 2, 2, 3]
    assert len(set(zip(xs, ys))) == len(PARENTS)
    assert ys[3] <= ys[1] <= ys[4] and ys[1] < ys[2]  # rank order top to bottom


def test_unknown_token_text_falls_back_to_id():
    fig = tree_figures.tree_figure(make_step(), {})
    assert "#104" in [a.text for a in fig.layout.annotations]


def test_root_only_step_draws_without_drafts():
    step = StepRecord(index=0, tokens=[5], parents=[-1], ranks=[0], draft_probs=[1.0], target_probs=[1.0],
                      accepted=[0], committed=[6])
    fig = tree_figures.tree_figure(step, {5: "a", 6: "b"})
    assert node_points(fig) == {0: "root"}
    # autoregressive: no "accepted 0 of 0 drafted tokens", and the token is the target's, not a bonus
    assert "the target alone wrote 1 token" in fig.layout.title.text and "drafted" not in fig.layout.title.text
    assert traces(fig, "bonus")[0].name == "the target's token"
    chart = figures.steps_figure([step])
    assert traces(chart, "bonus")[0].name == "the target's token"
    assert "× the target alone" not in figures.stats_line([step], 5.0)


def test_presentation_scale_enlarges_fonts_and_large_trees_zoom():
    small, big = tree_figures.tree_figure(make_step(), TEXTS), tree_figures.tree_figure(make_step(), TEXTS, scale=1.5)
    assert big.layout.annotations[0].font.size == 18 > small.layout.annotations[0].font.size
    assert big.layout.height > small.layout.height
    assert small.layout.xaxis.fixedrange  # a small tree is not zoomable (no accidental drags)
    n = 40
    wide = StepRecord(index=0, tokens=list(range(100, 100 + n)), parents=[-1] + [0] * (n - 1), ranks=[0] + list(range(1, n)),
                      draft_probs=[1.0] * n, target_probs=[1.0] * n, accepted=[0], committed=[7])
    fig = tree_figures.tree_figure(wide, {})
    assert not fig.layout.xaxis.fixedrange and fig.layout.dragmode == "zoom"
    assert 540 < fig.layout.height <= 700  # a large tree gets more height (its rows stay apart)


# ----- steps figure and stats ------------------------------------------------------------------
def steps():
    return [make_step(index=0), make_step(accepted=(0,), committed=(107,), index=1),
            make_step(accepted=(0, 1, 3, 6), committed=(101, 103, 106, 107), index=2)]


def test_steps_figure_stacks_accepted_and_bonus_tokens():
    fig = figures.steps_figure(steps())
    assert list(traces(fig, "accepted")[0].y) == [2, 0, 3]
    assert list(traces(fig, "bonus")[0].y) == [1, 1, 1]
    assert not traces(fig, "speedup")


def test_steps_figure_speedup_lines():
    fig = figures.steps_figure(steps(), baseline_tokens_per_s=10.0, expected_tokens=2.5, predicted_speedup=1.8)
    speed = traces(fig, "speedup")[0]
    # step 1: 3 tokens in 0.08 s = 37.5 tokens/s -> 3.75x the 10 tokens/s baseline
    assert speed.y[0] == pytest.approx(3.75)
    assert speed.y[-1] == pytest.approx(8 / 0.24 / 10)
    assert list(traces(fig, "predicted")[0].y) == [1.8, 1.8]
    assert list(traces(fig, "expected")[0].y) == [2.5, 2.5]


def test_stats_line():
    line = figures.stats_line(steps(), baseline_tokens_per_s=10.0)
    assert "8 tokens in 3 steps" in line and "2.67 tokens/step" in line
    assert "accepted 1.67 drafts/step (28% of 18 drafted)" in line  # 5 of 18
    assert "draft 25%" in line and "verify 6" in line  # 62.5%
    assert "3.33× the target alone" in line and "target alone measured: 10.0 tokens/s" in line
    assert line.startswith("measured **")
    estimated = figures.stats_line(steps(), baseline_tokens_per_s=10.0, baseline_source="estimated",
                                   expected_tokens=2.4)
    assert "≈3.33× the target alone" in estimated and "estimated from the device profile" in estimated
    assert "predicted 2.40 tokens/step" in estimated
    fig = figures.steps_figure(steps(), baseline_tokens_per_s=10.0, expected_tokens=2.5, baseline_source="estimated")
    assert "estimated" in traces(fig, "speedup")[0].name and "predicted" in traces(fig, "expected")[0].name
    at_launch = figures.stats_line(steps(), baseline_tokens_per_s=10.0, baseline_source=figures.MEASURED_AT_START)
    assert "**3.33× the target alone** (target alone measured at launch, before any page drew: 10.0" in at_launch
    assert "Compare races both here" in at_launch
    fig = figures.steps_figure(steps(), baseline_tokens_per_s=10.0, baseline_source=figures.MEASURED_AT_START)
    assert traces(fig, "speedup")[0].name == "measured speedup (running)"
    assert "measured at launch" in traces(fig, "speedup")[0].hovertemplate
    assert figures.stats_line([]) == "No steps yet."
    assert "slower than" not in line + estimated + at_launch


def test_a_stats_line_below_the_target_alone_says_why():
    """8 tokens in 0.24 s (33.3 tokens/s) against a faster target alone: fewer tokens a step than
    predicted, or steps that cost more than the target alone's timing."""
    kept_less = figures.stats_line(steps(), baseline_tokens_per_s=40.0, expected_tokens=3.5)
    assert "**0.83× the target alone**" in kept_less
    assert "drafts were kept less than predicted (2.67 tokens/step, against 3.50)" in kept_less
    as_predicted = figures.stats_line(steps(), baseline_tokens_per_s=40.0, expected_tokens=2.7,
                                      baseline_source=figures.MEASURED_AT_START)
    assert "its steps cost more than when the target alone was timed" in as_predicted
    assert "kept less" not in as_predicted and "priced" not in as_predicted
    thin = figures.stats_line(steps(), baseline_tokens_per_s=40.0, expected_tokens=3.5, priced_speedup=1.03)
    assert ("kept less than predicted (2.67 tokens/step, against 3.50); priced by this machine's profile its steps "
            "are 1.03× the target alone, so this page's drawing and the host took that thin a margin") in thin
    assert "a longer answer" not in thin
    assert "priced" not in figures.stats_line(steps(), baseline_tokens_per_s=40.0, expected_tokens=3.5,
                                              priced_speedup=0.9)  # no margin to take: not said


def test_steps_the_draft_gate_paused_are_named_so():
    from app.views.tree_figures import step_title

    paused = StepRecord(index=3, tokens=[100], parents=[-1], ranks=[0], draft_probs=[1.0], target_probs=[1.0],
                        accepted=[0], committed=[101], timings=StepTimings(verify_s=0.05), draft_paused=True)
    assert step_title(paused) == ("Step 4: the target alone wrote 1 token "
                                  "(drafting paused: this answer's drafts were not paying)")
    line = figures.stats_line(steps() + [paused], baseline_tokens_per_s=10.0)
    assert "drafting paused on 1 of 4 steps" in line
    assert "drafting paused" not in figures.stats_line(steps(), baseline_tokens_per_s=10.0)
    assert "(no draft)" in step_title(dataclasses.replace(paused, draft_paused=False))


def test_an_answer_with_steps_of_the_target_alone_is_measured_against_them():
    """From three target-alone steps on (the first step aside), the stats line, the running speedup
    and the slower-than explanation use them: the target alone under the answer's own load."""
    from app.views.tree_figures import step_title

    def alone(index, seconds, **flags):
        return StepRecord(index=index, tokens=[100], parents=[-1], ranks=[0], draft_probs=[1.0], target_probs=[1.0],
                          accepted=[0], committed=[101], timings=StepTimings(verify_s=seconds), **flags)

    drafted = [dataclasses.replace(s, index=i) for i, s in enumerate(steps() + steps())]  # 16 tokens, 0.48 s
    first_alone = alone(0, 0.5, timed_alone=True)  # the first step: never the baseline
    two = [alone(6, 0.04, timed_alone=True), alone(7, 0.06, draft_paused=True)]
    line = figures.stats_line([first_alone] + drafted + two, baseline_tokens_per_s=10.0,
                              baseline_source=figures.MEASURED_AT_START)
    assert "target alone measured at launch" in line  # two are not enough
    answer = drafted + two + [alone(8, 0.05, timed_alone=True)]  # 19 tokens in 0.63 s = 30.2 tokens/s
    line = figures.stats_line(answer, baseline_tokens_per_s=10.0, baseline_source=figures.MEASURED_AT_START)
    assert ("**1.51× the target alone** (target alone timed in this answer, under the same load: 20.0 tokens/s "
            "on 3 of its steps)") in line  # 3 tokens in 0.15 s
    assert "launch" not in line and "slower" not in line
    fig = figures.steps_figure(answer, baseline_tokens_per_s=10.0, baseline_source=figures.MEASURED_AT_START)
    assert traces(fig, "speedup")[0].y[-1] == pytest.approx(19 / 0.63 / 20.0)
    assert "timed in this answer" in traces(fig, "speedup")[0].hovertemplate
    slow = answer + [alone(9 + i, 0.008, timed_alone=True) for i in range(3)]  # 22 tokens in 0.654 s; 6 in 0.174 s
    line = figures.stats_line(slow, baseline_tokens_per_s=10.0, expected_tokens=2.0)
    assert "**0.98× the target alone**" in line
    assert "against the target alone's steps timed beside them" in line
    assert step_title(answer[-1]) == ("Step 9: the target alone wrote 1 token "
                                      "(timed: the answer's speed-up is measured against such steps)")


# ----- conversation functions ------------------------------------------------------------------
def test_safe_markdown_escapes_html_outside_code_only():
    out = safe_markdown("a <b>x</b> & `<i>` then\n```py\nif a<b:\n```\n<c")
    assert "&lt;b&gt;x&lt;/b&gt; &amp;" in out and "`<i>`" in out and "if a<b:" in out and out.endswith("&lt;c")
    assert safe_markdown("```\nunclosed <x>") == "```\nunclosed <x>"  # streaming code block


def test_display_messages_adds_notes():
    shown = display_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "note": "stopped"}])
    assert shown[1]["content"] == [{"type": "text", "text": "yo\n\n*stopped*"}]


def test_token_origins_split_drafts_from_bonus():
    assert token_origins(steps()[:2]) == [(101, "draft"), (104, "draft"), (107, "bonus"), (107, "bonus")]


class CountingTokenizer:
    """One token per character; the template adds 3 tokens per message and 2 for the prompt."""

    def apply_chat_template(self, messages, add_generation_prompt, return_dict):
        ids = []
        for m in messages:
            ids += [1, 2, 3] + [ord(ch) % 100 for ch in m["content"]]
        return {"input_ids": ids + [4, 5]}


def test_fit_context_drops_oldest_turns_but_keeps_the_system_prompt():
    history = [{"role": "user", "content": "a" * 20}, {"role": "assistant", "content": "b" * 20},
               {"role": "user", "content": "c" * 20}, {"role": "assistant", "content": "d" * 20},
               {"role": "user", "content": "e" * 10}]
    ids, dropped = fit_context(CountingTokenizer(), "sys", history, limit=None)
    assert dropped == 0 and len(ids) == 6 + 5 * 3 + 90 + 2
    ids, dropped = fit_context(CountingTokenizer(), "sys", history, limit=70)
    assert dropped == 2 and len(ids) == 6 + 3 * 3 + 50 + 2 == 67
    ids, dropped = fit_context(CountingTokenizer(), "sys", history, limit=30)
    assert dropped == 4 and ids[:6] == [1, 2, 3] + [ord(c) % 100 for c in "sys"]
    with pytest.raises(ContextTooLong):
        fit_context(CountingTokenizer(), "sys", history, limit=10)


def test_fit_context_reads_a_zero_limit_as_no_room():
    """0 tokens for the prompt (max new tokens and the tree fill the context) is no room, not "no
    limit": it let a request through that the engine then failed on (a 500 from the API)."""
    history = [{"role": "user", "content": "hi"}]
    for limit in (0, -5):
        with pytest.raises(ContextTooLong, match="no room"):
            fit_context(CountingTokenizer(), None, history, limit=limit)
    assert fit_context(CountingTokenizer(), None, history, limit=None)[1] == 0


def test_fit_context_renders_the_template_a_logarithmic_number_of_times():
    """A 400-message conversation over the limit: the fewest turns are dropped (as dropping them one
    at a time would), with at most 2 + log2(200) renders of the template rather than one per turn."""
    renders = []

    class Counted(CountingTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt, return_dict):
            renders.append(len(messages))
            return super().apply_chat_template(messages, add_generation_prompt, return_dict)

    history = [{"role": role, "content": f"{role} {i} " * (1 + i % 5)} for i in range(200) for role in ("user", "assistant")]
    history.append({"role": "user", "content": "the question"})
    for limit in (500, 3_000, 20_000):
        renders.clear()
        ids, dropped = fit_context(Counted(), "sys", history, limit)
        assert len(ids) <= limit and len(renders) <= 2 + 8
        kept = encode_chat(CountingTokenizer(), chat_messages("sys", history[dropped:]))
        assert ids == kept and history[dropped]["role"] == "user"
        one_more = next(i for i in range(dropped + 1, len(history)) if history[i]["role"] == "user")
        earlier = [i for i in range(dropped) if history[i]["role"] == "user" and i > 0]
        if earlier:  # keeping one more turn would not fit
            longer = encode_chat(CountingTokenizer(), chat_messages("sys", history[earlier[-1]:]))
            assert len(longer) > limit
        assert one_more > dropped


def test_export_import_round_trip():
    history = [{"role": "user", "content": "hi <b>"}, {"role": "assistant", "content": "hello", "note": "stopped"}]
    text = export_conversation("be brief", history, {"temperature": 0})
    system, imported = import_conversation(text)
    assert system == "be brief"
    assert imported == [{"role": "user", "content": "hi <b>"}, {"role": "assistant", "content": "hello"}]
    # a plain list of messages with a leading system message works too
    system, imported = import_conversation(json.dumps([{"role": "system", "content": "s"},
                                                       {"role": "user", "content": "u"}]))
    assert system == "s" and imported == [{"role": "user", "content": "u"}]


@pytest.mark.parametrize("payload, reason", [
    (b"not json at all", "not a JSON file"),
    (b"\xff\xfe\x00garbage", "not a JSON file"),
    (json.dumps({"nothing": 1}), "no 'messages'"),
    (json.dumps({"messages": "hi"}), "must be a list"),
    (json.dumps({"messages": [{"role": "tool", "content": "x"}]}), "role 'tool'"),
    (json.dumps({"messages": [{"role": "user", "content": ["x"]}]}), "content must be text"),
    (json.dumps({"messages": [{"role": "user"}]}), "'role' and 'content'"),
    (json.dumps({"messages": [{"role": "user", "content": "x", "extra": 1}]}), "'role' and 'content'"),
    (b" " * 1_000_001, "MB"),
])
def test_import_rejects_bad_files_with_a_reason(payload, reason):
    with pytest.raises(ValueError, match=reason):
        import_conversation(payload)


def test_race_places_the_speculative_answer_at_the_same_decoding_time():
    spec = steps()  # 3 steps of 0.08 s: 3, 1 and 4 tokens
    alone = [make_step(accepted=(0,), committed=(107,), index=i) for i in range(2)]  # 2 tokens in 0.16 s
    race = figures.race_html(spec, alone, total_tokens=8)
    assert "0.16 s of decoding" in race
    assert ">4 tokens<" in race  # by 0.16 s the speculative answer had committed 3 + 1 tokens
    assert ">2 tokens<" in race and "width:50.0%" in race and "width:25.0%" in race
    done = figures.race_html(spec, alone * 2, total_tokens=8)
    assert "done in 0.24 s" in done and "width:100.0%" in done


def test_the_live_tree_is_svg_with_legible_labels_and_the_whole_text_on_hover():
    """A chain of 8 (what the optimizer picks on CPUs) is drawn top-down, so its labels keep 14
    characters; a wide tree keeps at least 8. Every node has its whole text in a hover title; the
    SVG is escaped and small (sent at every live update)."""
    from engine.core.records import StepRecord, StepTimings

    texts = {i: f" token_number_{i}" for i in range(300)} | {7: "<b>&</b>"}
    chain = StepRecord(index=0, tokens=list(range(200, 209)), parents=list(range(-1, 8)), ranks=[0] + [1] * 8,
                       draft_probs=[1.0] + [0.9] * 8, target_probs=[1.0] + [0.8] * 8, accepted=[0, 1, 2, 3],
                       committed=[201, 202, 203, 250], timings=StepTimings(0.01, 0.02, 0.001), greedy=True,
                       verifier_p=[None] * 9, verifier_q=[None] * 9)
    svg = tree_figures.tree_svg(chain, texts)
    assert svg.count("<g class=\"sc-node") == 10 and len(svg) < 20_000  # 9 nodes and the bonus token
    labels = re.findall(r"<text[^>]*>([^<]*)</text>", svg)
    assert all(len(label) >= 14 for label in labels), labels
    assert tree_figures.tree_geometry(chain, texts).top_down
    assert "␣token_number_201" in svg  # the whole text on hover
    wide = StepRecord(index=0, tokens=[7] + list(range(100, 112)), parents=[-1] + [0] * 4 + [1, 1, 2, 2, 3, 3, 4, 4],
                      ranks=[0, 1, 2, 3, 4, 1, 2, 1, 2, 1, 2, 1, 2], draft_probs=[1.0] * 13, target_probs=[0.5] * 13,
                      accepted=[0, 1], committed=[100, 101], timings=StepTimings(0.01, 0.02, 0.001), greedy=True,
                      verifier_p=[None] * 13, verifier_q=[None] * 13)
    geometry = tree_figures.tree_geometry(wide, texts)
    assert not geometry.top_down and min(len(label) for label in geometry.labels[1:]) >= figures.MIN_LABEL_CHARS
    svg = tree_figures.tree_svg(wide, texts)
    assert "<b>" not in svg and "&lt;b&gt;&amp;&lt;/b&gt;" in svg


def test_copied_nodes_have_their_own_colour_hover_and_count():
    """A step whose tree holds a chain copied from the context: violet borders in the live SVG and
    the plotly tree, a hover that says where the copy came from, and the count in title and stats."""
    from app.views.tree_figures import COPY_COLOUR, step_title, tree_figure, tree_svg
    from engine.core.records import StepRecord

    step = StepRecord(index=0, tokens=[1, 20, 21, 30], parents=[-1, 0, 1, 0], ranks=[0, 1, 1, 2],
                      draft_probs=[1.0, 1.0, 1.0, 0.4], target_probs=[1.0, 0.9, 0.8, 0.05], accepted=[0, 1, 2],
                      committed=[20, 21, 7], greedy=True, sources=["root", "copy", "copy", "draft"],
                      copy_origins=[None, (1, 5), (1, 6), None])
    assert step.accepted_by_source() == {"draft": 0, "copy": 2}
    svg = tree_svg(step, {})
    assert svg.count("sc-copy") == 2 and COPY_COLOUR in svg
    assert "copied from the expected output given with the request, token 5" in svg
    assert "(2 copied from the context)" in step_title(step)
    figure = tree_figure(step, {})
    assert sum(a.bordercolor == COPY_COLOUR for a in figure.layout.annotations) == 2
    assert any(t.name == "copied from the context" for t in figure.data)
    assert "2 of them copied from the context" in figures.stats_line([step])
    plain = StepRecord(index=0, tokens=[1, 30], parents=[-1, 0], ranks=[0, 1], draft_probs=[1.0, 0.4],
                       target_probs=[1.0, 0.5], accepted=[0, 1], committed=[30, 2], greedy=True)
    assert "sc-copy" not in tree_svg(plain, {}) and "copied" not in figures.stats_line([plain])


def test_a_message_longer_than_the_context_can_hold_is_refused_before_the_template_renders():
    """Its characters alone exceed limit x the longest token: refused without rendering anything."""
    renders = []

    class Vocab(CountingTokenizer):
        def get_vocab(self):
            return {"a": 0, "abcd": 1, "xyz": 2}

        def apply_chat_template(self, messages, add_generation_prompt, return_dict):
            renders.append(1)
            return super().apply_chat_template(messages, add_generation_prompt, return_dict)

    with pytest.raises(ContextTooLong, match="4 characters a token"):
        fit_context(Vocab(), "", [{"role": "user", "content": "q" * 401}], limit=100)
    assert renders == []
    ids, _ = fit_context(Vocab(), "", [{"role": "user", "content": "q" * 50}], limit=100)
    assert len(ids) == 55 and renders == [1]
