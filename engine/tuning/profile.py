"""Hardware profile: target latency t_T(n) for n tree tokens and draft latency t_D(w) per level width.

``python -m engine.cli.profile`` measures both for a pair after a realistic prefix and caches the
result per (device, pair, dtype) as JSON in the user cache. The app measures this machine on a
first start with :class:`QuickProfiler`, a slice at a time between answers, and keeps the profile
only when :func:`refusals` finds nothing wrong with it (its repeats agree, its curves grow with n
beyond noise, its target alone agrees with the launch's own measurement).
"""
from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from collections.abc import Callable
from pathlib import Path

import torch

from engine.core.runner import make_runner, synchronize
from engine.core.sampling import choose_level_children, logits_to_probs
from engine.trees.tree import Tree


@dataclass
class HardwareProfile:
    """Median forward latencies in seconds, keyed by the number of new tokens."""

    device: str
    pair: str
    dtype: str
    prefix_len: int
    target: dict[int, float] = field(default_factory=dict)  # n tree tokens -> seconds
    draft: dict[int, float] = field(default_factory=dict)   # level width -> seconds
    # seconds every decoding step costs beyond the forwards timed above: the engine's work around
    # them and attention over a real chat's context rather than the profile's prefix
    step_overhead: float = 0.0
    # the CPU kernels' sources it was measured with (engine.kernels.build.kernel_digest): a
    # profile of this machine measured with other kernels is measured again
    kernels: str = ""
    # when it was measured (UTC, ISO 8601; "" in profiles written before it was kept), how many
    # readings each point is the median of, and their spread: the interquartile range over the
    # median, per size / width
    measured_at: str = ""
    repeats: int = 0
    target_spread: dict[int, float] = field(default_factory=dict)
    draft_spread: dict[int, float] = field(default_factory=dict)
    # the medians as measured, where ``target`` / ``draft`` hold their monotone fit (empty: as measured)
    target_raw: dict[int, float] = field(default_factory=dict)
    draft_raw: dict[int, float] = field(default_factory=dict)

    def target_time(self, n: int) -> float:
        return _interpolate(self.target, n)

    def token_time(self) -> float:
        """Seconds per token of the target alone as the engine decodes: ``t_T(1)`` + the step overhead."""
        return self.target_time(1) + self.step_overhead

    def draft_time(self, width: int) -> float:
        return _interpolate(self.draft, width) if self.draft else 0.0

    def max_spread(self) -> float:
        """The widest spread of any size or width's repeats (0 where none was kept)."""
        return max([*self.target_spread.values(), *self.draft_spread.values()], default=0.0)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "HardwareProfile":
        """A profile as :meth:`to_json` wrote it, or as older versions did (the fields added since
        take their defaults; fields this version does not know are ignored)."""
        raw = json.loads(text)
        known = {f.name for f in fields(cls)}
        raw = {k: v for k, v in raw.items() if k in known}
        for name in ("target", "draft", "target_spread", "draft_spread", "target_raw", "draft_raw"):
            if name in raw:
                raw[name] = {int(k): float(v) for k, v in raw[name].items()}
        return cls(**raw)


def _interpolate(points: dict[int, float], x: int) -> float:
    """Piecewise-linear in x through the measured points; linear extrapolation past the ends."""
    xs = sorted(points)
    if x in points:
        return points[x]
    if len(xs) == 1:
        return points[xs[0]] * max(x, 1) / xs[0]
    lo, hi = (xs[0], xs[1]) if x < xs[0] else (xs[-2], xs[-1]) if x > xs[-1] else \
        next((a, b) for a, b in zip(xs, xs[1:]) if a <= x <= b)
    slope = (points[hi] - points[lo]) / (hi - lo)
    return max(points[lo] + slope * (x - lo), 1e-9)


