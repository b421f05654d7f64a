"""The collector's log rate limit: one line per kind per interval, then a count."""

from __future__ import annotations

import logging

from forewarn.collector.http.lograte import RateLimitFilter


def test_one_line_per_kind_per_interval_then_the_count() -> None:
    now = [0.0]
    limiter = RateLimitFilter(10.0, clock=lambda: now[0])
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep()
    handler.addFilter(limiter)
    log = logging.getLogger("test.lograte")
    log.propagate = False
    log.addHandler(handler)
    try:
        for i in range(1000):
            log.warning("refused connection %d", i)
            log.error("another kind")
            now[0] += 0.05  # 1,000 of each within 50 s
        assert len(records) == 10
        assert records[0] == "refused connection 0"
        assert records[2] == "refused connection 200 [199 more like this in the last 10s]"
        assert records[3] == "another kind [199 more like this in the last 10s]"
    finally:
        log.removeHandler(handler)
