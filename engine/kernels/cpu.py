"""What this CPU advertises (Linux ``/proc/cpuinfo``): the instruction-set flags a native build of
the kernels is keyed by and a profile of them is stamped with, and the model name."""
from __future__ import annotations

import functools
from pathlib import Path


def _cpuinfo_value(key: str) -> str:
    """The value of the first ``key`` line of Linux's ``/proc/cpuinfo`` (empty where there is none
    or the file cannot be read)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.partition(":")[2].strip() for line in lines if line.split(":")[0].strip() == key), "")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags this CPU advertises (the ``flags`` line of ``/proc/cpuinfo``; empty
    where it cannot be read)."""
    return frozenset(_cpuinfo_value("flags").split())


@functools.cache
def cpu_model() -> str:
    """This CPU's model name (the ``model name`` line of ``/proc/cpuinfo``; empty where it cannot be
    read)."""
    return _cpuinfo_value("model name")
