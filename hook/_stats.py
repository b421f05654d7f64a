"""The Monitor's counters (:class:`MonitorStats`) and its rate-limited log."""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

__all__ = ["MonitorStats", "RateLimitedLog"]

_log = logging.getLogger("forewarn.hook")


@dataclasses.dataclass(frozen=True)
class MonitorStats:
    """Counters of one :class:`Monitor` (a snapshot)."""

    steps: int
    """``step()`` calls."""
    dropped: int
    """Reports (steps, beats, checkpoint reports) that did not reach an agent."""
    failures: int
    """``step()`` calls that failed inside the hook (bad arguments, bugs): counted, logged."""
    beats: int
    orders: int
    """Orders for this job that were accepted."""
    orders_ignored: int
    """Orders for another job, duplicates, or ones that came too late (see ``missed``)."""
    orders_invalid: int
    """Datagrams on the order socket that did not decode as a CheckpointOrder."""
    missed: int
    checkpoints: int
    values_skipped: int
    """Tensor values left out rather than waiting for the device."""
    connected: bool
    notices_absorbed: int = 0
    """Repeated preemption notices within the grace that did not abort the save."""


class RateLimitedLog:
    """At most one log line per key per ``interval_s``, with the count of suppressed ones."""

    def __init__(self, interval_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: collections.Counter[str] = collections.Counter()

    def warning(self, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._suppressed[key] += 1
            return
        self._last[key] = now
        n = self._suppressed.pop(key, 0)
        suffix = f" ({n} similar suppressed)" if n else ""
        _log.warning("forewarn: " + msg + suffix, *args)
