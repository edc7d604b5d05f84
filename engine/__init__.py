"""Sequoia tree speculative decoding on Hugging Face causal LMs (pure PyTorch + transformers).

The names below load on first use, so entry points can act before torch is imported
(:mod:`engine.hugepages`)."""
from __future__ import annotations

import importlib

_HOMES = {"SpeculativeEngine": "speculative", "Tree": "tree", "GenerationResult": "records",
          "StepRecord": "records", "StepTimings": "records", "EngineError": "errors",
          "InvalidTreeError": "errors", "InvalidParameterError": "errors", "ModelLoadError": "errors",
          "VocabularyMismatchError": "errors", "ContextOverflowError": "errors", "prepare": "kernels"}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
