"""Errors the engine raises on bad input. Each message is one line that names the fix."""


class EngineError(Exception):
    """Base class: anything the user can fix (bad model id, bad parameters, bad tree)."""


class InvalidTreeError(EngineError, ValueError):
    """A parent array that does not describe a rooted tree."""


class InvalidParameterError(EngineError, ValueError):
    """A generation parameter out of range (max_new_tokens, temperature, top_p, ...)."""


class ModelLoadError(EngineError):
    """A model that cannot be found, downloaded, verified or loaded."""


class VocabularyMismatchError(EngineError):
    """A draft/target pair whose vocabularies differ."""


class ContextOverflowError(EngineError):
    """A prompt plus generation budget longer than the target's context window."""


class InvalidDistributionError(EngineError, ValueError):
    """A probability vector or logits row with NaN/+inf entries or no mass (a broken model or dtype)."""


class GenerationCancelled(EngineError):
    """The caller asked a generation to stop (``should_stop``) before it finished."""
