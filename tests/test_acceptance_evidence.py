"""Acceptance that follows the conversation (engine.core.acceptance_evidence, the planner's
re-pick, a conversation cache's counts): counting ranks on hand-made steps, the prior's weight,
the re-pick's threshold, greedy answers priced by their conversation's earlier steps and
token-identical to the target's own greedy decoding, a branch dropping the steps it left, and
sampled answers that follow nothing but their settings (a seed gives one answer)."""
from __future__ import annotations

import pytest
import tiny_models as tm
import torch

from engine import SpeculativeEngine
from engine.core.acceptance_evidence import PRIOR_WEIGHT, PricedBy, RankCounts
from engine.core.prefix_cache import ConversationCache
from engine.core.records import StepRecord
from engine.core.settings import DecodeSettings, TreeSize, decide_tree
from engine.tuning.optimizer import AutoTuner, predict
from engine.tuning.planner import REPICK_GAIN, TreePlanner
from engine.tuning.profile import HardwareProfile

CALIBRATED = [0.8, 0.1, 0.05]
# a CPU-like profile: wider verification costs more, a draft level costs a sixth of a target step
PROFILE = HardwareProfile("synthetic", "tiny", "float32", 8, target={1: 0.030, 2: 0.032, 4: 0.036, 8: 0.045,
                                                                      16: 0.065, 32: 0.11},
                          draft={1: 0.005, 2: 0.0055, 4: 0.006, 8: 0.007, 16: 0.009})


def step(parents, ranks, accepted, sources=(), q=None, **flags) -> StepRecord:
    n = len(parents)
    return StepRecord(index=0, tokens=list(range(10, 10 + n)), parents=list(parents), ranks=list(ranks),
                      draft_probs=list(q or [1.0] * n), target_probs=[1.0] * n, accepted=list(accepted),
                      committed=[1], sources=list(sources), **flags)


def planner() -> TreePlanner:
    return TreePlanner(tuner=AutoTuner(PROFILE, {(0.0, 1.0): list(CALIBRATED), (0.7, 1.0): list(CALIBRATED)},
                                       max_size=32, max_depth=8))


def test_a_step_counts_the_ranks_its_walk_offered_and_the_one_it_kept():
    #        0
    #     1     2        (ranks 1, 2)
    #   3   4            (ranks 1, 2 below node 1)
    parents, ranks, q = [-1, 0, 0, 1, 1], [0, 1, 2, 1, 2], [1.0, 0.9, 0.5, 0.8, 0.3]
    kept_second_then_none = step(parents, ranks, [0, 2], q=q)
    assert RankCounts.of_step(kept_second_then_none) == RankCounts((1, 1), (0, 1), 1, ((0.9, 0),))
    deep = step(parents, ranks, [0, 1, 4], q=q)
    assert RankCounts.of_step(deep) == RankCounts((2, 2), (1, 1), 1, ((0.9, 1), (0.8, 0)))
    rejected = step(parents, ranks, [0], q=q)
    assert RankCounts.of_step(rejected) == RankCounts((1, 1), (0, 0), 1, ((0.9, 0),))
    total = RankCounts.of_steps([kept_second_then_none, deep, rejected])
    assert total == RankCounts((4, 4), (1, 2), 3, ((0.9, 0), (0.9, 1), (0.8, 0), (0.9, 0)))
    # a tree grown by the draft's confidence: below the first level only the samples count
    assert RankCounts.of_step(deep, grown=True) == RankCounts((1, 1), (1, 0), 1, ((0.9, 1), (0.8, 0)))
    # nothing drafted, paused, timed alone, or behind: nothing counted
    assert not RankCounts.of_step(step([-1], [0], [0]))
    for flag in ("draft_paused", "timed_alone"):
        assert not RankCounts.of_step(step(parents, ranks, [0, 1], **{flag: True}))
    assert not RankCounts.of_step(step(parents, ranks, [0, 1], draft_behind=5))
    # a copied child is not the draft's: it offers no rank, and a walk that kept it stops there
    copied = step([-1, 0, 0], [0, 1, 1], [0, 2], sources=["root", "draft", "copy"])
    assert RankCounts.of_step(copied) == RankCounts()
    assert RankCounts.of_step(step([-1, 0, 0], [0, 1, 1], [0, 1], sources=["root", "draft", "copy"])) == \
        RankCounts((1,), (1,), 1, ((1.0, 1),))


