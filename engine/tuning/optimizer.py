"""Sequoia's hardware-aware optimizer: pick the tree size and depth that maximise predicted speedup.

    S(n, d) = G(n, d) * (t_T(1) + o) / ( t_T(n) + draft cost of the tree + o )

The draft cost charges one draft forward per tree level that has children (the first one also
feeds the catch-up tokens) at the measured latency for that level's width; ``o`` is the profile's
step overhead, which every step pays, the target alone's included.

Where a draft level costs much (a CPU, where it is a third of a target token) a fixed tree must
be shallow; growing a chain only while the draft is sure of it may pay where it goes deeper. With
the calibration's (q, accepted) samples the optimizer also weighs chains grown while the draft's
path confidence reaches a threshold (:func:`grown_chain`), and keeps whichever is predicted fastest.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from engine.core.acceptance_evidence import PRIOR_SAMPLES
from engine.core.copy_policy import step_cost
from engine.trees import dp
from engine.trees.tree import Tree
from engine.tuning.acceptance import nearest_calibration, nearest_setting
from engine.tuning.profile import HardwareProfile

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TreeChoice:
    """The optimizer's pick and what it predicts."""

    tree: Tree
    size: int
    depth: int
    expected_tokens: float      # G(n, d): tokens per step
    step_time_s: float          # predicted seconds per step
    predicted_speedup: float    # over target-only decoding
    confidence: float = 0.0     # grow below a node only while the draft's q along its path reaches this


def candidate_sizes(max_size: int) -> list[int]:
    """Every size up to 16, then about 8 per octave (the table is exact; trees are rebuilt only here)."""
    sizes = list(range(1, min(max_size, 16) + 1))
    n = 16
    while n < max_size:
        n = min(max_size, int(n * 1.25) + 1)
        sizes.append(n)
    return sizes


def predict(tree: Tree, acceptance, profile: HardwareProfile) -> TreeChoice:
    tokens = tree.expected_tokens(acceptance)
    step = step_cost(tree, tree.size, profile)
    return TreeChoice(tree, tree.size, tree.depth, tokens, step, tokens * profile.token_time() / step)


GROWTH_THRESHOLDS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
MAX_GROWN_DEPTH = 8


def grown_chain(samples, depth: int, threshold: float, profile: HardwareProfile) -> TreeChoice:
    """A chain of up to ``depth`` draft tokens grown one more level while the draft's path confidence
    (the product of its q along the chain) reaches ``threshold``, as the engine's ``confidence``.

    ``samples``: (q of the drafted token, accepted 0/1) at successive positions of real answers,
    in order (:class:`engine.tuning.calibrate.Acceptance`'s ``confidence``). The policy is replayed
    over them as over text: a step at sample i drafts while q_i q_i+1 ... reaches the threshold,
    accepts the leading accepted ones and moves on past them and the bonus token, so runs of sure
    positions count as they come (a level drawn after a rejection is taken at the next sample's q:
    the step is charged for it either way).
    Mean tokens and step time (drafted levels at t_D, the first with the catch-up token; t_T of
    the rows; the overhead) as :func:`predict`'s."""
    q = [float(sample[0]) for sample in samples]
    accepted = [bool(sample[1]) for sample in samples]
    position = steps = tokens = 0
    seconds = 0.0
    while position < len(q):
        levels, path = 1, q[position]
        while levels < depth and position + levels < len(q) and path >= threshold:
            path *= q[position + levels]
            levels += 1
        taken = 0
        while taken < levels and position + taken < len(q) and accepted[position + taken]:
            taken += 1
        seconds += profile.draft_time(2) + (levels - 1) * profile.draft_time(1) + profile.target_time(levels + 1)
        tokens, steps, position = tokens + taken + 1, steps + 1, position + taken + 1
    expected, step_s = tokens / steps, seconds / steps + profile.step_overhead
    return TreeChoice(Tree.chain(depth), depth + 1, depth, expected, step_s,
                      expected * profile.token_time() / step_s, confidence=threshold)


