"""What the UI's controls mean, as plain values: the app's defaults, a value clamped into its
range, the tree that a method, size and depth name (DP trees cached), and the acceptance
calibration for a temperature and top-p. The handlers (:mod:`app.handlers`) and the teaching
views (:mod:`app.explain_view`) both use them; nothing here knows Gradio or the worker."""
from __future__ import annotations

import os
from functools import lru_cache

from engine.trees.tree import Tree
from engine.tuning.acceptance import EMBEDDED_PAIR, Calibration, calibration_for
from engine.tuning.tree_store import build_tree

DEFAULTS = {
    "title": "Sequoia Chat",
    "system_prompt": "",
    "temperature": 0.0,
    "top_p": 1.0,
    "max_new_tokens": 256,
    "max_new_tokens_limit": 2048,
    "seed": 0,
    "method": "sequoia",
    "tree_size": 8,
    "depth": 4,
    "auto": True,  # the optimizer's pick when the pair has one (tree_size and depth: for a manual tree)
    "max_tree_size": 64,
    "max_depth": 16,
    "compare": False,
    "copies": True,  # free drafts: continuations copied from the conversation, verified beside the draft's
    # an answer's 2nd step and every n-th after it the target decodes alone, timed: the stats line's
    # "× the target alone" then compares with the target under the same load (the page, other programs)
    "time_alone_every": 10,
    "highlight": False,
    # the pair (as calibrations name it) whose acceptance calibrations shape DP trees and predictions
    "pair": EMBEDDED_PAIR,
    # show predicted tokens/step; also off whenever the pair in use has no calibration of its own
    "predict": True,
}



def live_update_intervals(cores: int | None = None) -> dict[str, float]:
    """Seconds between live updates of an answer's text (``text_interval``) and of its tree and
    step figures (``plot_interval``), by the CPU cores this process may run on. The browser draws
    on the cores that decode: on 2 cores with headless Chromium, updates at 20 and 5 a second held
    the pick to 15 tokens/s against 29 with none (the renderer took 10 s of CPU for a 12 s answer,
    most of it re-rendering the chat), and 4 and 1 a second gave 20. Machines of up to 4 cores get
    those; larger ones 20 and 5. The live feed (``feed_interval``, ``feed_tree_interval``) costs
    Chromium 15-25 ms of CPU a record (style, layout, raster and a software draw of the changed
    area), each taken from a decoding core on 2 cores: up to 3 records and 2 trees a second there."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if cores <= 4:
        return {"text_interval": 0.25, "plot_interval": 1.0, "feed_interval": 0.3, "feed_tree_interval": 0.5}
    return {"text_interval": 0.05, "plot_interval": 0.2, "feed_interval": 0.1, "feed_tree_interval": 0.25}


DEFAULTS |= live_update_intervals()


@lru_cache(maxsize=64)
def cached_calibration(pair: str, temperature: float, top_p: float) -> Calibration:
    """:func:`engine.tuning.acceptance.calibration_for`, memoised (the controls ask at every change)."""
    return calibration_for(pair, temperature, top_p)


@lru_cache(maxsize=256)
def _cached_tree(size: int, depth: int, acceptance: tuple[float, ...]) -> Tree | None:
    return build_tree(size, depth, list(acceptance))


def resolve_tree(method: str, size: int, depth: int, acceptance) -> tuple[Tree | None, str]:
    """The tree for the controls and a short description. Raises EngineError on bad values."""
    size = int(max(1, size))
    depth = int(max(1, depth))
    if method == "autoregressive" or size == 1 and method != "chain":
        return None, "autoregressive: the target alone, 1 token per step, no draft"
    if method == "chain":
        return Tree.chain(depth), f"chain: {depth} draft tokens in a row ({depth + 1} nodes)"
    depth = min(depth, size - 1)
    tree = _cached_tree(size, depth, tuple(acceptance))
    kind = "a chain" if tree.size == tree.depth + 1 else "a DP-shaped tree"
    return tree, f"{method} on {kind}: {tree.size} nodes, depth {tree.depth}"


def clamp(value, low, high, cast=float):
    try:
        value = cast(value)
    except (TypeError, ValueError):
        value = low
    return max(low, min(high, value))
