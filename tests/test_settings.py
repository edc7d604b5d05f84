"""One settings object and one tree decision (engine.core.settings).

The settings are checked in one place, their defaults are the app's, keyword arguments build
them, and the tree comes from one function that the UI, the API, the worker's context limit and
the engine all reach: the same knobs decode with the same tree whichever way they come in. Tiny
random models with the real tokenizer; the bundled calibrations of the embedded pair.
"""
from __future__ import annotations

import dataclasses

import pytest
import test_app_support as support
import tiny_models as tm

from app.api import openai_requests
from app.page.controls import DEFAULTS, ChatControls
from app.serving.jobs import GenerationRequest
from engine import SpeculativeEngine
from engine.core.settings import (
    AUTO,
    DEFAULT_SIZE,
    ROOT_ONLY,
    DecodeSettings,
    TreeSize,
    decide_tree,
    settings_from,
)
from engine.errors import InvalidParameterError
from engine.models.prompts import encode_chat
from engine.trees.tree import Tree
from engine.tuning.optimizer import AutoTuner
from engine.tuning.planner import TreePlanner
from engine.tuning.profile import HardwareProfile

PROFILE = HardwareProfile(device="test", pair="tiny", dtype="float32", prefix_len=128,
                          target={1: 0.010, 4: 0.011, 16: 0.013, 64: 0.030}, draft={1: 0.001, 4: 0.0012, 16: 0.0015})


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    yield from support.one_torch_thread()


@pytest.fixture(scope="module")
def worker():
    yield from support.tiny_worker()


def bundled_tuner() -> AutoTuner:
    """The optimizer on a synthetic profile and the embedded pair's bundled calibrations."""
    from engine.tuning.acceptance import EMBEDDED_PAIR
    from engine.tuning.calibrate import find_acceptance

    return AutoTuner(PROFILE, find_acceptance(EMBEDDED_PAIR), max_size=32, max_depth=6, pair=EMBEDDED_PAIR)


# ----- the settings ------------------------------------------------------------------------------
def test_the_librarys_defaults_are_the_apps():
    library = DecodeSettings()
    assert (library.temperature, library.top_p, library.max_new_tokens, library.seed, library.method) == \
        (DEFAULTS["temperature"], DEFAULTS["top_p"], DEFAULTS["max_new_tokens"], DEFAULTS["seed"], DEFAULTS["method"])
    assert library.copies is DEFAULTS["copies"] is True  # free drafts on, in Python as in the app
    assert (library.tree == AUTO) is DEFAULTS["auto"] is True
    assert (DEFAULTS["tree_size"], DEFAULTS["depth"]) == (DEFAULT_SIZE.size, DEFAULT_SIZE.depth)


@pytest.mark.parametrize("changes,field", [
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"max_new_tokens": True}, "max_new_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"seed": 1.5}, "seed"), ({"method": "beam"}, "method"),
    ({"tree": "big"}, "tree"), ({"tree": TreeSize(0, 1)}, "tree size"), ({"tree": TreeSize(4, True)}, "tree depth"),
    ({"copies": "yes"}, "copies"), ({"trace": 1}, "trace"), ({"confidence": 2}, "confidence"),
    ({"logprobs": 21}, "logprobs"), ({"prediction": "text"}, "prediction"), ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"temprature": 0.5}, "unknown setting"),
])
def test_a_bad_setting_is_refused_in_one_line_naming_it(changes, field):
    with pytest.raises(InvalidParameterError, match=field) as info:
        settings_from(**changes)
    assert "\n" not in str(info.value)


