"""This machine's limits behind the hardware profile: why S(n, d) is what it is.

A decoding step streams every weight of the model it runs once, whatever the number of rows: one
target forward cannot take less than ``target bytes / memory bandwidth`` (its *floor*). Each row
also costs ``2 · multiply-adds`` operations, so past a few rows the forward is bound by the
machine's arithmetic instead (its *compute roof*, measured here as an int8 matrix product, the
arithmetic the k-quant kernels run on). The roofline ``max(floor, 2·P·n / ops)`` is the least a
forward over n rows can cost; the profile's measured t_T(n) and t_D(w) sit above it.

- :func:`measure_machine`: the memory bandwidth and the int8 compute roof, in about a second;
  :func:`machine_limits` measures them once per process (kept in memory, never on disk).
- :func:`weight_bytes`, :func:`multiply_adds`: what a forward of a model streams and computes per row.
- :class:`Roofline`: the limits against a profile; :func:`what_if` re-runs the optimizer with the
  draft's cost or the target's size scaled; :func:`one_sentence` says why a bigger tree would not
  pay here and what would make it pay.

No model runs here; the engine's forwards are timed by :mod:`engine.tuning.profile`.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache

import torch

from engine.tuning import explain
from engine.tuning.optimizer import TreeChoice, choose_tree
from engine.tuning.profile import HardwareProfile

STREAM_BYTES = 512 << 20      # the tensor streamed for the bandwidth: far beyond any cache
INT8_SHAPE = (512, 2048, 2048)  # (rows, inner, columns) of the int8 product timed for the compute roof


@dataclass(frozen=True)
class MachineLimits:
    """The memory bandwidth (GB/s, streaming a large tensor) and the compute roof (10⁹ operations
    a second, a multiply-add counted as 2) at torch's thread count. ``compute``: what the roof was
    measured with: ``"int8"`` (torch's int8 matrix product) or ``"float32"`` where this torch has
    no int8 product on this device."""

    bandwidth_gbs: float
    int8_gops: float
    measured_at: str
    compute: str = "int8"
    threads: int = 0


def _best_seconds(work, repeats: int, budget_s: float) -> float:
    """The fastest of up to ``repeats`` runs of ``work()`` after one warm-up (fewer when they would
    exceed ``budget_s``): a limit is what the machine can do, and a busy spell only ever slows a run."""
    work()
    times: list[float] = []
    while len(times) < repeats and (len(times) < 2 or sum(times) < budget_s):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_bandwidth(budget_s: float = 1.0, nbytes: int = STREAM_BYTES) -> float:
    """GB/s reading a float32 tensor of ``nbytes`` (a sum: every byte read once, nothing written),
    the best of a few runs."""
    data = torch.ones(nbytes // 4, dtype=torch.float32)
    seconds = _best_seconds(data.sum, 7, budget_s)
    return data.nbytes / seconds / 1e9


def measure_compute(budget_s: float = 1.0, shape: tuple[int, int, int] = INT8_SHAPE) -> tuple[float, str]:
    """``(10⁹ operations/s, kind)`` of a compute-bound matrix product, the best of a few runs: int8
    (``torch._int_mm``) where this torch has it on the CPU, else float32."""
    rows, inner, columns = shape
    a = torch.randint(-100, 100, (rows, inner), dtype=torch.int8)
    b = torch.randint(-100, 100, (inner, columns), dtype=torch.int8)
    kind = "int8"
    try:
        torch._int_mm(a[:32], b[:, :32].contiguous())
        work = lambda: torch._int_mm(a, b)  # noqa: E731
    except (AttributeError, RuntimeError, NotImplementedError):
        kind, fa, fb = "float32", a.float(), b.float()
        work = lambda: fa @ fb  # noqa: E731
    seconds = _best_seconds(work, 7, budget_s)
    return 2.0 * rows * inner * columns / seconds / 1e9, kind


def measure_machine(seconds_budget: float = 3.0) -> MachineLimits:
    """This machine's :class:`MachineLimits` (a second or two; at most about ``seconds_budget``)."""
    with torch.inference_mode():
        bandwidth = measure_bandwidth(seconds_budget / 3)
        gops, kind = measure_compute(seconds_budget / 3)
    return MachineLimits(bandwidth, gops, datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), kind,
                         torch.get_num_threads())


