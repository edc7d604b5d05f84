"""Which calibrated positional acceptance vector a setting uses, and where it comes from.

Calibrations (:mod:`engine.tuning.calibrate`) are measured per pair at a few (temperature, top-p)
settings. Every consumer (trees built for the controls, predicted tokens/step, the optimizer) takes
the calibration nearest to the setting in use. A pair with no calibration of its own borrows the
embedded pair's, and says so.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from engine.errors import EngineError

EMBEDDED_PAIR = "default-target+default-draft@int4"  # bundled in assets/acceptance

Setting = tuple[float, float]  # (temperature, top_p)


@dataclass(frozen=True)
class Calibration:
    """A positional acceptance vector ``vector[k - 1] = p_k`` measured on ``pair`` at
    (``temperature``, ``top_p``); ``borrowed`` when ``pair`` is not the pair in use."""

    vector: tuple[float, ...]
    temperature: float
    top_p: float
    pair: str
    borrowed: bool = False

    def label(self) -> str:
        setting = f"T={self.temperature:g}, top-p {self.top_p:g}"
        if self.borrowed:
            return f"acceptance: the embedded pair's {setting} calibration (none measured for this pair)"
        return f"acceptance: calibrated at {setting}"


def nearest_setting(settings: Iterable[Setting], temperature: float, top_p: float) -> Setting:
    """The calibrated setting closest to (temperature, top_p): least |ΔT| + |Δtop-p|, ties to the
    smaller setting."""
    return min(settings, key=lambda k: (abs(k[0] - temperature) + abs(k[1] - top_p), k))


def nearest_calibration(calibrations: Mapping[Setting, list[float]], temperature: float, top_p: float,
                        pair: str, borrowed: bool = False) -> Calibration:
    key = nearest_setting(calibrations, temperature, top_p)
    return Calibration(tuple(float(p) for p in calibrations[key]), key[0], key[1], pair, borrowed)


def calibration_for(pair: str, temperature: float = 0.0, top_p: float = 1.0) -> Calibration:
    """The calibration of ``pair`` nearest to the setting; the embedded pair's when ``pair`` has none."""
    from engine.tuning.calibrate import find_acceptance

    found = find_acceptance(pair)
    if found:
        return nearest_calibration(found, temperature, top_p, pair)
    bundled = find_acceptance(EMBEDDED_PAIR)
    if not bundled:
        raise EngineError(f"no acceptance calibration for {pair} and none bundled for the embedded pair: "
                          f"run python -m engine.cli.calibrate")
    return nearest_calibration(bundled, temperature, top_p, EMBEDDED_PAIR, borrowed=True)


def acceptance_for(pair: str, temperature: float = 0.0, top_p: float = 1.0) -> list[float]:
    """The vector of :func:`calibration_for`."""
    return list(calibration_for(pair, temperature, top_p).vector)


def default_acceptance() -> list[float]:
    """The embedded pair's greedy vector: what shapes a tree when no pair or setting is given."""
    return acceptance_for(EMBEDDED_PAIR)