@dataclass(frozen=True)
class Followed:
    """A conversation's own (q, kept) samples (:class:`engine.core.acceptance_evidence.RankCounts`)
    that grown chains are priced by beside the calibration's, which weighs as ``weight`` of them;
    ``calibrated``: the calibration's vector (the one its samples are scaled to)."""

    samples: tuple
    weight: float
    calibrated: tuple


def choose_tree(acceptance, profile: HardwareProfile, max_size: int | None = None,
                max_depth: int = 16, chains_only: bool = False, confidence=None,
                followed: Followed | None = None) -> TreeChoice:
    """The (n, d) maximising predicted speedup, with its DP tree (a chain of d = n - 1 when
    ``chains_only``, for methods that verify chains only). ``n = 1`` (no drafting) always competes,
    and with ``confidence`` samples (:func:`grown_chain`) so do chains grown by confidence
    (:func:`price_grown`; ``followed``: a conversation's samples beside them)."""
    max_size = max_size or max(profile.target)
    best = _best_fixed_tree(acceptance, profile, max_size, max_depth, chains_only)
    if not confidence or max_depth < 2 or max_size < 3:
        return best
    scale = growth_scale(followed.calibrated if followed is not None else acceptance, confidence, profile)
    for depth in range(2, min(max_depth, max_size - 1, MAX_GROWN_DEPTH) + 1):
        for threshold in GROWTH_THRESHOLDS:
            choice = price_grown(confidence, depth, threshold, profile, scale, followed)
            if choice.predicted_speedup > best.predicted_speedup:
                best = choice
    return best


def growth_scale(acceptance, confidence, profile: HardwareProfile) -> float:
    """The vector ``acceptance``'s one-token chain over the ``confidence`` samples' own: what growth's
    tokens are scaled by, so that grown and fixed trees are judged on the same acceptance."""
    return (predict(Tree.chain(1), acceptance, profile).expected_tokens
            / grown_chain(confidence, 1, 1.0, profile).expected_tokens)


def price_grown(confidence, depth: int, threshold: float, profile: HardwareProfile, scale: float,
                followed: Followed | None = None) -> TreeChoice:
    """A chain grown by confidence (:func:`grown_chain`) over the calibration's samples, its tokens
    times ``scale`` (:func:`growth_scale` of the calibration's vector); with ``followed``, blended
    with the same chain over the conversation's samples (these need no scale: they are the
    conversation's acceptance), the calibration's weighing as ``followed.weight`` samples."""
    choice = grown_chain(confidence, depth, threshold, profile)
    tokens, seconds = choice.expected_tokens * scale, choice.step_time_s
    if followed is not None and followed.samples:
        own, n, w = grown_chain(followed.samples, depth, threshold, profile), len(followed.samples), followed.weight
        tokens = (w * tokens + n * own.expected_tokens) / (w + n)
        seconds = (w * seconds + n * own.step_time_s) / (w + n)
    return dataclasses.replace(choice, expected_tokens=tokens, step_time_s=seconds,
                               predicted_speedup=tokens * profile.token_time() / seconds)


def _best_fixed_tree(acceptance, profile: HardwareProfile, max_size: int, max_depth: int,
                     chains_only: bool) -> TreeChoice:
    best = predict(Tree.chain(0), acceptance, profile)
    if chains_only:
        for d in range(1, min(max_depth, max_size - 1) + 1):
            choice = predict(Tree.chain(d), acceptance, profile)
            if choice.predicted_speedup > best.predicted_speedup:
                best = choice
        return best
    table = dp.solve(acceptance, max_size, max_depth)
    for n in candidate_sizes(max_size)[1:]:
        for d in range(1, min(max_depth, n - 1) + 1):
            value = float(table.best[n, d + 1])
            if value == float("-inf"):
                continue
            # cheap bound first: even with a free draft this (n, d) cannot win
            if value * profile.token_time() / (profile.target_time(n) + profile.step_overhead) <= best.predicted_speedup:
                continue
            choice = predict(Tree.from_parents(dp.optimal_parents(table, n, d)), acceptance, profile)
            if choice.predicted_speedup > best.predicted_speedup:
                best = choice
    return best