_measured: dict[int, MachineLimits] = {}
_measuring = threading.Lock()


def machine_limits() -> MachineLimits:
    """:func:`measure_machine`, once per process and thread count (later calls return the first
    measurement). It runs on a thread that ends with it: its large torch ops would start an OpenMP
    team on the calling thread (a UI handler's, kept for the process's life), beside the engine
    thread's own; with more OpenMP threads than cores every decoding step then loses time
    (tests/test_openmp_teams.py)."""
    threads = torch.get_num_threads()
    with _measuring:
        if threads not in _measured:
            outcome: list = []
            thread = threading.Thread(target=lambda: outcome.append(measure_machine()), name="roofline")
            thread.start()
            thread.join()
            if not outcome:
                raise RuntimeError("measuring this machine's limits failed (see the log)")
            _measured[threads] = outcome[0]
        return _measured[threads]


# ----- what a forward streams and computes --------------------------------------------------------------
def _streamed_modules(model: torch.nn.Module):
    """The modules a forward reads in full: all but the input embedding (a forward reads only its
    tokens' rows) and, under a restricted draft head (one computing its ``part`` of a ``full`` head,
    :class:`engine.backends.draft_vocabulary.SubVocabularyHead`), the whole head it was cut from."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    stack = [model]
    while stack:
        module = stack.pop()
        if module is embedding:
            continue
        yield module
        children = dict(module.named_children())
        if "part" in children and "full" in children:
            del children["full"]
        stack.extend(children.values())


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one forward streams: every parameter and buffer of the modules it reads
    (packed int4 tiles and their scales, float weights, norms; a restricted draft head's own rows,
    not the whole head's), each tensor once however many modules share it; the input embedding aside."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for module in _streamed_modules(model):
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            if tensor is None:
                continue
            try:
                key = (tensor.untyped_storage().data_ptr(), tensor.nbytes)
            except (RuntimeError, NotImplementedError):  # a tensor without a plain storage
                key = (id(tensor), tensor.nbytes)
            if key not in seen:
                seen.add(key)
                total += tensor.nbytes
    return total


def multiply_adds(model: torch.nn.Module) -> int:
    """Multiply-adds per row of a forward: the matrices' inputs × outputs (every leaf module with
    ``in_features`` and ``out_features``: float and int4 linears, a restricted head's own rows);
    attention over the context aside."""
    return sum(int(m.in_features) * int(m.out_features) for m in _streamed_modules(model)
               if next(m.children(), None) is None and hasattr(m, "in_features") and hasattr(m, "out_features"))


# ----- the roofline against the profile ------------------------------------------------------------------
@dataclass(frozen=True)
class Roofline:
    """The machine's limits for one pair, against its measured profile (None: not measured).

    ``target_bytes`` / ``draft_bytes``: what one forward of each streams (:func:`weight_bytes`);
    ``target_macs`` / ``draft_macs``: its multiply-adds per row (:func:`multiply_adds`)."""

    limits: MachineLimits
    profile: HardwareProfile | None
    target_bytes: int
    draft_bytes: int
    target_macs: int
    draft_macs: int = 0

    @property
    def target_floor_s(self) -> float:
        """Seconds to stream the target's weights once at the measured bandwidth."""
        return self.target_bytes / (self.limits.bandwidth_gbs * 1e9)

    @property
    def draft_floor_s(self) -> float:
        """Seconds to stream the draft's weights once (a level of any small width)."""
        return self.draft_bytes / (self.limits.bandwidth_gbs * 1e9)

    def compute_s(self, n: int) -> float:
        """Seconds of arithmetic for ``n`` target rows at the compute roof."""
        return 2.0 * self.target_macs * n / (self.limits.int8_gops * 1e9)

    def roof(self, n: int) -> float:
        """The least a target forward over ``n`` rows can cost here: its floor or its arithmetic."""
        return max(self.target_floor_s, self.compute_s(n))

    def draft_roof(self, width: int) -> float:
        return max(self.draft_floor_s, 2.0 * self.draft_macs * width / (self.limits.int8_gops * 1e9))

    @property
    def compute_bound_from(self) -> int:
        """The fewest rows whose arithmetic takes longer than streaming the weights."""
        per_row = self.compute_s(1)
        return int(self.target_floor_s // per_row) + 1 if per_row > 0 else 1 << 30

    def measured_target(self) -> dict[int, float]:
        """The profile's t_T(n) (seconds per size), as the optimizer uses it; empty without a profile."""
        return dict(sorted(self.profile.target.items())) if self.profile is not None else {}

    def measured_draft(self) -> dict[int, float]:
        return dict(sorted(self.profile.draft.items())) if self.profile is not None else {}

    def scaled(self, draft_cost: float = 1.0, target_size: float = 1.0) -> "Roofline":
        """This roofline with a draft whose level costs ``draft_cost`` times as much (its weights
        too) and a target ``target_size`` times as large (its bytes, its arithmetic, its measured times)."""
        profile = None if self.profile is None else rescaled(self.profile, draft=draft_cost, target=target_size)
        return dataclasses.replace(self, profile=profile, target_bytes=round(self.target_bytes * target_size),
                                   target_macs=round(self.target_macs * target_size),
                                   draft_bytes=round(self.draft_bytes * draft_cost),
                                   draft_macs=round(self.draft_macs * draft_cost))


def roofline_of(limits: MachineLimits, profile: HardwareProfile | None, target: torch.nn.Module,
                draft: torch.nn.Module | None) -> Roofline:
    """The :class:`Roofline` of a loaded pair (``draft`` None: the target alone)."""
    return Roofline(limits, profile, weight_bytes(target), weight_bytes(draft) if draft is not None else 0,
                    multiply_adds(target), multiply_adds(draft) if draft is not None else 0)


def rescaled(profile: HardwareProfile, draft: float = 1.0, target: float = 1.0, compute: float = 1.0,
             bandwidth: float = 1.0) -> HardwareProfile:
    """``profile`` on another machine or pair, to first order: the draft's levels ``draft`` times as
    dear, the target ``target`` times as large, rows beyond the first ``compute`` times as cheap
    (t_T(n) - t_T(1) divided by it) and memory ``bandwidth`` times as fast (t_T(1) and t_D(w)
    divided by it). The step overhead is kept."""
    one = profile.target_time(1)
    verify = {n: target * (one / bandwidth + max(t - one, 0.0) / compute) for n, t in profile.target.items()}
    levels = {w: draft * t / bandwidth for w, t in profile.draft.items()}
    return dataclasses.replace(profile, target=verify, draft=levels, target_raw={}, draft_raw={},
                               target_spread={}, draft_spread={})


# ----- what if ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WhatIf:
    """The optimizer re-run on a scaled roofline: its ``pick`` and the S(n, d) ``tables``, and how it was asked."""

    roofline: Roofline
    vector: tuple[float, ...]
    pick: TreeChoice
    tables: explain.Tables
    grid: tuple[int, int] = (64, 16)   # (max tree size, max depth)
    chains_only: bool = False
    confidence: tuple | None = None    # the calibration's (q, accepted) samples, where chains grown by confidence compete


def what_if(roofline: Roofline, vector, draft_cost_scale: float = 1.0, target_scale: float = 1.0,
            grid: tuple[int, int] = (64, 16), chains_only: bool = False, confidence=None) -> WhatIf:
    """The optimizer's pick and S(n, d) with every draft level ``draft_cost_scale`` times as dear and
    the target ``target_scale`` times as large (e.g. 1.5B → 7B: about 7 / 1.5 in bytes and
    arithmetic, the same draft): :func:`engine.tuning.optimizer.choose_tree` and
    :func:`engine.tuning.explain.tables` on the rescaled profile. Raises ValueError without a profile."""
    if roofline.profile is None:
        raise ValueError("no hardware profile: nothing to re-run the optimizer on")
    scaled = roofline.scaled(draft_cost_scale, target_scale)
    vector = tuple(float(p) for p in vector)
    samples = tuple(tuple(s) for s in confidence) if confidence else None
    pick = _pick(scaled.profile, vector, grid, chains_only, samples)
    tables = explain.tables(vector, scaled.profile, grid[0], grid[1], chains_only)
    return WhatIf(scaled, vector, pick, tables, grid, chains_only, samples)


def _pick(profile: HardwareProfile, vector: tuple[float, ...], grid: tuple[int, int], chains_only: bool,
          confidence) -> TreeChoice:
    return choose_tree(vector, profile, grid[0], grid[1], chains_only=chains_only,
                       confidence=list(confidence) if confidence else None)


# ----- in one sentence --------------------------------------------------------------------------------------
def _ms(seconds: float) -> str:
    digits = 2 if seconds < 0.001 else 1 if seconds < 0.01 else 0
    return f"{seconds * 1e3:.{digits}f} ms"


def _times(a: float, b: float) -> tuple[str, str]:
    """Two speedups, with a third decimal where two would show them equal."""
    digits = 3 if f"{a:.2f}" == f"{b:.2f}" else 2
    return f"{a:.{digits}f}×", f"{b:.{digits}f}×"


def _factor(x: float) -> str:
    return f"{x:.2f}" if x < 2 else f"{x:.1f}"


def achieved_gops(roofline: Roofline) -> float | None:
    """The target's arithmetic rate at its largest measured size (10⁹ operations/s), None without a profile."""
    measured = roofline.measured_target()
    if not measured:
        return None
    n = max(measured)
    return 2.0 * roofline.target_macs * n / measured[n] / 1e9


def limits_sentence(roofline: Roofline) -> str:
    """The floor, the roof and the draft against its floor, in numbers."""
    limits = roofline.limits
    floor, per_row = roofline.target_floor_s, roofline.compute_s(1)
    words = (f"One target forward streams {roofline.target_bytes / 1e9:.2f} GB of weights: at "
             f"{limits.bandwidth_gbs:.0f} GB/s its floor is {_ms(floor)}")
    if roofline.profile is None:
        return words + (f"; its rows turn compute-bound past n = {roofline.compute_bound_from - 1} "
                        f"({limits.compute} roof {limits.int8_gops:.0f} GOPS). No profile: nothing measured to set against them.")
    one = roofline.profile.target_time(1)
    words += f", and t_T(1) measures {_ms(one)} ({_factor(one / floor)}× its floor)."
    words += (f" At the {limits.compute} roof ({limits.int8_gops:.0f} GOPS) a row's arithmetic takes {_ms(per_row)}, "
              f"so rows turn compute-bound past n = {roofline.compute_bound_from - 1}")
    achieved = achieved_gops(roofline)
    if achieved is not None:
        n = max(roofline.measured_target())
        words += (f"; the kernels reach {achieved:.0f} GOPS ({n} rows: "
                  f"{roofline.profile.target_time(n) / one:.1f}× one row)")
    words += "."
    if roofline.draft_bytes and roofline.profile.draft:
        level = roofline.profile.draft_time(1)
        words += (f" The draft's level costs {_ms(level)}, its floor is {_ms(roofline.draft_floor_s)}: "
                  f"{level / roofline.draft_floor_s:.1f}× its floor ({level / one:.2f} of a target step).")
    return words


def _boundary(bigger, easy: float, steps: int = 7) -> float | None:
    """The factor nearest 1 (between 1 and ``easy``, geometrically) at which ``bigger(factor)`` holds,
    None when it does not even at ``easy``. Assumes it holds from some point on towards ``easy``."""
    if not bigger(easy):
        return None
    hard = 1.0
    for _ in range(steps):
        middle = (hard * easy) ** 0.5
        if bigger(middle):
            easy = middle
        else:
            hard = middle
    return easy


def _bigger_tree(what: WhatIf) -> dict | None:
    """The best cell of S(n, d) above the pick's size, None when there is none."""
    tables, size = what.tables, what.pick.size
    if tables.speedup is None:
        return None
    cells = [(s, -tables.sizes[j], -tables.depths[i]) for i, row in enumerate(tables.speedup)
             for j, s in enumerate(row) if s is not None and tables.sizes[j] > size]
    if not cells:
        return None
    speed, n, d = max(cells)
    return tables.cell(-n, -d)


@lru_cache(maxsize=64)
def _factors(profile_json: str, vector: tuple[float, ...], grid: tuple[int, int], chains_only: bool, confidence,
             size: int) -> tuple[float | None, float | None, float | None]:
    """``(draft cost, arithmetic, bandwidth)`` factors, each on its own, at which the optimizer picks a
    tree bigger than ``size`` on the profile (:func:`_boundary` over :func:`rescaled`; cached: a step's
    answer redraws the panel with the same profile)."""
    base = HardwareProfile.from_json(profile_json)

    def bigger(**change) -> bool:
        return _pick(rescaled(base, **change), vector, grid, chains_only, confidence).size > size

    return (_boundary(lambda s: bigger(draft=s), 0.02) if base.draft else None,
            _boundary(lambda c: bigger(compute=c), 50.0), _boundary(lambda b: bigger(bandwidth=b), 0.05))


def _what_would(what: WhatIf) -> list[str]:
    """What would make the optimizer pick a bigger tree: each of the draft's cost, the rows' arithmetic
    and the memory bandwidth on its own, as found by re-running the optimizer (bisection)."""
    base = what.roofline.profile
    draft, compute, bandwidth = _factors(explain.profile_key(base), what.vector, what.grid, what.chains_only,
                                         what.confidence, what.pick.size)
    limits, level = what.roofline.limits, base.draft_time(1)
    out = []
    if draft is not None:
        floor = what.roofline.draft_floor_s
        below = f", {draft * level / floor:.2f}× its floor: a smaller draft" if floor and draft * level < floor else ""
        out.append(f"draft levels at ≤ {_ms(draft * level)} (×{draft:.2f}{below})")
    achieved = achieved_gops(what.roofline)
    if compute is not None and achieved is not None:
        past = f", past this machine's {limits.compute} roof" if achieved * compute > limits.int8_gops else ""
        out.append(f"rows beyond the first {_factor(compute)}× cheaper (≈ {achieved * compute:.0f} GOPS{past})")
    if bandwidth is not None:
        out.append(f"memory at ≤ {limits.bandwidth_gbs * bandwidth:.1f} GB/s (every forward's floor "
                   f"{_factor(1 / bandwidth)}× higher, the rows' arithmetic unchanged)")
    return out


def one_sentence(what: WhatIf) -> str:
    """Why a bigger tree than ``what.pick`` would not pay on this roofline, and at what draft cost,
    arithmetic rate or bandwidth it would (each found by re-running the optimizer), after the
    limits themselves (:func:`limits_sentence`)."""
    words = limits_sentence(what.roofline)
    pick, other = what.pick, _bigger_tree(what)
    if other is None:
        return words + f" The pick, n = {pick.size}, is the largest tree the grid holds."
    size = "the target alone" if pick.size == 1 else f"n = {pick.size}, d = {pick.depth}"
    words += (f" A bigger tree would not pay: the best one, n = {other['size']}, d ≤ {other['depth']}, writes "
              f"{other['expected_tokens']:.2f} tokens a step against the pick's ({size}) {pick.expected_tokens:.2f}, "
              f"but costs {_ms(other['verify_s'])} to verify and {_ms(other['draft_s'])} to draft: "
              "{} against {}.".format(*_times(other['speedup'], pick.predicted_speedup)))
    would = _what_would(what)
    if not would:
        return words + " No cheaper draft, faster arithmetic or slower memory within 50× would change that."
    return words + " It would pay with " + (", with ".join(would[:-1]) + " or with " + would[-1]
                                              if len(would) > 1 else would[0]) + "."
