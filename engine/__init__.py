"""Sequoia tree speculative decoding on Hugging Face causal LMs (pure PyTorch + transformers).

The library, by concern:

- :mod:`engine.errors`: the errors every package raises on bad input, one line each;
- :mod:`engine.user_cache`: where the user cache is, and how a weights file gets there whole;
- :mod:`engine.kernels`: the compiled CPU kernels (C++ sources, building and loading them);
- :mod:`engine.core`: one draft-verify step and the loop around it (speculative, verify,
  sampling, runner, kv_cache, prefix_cache, records);
- :mod:`engine.trees`: token trees and Sequoia's dynamic program (tree, dp);
- :mod:`engine.tuning`: what the optimizer measures and decides (acceptance, calibrate,
  profile, optimizer, tree_store, replay, sampled_replay);
- :mod:`engine.backends`: CPU and CUDA machinery (kquant, kernels, quantize, mapped,
  hugepages, offload);
- :mod:`engine.models`: loading pairs, the bundled prompts, random-weight stand-ins;
- :mod:`bench.peer`: llama.cpp run on the same files, for benchmarks;
- :mod:`engine.cli`: the command lines (``python -m engine.cli.<tool>``, the one way to run
  each); nothing in the library imports them.

The names below load on first use, so entry points can act before torch is imported
(:mod:`engine.backends.hugepages`)."""
from __future__ import annotations

import importlib

_HOMES = {"SpeculativeEngine": "core.speculative", "DecodeSettings": "core.settings", "TreeSize": "core.settings",
          "TimedAlone": "core.timed_alone", "Tree": "trees.tree", "GenerationResult": "core.records",
          "StepRecord": "core.records", "StepTimings": "core.records", "EngineError": "errors",
          "InvalidTreeError": "errors", "InvalidParameterError": "errors",
          "ModelLoadError": "errors", "VocabularyMismatchError": "errors",
          "ContextOverflowError": "errors", "prepare": "backends.kernels"}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
