"""The limits on how much the policy does at once: a :class:`TokenBucket` per action kind
(the rate limit) and a :class:`CircuitBreaker` (no mass action on a large share of the jobs
or the fleet within a window)."""

from __future__ import annotations

import collections
import math
from typing import Any

__all__ = ["CircuitBreaker", "TokenBucket"]


class TokenBucket:
    """A token bucket: ``rate`` tokens per second up to ``burst``; one token per action."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = max(1.0, burst)
        self.tokens = self.burst
        self.updated = now

    def take(self, now: float) -> bool:
        """Take a token if one is there."""
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class CircuitBreaker:
    """Refuses acting on more than ``share`` of a population of targets within ``window_s``.

    ``check`` answers whether a new target fits; ``note`` counts an action. A target already
    acted on within the window is not counted twice. The breaker is *tripped* from its
    first refusal until the window holds no refusal any more; :meth:`check` says when a
    refusal is the first of a trip, so the caller alerts once.
    """

    def __init__(self, share: float, window_s: float, minimum: int = 1) -> None:
        self.share = share
        self.window_s = window_s
        self.minimum = minimum
        self._acted: collections.deque[tuple[float, str]] = collections.deque()
        self._last_refusal: float | None = None

    def _prune(self, now: float) -> None:
        while self._acted and self._acted[0][0] < now - self.window_s:
            self._acted.popleft()

    def limit(self, population: int) -> int:
        """Most distinct targets allowed within the window."""
        return max(self.minimum, math.floor(self.share * population))

    def check(self, target: str, population: int, now: float) -> tuple[bool, bool, dict[str, Any]]:
        """(allowed, first refusal of this trip, inputs)."""
        self._prune(now)
        targets = {t for _, t in self._acted}
        limit = self.limit(population)
        inputs = {
            "breaker_targets_in_window": len(targets),
            "breaker_limit": limit,
            "breaker_population": population,
            "breaker_share": self.share,
            "breaker_window_s": self.window_s,
        }
        if target in targets or len(targets) < limit:
            return True, False, inputs
        first = self._last_refusal is None or self._last_refusal < now - self.window_s
        self._last_refusal = now
        return False, first, inputs

    def refused(self, now: float) -> None:
        """A refusal at ``now`` stored earlier (a previous leader's): the breaker is
        tripped, so its next refusal within the window raises no second alert."""
        self._last_refusal = now

    def note(self, target: str, now: float) -> None:
        """Count an action on ``target``."""
        self._acted.append((now, target))