def measure_forward(model, prefix: list[int], n: int, repeats: int = 3, runner=None,
                    draft_level: bool = False, prefilled: bool = False) -> float:
    """Median seconds of one forward over ``n`` tree tokens (a chain mask) after ``prefix``.

    ``runner`` (an :mod:`engine.core.runner` runner of ``model``) is what the engine would use; by
    default a static runner with CUDA graphs on CUDA and a dynamic one on CPU. ``draft_level``
    adds what the engine does with a draft level's logits (probabilities, each row's top
    children and their q, read back to the host): on a GPU that costs as much as the forward.
    ``prefilled``: ``runner`` already holds exactly ``prefix`` (it is left so again).
    """
    if runner is None:
        on_cuda = next(model.parameters()).device.type == "cuda"
        runner = make_runner(model, static=on_cuda, max_len=len(prefix) + n, cuda_graphs=on_cuda)
    device = runner.device
    tree = Tree.chain(n - 1)
    positions = tree.position_ids(len(prefix))
    ids = torch.randint(0, min(1000, model.config.vocab_size), (n,)).tolist()
    with torch.inference_mode():
        if not prefilled:
            runner.reset()
            runner.forward(prefix, start=0, logits_to_keep=1)
        times = []
        for _ in range(repeats + 1):  # the first run warms up (and captures a graph)
            synchronize(device)
            start = time.perf_counter()
            logits = runner.forward(ids, start=len(prefix), tail=tree.ancestor_matrix, positions=positions)
            if draft_level:
                _level_bookkeeping(logits)
            synchronize(device)
            times.append(time.perf_counter() - start)
            runner.compact(len(prefix), [])
    return statistics.median(times[1:])


def _level_bookkeeping(logits: torch.Tensor) -> None:
    """The engine's work on one draft level's logits ``[w, V]``, as in ``_draft_tree`` (greedy)."""
    probs = logits_to_probs(logits, 0.0, 1.0)
    rows = list(range(probs.shape[0]))
    children = choose_level_children(probs, rows, [2] * len(rows), "sequoia", True)
    probs[rows, [c[0] for c in children]].tolist()


def measure_profile(target, draft, prefix: list[int], sizes: list[int], widths: list[int], pair: str,
                    repeats: int = 3, progress: bool = True) -> HardwareProfile:
    """Profile ``target`` at each size and ``draft`` at each width (each forward timed by
    :func:`measure_forward`).

    The sizes are timed round-robin, ``repeats`` rounds, and each keeps its median and the spread
    of its readings: a slow spell of a shared machine then lands on every size alike instead of
    on a few (timed one size after another, a lucky spell once put n = 4 at 60% of n = 1). Curves
    are kept as measured here, not forced to grow with n (:func:`fit_monotone` does that, for the
    app's profile): oneDNN's one-row kernel really is slower than its four-row one on some CPUs."""
    from tqdm.auto import tqdm

    rounds = _Rounds(target, draft, prefix, sizes, widths, pair)
    with tqdm(total=len(rounds.jobs) * repeats, desc="profiling", disable=not progress) as bar:
        for _ in range(repeats):
            rounds.measure_round(bar.update)
    return rounds.profile()


class _Rounds:
    """The readings of :func:`measure_profile`, one round over every size and width at a time."""

    def __init__(self, target, draft, prefix, sizes, widths, pair, runners=None, forward=None) -> None:
        from engine.kernels.build import kernel_digest

        device = next(target.parameters()).device
        self.base = HardwareProfile(device=device_name(device), pair=pair, dtype=str(target.dtype).removeprefix("torch."),
                                    prefix_len=len(prefix), kernels=kernel_digest() if device.type == "cpu" else "")
        self.models, self.prefix, self.forward = {"target": target, "draft": draft}, prefix, forward
        self.jobs = [("target", n) for n in sizes] + ([("draft", w) for w in widths] if draft is not None else [])
        self.readings: dict[tuple[str, int], list[float]] = {job: [] for job in self.jobs}
        self.prefilled = runners is None and device.type == "cpu"  # one runner a model, the prefix read once
        if self.prefilled:
            runners = {kind: make_runner(model, static=False, max_len=len(prefix) + max(sizes + widths), cuda_graphs=False)
                       for kind, model in self.models.items() if model is not None}
            with torch.inference_mode():
                for runner in runners.values():
                    runner.forward(prefix, start=0, logits_to_keep=1)
        self.runners = runners or {}

    def measure_round(self, after_each: Callable[[], object] = lambda: None) -> None:
        forward = self.forward or measure_forward
        for kind, n in self.jobs:
            self.readings[kind, n].append(forward(self.models[kind], self.prefix, n, 1, self.runners.get(kind),
                                                  draft_level=kind == "draft", prefilled=self.prefilled))
            after_each()

    def profile(self) -> HardwareProfile:
        profile = HardwareProfile(**{f.name: getattr(self.base, f.name) for f in fields(HardwareProfile)
                                     if f.name not in ("target", "draft", "target_spread", "draft_spread",
                                                       "target_raw", "draft_raw")})
        for (kind, n), times in self.readings.items():
            if times:
                getattr(profile, kind)[n] = statistics.median(times)
                getattr(profile, f"{kind}_spread")[n] = spread(times)
        profile.repeats = min((len(t) for t in self.readings.values()), default=0)
        profile.measured_at = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return profile


