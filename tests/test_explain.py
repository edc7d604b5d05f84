"""The three teaching views: engine.tuning.explain's tables and sentence, app.explain_figures' figures and
sentences, and the app's handlers (tiny models with the real tokenizer; the bundled CPU profile and
calibrations). No mocks: real DP tables, real profiles, real decoding with the trace on."""
from __future__ import annotations

import dataclasses

from pathlib import Path

import pytest
import test_app_support as support

from app.views import explain_figures as xf
from app.views import explain_text
from app.page import answer_stream
from app.page import ui
from engine.core.settings import DecodeSettings
from app.serving.jobs import GenerationRequest
from app.serving.pair import make_engine
from app.serving.worker import Worker
from engine.tuning.planner import TreePlanner
from engine.core.records import StepRecord, StepTimings, VerifierEvent
from engine.trees import dp
from engine.trees.tree import Tree
from engine.tuning import explain
from engine.tuning.acceptance import calibration_for
from engine.tuning.optimizer import AutoTuner, candidate_sizes, choose_tree, predict
from engine.tuning.profile import HardwareProfile

ASSETS = Path(__file__).resolve().parent.parent / "assets"
Q4K = "default-target@q4k+default-draft@int4"
FLOAT = "default-target+default-draft@int4"
PROFILES = {Q4K: ASSETS / "profiles/cpu-x86_64-avx2-2threads__default-target_q4k_default-draft_int4__float32.json",
            FLOAT: ASSETS / "profiles/cpu-x86_64-avx512vnni-2threads__default-target_default-draft_int4__float32.json"}


def profile(pair: str) -> HardwareProfile:
    return HardwareProfile.from_json(PROFILES[pair].read_text())


def vector(pair: str, temperature: float = 0.0, top_p: float = 1.0) -> tuple[float, ...]:
    return calibration_for(pair, temperature, top_p).vector


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    yield from support.one_torch_thread()


# ----- engine.tuning.explain: the tables ------------------------------------------------------------------
def test_g_is_the_dp_table_and_s_is_the_optimizers_prediction():
    v, prof = vector(FLOAT), profile(FLOAT)
    tables = explain.tables(v, prof, 24, 6)
    g = dp.expected_tokens_table(v, 24, 6)
    for n in (1, 2, 5, 8, 13, 24):
        for d in (1, 3, 6):
            cell = tables.cell(n, d)
            assert cell["expected_tokens"] == pytest.approx(float(g[n, d]))
            if n > 1:
                tree = Tree.from_parents(dp.optimal_parents(dp.solve(v, n, min(d, n - 1)), n, min(d, n - 1)))
                choice = predict(tree, v, prof)
                assert cell["speedup"] == pytest.approx(choice.predicted_speedup)
                assert cell["verify_s"] + cell["draft_s"] + prof.step_overhead == pytest.approx(choice.step_time_s)
    assert tables.cell(1, 4) == {"size": 1, "depth": 4, "expected_tokens": 1.0, "verify_s": prof.target_time(1),
                                 "draft_s": 0.0, "speedup": 1.0}


def test_the_optimizers_pick_is_the_best_cell_among_the_sizes_it_tries():
    for pair in (FLOAT, Q4K):
        v, prof = vector(pair, 0.6, 1.0), profile(pair)
        pick = choose_tree(v, prof, 64, 16)
        tables = explain.tables(v, prof, 64, 16)
        tried = set(candidate_sizes(64))
        best = max(s for i, row in enumerate(tables.speedup) for j, s in enumerate(row)
                   if s is not None and tables.sizes[j] in tried)
        assert pick.predicted_speedup == pytest.approx(best)
        assert tables.cell(pick.size, max(pick.depth, 1))["speedup"] == pytest.approx(pick.predicted_speedup)


def dear_draft(prof: HardwareProfile) -> HardwareProfile:
    """``prof`` with a draft twice as dear and no step overhead: no tree pays for itself."""
    return HardwareProfile(prof.device, prof.pair, prof.dtype, prof.prefix_len, dict(prof.target),
                           {w: 2 * t for w, t in prof.draft.items()})


