"""One answer's decoding settings and the one decision of the tree they decode with.

:class:`DecodeSettings` is what a user chooses (temperature, top-p, budget, seed, method, the
tree, free drafts, logprobs, the verifier's trace), frozen and checked once by
:func:`check_settings`, whose errors are the one-line :class:`InvalidParameterError`. Its
defaults are the app's: a Python caller gets what the chat serves. The UI builds one from its
controls, the API from a request body, and it reaches :meth:`SpeculativeEngine.stream` unchanged.

:func:`decide_tree` turns the settings' tree spec into the tree to decode, asking a planner
(:class:`engine.tuning.planner.TreePlanner`: the pair's calibration and this machine's profile)
where the spec names a size or ``"auto"``. The UI, the API, the worker's context limit and the
engine all call it, so the same knobs always decode with the same tree.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Protocol

from engine.core.acceptance_evidence import PricedBy, RankCounts
from engine.core.logprobs import check_logprobs
from engine.errors import InvalidParameterError
from engine.trees.tree import Tree

AUTO = "auto"
METHODS = ("sequoia", "specinfer", "chain", "topk", "autoregressive")
COPY_METHODS = ("sequoia", "specinfer", "topk")  # verifiers that take copied children (and T = 0)
ROOT_ONLY = Tree.chain(0)


@dataclass(frozen=True)
class TreeSize:
    """A tree named by its size (nodes, the root included) and depth: Sequoia's DP tree for the
    pair's calibration at the answer's temperature and top-p (a chain of ``depth`` for ``chain``;
    the depth is capped at ``size - 1``; size 1 is the target alone)."""

    size: int
    depth: int


TreeSpec = Tree | TreeSize | str | None  # a Tree as given, a size, "auto" (the optimizer's pick), None (target alone)


@dataclass(frozen=True)
class DecodeSettings:
    """What to decode with; :func:`check_settings` makes one valid (``DecodeSettings(...)`` alone
    does not check). ``tree``: a :data:`TreeSpec`. ``copies``: continuations copied from the
    context are verified beside the draft's (``sequoia``, ``specinfer``, ``topk`` only).
    ``prediction``: token ids of an expected answer, copied from likewise. ``logprobs``: each
    committed token's logprob and this many alternatives (None: off). ``trace``: every decision of
    the acceptance walk. ``confidence``: grow the tree below a node only while the draft's q along
    its path reaches it (None: 0, or the optimizer's threshold under ``"auto"``).
    ``stop_token_ids``: None for the engine's own."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    method: str = "sequoia"
    tree: TreeSpec = AUTO
    copies: bool = True
    prediction: tuple[int, ...] | None = None
    logprobs: int | None = None
    trace: bool = False
    confidence: float | None = None
    stop_token_ids: frozenset[int] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def copying(self) -> bool:
        """Whether steps propose copies from the context: asked for (or a prediction given) and
        the method verifies copied children."""
        return (self.copies or bool(self.prediction)) and self.method in COPY_METHODS


SETTING_NAMES = frozenset(f.name for f in dataclasses.fields(DecodeSettings))


def settings_from(settings: DecodeSettings | None = None, **changes: Any) -> DecodeSettings:
    """``settings`` (default: the defaults) with ``changes`` applied, checked: keyword arguments
    are shorthand for the object, as ``generate(**kwargs)`` builds a ``GenerationConfig``."""
    unknown = sorted(set(changes) - SETTING_NAMES)
    if unknown:
        raise InvalidParameterError(f"unknown setting(s): {', '.join(unknown)} (known: {', '.join(sorted(SETTING_NAMES))})")
    if settings is not None and not isinstance(settings, DecodeSettings):
        raise InvalidParameterError(f"settings must be a DecodeSettings, got {type(settings).__name__}")
    return check_settings(dataclasses.replace(settings or DecodeSettings(), **changes))


def check_settings(settings: DecodeSettings) -> DecodeSettings:
    """``settings`` with every field checked and normalised (floats, a tuple of prediction ids, a
    frozenset of stop ids); else :class:`InvalidParameterError` naming the field."""
    s = settings
    if isinstance(s.max_new_tokens, bool) or not isinstance(s.max_new_tokens, int) or s.max_new_tokens < 1:
        raise InvalidParameterError(f"max_new_tokens must be an integer >= 1, got {s.max_new_tokens!r}")
    if not _is_number(s.temperature) or not math.isfinite(s.temperature) or s.temperature < 0:
        raise InvalidParameterError(f"temperature must be a finite number >= 0 (0 = greedy), got {s.temperature!r}")
    if not _is_number(s.top_p) or not 0 < s.top_p <= 1:
        raise InvalidParameterError(f"top_p must be in (0, 1], got {s.top_p!r}")
    if isinstance(s.seed, bool) or not isinstance(s.seed, int):
        raise InvalidParameterError(f"seed must be an integer, got {s.seed!r}")
    if s.method not in METHODS:
        raise InvalidParameterError(f"method must be one of {', '.join(METHODS)}, got {s.method!r}")
    _check_tree_spec(s.tree)
    for name in ("copies", "trace"):
        if not isinstance(getattr(s, name), bool):
            raise InvalidParameterError(f"{name} must be true or false, got {getattr(s, name)!r}")
    if s.confidence is not None and (not _is_number(s.confidence) or not 0.0 <= s.confidence <= 1.0):
        raise InvalidParameterError(f"confidence must be a number in [0, 1] (0 = the whole tree), got {s.confidence!r}")
    return dataclasses.replace(
        s, temperature=float(s.temperature), top_p=float(s.top_p), logprobs=check_logprobs(s.logprobs),
        confidence=None if s.confidence is None else float(s.confidence),
        prediction=_token_tuple(s.prediction, "prediction") or None if s.prediction is not None else None,
        stop_token_ids=None if s.stop_token_ids is None else frozenset(_token_tuple(s.stop_token_ids, "stop_token_ids")))


def _check_tree_spec(spec) -> None:
    if spec is None or isinstance(spec, Tree) or (isinstance(spec, str) and spec == AUTO):
        return
    if isinstance(spec, TreeSize):
        for name in ("size", "depth"):
            value = getattr(spec, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParameterError(f"tree {name} must be an integer >= 1, got {value!r}")
        return
    raise InvalidParameterError(f"tree must be an engine.Tree, a TreeSize, 'auto' or None, got {spec!r}")


def _token_tuple(ids, name: str) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__") or \
            any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise InvalidParameterError(f"{name} must be a list of token ids, got {ids!r}")
    return tuple(ids)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ----- the one tree decision ----------------------------------------------------------------------
class Planner(Protocol):
    """What :func:`decide_tree` asks (:class:`engine.tuning.planner.TreePlanner`); ``evidence``:
    a conversation's own :class:`RankCounts` (None: the calibration alone)."""

    def acceptance(self, temperature: float, top_p: float, evidence: RankCounts | None = None) -> PricedBy: ...

    def sized_tree(self, size: int, depth: int, temperature: float, top_p: float,
                   evidence: RankCounts | None = None) -> Tree: ...

    def choose(self, temperature: float, top_p: float, method: str, evidence: RankCounts | None = None) -> Any | None: ...


DEFAULT_SIZE = TreeSize(8, 4)  # "auto" where the pair has no hardware profile: the app's manual default


@dataclass(frozen=True)
class TreeDecision:
    """The tree an answer decodes with (``ROOT_ONLY``: the target alone), the method that verifies
    it, and, for the optimizer's pick, its :class:`engine.tuning.optimizer.TreeChoice`
    (``choice``: expected tokens a step, predicted speed-up). ``confidence``: the growth threshold
    the steps use."""

    tree: Tree
    method: str
    choice: Any | None = None
    confidence: float = 0.0
    priced_by: PricedBy | None = None  # the acceptance that shaped and priced the tree (None: no planner asked)

    @property
    def auto(self) -> bool:
        """Whether the optimizer picked the tree (its choice drives the draft gate)."""
        return self.choice is not None

    @property
    def drafts(self) -> bool:
        return self.tree.depth > 0


def decide_tree(settings: DecodeSettings, planner: Planner | None, evidence: RankCounts | None = None) -> TreeDecision:
    """The tree ``settings`` decode with. ``None`` and ``autoregressive`` (or size 1, but for
    ``chain``): the target alone. A ``Tree``: itself (``chain`` needs a chain). A
    :class:`TreeSize`: a chain of its depth for ``chain``, else the planner's DP tree with the
    depth capped at ``size - 1``. ``"auto"``: the planner's pick for this temperature, top-p and
    method; a planner without a hardware profile gives :data:`DEFAULT_SIZE` instead. ``evidence``:
    a conversation's own acceptance counts, which shape a size's or ``"auto"``'s tree for greedy
    answers only (their output is the target's whatever the tree; a sampled answer's draws depend
    on its tree, so it follows nothing but its settings). :class:`InvalidParameterError` when a
    spec needs a planner and there is none."""
    spec, method = settings.tree, settings.method
    evidence = evidence if evidence and settings.greedy else None
    confidence = settings.confidence or 0.0
    if spec is None or method == "autoregressive":
        return TreeDecision(ROOT_ONLY, method, confidence=confidence)
    choice = None
    if isinstance(spec, str):
        _need(planner, "tree='auto'")
        choice = planner.choose(settings.temperature, settings.top_p, method, evidence)
        if choice is None:
            spec = DEFAULT_SIZE
        else:
            tree = choice.tree
            confidence = choice.confidence if settings.confidence is None else settings.confidence
    if isinstance(spec, TreeSize):
        if method == "chain":
            tree = Tree.chain(spec.depth)
        elif spec.size == 1:
            tree = ROOT_ONLY
        else:
            _need(planner, f"tree=TreeSize({spec.size}, {spec.depth})")
            tree = planner.sized_tree(spec.size, min(spec.depth, spec.size - 1), settings.temperature, settings.top_p,
                                      evidence)
    elif isinstance(spec, Tree):
        tree = spec
    if method == "chain" and tree.size != tree.depth + 1:
        raise InvalidParameterError("method 'chain' needs a chain tree: use Tree.chain(depth)")
    priced = planner.acceptance(settings.temperature, settings.top_p, evidence) if planner is not None else None
    return TreeDecision(tree, method, choice, confidence, priced)


def _need(planner: Planner | None, what: str) -> None:
    if planner is None:
        raise InvalidParameterError(
            f"{what} needs the pair's calibration: build the engine with "
            f"planner=engine.tuning.planner.TreePlanner(pair), or pass tree=engine.Tree(...) or tree=None")