def test_the_calibration_weighs_as_prior_weight_nodes_and_the_counts_take_over():
    assert RankCounts().blend(CALIBRATED) == pytest.approx(CALIBRATED)
    few = RankCounts((3, 3), (0, 0), 3)  # three rejections do not swing it
    assert few.blend(CALIBRATED)[0] == pytest.approx(PRIOR_WEIGHT * 0.8 / (PRIOR_WEIGHT + 3))
    assert few.blend(CALIBRATED)[0] > 0.7 and few.blend(CALIBRATED)[2] == pytest.approx(0.05)
    many = RankCounts((1000, 1000, 1000), (400, 50, 10), 1000)
    assert many.blend(CALIBRATED) == pytest.approx([0.4, 0.05, 0.01], abs=0.02)
    assert sum(RankCounts((10,), (10,), 10).blend([0.9, 0.1])) <= 1.0 + 1e-12


def test_the_planner_re_picks_for_a_conversation_that_keeps_less_and_says_so():
    p = planner()
    settings = DecodeSettings(tree="auto", temperature=0.0)
    calibrated = decide_tree(settings, p)
    assert calibrated.priced_by == PricedBy(tuple(CALIBRATED)) and calibrated.priced_by.label() == "calibrated"
    poor = RankCounts((400, 400, 400), (120, 20, 8), 400)
    followed = decide_tree(settings, p, poor)
    assert followed.priced_by.steps == 400 and followed.priced_by.label() == "this conversation's after 400 steps"
    assert followed.choice.size < calibrated.choice.size
    assert followed.choice.expected_tokens == pytest.approx(followed.tree.expected_tokens(followed.priced_by.vector))
    # sized trees follow it too; a sampled answer's tree follows nothing but its settings
    assert decide_tree(DecodeSettings(tree=TreeSize(16, 6)), p, poor).tree != decide_tree(
        DecodeSettings(tree=TreeSize(16, 6)), p).tree
    sampled = DecodeSettings(tree="auto", temperature=0.7)
    assert decide_tree(sampled, p, poor) == decide_tree(sampled, p)


def test_a_hair_of_predicted_gain_keeps_the_calibrated_tree():
    p = planner()
    settings = DecodeSettings(tree="auto")
    calibrated = decide_tree(settings, p).choice
    close = RankCounts((40, 40, 40), (31, 4, 2), 40)  # about what the calibration says
    followed = decide_tree(settings, p, close)
    assert followed.tree == calibrated.tree
    vector = followed.priced_by.vector
    assert followed.choice == predict(calibrated.tree, vector, PROFILE)  # re-priced, not re-picked
    best = p.tuner.choose_for(vector, 0.0, 1.0)
    assert best.predicted_speedup <= followed.choice.predicted_speedup * REPICK_GAIN


@pytest.fixture(scope="module")
def models():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    target = tm.qwen2(seed=5)
    yield target, tm.perturbed(target, 0.05)
    torch.set_num_threads(before)


PROMPT = [5, 17, 3, 42, 9, 11, 7, 8]


def engine_and_cache(models) -> tuple[SpeculativeEngine, ConversationCache]:
    """An engine on the tiny pair with the planner above, and a fresh conversation cache of it."""
    target, draft = models
    return SpeculativeEngine(target, draft, stop_token_ids=[], planner=planner()), ConversationCache(target, draft)


def test_greedy_turns_are_priced_by_their_conversation_and_stay_exact(models):
    target = models[0]
    engine, cache = engine_and_cache(models)
    first_prompt = PROMPT
    first = engine.generate(first_prompt, max_new_tokens=40, cache=cache, copies=False)
    assert first.decision.priced_by.steps == 0 and first.tokens == tm.hf_greedy(target, first_prompt, 40)
    counted = RankCounts.of_steps(first.steps, grown=first.decision.confidence > 0)
    turn = first_prompt + first.tokens + [21, 22, 23]
    second = engine.generate(turn, max_new_tokens=30, cache=cache, copies=False)
    assert second.decision.priced_by.steps == counted.steps > 0
    assert second.decision.priced_by.vector == counted.blend(CALIBRATED)
    assert second.tokens == tm.hf_greedy(target, turn, 30)
    # a branch (the first message edited): the steps it left behind price nothing
    branch = [5, 17, 3, 59, 58]
    edited = engine.generate(branch, max_new_tokens=8, cache=cache, copies=False)
    assert edited.decision.priced_by.steps == 0 and edited.tokens == tm.hf_greedy(target, branch, 8)
    assert engine.decide(DecodeSettings(), RankCounts()).priced_by.steps == 0