def test_on_the_int4_cpu_profile_only_a_small_chain_pays_and_on_the_float_one_a_tree_does():
    q4k = explain.tables(vector(Q4K), profile(Q4K), 64, 16)
    assert profile(Q4K).step_overhead > 0
    assert 1.0 < q4k.best()["speedup"] < 1.25 and q4k.best()["size"] <= 3  # a draft level ≈ half a target token
    assert all(s < 1.0 for row in q4k.speedup for n, s in zip(q4k.sizes, row) if s is not None and n >= 8)
    dear = explain.tables(vector(Q4K), dear_draft(profile(Q4K)), 64, 16)
    assert max(s for row in dear.speedup for s in row[1:] if s is not None) < 1.0 and dear.best()["size"] == 1
    floating = explain.tables(vector(FLOAT), profile(FLOAT), 64, 16)
    assert floating.best()["size"] > 1 and floating.best()["speedup"] > 1.5


def test_chains_only_fills_the_diagonal():
    tables = explain.tables(vector(FLOAT), profile(FLOAT), 12, 6, chains_only=True)
    for d in range(1, 7):
        assert tables.cell(d + 1, d)["expected_tokens"] == pytest.approx(Tree.chain(d).expected_tokens(vector(FLOAT)))
        assert tables.cell(d + 3, d) is None


def test_tables_are_cached_and_fast_after_the_first_call():
    v, prof = vector(FLOAT, 0.6, 0.9), profile(FLOAT)
    first = explain.tables(v, prof, 64, 16)
    again = explain.tables(list(v), HardwareProfile.from_json(PROFILES[FLOAT].read_text()), 64, 16)
    assert again is first  # the same object: served from the cache, not computed again
    assert explain.tables(v, None, 64, 16).speedup is None  # no profile: G only


def test_profile_source_names_the_bundled_file():
    assert explain_text.profile_source(profile(Q4K)) == f"bundled with the app: assets/profiles/{PROFILES[Q4K].name}"
    changed = profile(Q4K)
    changed.target[1] *= 2
    assert explain_text.profile_source(changed).startswith("not saved")


# ----- engine.tuning.explain: the sentence -------------------------------------------------------------------
def test_the_sentence_explains_honestly_why_a_dear_draft_drafts_nothing():
    v, prof = vector(Q4K), dear_draft(profile(Q4K))
    pick = choose_tree(v, prof, 64, 16)
    assert pick.size == 1
    mine = predict(Tree.optimal(v, 8, 4), v, prof)
    line = explain_text.explain_choice(pick, mine, prof)
    assert line.startswith("The optimizer drafts nothing")
    assert f"{mine.expected_tokens:.2f} tokens per step" in line and f"{mine.predicted_speedup:.2f}×" in line
    assert f"{prof.draft_time(1) / prof.target_time(1):.2f}" in line  # a draft forward ≈ 1.05 target tokens
    assert f"{prof.target_time(4) / prof.target_time(1):.1f}× / {prof.target_time(8) / prof.target_time(1):.1f}× one token" \
        in line  # verifying 4 / 8 tokens
    same = explain_text.explain_choice(pick, pick, prof)
    assert same.startswith("Your setting is the optimizer's pick") and "No tree is predicted to pay" in same


def test_the_sentence_compares_the_numbers_of_both_settings():
    v, prof = vector(FLOAT), profile(FLOAT)
    pick = choose_tree(v, prof, 64, 16)
    mine = predict(Tree.chain(1), v, prof)
    line = explain_text.explain_choice(pick, mine, prof)
    assert line.startswith(f"The optimizer picks {pick.size} nodes, depth {pick.depth} over your 2 nodes, depth 1")
    for choice in (pick, mine):
        assert f"G = {choice.expected_tokens:.2f} tokens/step" in line
        assert f"{prof.target_time(choice.size) * 1e3:.0f} ms verify" in line
        assert f"predicted {choice.predicted_speedup:.2f}×" in line
    alone = explain_text.explain_choice(pick, predict(Tree.chain(0), v, prof), prof)
    assert "over the target alone" in alone