def spread(times: list[float]) -> float:
    """How much repeated readings of one forward disagree: their interquartile range over their
    median (0 for fewer than 2). Three readings a, b, c (sorted): (c - a) / 2b."""
    if len(times) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    middle = statistics.median(times)
    return (q3 - q1) / middle if middle > 0 else 0.0


def fit_monotone(points: dict[int, float]) -> dict[int, float]:
    """The closest curve (least squares) through ``points`` that never decreases with n:
    pool-adjacent-violators, each run of points that goes down replaced by its mean."""
    xs = sorted(points)
    blocks: list[list[float]] = []  # [sum, count] of each pooled run
    for x in xs:
        blocks.append([points[x], 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted = [total / count for total, count in blocks for _ in range(int(count))]
    return dict(zip(xs, fitted))


def monotone_profile(profile: HardwareProfile) -> HardwareProfile:
    """``profile`` with t_T(n) and t_D(w) fitted to never decrease (:func:`fit_monotone`), the
    medians as measured kept in ``target_raw`` / ``draft_raw``."""
    import dataclasses

    raw_target, raw_draft = profile.target_raw or dict(profile.target), profile.draft_raw or dict(profile.draft)
    return dataclasses.replace(profile, target=fit_monotone(raw_target), draft=fit_monotone(raw_draft),
                               target_raw=raw_target, draft_raw=raw_draft)


# What makes a measured profile untrustworthy (:func:`refusals`). Each reading's noise on these
# machines is a few percent in a quiet minute; a shared machine drifts by about ±20% over longer
# spells, which is why the cross-check's margin is wider than the repeats'.
SPREAD_LIMIT = 0.30      # a size's readings: interquartile range over the median
MONOTONE_SLACK = 0.15    # a smaller size's median may exceed a larger one's by this much (then fitted)
AGREEMENT = 0.15         # the profile's target alone against the launch's measured rate, either way
NOISE_FLOOR_S = 0.002    # differences below 2 ms are timer and scheduler noise whatever the ratio
# a slice of the app's measurement put off while the machine is busy (others_busy): how often it
# looks again, and for how long in all before it measures anyway (the checks above then judge)
QUIET_RETRY_S, QUIET_WAIT_S = 5.0, 60.0
QUIET_CORES = 0.35       # busy beyond this many cores (of the machine's others) is not quiet


def refusals(profile: HardwareProfile, reference_tokens_per_s: float | None = None) -> list[str]:
    """Why ``profile`` (as measured: its raw medians and spreads) should not be trusted, in words;
    empty when it should. Refused: a size or width whose repeats spread beyond
    :data:`SPREAD_LIMIT`; a curve that falls with n by more than :data:`MONOTONE_SLACK` (a slow
    spell on one size: smaller dips are fitted away); a target alone (``1 / (t_T(1) + step
    overhead)``) more than :data:`AGREEMENT` off ``reference_tokens_per_s``, the target-alone
    rate the launch measured. Differences under :data:`NOISE_FLOOR_S` never count."""
    reasons = []
    for name, kind in (("t_T", "target"), ("t_D", "draft")):
        medians = getattr(profile, f"{kind}_raw") or getattr(profile, kind)
        for n, share in sorted(getattr(profile, f"{kind}_spread").items()):
            if share > SPREAD_LIMIT and share * medians.get(n, 0.0) > NOISE_FLOOR_S:
                reasons.append(f"{name}({n}) varied {share:.0%} between repeats (limit {SPREAD_LIMIT:.0%})")
        xs = sorted(medians)
        for i, small in enumerate(xs):
            above = [big for big in xs[i + 1:] if medians[small] > medians[big] * (1 + MONOTONE_SLACK)
                     and medians[small] - medians[big] > NOISE_FLOOR_S]
            if above:
                reasons.append(f"{name}({small}) = {medians[small] * 1e3:.0f} ms above {name}({above[0]}) = "
                               f"{medians[above[0]] * 1e3:.0f} ms")
    disagreement = launch_disagreement(profile, reference_tokens_per_s)
    return reasons + ([disagreement] if disagreement else [])


def launch_disagreement(profile: HardwareProfile, reference_tokens_per_s: float | None) -> str:
    """How ``profile``'s target alone (``1 / (t_T(1) + step overhead)``) is more than
    :data:`AGREEMENT` off ``reference_tokens_per_s``, the rate the launch measured, in words; ""
    when it agrees (or there is nothing to compare)."""
    if not reference_tokens_per_s or not profile.target:
        return ""
    implied = 1.0 / profile.token_time()
    off = implied / reference_tokens_per_s - 1.0
    if abs(off) <= AGREEMENT or abs(1.0 / implied - 1.0 / reference_tokens_per_s) <= NOISE_FLOOR_S:
        return ""
    return (f"its target alone, {implied:.1f} tokens/s, is {off:+.0%} off the {reference_tokens_per_s:.1f} "
            f"measured at launch (limit ±{AGREEMENT:.0%})")


QUICK_SIZES, QUICK_WIDTHS = [1, 2, 4, 8, 16], [1, 2, 4]  # what a first start measures (the CPU's best trees are small)


def quick_profile(target, draft, tokenizer, pair: str, repeats: int = 3, prefix_len: int = 128) -> HardwareProfile:
    """This machine's profile of the pair in about a minute on 2 CPU cores: what the app measures in
    the background on a first start (``python -m engine.cli.profile`` measures more sizes), its
    curves fitted to grow with n (:func:`monotone_profile`). The app measures it a slice at a time
    (:class:`QuickProfiler`)."""
    profiler = QuickProfiler(target, draft, tokenizer, pair, repeats, prefix_len)
    while not profiler.done:
        profiler.measure_slice()
    return profiler.profile()


class QuickProfiler:
    """:func:`quick_profile` measured in short slices, so that a worker can serve the answers that
    arrive meanwhile between them: the first slice reads the prefix, each of the next ``repeats``
    times every size and width once (a round: a second or two on 2 cores), the last the step
    overhead. ``forward`` / ``overhead`` stand in for :func:`measure_forward` /
    :func:`measure_step_overhead` (tests: a fake clock); ``prompts``: ``(prefix, chat)`` instead of
    :func:`profile_prompts`'s."""

    def __init__(self, target, draft, tokenizer, pair: str, repeats: int = 3, prefix_len: int = 128, *,
                 clocks: tuple[Callable | None, Callable | None] = (None, None),
                 prompts: tuple[list[int], list[int]] | None = None) -> None:
        """``clocks``: what times one forward and the step overhead (default :func:`measure_forward`
        and :func:`measure_step_overhead`; tests pass fake clocks)."""
        self.target, self.draft, self.pair, self.repeats = target, draft, pair, repeats
        self.prefix, self.chat = prompts or profile_prompts(tokenizer, prefix_len)
        self.forward, self.overhead = clocks
        self.rounds: _Rounds | None = None
        self.rounds_done = 0
        self.step_overhead: float | None = None

    @property
    def done(self) -> bool:
        return self.step_overhead is not None

    @property
    def slices_left(self) -> int:
        return 0 if self.done else (self.rounds is None) + self.repeats - self.rounds_done + 1

    def measure_slice(self) -> None:
        """Measure the next slice (nothing once :attr:`done`)."""
        if self.done:
            return
        if self.rounds is None:
            self.rounds = _Rounds(self.target, self.draft, self.prefix, QUICK_SIZES, QUICK_WIDTHS, self.pair,
                                  forward=self.forward)
        elif self.rounds_done < self.repeats:
            self.rounds.measure_round()
            self.rounds_done += 1
        else:
            one = statistics.median(self.rounds.readings["target", 1])
            self.step_overhead = (self.overhead or measure_step_overhead)(self.target, self.draft, self.chat, one)
            self.rounds.runners = {}  # their caches are not needed any more

    def profile(self) -> HardwareProfile:
        """The profile measured (once :attr:`done`): the medians fitted to grow with n, as measured
        in ``*_raw``, with their spreads, the date and the step overhead."""
        profile = monotone_profile(self.rounds.profile())
        profile.step_overhead = self.step_overhead or 0.0
        return profile


def others_busy(window_s: float = 0.5) -> float:
    """Cores this machine kept busy over the next ``window_s`` seconds, apart from the calling
    thread (which sleeps meanwhile): other programs, a browser drawing, the web server's threads.
    0 where the machine's CPU times cannot be read."""
    before, start = _busy_seconds(), time.monotonic()
    time.sleep(window_s)
    after = _busy_seconds()
    if before is None or after is None:
        return 0.0
    return max(after - before, 0.0) / max(time.monotonic() - start, 1e-6)


def _busy_seconds() -> float | None:
    """Seconds all cores have spent busy since boot (psutil, else Linux's /proc/stat), or None."""
    try:
        import psutil

        t = psutil.cpu_times()
        return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0)
    except ImportError:
        pass
    try:
        import os

        ticks = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
        user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def profile_prompts(tokenizer, prefix_len: int) -> tuple[list[int], list[int]]:
    """``(prefix, chat)``: the bundled chat prompts' text as one ``prefix_len``-token prefix, and the
    first bundled chat prompt (for the step overhead)."""
    from engine.models.prompts import encode_chat, load_prompt_set

    prompts = load_prompt_set("chat")
    text = " ".join(m["content"] for p in prompts for m in p["messages"])
    prefix = (encode_chat(tokenizer, [{"role": "user", "content": text}]) * 4)[:prefix_len]
    return prefix, encode_chat(tokenizer, prompts[0]["messages"])


def measure_step_overhead(target, draft, prompt: list[int], forward_s: float, tokens: int = 24,
                          rounds: int = 3) -> float:
    """Seconds a decoding step of the engine costs beyond the target's one-token forward
    ``forward_s`` (the profile's ``t_T(1)``): the decode time per token of the target alone (greedy,
    ``tokens`` tokens after ``prompt``, the fastest of ``rounds`` answers after a warm-up) minus
    ``forward_s``, never below 0. Every step pays it, drafting or not, so it shrinks the share
    of a step the draft and the wider verification take."""
    from engine.core.speculative import SpeculativeEngine

    engine = SpeculativeEngine(target, draft)
    engine.generate(prompt, max_new_tokens=4, tree=None, copies=False)
    per_token = min(1.0 / engine.generate(prompt, max_new_tokens=tokens, tree=None, copies=False).tokens_per_second
                    for _ in range(rounds))
    return max(per_token - forward_s, 0.0)


def device_name(device: torch.device) -> str:
    """What a profile is measured on: the GPU's name, or the CPU's architecture, vector ISA and
    thread count (``cpu-x86_64-avx512vnni-2threads``). The ISA is part of it because machines of
    the same architecture differ several-fold here: the k-quant kernels take int8 dot products in
    one VNNI instruction where AVX2 needs three."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{platform.machine()}-{cpu_isa()}-{torch.get_num_threads()}threads"


def cpu_isa() -> str:
    """The widest integer vector ISA this CPU advertises that the kernels use: ``avx512vnni``,
    ``avx2`` or ``generic`` (also where the flags cannot be read); the narrower one the kernels are
    built for when ``$SEQUOIA_KERNEL_MARCH`` picks another path (``x86-64-v3``: ``avx2``)."""
    from engine.kernels.cpu import cpu_flags
    from engine.kernels.build import kernel_march

    march = kernel_march()
    if march != "native":
        return {"x86-64-v3": "avx2"}.get(march, "generic")
    flags = cpu_flags()
    if {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
        return "avx512vnni"
    return "avx2" if "avx2" in flags else "generic"


def profile_path(profile_dir: Path, device: str, pair: str, dtype: str) -> Path:
    from engine.tuning.calibrate import safe_name

    return profile_dir / f"{safe_name(f'{device}__{pair}__{dtype}')}.json"


def powers_of_two(limit: int) -> list[int]:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out
