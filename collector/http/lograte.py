"""Rate-limited logging for the collector service: a flood (refused connections, bad
requests, ``accept`` failures) must not become a flood of log lines.

:class:`RateLimitFilter` lets one record per *kind* (logger name, level and message
template, so the same message with other arguments is the same kind) through per
``every_s`` seconds; the first record let through after others were suppressed says how
many (``[42 more like this in the last 10s]``). Tracebacks of suppressed records are dropped
with them. :func:`rate_limit_logging` installs it on the handlers of the root logger and of
uvicorn's logger, where every record ends up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["RateLimitFilter", "rate_limit_logging"]

MAX_KINDS = 10_000
"""Kinds remembered; beyond it the table starts over (only ever more lines, never fewer)."""


class RateLimitFilter(logging.Filter):
    """See the module docstring. Thread-safe enough: a race lets one extra line through."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every_s = every_s
        self.clock = clock
        self._kinds: dict[tuple[str, int, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "fw_passed", None) is self:  # a second handler: same verdict
            return True
        key = (record.name, record.levelno, str(record.msg))
        now = self.clock()
        last = self._kinds.get(key)
        if last is not None and now - last[0] < self.every_s:
            self._kinds[key] = (last[0], last[1] + 1)
            return False
        if len(self._kinds) >= MAX_KINDS:
            self._kinds.clear()
        self._kinds[key] = (now, 0)
        if last is not None and last[1]:
            record.msg = f"{record.msg} [{last[1]} more like this in the last {now - last[0]:.0f}s]"
        record.fw_passed = self
        return True


def rate_limit_logging(every_s: float) -> RateLimitFilter | None:
    """Install one :class:`RateLimitFilter` on the root and uvicorn handlers (call after
    logging and uvicorn's logging are configured); None when ``every_s`` is 0."""
    if every_s <= 0:
        return None
    limiter = RateLimitFilter(every_s)
    for name in ("", "uvicorn", "uvicorn.error", "uvicorn.access"):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(limiter)
    return limiter
