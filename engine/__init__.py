"""Sequoia tree speculative decoding on Hugging Face causal LMs (pure PyTorch + transformers)."""
from .errors import (ContextOverflowError, EngineError, InvalidParameterError, InvalidTreeError, ModelLoadError,
                     VocabularyMismatchError)
from .records import GenerationResult, StepRecord, StepTimings
from .speculative import SpeculativeEngine
from .tree import Tree

__all__ = ["SpeculativeEngine", "Tree", "GenerationResult", "StepRecord", "StepTimings", "EngineError",
           "InvalidTreeError", "InvalidParameterError", "ModelLoadError", "VocabularyMismatchError",
           "ContextOverflowError"]
