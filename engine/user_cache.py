"""The user cache: where the engine keeps what it builds once (assembled GGUFs, packed weights,
compiled kernels, measured profiles and trees, the llama.cpp peer), and how a weights file gets
there whole. Imports nothing from the engine, so every package may use it."""
from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PROJECT = "sequoia-chat"


def cache_dir() -> Path:
    """``$SEQUOIA_CACHE`` or ``$XDG_CACHE_HOME/sequoia-chat`` (default ``~/.cache/sequoia-chat``)."""
    if os.environ.get("SEQUOIA_CACHE"):
        return Path(os.environ["SEQUOIA_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / PROJECT


def save_cache_atomically(path: Path, tensors: dict[str, torch.Tensor], what: str,
                          metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` as safetensors at ``path`` atomically: a half-written cache is never read,
    nor left behind. A failure is only a warning: ``what`` is quantised again at the next start."""
    from safetensors.torch import save_file

    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".partial")
        os.close(fd)
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    except OSError as exc:
        logging.getLogger(__name__).warning("could not cache %s (%s); it is quantised at every start", what, exc)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