@dataclass
class AutoTuner:
    """What ``tree="auto"`` needs: a hardware profile and calibrated acceptance vectors.

    ``acceptance`` maps (temperature, top_p) to a vector; the nearest calibrated setting is used
    (:func:`engine.tuning.acceptance.nearest_setting`). ``confidence`` maps settings to the
    calibration's (q, accepted) samples, where measured: there chains grown by confidence compete.
    Choices are memoised per setting and constraint.
    """

    profile: HardwareProfile
    acceptance: dict[tuple[float, float], list[float]]
    max_size: int | None = None
    max_depth: int = 16
    pair: str = ""
    confidence: dict[tuple[float, float], list] = field(default_factory=dict)
    # where the profile was measured, as the UI says it: "this machine", or a bundled or nearest
    # profile of another machine (see load_tuner)
    origin: str = "this machine"

    @property
    def measured_here(self) -> bool:
        return self.origin == "this machine"

    @property
    def profile_words(self) -> str:
        """Whose profile it is, as a sentence names it: "the profile this machine stored", "the bundled, measured on …"."""
        return "the profile this machine stored" if self.measured_here else f"the {self.origin}"

    def __post_init__(self) -> None:
        if not self.acceptance:
            raise ValueError("AutoTuner needs at least one calibrated acceptance vector")
        self._chosen: dict[tuple[float, float, bool, bool], TreeChoice] = {}

    def calibration(self, temperature: float, top_p: float):
        """The :class:`engine.tuning.acceptance.Calibration` the optimizer uses at this setting."""
        return nearest_calibration(self.acceptance, temperature, top_p, self.pair)

    def choose(self, temperature: float, top_p: float, method: str = "sequoia", grown: bool = True) -> TreeChoice:
        """The best tree for this setting that ``method`` can verify (a chain for ``chain``);
        ``grown=False``: the best fixed tree, without growth by confidence."""
        key = (*nearest_setting(self.acceptance, temperature, top_p), method == "chain", grown)
        if key not in self._chosen:
            self._chosen[key] = choose_tree(self.acceptance[key[:2]], self.profile, self.max_size, self.max_depth,
                                            chains_only=key[2],
                                            confidence=self.confidence.get(key[:2]) if grown else None)
        return self._chosen[key]

    def choose_for(self, vector, temperature: float, top_p: float, method: str = "sequoia",
                   samples: tuple = ()) -> TreeChoice:
        """:meth:`choose` for a conversation: its acceptance ``vector`` in place of the setting's
        calibration, and its (q, kept) ``samples`` beside the calibration's for grown chains. Not memoised."""
        key = nearest_setting(self.acceptance, temperature, top_p)
        return choose_tree(list(vector), self.profile, self.max_size, self.max_depth, chains_only=method == "chain",
                           confidence=self.confidence.get(key), followed=self._followed(key, samples))

    def reprice(self, choice: TreeChoice, vector, temperature: float, top_p: float, samples: tuple = ()) -> TreeChoice:
        """``choice`` (a pick of :meth:`choose`) priced for a conversation, as :meth:`choose_for` prices trees."""
        if choice.confidence <= 0:
            return predict(choice.tree, list(vector), self.profile)
        key = nearest_setting(self.acceptance, temperature, top_p)
        scale = growth_scale(self.acceptance[key], self.confidence[key], self.profile)
        return price_grown(self.confidence[key], choice.depth, choice.confidence, self.profile, scale,
                           self._followed(key, samples))

    def _followed(self, key, samples: tuple) -> Followed:
        return Followed(tuple(samples), PRIOR_SAMPLES, tuple(self.acceptance[key]))


