"""Phases of a training loop in which a long pause between steps is expected.

``with monitor.phase("eval"):`` (or ``data``, ``compile``, ``checkpoint``) tells the agent
at once (an early beat): its hang bound for a rank in a phase is learned from the longest
earlier stay in that phase (the first one gets the startup timeout), and the phase's time
is left out of the next step time. Beats carry the current phase, when it began, and the
longest stay of each phase.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Final

__all__ = ["Phases"]

MAX_PHASES: Final = 16
"""Phases whose longest stay a beat carries (the wire's limit)."""


class Phases:
    """The current phase and the longest stay of each (what beats carry)."""

    def __init__(self, clock: Callable[[], float], monotonic: Callable[[], float],
                 beat_soon: Callable[[], None]) -> None:
        self.name = ""
        self.started: float | None = None
        self.longest: dict[str, float] = {}
        self._time = clock
        self._mono = monotonic
        self._beat_soon = beat_soon

    @contextlib.contextmanager
    def enter(self, name: str, left: Callable[[float], None]) -> Iterator[None]:
        """Be in phase ``name`` for the ``with`` block; ``left(seconds)`` after it."""
        name = str(name)[:32]
        outer = self.name
        self.name, self.started = name, self._time()
        began = self._mono()
        self._beat_soon()
        try:
            yield
        finally:
            took = self._mono() - began
            longest = self.longest
            if took > longest.get(name, -1.0) and (name in longest
                                                   or len(longest) < MAX_PHASES):
                longest[name] = took
            left(took)
            self.name, self.started = outer, self._time()
