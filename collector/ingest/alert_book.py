"""Inbound alerts, deduplicated and stored in batches: an alert storm costs neither
decisions nor disk.

Alertmanager re-sends every firing alert of a group at each ``group_interval`` and
``repeat_interval``; Grafana likewise. :class:`AlertBook` keeps the alerts firing now, keyed
by source and label set (the same labels while firing are one alert):

* an alert not firing yet becomes a :class:`~forewarn.wire.Finding` for the policy, once;
* an alert already firing only updates its row (``last_seen``, ``count``): no finding, no
  decision; the finding it raised is handed back as *refreshed* (its source is not silent);
* a resolved alert leaves the book (a later firing is new again) and gives a healthy
  finding of the same check and subject that *clears* the one it raised (stored, so the
  GPU's health follows, and passed to the policy, which resolves the tracked finding);
  an alert not re-sent within ``ttl_s`` leaves the book too (the sender went silent);
* rows (table ``alerts``, one per label set) and the new findings are written by
  :meth:`AlertBook.flush` every half second in a few short transactions, never on the
  request path; the table keeps at most ``max_rows`` rows (least recently seen dropped first) and
  nothing older than the retention.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from forewarn.wire import Finding, Health, SuggestedAction

from ..jobs.jobview import JobView
from .alerts import AlertPayload, alert_finding, alert_labels
from .batch import store_findings

__all__ = ["AlertBook", "AlertIntake", "firing_heard"]

WRITE_CHUNK = 100
"""Rows (or findings) per write transaction of a flush."""
PRUNE_EVERY_S = 60.0
"""A flush with nothing new still prunes the table this often (retention)."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS alerts (
    key TEXT PRIMARY KEY, source TEXT NOT NULL, alertname TEXT NOT NULL,
    subject TEXT NOT NULL, status TEXT NOT NULL, labels TEXT NOT NULL,
    first_seen REAL NOT NULL, last_seen REAL NOT NULL, count INTEGER NOT NULL)
"""
_UPSERT = """
INSERT INTO alerts (key, source, alertname, subject, status, labels, first_seen, last_seen,
    count) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (key) DO UPDATE SET status = excluded.status, last_seen = excluded.last_seen,
    subject = CASE WHEN excluded.subject = '' THEN alerts.subject ELSE excluded.subject END,
    count = alerts.count + excluded.count