# ----- app.explain_figures: heatmaps --------------------------------------------------------------------
def marks(fig) -> dict:
    return {t.meta["kind"]: (t.x[0], t.y[0], t.text[0]) for t in fig.data if t.meta and t.meta.get("kind") in
            ("pick", "yours")}


def test_heatmaps_mark_the_pick_and_the_users_setting():
    tables = explain.tables(vector(FLOAT), profile(FLOAT), 64, 16)
    g = xf.expected_heatmap(tables, pick=(12, 5), yours=(8, 4), calibration="T=0")
    assert marks(g) == {"pick": (12, 5, "pick"), "yours": (8, 4, "you")}
    heat = [t for t in g.data if t.type == "heatmap"][0]
    assert len(heat.x) == 64 and len(heat.y) == 16 and "G = " in heat.text[3][7]
    s = xf.speedup_heatmap(tables, pick=(12, 5))
    heat = [t for t in s.data if t.type == "heatmap"][0]
    assert "predicted speedup S" in heat.text[3][7]
    middle = [stop for stop, colour in heat.colorscale if colour == "#fef9c3"][0]  # 1× is the pale middle
    assert heat.zmin + middle * (heat.zmax - heat.zmin) == pytest.approx(1.0)
    assert marks(s) == {"pick": (12, 5, "pick = you")}  # no setting of the user's given: one marker
    q4k = [t for t in xf.speedup_heatmap(explain.tables(vector(Q4K), profile(Q4K), 64, 16)).data
           if t.type == "heatmap"][0]
    assert q4k.zmin < 1.0 < q4k.zmax  # mostly below 1 on this profile, a small chain above
    none = xf.speedup_heatmap(explain.tables(vector(FLOAT), None, 16, 4))
    assert "No hardware profile" in none.layout.annotations[0].text


def test_profile_figure_shows_both_curves_in_ms():
    prof = profile(Q4K)
    fig = xf.profile_figure(prof)
    target = [t for t in fig.data if t.meta["kind"] == "target"][0]
    assert list(target.x) == sorted(prof.target) and target.y[0] == pytest.approx(prof.target[1] * 1e3)
    assert f"{prof.target[8] / prof.target[1]:.2f}× one target token" in target.text[3]  # t_T(8) / t_T(1)
    assert f"every step also costs {prof.step_overhead * 1e3:.0f} ms" in xf.profile_caption(prof, "")
    assert "bundled" in xf.profile_caption(prof, explain_text.profile_source(prof))


# ----- app.explain_figures: acceptance per position -----------------------------------------------------
def hand_step(parents, accepted, committed=(1,)) -> StepRecord:
    n = len(parents)
    ranks = Tree.from_parents(parents).ranks
    return StepRecord(index=0, tokens=list(range(10, 10 + n)), parents=list(parents), ranks=list(ranks),
                      draft_probs=[1.0] * n, target_probs=[1.0] * n, accepted=list(accepted),
                      committed=list(committed), timings=StepTimings(0.01, 0.02, 0.0))


def test_acceptance_per_depth_counts_reached_and_accepted():
    tree = [-1, 0, 0, 1, 1, 3]  # root: 2 children; node 1: 2 children; node 3: 1 child; 2, 4, 5 leaves
    steps = [hand_step(tree, [0]),           # depth 1 reached, nothing accepted
             hand_step(tree, [0, 2]),        # depth 1 accepted; node 2 is a leaf: depth 2 not reached
             hand_step(tree, [0, 1, 3, 5]),  # depths 1, 2, 3 reached and accepted
             hand_step(tree, [0, 1])]        # depth 1 accepted, depth 2 reached, refused
    rows = xf.acceptance_by_depth(steps, [0.5, 0.2, 0.1])
    assert [(r["depth"], r["reached"], r["accepted"]) for r in rows] == [(1, 4, 3), (2, 2, 1), (3, 1, 1)]
    assert rows[0]["rate"] == 0.75
    assert rows[0]["predicted"] == pytest.approx(0.7)  # two children: p1 + p2
    assert rows[2]["predicted"] == pytest.approx(0.5)  # one child
    assert xf.acceptance_by_depth([hand_step([-1], [0])], [0.5]) == []  # the target alone reaches nothing
    fig = xf.acceptance_figure(rows, "T=0", 2.5)
    bars = [t for t in fig.data if t.meta["kind"] == "measured"][0]
    assert list(bars.text) == ["3/4", "1/2", "1/1"] and "2.50 tokens/step" in fig.layout.title.text
    assert "excludes the bonus token" in xf.ACCEPTANCE_DEFINITIONS and "plus the bonus" in xf.ACCEPTANCE_DEFINITIONS


