"""Alert webhooks into the policy without delaying a decision about an agent's finding.

Alerts go through an :class:`~..ingest.alert_book.AlertBook` (deduplicated, stored in
batches every :data:`ALERT_FLUSH_S`); only alerts that start firing or resolve reach the
policy, coalesced by check, subject and health (at most :data:`ALERT_QUEUE_MAX` waiting;
more are dropped and counted, their rows and findings stored all the same) and handed over
:data:`ALERT_CHUNK` at a time on the policy thread's bulk lane (:mod:`.policy_thread`), so
a storm never holds up the decision lane. Alerts re-sent while firing keep their findings
from expiring.

With shared state (several replicas) the replica that receives an alert only stores it:
the leader reads the stored findings back from its feed and queues them here
(:meth:`AlertIntake.queue`), so each alert is decided once, by the leader, whichever
replica received it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge

from forewarn.wire import Finding

from ..ingest.alert_book import AlertBook

if TYPE_CHECKING:
    from ..ingest.alerts import AlertPayload
    from .seam import DecideContext

__all__ = ["ALERT_CHUNK", "ALERT_FLUSH_S", "ALERT_QUEUE_MAX", "ALERT_SOURCES", "AlertIntake",
           "AlertLimits"]

log = logging.getLogger(__name__)

ALERT_CHUNK = 4
"""Alert findings the policy takes per turn on the bulk lane (bounds how long a decision
about an agent's finding can wait behind alerts)."""
ALERT_QUEUE_MAX = 10_000
"""Alert findings (distinct check and subject) waiting for the policy; more are dropped
and counted: their rows and findings are stored all the same."""
ALERT_FLUSH_S = 0.5
ALERT_SOURCES = frozenset({"alertmanager", "grafana"})
"""The webhooks' sources, which are also the origin their findings are stored with."""
BULK_SAVE_S = 1.0
"""How often the bulk lane writes the incidents that changed while alerts keep coming."""


@dataclasses.dataclass(frozen=True)
class AlertLimits:
    """How long alert rows live (``alert_ttl_s``, ``alert_max_rows``, the retention)."""

    ttl_s: float = 7200.0
    max_rows: int = 10_000
    retention_s: float = 30 * 86400.0


class AlertIntake:
    """The alert book and the bulk-lane queue (module docstring). ``decide(finding,
    source)`` runs one alert finding through the policy (cost model bypassed);
    ``refresh(findings, source, now)`` keeps re-sent firing alerts from expiring;
    ``save()`` writes the incidents that changed."""

    def __init__(self, limits: AlertLimits, *, decide: Callable[[Finding, str], None],
                 refresh: Callable[[list[Finding], str, float], None],
                 save: Callable[[], None]) -> None:
        self.limits = limits
        self._decide = decide
        self._refresh = refresh
        self._save = save
        self.book: AlertBook | None = None
        self._ctx: DecideContext | None = None
        self._queue: collections.OrderedDict[str, tuple[Finding, str]] = (
            collections.OrderedDict())
        self._lock = threading.Lock()
        self._turn_queued = False
        self._deciding = 0
        """Alert findings taken off the queue by a turn and not yet through the policy."""
        self._flusher: concurrent.futures.Future[None] | None = None
        self._bulk_saved = 0.0

    def start(self, ctx: DecideContext) -> None:
        """The alert book, its metrics and its periodic store."""
        self._ctx = ctx
        registry = ctx.metrics.registry
        limits = self.limits
        self.book = AlertBook(ttl_s=limits.ttl_s, max_rows=limits.max_rows,
                              retention_s=limits.retention_s, clock=ctx.clock)
        self._m_alerts = Counter("forewarn_collector_alerts",
                                 "Inbound alerts by result: new (a finding for the policy), "
                                 "duplicate (already firing), resolved, skipped, dropped "
                                 "(policy queue full).", ["source", "result"], registry=registry)
        self._m_queue = Gauge("forewarn_collector_alert_findings_queued",
                              "Alert findings waiting for the policy.", registry=registry)
        if ctx.loop is not None:
            self._flusher = asyncio.run_coroutine_threadsafe(_flush_alerts(self.book, ctx),
                                                             ctx.loop)

    def stop(self) -> None:
        """Stop the periodic store and store the last alerts."""
        if self._flusher is not None:
            self._flusher.cancel()
        if self.book is not None and self._ctx is not None:
            try:
                self.book.flush(self._ctx.store)
            except Exception:
                log.exception("storing the last alerts failed")

    async def handle(self, ctx: DecideContext, payload: AlertPayload, source: str
                     ) -> dict[str, Any]:
        """Sort the alerts (off the loop), queue the new ones for the policy, answer at
        once: the policy's decisions are in ``GET /api/v1/decisions``."""
        book = self.book
        if book is None:
            raise RuntimeError("alert webhook before the policy service started")
        intake = await asyncio.to_thread(book.accept, payload, source, ctx.jobs, ctx.clock())
        for f in intake.findings + intake.cleared:
            ctx.metrics.findings.labels(f.health.value, source).inc()
        # Shared state: the leader queues them from its feed once the book stored them.
        dropped = 0 if ctx.leader.shared else self.queue(intake.findings + intake.cleared,
                                                          source)
        if intake.refreshed:
            ctx.submit_bulk(self._refresh, intake.refreshed, source, ctx.clock())
        for result, n in (("new", len(intake.findings)), ("duplicate", intake.duplicates),
                          ("resolved", intake.resolved), ("skipped", len(intake.skipped)),
                          ("dropped", dropped)):
            if n:
                self._m_alerts.labels(source, result).inc(n)
        return {"findings": len(intake.findings), "duplicates": intake.duplicates,
                "resolved": intake.resolved, "skipped": intake.skipped}

    def queue(self, findings: list[Finding], source: str) -> int:
        """Coalesce new alert findings (and the healthy ones of resolved alerts) by check,
        subject and health for the bulk lane; returns how many were dropped because the
        queue is full."""
        ctx = self._ctx
        if ctx is None:
            raise RuntimeError("alert findings before the policy service started")
        dropped = 0
        with self._lock:
            for f in findings:
                key = f"{f.check}|{f.subject.key()}|{f.health.value}"
                if key not in self._queue and len(self._queue) >= ALERT_QUEUE_MAX:
                    dropped += 1
                    continue
                self._queue[key] = (f, source)
            self._m_queue.set(len(self._queue))
            start = bool(self._queue) and not self._turn_queued
            self._turn_queued = self._turn_queued or start
        if dropped:
            log.warning("alert findings dropped: %d (the policy is %d behind)", dropped,
                        ALERT_QUEUE_MAX)
        if start:
            ctx.submit_bulk(self._turn, ctx)
        return dropped

    def idle(self) -> bool:
        """Whether every alert finding queued has been through the policy (any thread)."""
        with self._lock:
            return not self._queue and not self._deciding

    def _turn(self, ctx: DecideContext) -> None:
        """Bulk lane: run up to :data:`ALERT_CHUNK` alert findings through the policy,
        then queue the next turn behind any decision work that arrived meanwhile."""
        with self._lock:
            chunk = [self._queue.popitem(last=False)[1]
                     for _ in range(min(ALERT_CHUNK, len(self._queue)))]
            self._m_queue.set(len(self._queue))
            more = bool(self._queue)
            self._turn_queued = more
            self._deciding = len(chunk)
        if more:
            ctx.submit_bulk(self._turn, ctx)
        try:
            for finding, source in chunk:
                try:
                    self._decide(finding, source)
                except Exception:
                    ctx.metrics.policy_errors.inc()
                    log.exception("policy failed on alert finding %s", finding.check)
        finally:
            with self._lock:
                self._deciding = 0
        # During a storm the incidents are written once a second and when the queue runs
        # dry, not after every chunk: a write per turn would hold up the decision lane.
        mono = time.monotonic()
        if not more or mono - self._bulk_saved >= BULK_SAVE_S:
            self._bulk_saved = mono
            self._save()


async def _flush_alerts(book: AlertBook, ctx: DecideContext) -> None:
    """Store the alert book's rows and new findings every :data:`ALERT_FLUSH_S`."""
    while True:
        await asyncio.sleep(ALERT_FLUSH_S)
        try:
            await asyncio.to_thread(book.flush, ctx.store)
        except Exception:
            log.exception("storing alerts failed; they are kept for the next try")
