"""Hardware profile: target latency t_T(n) for n tree tokens and draft latency t_D(w) per level width.

``python -m engine.cli.profile`` measures both for a pair after a realistic prefix and caches the
result per (device, pair, dtype) as JSON in the user cache.
"""
from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
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

    def target_time(self, n: int) -> float:
        return _interpolate(self.target, n)

    def token_time(self) -> float:
        """Seconds per token of the target alone as the engine decodes: ``t_T(1)`` + the step overhead."""
        return self.target_time(1) + self.step_overhead

    def draft_time(self, width: int) -> float:
        return _interpolate(self.draft, width) if self.draft else 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "HardwareProfile":
        raw = json.loads(text)
        raw["target"] = {int(k): float(v) for k, v in raw["target"].items()}
        raw["draft"] = {int(k): float(v) for k, v in raw["draft"].items()}
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
                    repeats: int = 3, progress: bool = True, runners: dict | None = None) -> HardwareProfile:
    """Profile ``target`` at each size and ``draft`` at each width; ``runners`` maps "target" /
    "draft" to the runner to time (default: see :func:`measure_forward`).

    The sizes are timed round-robin, ``repeats`` rounds, and each keeps its median: a slow
    spell of a shared machine then lands on every size alike instead of on a few (timed one
    size after another, a lucky spell once put n = 4 at 60% of n = 1). Curves are kept as
    measured, not forced to grow with n: oneDNN's one-row kernel really is slower than its
    four-row one here."""
    from tqdm.auto import tqdm

    from engine.kernels.build import kernel_digest

    device = next(target.parameters()).device
    profile = HardwareProfile(device=device_name(device), pair=pair, dtype=str(target.dtype).removeprefix("torch."),
                              prefix_len=len(prefix), kernels=kernel_digest() if device.type == "cpu" else "")
    jobs = [("target", n) for n in sizes] + ([("draft", w) for w in widths] if draft is not None else [])
    readings: dict[tuple[str, int], list[float]] = {job: [] for job in jobs}
    prefilled = runners is None and device.type == "cpu"  # one runner a model, the prefix read once
    if prefilled:
        runners = {kind: make_runner(model, static=False, max_len=len(prefix) + max(sizes + widths), cuda_graphs=False)
                   for kind, model in (("target", target), ("draft", draft)) if model is not None}
        with torch.inference_mode():
            for runner in runners.values():
                runner.forward(prefix, start=0, logits_to_keep=1)
    with tqdm(total=len(jobs) * repeats, desc="profiling", disable=not progress) as bar:
        for _ in range(repeats):
            for kind, n in jobs:
                model = target if kind == "target" else draft
                readings[kind, n].append(measure_forward(model, prefix, n, 1, (runners or {}).get(kind),
                                                         draft_level=kind == "draft", prefilled=prefilled))
                bar.update()
    for (kind, n), times in readings.items():
        getattr(profile, kind)[n] = statistics.median(times)
    return profile


QUICK_SIZES, QUICK_WIDTHS = [1, 2, 4, 8, 16], [1, 2, 4]  # what a first start measures (the CPU's best trees are small)


def quick_profile(target, draft, tokenizer, pair: str, repeats: int = 3, prefix_len: int = 128) -> HardwareProfile:
    """This machine's profile of the pair in about a minute on 2 CPU cores: what the app measures in
    the background on a first start (``python -m engine.cli.profile`` measures more sizes)."""
    prefix, chat = profile_prompts(tokenizer, prefix_len)
    profile = measure_profile(target, draft, prefix, QUICK_SIZES, QUICK_WIDTHS, pair, repeats, progress=False)
    profile.step_overhead = measure_step_overhead(target, draft, chat, profile.target_time(1))
    return profile


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