def test_checked_settings_are_normalised_and_frozen():
    settings = settings_from(temperature=1, top_p=1, prediction=[5, 6], stop_token_ids=[2, 2, 3])
    assert settings.temperature == 1.0 and isinstance(settings.temperature, float)
    assert settings.prediction == (5, 6) and settings.stop_token_ids == frozenset({2, 3})
    assert settings_from(settings, seed=4) == dataclasses.replace(settings, seed=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.seed = 3
    assert settings_from(prediction=[]).prediction is None
    assert settings_from(method="chain", copies=True).copying is False  # chain takes no copied children
    assert settings_from(prediction=[1]).copying and not settings_from(copies=False).copying


# ----- the one tree decision ---------------------------------------------------------------------
def test_each_tree_spec_decides_its_tree():
    planner = TreePlanner(tuner=bundled_tuner())
    chain = Tree.chain(3)
    assert decide_tree(settings_from(tree=None), planner).tree == ROOT_ONLY
    assert decide_tree(settings_from(tree=chain, method="autoregressive"), planner).tree == ROOT_ONLY
    assert decide_tree(settings_from(tree=chain), planner).tree is chain
    assert decide_tree(settings_from(tree=TreeSize(1, 4)), planner).tree == ROOT_ONLY
    assert decide_tree(settings_from(tree=TreeSize(8, 5), method="chain"), planner).tree == Tree.chain(5)
    capped = decide_tree(settings_from(tree=TreeSize(4, 8)), planner).tree
    assert capped.size == 4 and capped == Tree.chain(3)  # depth capped at size - 1: a chain
    sized = decide_tree(settings_from(tree=TreeSize(8, 4), temperature=0.7), planner)
    assert sized.tree == planner.sized_tree(8, 4, 0.7, 1.0) and sized.tree.size == 8 and not sized.auto
    auto = decide_tree(settings_from(temperature=0.7), planner)
    assert auto.auto and auto.tree == bundled_tuner().choose(0.7, 1.0, "sequoia").tree
    assert auto.confidence == auto.choice.confidence
    assert decide_tree(settings_from(confidence=0.0), planner).confidence == 0.0  # an explicit threshold wins
    with pytest.raises(InvalidParameterError, match="chain"):
        decide_tree(settings_from(tree=Tree.k_ary(2, 2), method="chain"), planner)


def test_auto_without_a_profile_is_the_apps_manual_default_and_without_a_planner_an_error():
    planner = TreePlanner()  # the embedded pair's calibration, no profile
    decision = decide_tree(settings_from(), planner)
    assert decision.tree == planner.sized_tree(DEFAULT_SIZE.size, DEFAULT_SIZE.depth, 0.0, 1.0) and not decision.auto
    for spec in (AUTO, TreeSize(8, 4)):
        with pytest.raises(InvalidParameterError, match="planner"):
            decide_tree(settings_from(tree=spec), None)
    assert decide_tree(settings_from(tree=Tree.chain(2)), None).tree == Tree.chain(2)


def test_a_sized_tree_follows_the_calibration_of_the_setting():
    planner = TreePlanner()
    greedy = planner.decide(settings_from(tree=TreeSize(16, 6), temperature=0.0)).tree
    sampled = planner.decide(settings_from(tree=TreeSize(16, 6), temperature=0.7)).tree
    assert planner.calibration(0.0, 1.0).vector != planner.calibration(0.7, 1.0).vector
    assert greedy != sampled  # the same size, shaped for each setting's acceptance


def ui_settings(worker, **knobs) -> DecodeSettings:
    """What the chat's handlers decode with for these controls (app.handlers.ChatApp._answer)."""
    values = {"system": "", "temperature": 0.0, "top_p": 1.0, "max_new": 16, "seed": 0, "method": "sequoia",
              "size": 8, "depth": 4, "auto": False} | knobs
    controls = ChatControls.read([values.get(name) for name in ("system", "temperature", "top_p", "max_new",
                                                                 "seed", "method", "size", "depth", "auto")],
                                 DEFAULTS)
    return controls.settings(worker.tuner is not None, copies=True)


def api_settings(worker, **knobs) -> DecodeSettings:
    """What the OpenAI API decodes with for the same knobs (app.openai_requests.parse_chat)."""
    sequoia = {"method": knobs.get("method", "sequoia")}
    sequoia |= {"auto": True} if knobs.get("auto") else {"tree_size": knobs.get("size", 8), "depth": knobs.get("depth", 4)}
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "seed": 0, "sequoia": sequoia,
            "temperature": knobs.get("temperature", 0.0), "top_p": knobs.get("top_p", 1.0)}
    return openai_requests.parse_chat(body, worker, {"tree_size": 8, "depth": 4}).request.settings


# at T = 0.7 and 1.0 the DP trees of 16/6 and 12/3 differ from the greedy calibration's, which the API
# once built whatever the temperature
KNOBS = [dict(), dict(temperature=0.7, size=16, depth=6), dict(temperature=0.7, top_p=0.9, size=24, depth=6),
         dict(method="specinfer", temperature=1.0, size=12, depth=3), dict(method="chain", size=8, depth=5),
         dict(method="topk", temperature=0.3, size=6, depth=2), dict(method="autoregressive"),
         dict(size=1, depth=1), dict(auto=True), dict(auto=True, temperature=0.7, method="chain")]