def test_a_seeded_sampled_answer_is_one_answer_whatever_the_conversation_kept(models):
    engine, cache = engine_and_cache(models)
    greedy = engine.generate(PROMPT, max_new_tokens=24, cache=cache, copies=False)
    turn = PROMPT + greedy.tokens + [21, 22]
    fresh = engine.generate(turn, max_new_tokens=20, temperature=0.7, seed=11, copies=False)
    again = engine.generate(turn, max_new_tokens=20, temperature=0.7, seed=11, copies=False, cache=cache)
    assert again.decision.priced_by.steps == 0 and again.tokens == fresh.tokens


def test_the_stats_line_says_which_acceptance_predicted_the_answer():
    """Through the app (tiny pair, the page's handlers): the first greedy answer of a conversation is
    predicted by the calibration, the next by the conversation's own steps, and the line says so."""
    import test_app_support as support

    from app.page import answer_stream, ui

    for worker in support.tiny_worker():
        app = ui.build_demo(worker, worker.tokenizer, {}).chat_app
        c = app.c

        def ask(message, history=()):
            return list(app.respond(message, list(history), answer_stream.Run(), "", 0.0, 1.0, 24, 0, "sequoia",
                                    8, 4, False, False, False))[-1]
        first = ask("Tell me about oak trees")
        assert first[c.run].acceptance == "calibrated" and "(acceptance calibrated; measured " in first[c.stats]
        second = ask("And elms?", first[c.history])
        # every drafting step of the first answer (its text need not tokenise back as it was drafted)
        steps = RankCounts.of_steps(first[c.run].steps).steps
        assert steps > 0 and second[c.run].acceptance == f"this conversation's after {steps} steps"
        assert f"(acceptance {second[c.run].acceptance}; measured " in second[c.stats]


def test_a_grown_chain_is_priced_by_the_conversations_samples_beside_the_calibrations():
    """The calibration's (q, kept) samples weigh as PRIOR_SAMPLES positions; a conversation whose
    sure-looking positions are rejected prices the same chain lower, and the pick follows."""
    from engine.core.acceptance_evidence import PRIOR_SAMPLES
    from engine.tuning.optimizer import grown_chain, growth_scale, price_grown

    sure = [(0.95, 1)] * 9 + [(0.2, 0)]
    tuner = AutoTuner(PROFILE, {(0.0, 1.0): list(CALIBRATED)}, max_size=32, max_depth=8,
                      confidence={(0.0, 1.0): sure * 40})
    p = TreePlanner(tuner=tuner)
    calibrated = decide_tree(DecodeSettings(), p)
    assert calibrated.choice.confidence > 0  # a chain grown while the draft is sure
    wrong = RankCounts((300,), (60,), 300, tuple([(0.95, 0), (0.95, 1)] * 150))
    followed = decide_tree(DecodeSettings(), p, wrong)
    assert followed.choice.expected_tokens < calibrated.choice.expected_tokens
    again = tuner.reprice(calibrated.choice, followed.priced_by.vector, 0.0, 1.0, wrong.samples)
    alone = price_grown(sure * 40, calibrated.choice.depth, calibrated.choice.confidence, PROFILE,
                        growth_scale(CALIBRATED, sure * 40, PROFILE))
    own = grown_chain(wrong.samples, calibrated.choice.depth, calibrated.choice.confidence, PROFILE)
    assert alone == calibrated.choice
    assert again.expected_tokens == pytest.approx((PRIOR_SAMPLES * alone.expected_tokens + 300 * own.expected_tokens)
                                                  / (PRIOR_SAMPLES + 300))