# ----- app.explain_figures: step-through ----------------------------------------------------------------
TEXTS = {10: "root", 11: " the", 12: " a", 13: " tree", 14: "!", 20: " cat"}


def traced_step(events, greedy=False, method="sequoia", committed=(11, 13, 14)) -> StepRecord:
    step = hand_step([-1, 0, 0, 1], [e.child for e in events if e.accepted and e.child is not None], committed)
    step.accepted = [0] + step.accepted
    step.greedy, step.method, step.trace = greedy, method, list(events)
    return step


def test_sentences_explain_accept_reject_and_bonus():
    rejected = VerifierEvent(0, 2, 12, False, "sample", r=0.85, p_x=0.2, q_x=0.5, top_p=[(11, 0.5), (12, 0.2)],
                             top_q=[(12, 0.5), (11, 0.3)], residual=[(11, 0.7), (20, 0.3)])
    accepted = VerifierEvent(0, 1, 11, True, "sample", r=0.41, p_x=0.73, q_x=1.0, top_p=[(11, 0.7)], top_q=[(11, 1.0)])
    leaf = VerifierEvent(1, 3, 13, True, "sample", r=0.1, p_x=0.9, q_x=0.5)
    bonus = VerifierEvent(3, None, 14, True, "bonus", p_x=0.4, top_p=[(14, 0.4)])
    step = traced_step([rejected, accepted, leaf, bonus])
    assert xf.event_sentence(step, accepted, TEXTS) == (
        "r = 0.41 &lt; min(1, p/q) = 0.73 (residual p(‘␣the’) = 0.730, renormalised q(‘␣the’) = 1.000): ‘␣the’ is "
        "accepted, the walk moves to its children.")
    no = xf.event_sentence(step, rejected, TEXTS)
    assert "r = 0.85 ≥ min(1, p/q) = 0.40" in no and "rejected" in no and "norm(relu(p − q))" in no
    assert "the next sibling ‘␣the’ is judged on it" in no and "renormalised without" in no
    assert "it is a leaf, so the bonus token comes next" in xf.event_sentence(step, leaf, TEXTS)
    assert "‘␣tree’ is a leaf: the bonus token ‘!’ is drawn from the target's p" in xf.event_sentence(step, bonus, TEXTS)
    gauge = xf.acceptance_gauge(rejected)
    assert "width:40.0%" in gauge and "left:85.0%" in gauge and "rejected" in gauge
    assert xf.acceptance_gauge(bonus) == ""


def test_greedy_sentences_name_the_argmax():
    miss = VerifierEvent(0, 1, 11, False, "argmax", target_token=12)
    hit = VerifierEvent(0, 2, 12, True, "argmax", target_token=12)
    bonus = VerifierEvent(2, None, 20, True, "bonus", target_token=20)
    step = traced_step([miss, hit, bonus], greedy=True)
    assert "most likely token after ‘root’ is ‘␣a’; the child ‘␣the’ is not it: rejected, the next sibling" in \
        xf.event_sentence(step, miss, TEXTS)
    assert "matches it: accepted" in xf.event_sentence(step, hit, TEXTS)
    assert "the bonus token is the target's argmax ‘␣cat’" in xf.event_sentence(step, bonus, TEXTS)