"""


@dataclasses.dataclass
class AlertIntake:
    """What one webhook request brought."""

    findings: list[Finding] = dataclasses.field(default_factory=list)
    """Alerts that started firing: for the policy."""
    duplicates: int = 0
    """Alerts already firing (row updated only)."""
    resolved: int = 0
    skipped: list[str] = dataclasses.field(default_factory=list)
    cleared: list[Finding] = dataclasses.field(default_factory=list)
    """Healthy findings that end what resolved alerts raised: for the policy."""
    refreshed: list[Finding] = dataclasses.field(default_factory=list)
    """The findings raised by alerts re-sent while firing (their source is alive)."""


@dataclasses.dataclass
class _Row:
    source: str
    alertname: str
    subject: str
    status: str
    labels: str
    first_seen: float
    last_seen: float
    count: int


def alert_key(source: str, labels: dict[str, str]) -> str:
    """Identity of an alert: its source and label set (Alertmanager's fingerprint is a
    hash of the labels too, but a sender may leave it out)."""
    text = json.dumps(sorted(labels.items()), separators=(",", ":"))
    return f"{source}:{hashlib.sha256(text.encode()).hexdigest()[:32]}"


def firing_heard(store: Any, since: float) -> list[tuple[str, str, str, float]]:
    """``(source, subject, check, last seen)`` of the firing alerts any replica heard
    since ``since`` (their rows, re-sends included: each replica's book writes its own):
    with several replicas, a re-send may reach one that does not decide."""
    rows = store.query("SELECT source, alertname, subject, MAX(last_seen) AS seen"
                       " FROM alerts WHERE status = 'firing' AND last_seen > ?"
                       " AND subject <> '' GROUP BY source, alertname, subject", (since,))
    return [(str(r["source"]), str(r["subject"]), f"alert:{r['alertname']}"[:256],
             float(r["seen"])) for r in rows]


class AlertBook:
    """See the module docstring. ``accept`` and ``flush`` may run on different threads."""

    def __init__(self, *, ttl_s: float, max_rows: int, retention_s: float,
                 clock: Callable[[], float]) -> None:
        self.ttl_s = ttl_s
        self.max_rows = max_rows
        self.retention_s = retention_s
        self.clock = clock
        self._lock = threading.Lock()
        self._firing: collections.OrderedDict[str, float] = collections.OrderedDict()
        """key -> last seen, least recently seen first."""
        self._raised: dict[str, Finding] = {}
        """key -> the finding the firing alert raised (until it resolves or is forgotten)."""
        self._rows: dict[str, _Row] = {}
        """Rows to write at the next flush."""
        self._findings: list[tuple[Finding, str]] = []
        self._schema_ready = False
        self._pruned = 0.0

    def accept(self, payload: AlertPayload, source: str, jobs: JobView, now: float
               ) -> AlertIntake:
        """Sort the alerts of one request into new, duplicate, resolved and skipped."""
        out = AlertIntake()
        for i, alert in enumerate(payload.alerts):
            labels = alert_labels(payload, alert)
            key = alert_key(source, labels)
            with self._lock:
                seen = self._firing.get(key)
            firing = alert.status == "firing"
            if firing and seen is not None and now - seen <= self.ttl_s:
                out.duplicates += 1
                self._note(key, source, labels, "firing", "", now)
                with self._lock:
                    raised = self._raised.get(key)
                if raised is not None:
                    out.refreshed.append(raised)
                continue
            if not firing:
                with self._lock:
                    known = self._firing.pop(key, None) is not None
                    raised = self._raised.pop(key, None)
                if known:
                    out.resolved += 1
                    self._note(key, source, labels, alert.status[:32], "", now)
                    if raised is not None:
                        self._clear(raised, source, now, out)
                else:
                    out.skipped.append(f"alerts[{i}] {labels.get('alertname', 'alert')}: "
                                       f"status {alert.status!r}, not firing")
                continue
            found = alert_finding(payload, alert, jobs, source, now)
            if isinstance(found, str):
                out.skipped.append(f"alerts[{i}] {found}")
                continue
            out.findings.append(found)
            self._note(key, source, labels, "firing", found.subject.key(), now)
            with self._lock:
                self._findings.append((found, source))
                self._raised[key] = found
        return out

    def _clear(self, raised: Finding, source: str, now: float, out: AlertIntake) -> None:
        """The healthy finding that ends ``raised`` (same check and subject)."""
        cleared = msgspec.structs.replace(
            raised, health=Health.HEALTHY, action=SuggestedAction.NONE, time=now,
            reason=f"resolved: {raised.reason}"[:4096])
        out.cleared.append(cleared)
        with self._lock:
            self._findings.append((cleared, source))

    def _note(self, key: str, source: str, labels: dict[str, str], status: str,
              subject: str, now: float) -> None:
        with self._lock:
            if status == "firing":
                self._firing[key] = now
                self._firing.move_to_end(key)
                while len(self._firing) > self.max_rows:
                    self._raised.pop(self._firing.popitem(last=False)[0], None)
            row = self._rows.get(key)
            if row is None:
                self._rows[key] = _Row(source, labels.get("alertname", "")[:256], subject,
                                       status, json.dumps(labels)[:8192], now, now, 1)
            else:
                row.status, row.last_seen, row.count = status, now, row.count + 1
                row.subject = subject or row.subject
            if len(self._rows) > self.max_rows:  # flushes stalled: keep the newest
                for stale in list(self._rows)[: len(self._rows) - self.max_rows]:
                    del self._rows[stale]

    def flush(self, store: Any) -> int:
        """Write the rows and new findings gathered since the last flush (in short
        transactions) and keep the table bounded; returns rows written. On a failure what
        was not written is kept for the next flush (a part already written may count its
        re-sends twice)."""
        with self._lock:
            rows, self._rows = self._rows, {}
            findings, self._findings = self._findings, []
        if not self._schema_ready:
            with store.write() as conn:
                conn.execute(SCHEMA)
            self._schema_ready = True
        if not rows and not findings:
            if self.clock() - self._pruned > PRUNE_EVERY_S:
                self._prune(store)
            return 0
        try:
            self._write(store, rows, findings)
        except Exception:
            with self._lock:  # kept for the next flush (newer notes win)
                self._rows = {**rows, **self._rows}
                self._findings[:0] = findings
            raise
        return len(rows)

    def _write(self, store: Any, rows: dict[str, _Row], findings: list[tuple[Finding, str]]
               ) -> None:
        """In transactions of at most :data:`WRITE_CHUNK` rows: the store has one writer,
        and an agent's batch must not wait behind a storm's worth of rows."""
        now = self.clock()
        items = list(rows.items())
        for i in range(0, len(items), WRITE_CHUNK):
            with store.write() as conn:
                conn.executemany(_UPSERT, [
                    (k, r.source, r.alertname, r.subject, r.status, r.labels, r.first_seen,
                     r.last_seen, r.count) for k, r in items[i:i + WRITE_CHUNK]])
        for i in range(0, len(findings), WRITE_CHUNK):
            part = findings[i:i + WRITE_CHUNK]
            with store.write() as conn:
                for source in sorted({s for _f, s in part}):
                    store_findings(conn, [f for f, s in part if s == source], node="",
                                   origin=source, received=now)
        self._prune(store)

    def _prune(self, store: Any) -> None:
        """Drop rows older than the retention, then the least recently seen beyond
        ``max_rows``."""
        now = self._pruned = self.clock()
        with store.write() as conn:
            conn.execute("DELETE FROM alerts WHERE last_seen < ?", (now - self.retention_s,))
            excess = conn.execute("SELECT count(*) FROM alerts").fetchone()[0] - self.max_rows
            if excess > 0:
                conn.execute("DELETE FROM alerts WHERE key IN (SELECT key FROM alerts "
                              "ORDER BY last_seen LIMIT ?)", (excess,))
