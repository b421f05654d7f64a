"""The service's book of findings: every finding the policy sees is tracked in its incident
(:mod:`.incidents`), findings made inside the collector (its detectors, expiry) are stored
and counted, and the incidents that changed are written after each turn of the policy
thread.

A tracked finding is resolved by its source (the agent's healthy finding, a resolved alert)
or expired when its source is silent for ``finding_ttl_s`` (:meth:`FindingLedger.expire`,
called every :data:`EXPIRE_EVERY_S`): a closing ``unknown`` finding is stored for it, so
its GPU's colour clears. Open incidents are taken back from the store at start, and again
when a replica starts to lead (:meth:`FindingLedger.take_over`): with shared state another
replica decided until then.

Runs on the policy thread only (not thread-safe, like :class:`~.incidents.IncidentBook`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from forewarn.wire import Finding, Health, SuggestedAction

from ..ingest.alert_book import firing_heard
from ..ingest.batch import store_findings
from .incidents import IncidentBook, TrackedFinding, save_incidents, tracked_key

if TYPE_CHECKING:
    from .seam import DecideContext

__all__ = ["EXPIRE_EVERY_S", "FindingLedger"]

log = logging.getLogger(__name__)

EXPIRE_EVERY_S = 5.0
"""How often silent sources' findings are checked for expiry."""
_OPEN_INCIDENTS = "SELECT * FROM incidents WHERE state = 'open'"


class FindingLedger:
    """Incidents of the findings the policy sees (see the module docstring); ``ttl_s``:
    silence after which a source's findings expire; ``window_s``: how long a closed
    incident takes new findings about its scope."""

    def __init__(self, *, ttl_s: float = 7200.0, window_s: float = 300.0) -> None:
        self.ttl_s = ttl_s
        self.window_s = window_s
        self.book: IncidentBook | None = None
        self._ctx: DecideContext | None = None

    def start(self, ctx: DecideContext) -> IncidentBook:
        """The incident book, with the open incidents a previous run stored."""
        self._ctx = ctx
        book = IncidentBook(ttl_s=self.ttl_s, window_s=self.window_s, clock=ctx.clock,
                            registry=ctx.metrics.registry)
        reopened = book.load(ctx.store.query(_OPEN_INCIDENTS), ctx.clock())
        if reopened:
            log.info("%d open incident(s) taken back from the store", reopened)
        self.book = book
        return book

    def take_over(self) -> None:
        """This replica leads now: the incidents as the last leader stored them, their
        sources given ``ttl_s`` from now to speak (this replica did not hear them)."""
        ctx, book = self._ctx, self.book
        if ctx is None or book is None:
            return
        taken = book.reload(ctx.store.query(_OPEN_INCIDENTS), ctx.clock())
        log.warning("leading: %d open incident(s) taken over from the store", taken)

    def heard(self, liveness: str, now: float) -> None:
        """A source spoke (``agent:<node>``): its findings are not silent."""
        if self.book is not None:
            self.book.heard(liveness, now)

    def refresh(self, findings: Sequence[Finding], source: str, now: float) -> None:
        """``source`` re-sent these firing findings (an alert's repeat)."""
        if self.book is not None:
            for f in findings:
                self.book.refresh(f, source, now)

    def record(self, findings: Sequence[Finding], origin: str, now: float) -> None:
        """Store findings made in the collector and count them (``origin`` labels both)."""
        ctx = self._ctx
        if ctx is None:
            return
        with ctx.store.write() as conn:
            store_findings(conn, findings, node="", origin=origin, received=now)
        for f in findings:
            ctx.metrics.findings.labels(f.health.value, origin).inc()

    def expire(self, now: float) -> list[TrackedFinding]:
        """End the findings whose source went silent for ``ttl_s``; a closing ``unknown``
        finding is stored for each, so its GPU's colour clears."""
        book = self.book
        if book is None:
            return []
        self._alerts_heard(now)
        expired = book.expire(now)
        if expired:
            log.warning("%d finding(s) expired: their source was silent for %.0f s: %s",
                        len(expired), book.ttl_s, ", ".join(t.key for t in expired[:5]))
            closing = [msgspec.structs.replace(
                t.finding, health=Health.UNKNOWN, action=SuggestedAction.NONE, time=now,
                reason=f"expired: {t.source} silent for {book.ttl_s:.0f} s "
                f"(was: {t.finding.reason})"[:4096]) for t in expired]
            self.record(closing, "expiry", now)
        self.save()
        return expired

    def _alerts_heard(self, now: float) -> None:
        """Shared state: a firing alert re-sent to another replica is not silent either.
        That replica only stores it (its row's ``last_seen``), so the leader reads the rows
        before it expires anything."""
        ctx, book = self._ctx, self.book
        if ctx is None or book is None or not ctx.leader.shared:
            return
        try:
            heard = firing_heard(ctx.store, now - book.ttl_s)
        except Exception:  # the store is down: what this replica heard itself stands
            ctx.metrics.policy_errors.inc()
            log.exception("reading the alerts other replicas heard failed")
            return
        book.refresh_seen({tracked_key(source, subject, check): seen
                           for source, subject, check, seen in heard})

    def save(self) -> None:
        """Write the incidents that changed; a failure is logged and counted."""
        ctx, book = self._ctx, self.book
        if ctx is None or book is None:
            return
        changed = book.take_changed()
        try:
            save_incidents(ctx.store, changed)
        except Exception:
            ctx.metrics.policy_errors.inc()
            log.exception("storing %d incident(s) failed", len(changed))