@pytest.mark.parametrize("knobs", KNOBS, ids=[",".join(f"{k}={v}" for k, v in k.items()) or "defaults" for k in KNOBS])
def test_the_ui_and_the_api_decode_the_same_knobs_with_the_same_tree(worker, knobs):
    """Through the worker end to end: both jobs' engines report the tree they decoded with, and every
    step's tree is it (copies off here, so no step adds a copied branch)."""
    worker.set_tuner(bundled_tuner())
    try:
        ui, api = ui_settings(worker, **knobs), api_settings(worker, **knobs)
        assert worker.decide(ui).tree == worker.decide(api).tree
        ids = encode_chat(worker.tokenizer, [{"role": "user", "content": "Hi"}])
        trees = []
        for settings in (ui, api):
            events = worker.submit(GenerationRequest(ids, dataclasses.replace(settings, copies=False))).wait(60)
            assert events[-1].kind == "done", events[-1]
            started = next(e.data for e in events if e.kind == "started")
            steps = [e.data for e in events if e.kind == "step"]
            assert all(tuple(s.parents) == started["decision"].tree.parents for s in steps
                       if not s.draft_paused and len(s.parents) > 1)
            trees.append(started["decision"].tree)
        assert trees[0] == trees[1]
    finally:
        worker.set_tuner(None)


def test_the_context_limit_counts_the_tree_the_engine_decodes(worker):
    worker.set_tuner(bundled_tuner())
    try:
        for settings in (settings_from(temperature=0.7, method="chain"), settings_from(tree=TreeSize(12, 3))):
            size = worker.decide(settings).tree.size
            assert worker.context_limit(settings) == worker.engine.max_context - settings.max_new_tokens - size
    finally:
        worker.set_tuner(None)


# ----- the engine reports what it decoded with ------------------------------------------------------
def test_keyword_arguments_build_the_settings_and_the_generation_says_what_it_used():
    target = tm.qwen2(seed=3)
    engine = SpeculativeEngine(target, tm.perturbed(target, 0.05, seed=1), stop_token_ids=[],
                               planner=TreePlanner(tuner=bundled_tuner()))
    prompt = [3, 1, 4, 1, 5]
    result = engine.generate(prompt, max_new_tokens=24, temperature=0, tree="auto")  # the README's example
    assert result.tokens == tm.hf_greedy(target, prompt, 24)
    assert result.decision.auto and result.decision == engine.decide(settings_from(max_new_tokens=24))
    generation = engine.stream(prompt, settings_from(max_new_tokens=8, tree=Tree.chain(2)))
    assert generation.decision.tree == Tree.chain(2) and generation.settings.max_new_tokens == 8
    assert generation.prefill_s == 0.0 and generation.reused_tokens == 0
    steps = list(generation)
    assert generation.prefill_s > 0 and [t for s in steps for t in s.committed] == result.tokens[:8]
    assert not [name for name in vars(engine) if name.startswith("last_")]  # nothing handed out on the side
    with pytest.raises(InvalidParameterError, match="unknown setting"):
        engine.stream(prompt, max_new_token=8)


def test_eight_identical_seeded_calls_with_free_drafts_give_one_answer():
    """Copies' and the draft's measured acceptance are the generation's own: a seeded answer's trees
    depend on nothing an earlier answer left on the engine. A repetitive prompt, so copies are
    proposed, at T = 0.8."""
    target = tm.qwen2(seed=3)
    engine = SpeculativeEngine(target, tm.perturbed(target, 0.05, seed=1), stop_token_ids=[])
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 4
    runs = [engine.generate(prompt, max_new_tokens=40, temperature=0.8, tree=Tree.k_ary(2, 2), seed=7)
            for _ in range(8)]
    assert sum(s.sources.count("copy") for s in runs[0].steps) > 0, "no copy was proposed: the test proves nothing"
    assert all(run.tokens == runs[0].tokens for run in runs)
    assert all([s.parents for s in run.steps] == [s.parents for s in runs[0].steps] for run in runs)
