"""What the UI's controls mean, as plain values: the app's defaults, a value clamped into its
range, and the chat's controls read once into the settings an answer decodes with. The handlers
(:mod:`app.page.handlers`) and the teaching views (:mod:`app.page.explain_view`) both use them; nothing
here knows Gradio or the worker."""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, fields

from engine.core.settings import AUTO, DEFAULT_SIZE, METHODS, DecodeSettings, TreeSize, TreeSpec, settings_from

_LIBRARY = DecodeSettings()  # the engine's defaults are the app's: they are read from one place

DEFAULTS = {
    "title": "Sequoia Chat",
    "system_prompt": "",
    "temperature": _LIBRARY.temperature,
    "top_p": _LIBRARY.top_p,
    "max_new_tokens": _LIBRARY.max_new_tokens,
    "max_new_tokens_limit": 2048,
    "seed": _LIBRARY.seed,
    "method": _LIBRARY.method,
    "tree_size": DEFAULT_SIZE.size,
    "depth": DEFAULT_SIZE.depth,
    "auto": _LIBRARY.tree == AUTO,  # the optimizer's pick when the pair has one (tree_size and depth: for a manual tree)
    "max_tree_size": 64,
    "max_depth": 16,
    "compare": False,
    "copies": _LIBRARY.copies,  # free drafts: continuations copied from the conversation, verified beside the draft's
    # an answer's 2nd step and every n-th after it the target decodes alone, timed: the stats line's
    # "× the target alone" then compares with the target under the same load (the page, other programs)
    "time_alone_every": 10,
    "highlight": False,
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


def clamp(value, low, high, cast=float):
    try:
        value = cast(value)
    except (TypeError, ValueError):
        value = low
    return max(low, min(high, value))


def sampling(temperature, top_p) -> tuple[float, float]:
    """The temperature and top-p controls as values in their sliders' ranges."""
    return clamp(temperature, 0.0, 2.0), clamp(top_p, 0.01, 1.0)


@dataclass(frozen=True)
class ChatControls:
    """The chat's controls as the handlers read them, each clamped into its range once: the
    system prompt, sampling, budget, seed, method, the tree (size and depth, or Auto) and the
    page's switches (Compare, highlight, presentation mode)."""

    system: str = ""
    temperature: float = 0.0
    top_p: float = 1.0
    max_new: int = 256
    seed: int = 0
    method: str = "sequoia"
    size: int = 8
    depth: int = 4
    auto: bool = True
    compare: bool = False
    highlight: bool = False
    present: bool = False

    @classmethod
    def read(cls, values: Sequence, options: dict) -> "ChatControls":
        """From the components' values in :data:`CONTROL_NAMES` order."""
        v = dict(zip(CONTROL_NAMES, values))
        temperature, top_p = sampling(v.get("temperature"), v.get("top_p"))
        return cls(system=str(v.get("system") or ""), temperature=temperature, top_p=top_p,
                   max_new=int(clamp(v.get("max_new"), 1, options["max_new_tokens_limit"], int)),
                   seed=int(clamp(v.get("seed"), 0, 2**31 - 1, int)),
                   method=v.get("method") if v.get("method") in METHODS else "sequoia",
                   size=int(clamp(v.get("size"), 1, options["max_tree_size"], int)),
                   depth=int(clamp(v.get("depth"), 1, options["max_depth"], int)),
                   auto=bool(v.get("auto")), compare=bool(v.get("compare")), highlight=bool(v.get("highlight")),
                   present=bool(v.get("present")))

    def tree(self, can_pick: bool) -> TreeSpec:
        """The tree the controls name: Auto where the pair has an optimizer, else the sliders' size."""
        return AUTO if self.auto and can_pick and self.method != "autoregressive" else TreeSize(self.size, self.depth)

    def settings(self, can_pick: bool, copies: bool = False, trace: bool = False) -> DecodeSettings:
        """The :class:`~engine.core.settings.DecodeSettings` the chat decodes with (checked)."""
        return settings_from(max_new_tokens=self.max_new, temperature=self.temperature, top_p=self.top_p,
                             seed=self.seed, method=self.method, tree=self.tree(can_pick), copies=copies, trace=trace)


CONTROL_NAMES = tuple(f.name for f in fields(ChatControls))  # the order the page passes them in