def test_event_figure_puts_p_and_q_side_by_side_and_the_residual_apart():
    event = VerifierEvent(0, 2, 12, False, "sample", r=0.85, p_x=0.2, q_x=0.5, top_p=[(11, 0.5), (12, 0.2)],
                          top_q=[(12, 0.5), (13, 0.3)], residual=[(11, 0.7), (20, 0.3)])
    fig = xf.event_figure(event, TEXTS)
    by_kind = {t.meta["kind"]: t for t in fig.data}
    assert list(by_kind["p"].x) == ["␣the", "␣a", "␣tree"] and list(by_kind["p"].y) == [0.5, 0.2, None]
    assert list(by_kind["q"].y) == [None, 0.5, 0.3]
    assert list(by_kind["residual"].x) == ["␣the", "␣cat"] and fig.layout.barmode == "group"
    assert list(by_kind["p"].marker.line.width) == [0, 3, 0]  # the judged token is outlined
    assert "residual" not in {t.meta["kind"] for t in xf.event_figure(VerifierEvent(0, 1, 11, True, "sample", r=0.1,
                                                                                     p_x=0.5, q_x=0.3), TEXTS).data}


def test_focus_tree_outlines_the_node_being_judged():
    event = VerifierEvent(1, 3, 13, True, "sample", r=0.1, p_x=0.9, q_x=0.5)
    step = traced_step([VerifierEvent(0, 1, 11, True, "sample", r=0.2, p_x=0.5, q_x=0.5), event,
                        VerifierEvent(3, None, 14, True, "bonus")])
    fig = xf.focus_tree(step, TEXTS, event)
    chips = fig.layout.annotations  # one per node, then the bonus
    assert (chips[3].bordercolor, chips[3].borderwidth) == (xf.PICK_COLOUR, 4)
    assert (chips[1].bordercolor, chips[1].borderwidth) == (xf.YOURS_COLOUR, 4)
    assert {a.borderwidth for i, a in enumerate(chips) if i not in (1, 3)} <= {1, 2}
    assert {t.meta["kind"]: t.meta["node"] for t in fig.data if t.meta.get("kind") in ("at", "focus")} == \
        {"at": 1, "focus": 3}
    bonus = xf.focus_tree(step, TEXTS, step.trace[-1])
    assert bonus.layout.annotations[len(step.tokens)].bordercolor == xf.PICK_COLOUR


# ----- the app's handlers ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def app():
    tokenizer = support.tokenizer()
    target, draft = support.tiny_pair()
    worker = Worker(make_engine(target, draft, tokenizer), tokenizer, {"target": "tiny-target", "draft": "tiny-draft"},
                    planner=TreePlanner(FLOAT))
    demo = ui.build_demo(worker, tokenizer)
    yield demo.chat_app
    worker.close()


def tuner_for(pair: str) -> AutoTuner:
    from engine.tuning.calibrate import find_acceptance
    return AutoTuner(profile(pair), find_acceptance(pair), pair=pair)


def test_why_follows_the_controls(app):
    app.worker.set_tuner(tuner_for(FLOAT))
    try:
        text, g, s, prof = app.explain.why("sequoia", 16, 6, False, 0.0, 1.0)
        pick = app.worker.tuner.choose(0.0, 1.0)
        assert (pick.size, pick.depth) == (8, 4)  # on this profile, at T = 0
        assert "The optimizer picks 8 nodes, depth 4 over your 16 nodes, depth 6" in text
        assert marks(s) == {"pick": (8, 4, "pick"), "yours": (16, 6, "you")}
        assert "bundled with the app" in text and "calibrated at T=0, top-p 1" in text
        bigger = app.explain.why("sequoia", 24, 6, False, 0.0, 1.0)
        assert marks(bigger[2])["yours"] == (24, 6, "you") and bigger[0] != text
        same = app.explain.why("sequoia", 8, 4, False, 0.0, 1.0)
        assert "Your setting is the optimizer&#x27;s pick: 8 nodes, depth 4" in same[0] and "yours" not in marks(same[2])
        sampled = app.explain.why("sequoia", 8, 4, False, 0.6, 1.0)
        assert "T=0.6, top-p 1" in sampled[0]
        zg = [t for t in g.data if t.type == "heatmap"][0].z
        assert [t for t in sampled[1].data if t.type == "heatmap"][0].z != zg  # another acceptance vector
        auto = app.explain.why("sequoia", 8, 4, True, 0.0, 1.0)
        assert auto[0].count("Your setting is the optimizer&#x27;s pick") == 1 and "yours" not in marks(auto[2])
        chain = app.explain.why("chain", 8, 3, False, 0.0, 1.0)
        assert marks(chain[2])["yours"] == (4, 3, "you")
    finally:
        app.worker.set_tuner(None)