def load_tuner(pair: str, target, cache: Path | None = None, nearest: bool = True):
    """An :class:`engine.tuning.optimizer.AutoTuner` for ``pair`` ("target+draft" as the engine CLIs name
    it) from a hardware profile for this device/dtype and at least one acceptance vector, as
    written by ``python -m engine.cli.profile`` and ``python -m engine.cli.calibrate``. The user cache is
    searched first (a profile there was measured on this machine: ``origin`` "this machine"), then
    the measurements bundled in ``assets/`` for the embedded pair. With ``nearest``, a device no
    profile names exactly (another thread count, another ISA) gets the nearest profile of the pair,
    its ``origin`` saying whose it is, until this machine is measured
    (:func:`engine.tuning.profile.quick_profile`). None without an acceptance vector or any profile."""
    from engine.user_cache import cache_dir
    from engine.models.prompts import ASSETS

    directories = (cache or cache_dir(), ASSETS)
    for directory in directories:
        tuner = _tuner_from(directory, pair, target)
        if tuner is not None:
            tuner.origin = "this machine" if directory != ASSETS else f"bundled, measured on {tuner.profile.device}"
            return tuner
    if nearest:
        for path in _nearest_profiles(directories, pair, target):
            tuner = _tuner_from(path.parent.parent, pair, target, path)
            if tuner is not None:
                tuner.origin = f"nearest bundled profile, measured on {tuner.profile.device}"
                return tuner
    return None


def _nearest_profiles(directories, pair: str, target) -> list[Path]:
    """The profiles of ``pair`` (any device of this kind, this dtype), the closest to this device
    first: the same architecture and vector ISA first, then the nearest thread count."""
    from engine.tuning.calibrate import safe_name
    from engine.tuning.profile import device_name

    param = next(target.parameters())
    here = device_name(param.device)
    suffix = f"__{safe_name(pair)}__{str(param.dtype).removeprefix('torch.')}.json"

    def kind_and_threads(device: str) -> tuple[str, int | None]:
        match = re.fullmatch(r"(.*)-(\d+)threads", device)
        return (match[1], int(match[2])) if match else (device, None)

    here_kind, here_threads = kind_and_threads(here)

    def distance(path: Path) -> tuple:
        kind, threads = kind_and_threads(path.name[: -len(suffix)])
        gap = abs(threads - here_threads) if threads is not None and here_threads is not None else 1 << 20
        return (kind != here_kind, gap, path.name)

    found = [p for d in directories for p in (Path(d) / "profiles").glob(f"*{suffix}")
             if p.name.split("-")[0] == here.split("-")[0]]  # a CPU's for a CPU, a GPU's for a GPU
    return sorted(found, key=distance)


def _tuner_from(directory: Path, pair: str, target, path: Path | None = None):
    from engine.kernels.build import kernel_digest
    from engine.tuning.calibrate import acceptance_vectors, find_calibrations
    from engine.tuning.profile import device_name, profile_path

    param = next(target.parameters())
    dtype = str(param.dtype).removeprefix("torch.")
    path = path or profile_path(directory / "profiles", device_name(param.device), pair, dtype)
    from engine.models.prompts import ASSETS

    # this folder's calibrations, then the bundled ones: a profile measured here needs no calibration of its own
    calibrations = find_calibrations(pair, [directory / "acceptance", ASSETS / "acceptance"])  # each read once
    if not path.exists() or not calibrations:
        return None
    acceptance = acceptance_vectors(calibrations)
    confidence = {setting: measured.confidence for setting, measured in calibrations.items() if measured.confidence}
    try:
        profile = HardwareProfile.from_json(path.read_text())
    except (OSError, ValueError, TypeError, KeyError, json.JSONDecodeError) as exc:
        log.warning("ignoring the hardware profile %s: %s", path, exc)
        return None
    if directory != ASSETS and param.device.type == "cpu" and profile.kernels != kernel_digest():
        log.info("the hardware profile %s was measured with other kernels: this machine is measured again", path)
        return None
    return AutoTuner(profile, acceptance, pair=pair, confidence=confidence)
