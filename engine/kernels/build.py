"""Building and loading the compiled kernels: the C++ sources of ``csrc/`` as one torch extension,
built once into the user cache (about a minute a path) for the ``-march`` this CPU runs, and loaded
on first use. :func:`compiled_kernels` is what the engine runs (None where no compiler is found:
the k-quant layers then run their pure-torch reference and sampling its torch operations);
:func:`kernel_digest` is what a timing of them is stamped with.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
from functools import lru_cache
from pathlib import Path

import torch

from engine.kernels import cpu

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("csrc") / name for name in ("kquant.cpp", "nucleus.cpp")]
HEADERS = [Path(__file__).with_name("csrc") / name for name in ("fixed_exp.h", "blocks.h")]  # part of the build's digest, not compiled alone


@lru_cache(maxsize=1)
def compiled_kernels():
    """The compiled kernels, built once into the cache (about a minute), or None when they cannot
    be built here (no compiler); the reason is logged. The k-quant layers
    (:mod:`engine.backends.kquant`) and sampling (:func:`engine.core.sampling.compiled`) both take
    their functions from these."""
    venv_bin = Path(sys.executable).parent  # pip's ninja lands beside the interpreter, maybe off PATH
    if shutil.which("ninja") is None and (venv_bin / "ninja").exists():
        os.environ["PATH"] = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"
    try:
        return compile_kernels(kernel_march())
    except (OSError, RuntimeError, ImportError) as exc:
        log.warning("the k-quant kernels could not be built (%s); using the pure-torch reference", exc)
        return None


def kernel_march() -> str:
    """The ``-march`` the engine's kernels are built for: ``native``, unless ``$SEQUOIA_KERNEL_MARCH``
    names another path this CPU runs (:func:`other_marches`: ``x86-64-v3`` runs the AVX2 path on an
    AVX-512 machine, to measure it there); anything else is refused with a warning."""
    march = os.environ.get("SEQUOIA_KERNEL_MARCH", "native") or "native"
    if march != "native" and march not in other_marches():
        if march not in _REFUSED_MARCHES:  # said once, not at every profile stamp and build
            _REFUSED_MARCHES.add(march)
            log.warning("SEQUOIA_KERNEL_MARCH=%s is not a path this CPU runs (%s); building for native",
                        march, ", ".join(["native", *other_marches()]))
        return "native"
    return march


_REFUSED_MARCHES: set[str] = set()


def compile_kernels(march: str = "native"):
    """Build (once, into the cache) and import the kernels for ``-march=<march>``: ``native`` is what
    the engine uses; ``x86-64-v3`` (AVX2) and ``x86-64`` (portable) let a test check that every
    integer path computes the same numbers. Raises what the compiler or the import raise."""
    from torch.utils.cpp_extension import load

    from engine.user_cache import cache_dir

    digest = build_key(march)
    tag = "" if march == "native" else "_" + march.replace("-", "_")  # a module name of its own per path
    build = cache_dir() / "kernels" / f"kquant-{digest}{tag}"
    build.mkdir(parents=True, exist_ok=True)
    # Without GCC's unroll-and-jam, which interleaves a panel's sub-blocks and so spills the unpacked
    # weights (a copy of the AVX2 Q4_K panel alone, one thread: 75 -> 84 G multiply-adds/s).
    return load(name="sequoia_kquant" + tag, sources=[str(s) for s in SOURCES], build_directory=str(build),
                extra_cflags=["-O3", "-fno-loop-unroll-and-jam", f"-march={march}", "-ffp-contract=off", "-fopenmp"],
                extra_ldflags=["-fopenmp"], verbose=os.environ.get("SEQUOIA_VERBOSE_BUILD") == "1")


def _source_bytes() -> bytes:
    return b"".join(s.read_bytes() for s in SOURCES + HEADERS)


def kernel_digest() -> str:
    """What a timing of the kernels (a hardware profile) depends on besides the thread count: their
    sources, the path they are built for (:func:`kernel_march`) and the CPU that runs them (its model
    and flags). A profile stamped with another digest was measured with other kernels or on another
    CPU, even where both share a home folder and a profile's name."""
    machine = f"{kernel_march()}|{cpu.cpu_model()}|{' '.join(sorted(cpu.cpu_flags()))}"
    return hashlib.sha256(_source_bytes() + machine.encode()).hexdigest()[:12]


def build_key(march: str) -> str:
    """The build folder's key: the sources, torch's version, the sources' folder (ninja rebuilds
    when a source's path changes, so two checkouts sharing one folder would rebuild each other's
    kernels at every start), and for ``native`` the CPU's instruction-set flags: a home folder or
    image shared by an AVX-512 and an AVX2 machine keeps one build for each, never running the
    other's instructions (SIGILL)."""
    flags = " ".join(sorted(cpu.cpu_flags())) + platform.machine() if march == "native" else ""
    key = _source_bytes() + torch.__version__.encode() \
        + str(SOURCES[0].parent).encode() + flags.encode()
    return hashlib.sha256(key).hexdigest()[:12]


def kernels_available() -> bool:
    """True when the compiled kernels load (built on first use)."""
    return compiled_kernels() is not None


def simd_path() -> str:
    """The kernels' integer path on this CPU: ``avx512-vnni``, ``avx2``, ``portable``, or ``none``
    when they are not built (the pure-torch reference runs)."""
    ext = compiled_kernels()
    return "none" if ext is None else ext.simd_path()


def other_marches() -> list[str]:
    """The other ``-march`` builds this CPU can run, which the tests compare with the native one:
    the portable path, and the AVX2 path where the CPU has AVX2 (x86 only)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    return ["x86-64"] + (["x86-64-v3"] if "avx2" in cpu.cpu_flags() else [])


def build_kernels(every_path: bool = False) -> str:
    """Build the kernels now (``make kernels``; with ``every_path`` also :func:`other_marches`, as
    ``make test`` does); returns a line saying what was built."""
    if compiled_kernels() is None:
        raise RuntimeError("the k-quant kernels could not be built; see the log above")
    others = [compile_kernels(march).simd_path() for march in other_marches()] if every_path else []
    return f"k-quant kernels ready ({', '.join([simd_path(), *others])})"