def test_why_on_the_int4_cpu_explains_the_small_chain_it_picks(app):
    app.worker.set_tuner(tuner_for(Q4K))  # its calibrations are the tuner's: Q4K's
    try:
        pick = app.worker.tuner.choose(0.0, 1.0)
        text = app.explain.why("sequoia", 8, 4, False, 0.0, 1.0)[0]
        assert f"The optimizer picks {pick.size} nodes, depth {pick.depth} over your 8 nodes, depth 4" in text
        assert f"{profile(Q4K).step_overhead * 1e3:.0f} ms other" in text  # the step overhead, named
    finally:
        app.worker.set_tuner(None)


def test_why_without_a_profile_shows_g_only(app):
    text, g, s, prof = app.explain.why("sequoia", 8, 4, False, 0.0, 1.0)
    assert "No hardware profile" in text and "tokens per step (G)" in text
    assert any(t.type == "heatmap" for t in g.data) and not any(t.type == "heatmap" for t in s.data)


def test_walking_a_traced_answer_on_tiny_models(app):
    """The app asks for the trace only for a session that ticked the box; the walk then covers every
    decision of every step, Next crossing from one step to the next."""
    settings = DecodeSettings(max_new_tokens=12, temperature=0.9, tree=Tree.k_ary(2, 2), seed=3,
                              trace=app.explain.wants_trace("local"))
    request = GenerationRequest(settings=settings, messages=[{"role": "user", "content": "Hi"}])
    assert request.settings.trace is False
    app.explain.set_trace(True)
    assert app.explain.wants_trace("local")
    app.explain.set_trace(False)
    job = app.worker.submit(dataclasses.replace(request, settings=dataclasses.replace(request.settings, trace=True)),
                            session="walk")
    steps = [e.data for e in job.wait(timeout=120) if e.kind == "step"]
    assert steps and all(s.trace for s in steps)
    run = answer_stream.Run(steps=steps, texts={})
    step_slider, event_slider, text, tree, bars = app.explain.walk(run, 1, 1)
    assert "Step 1, decision 1 of" in text and ("r = " in text or "bonus" in text)
    seen, position = [], (1, 1)
    for _ in range(sum(len(s.trace) for s in steps) - 1):
        out = app.explain.move(run, *position, +1)
        position = (out[0]["value"], out[1]["value"])
        seen.append(position)
    assert seen[-1] == (len(steps), len(steps[-1].trace))  # walked to the last decision of the last step
    assert app.explain.move(run, *position, -1)[1]["value"] == max(len(steps[-1].trace) - 1, 1)
    untraced = answer_stream.Run(steps=[hand_step([-1, 0], [0])], texts={})
    assert "without the verifier's trace" in app.explain.walk(untraced, 1, 1)[2]
    conversation, *rest = app.explain.after_answer(run, [], 0.9, 1.0)
    assert conversation == [steps]
    assert app.explain.after_answer(run, conversation, 0.9, 1.0)[0] == [steps]  # the same answer, counted once


def test_a_grown_pick_is_named_with_its_threshold_everywhere_it_is_shown():
    from app.views.text import describe_choice
    from app.views.explain_text import describe_setting
    from engine.tuning.optimizer import TreeChoice

    grown = TreeChoice(Tree.chain(2), 3, 2, 2.3, 0.06, 1.08, confidence=0.7)
    fixed = TreeChoice(Tree.chain(1), 2, 1, 1.8, 0.05, 1.06)
    assert describe_setting(grown) == "a chain of up to 2 grown while the draft's path confidence is ≥ 0.7"
    assert describe_setting(fixed) == "2 nodes, depth 1"
    assert describe_choice(grown).startswith(describe_setting(grown) + " · predicted 2.30 tokens/step")
    assert "per step on average" in explain_text.explain_choice(grown, fixed, profile(Q4K))
