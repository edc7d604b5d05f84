"""A per-step policy the app passes to :meth:`SpeculativeEngine.stream`: some steps of an answer
decode with the target alone, timed, so that the answer carries its own measure of the target
alone under whatever load it decoded under (a page drawing, another program)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidParameterError


@dataclass(frozen=True)
class TimedAlone:
    """The second step and every ``every``-th after it (indices 1, every + 1, 2 every + 1, ...: a
    short answer gets its share too) go to the target alone. Which step goes alone depends on its
    index only, so the law of the output is kept."""

    every: int

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 2:
            raise InvalidParameterError(f"TimedAlone.every must be an integer >= 2, got {self.every!r}")

    def applies(self, step_index: int) -> bool:
        """Whether step ``step_index`` (0-based) decodes with the target alone."""
        return step_index % self.every == 1
