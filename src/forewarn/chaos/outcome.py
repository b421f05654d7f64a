"""What a chaos scenario is (:class:`Scenario`: a fault, the rig it runs on, its stated
expectation and the function that runs it) and what it saw (:class:`Outcome`); the
registry is :data:`forewarn.chaos.scenarios.SCENARIOS`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from forewarn.chaos.lab import Lab

__all__ = ["Outcome", "Scenario"]


@dataclasses.dataclass
class Outcome:
    """What one scenario saw (see the module docstring)."""

    name: str
    expected: str
    passed: bool = False
    detected: str = ""
    detection_s: float | None = None
    action: str = ""
    lost: str = ""
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)
    problems: list[str] = dataclasses.field(default_factory=list)
    skipped: str = ""
    """Why the scenario could not run here (e.g. no permission to mount); not a pass."""

    def expect(self, ok: bool, problem: str) -> bool:
        """Record ``problem`` unless ``ok``; returns ``ok``."""
        if not ok:
            self.problems.append(problem)
        return ok

    def finish(self) -> Outcome:
        self.passed = not self.problems
        return self


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A fault, the rig it runs on, its stated expectation, and the function that runs it."""

    name: str
    rig: str
    """training, hardware, telemetry (a rig of its own, accounted at the end), store, or
    scale (the scale-out rig, :mod:`forewarn.chaos.scale_lab`)."""
    expected: str
    run: Callable[[Lab, Outcome], None]
