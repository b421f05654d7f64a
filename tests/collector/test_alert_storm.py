"""An alert storm must not stall decisions nor grow the database: the real collector
service (uvicorn on loopback, SQLite, the real policy), alerts over real HTTP."""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from forewarn.collector.ingest.alert_book import AlertBook
from forewarn.collector.ingest.alerts import parse_alerts
from forewarn.collector.jobs.jobmap import StoreJobView
from forewarn.collector.storage.store import Store
from forewarn.wire import Finding, Health, Subject, SuggestedAction

from support.collector import ALERT_TOKEN, Service, start_job_service, stop_service
from support.polling import poll

DISTINCT = 400
"""Distinct alerts (label sets) in the storm; each is re-sent many times."""


def storm_payload(start: int, n: int) -> dict[str, Any]:
    """An Alertmanager body of ``n`` firing alerts about GPUs of nodes without jobs."""
    alerts = []
    for i in range(start, start + n):
        k = i % DISTINCT
        alerts.append({"status": "firing", "annotations": {"summary": "hot"},
                       "labels": {"alertname": f"Storm{k % 20}", "node": f"storm{k // 20}",
                                  "gpu": str(k % 8), "severity": "warning"},
                       "startsAt": "2026-01-01T00:00:00Z", "fingerprint": f"{k:016x}"})
    return {"version": "4", "status": "firing", "receiver": "forewarn", "groupLabels": {},
            "commonLabels": {}, "alerts": alerts}


class Storm:
    """Post alerts, ``per_post`` per request, from ``threads`` threads, until stopped or
    ``limit`` alerts were posted (a bounded loop)."""

    def __init__(self, url: str, limit: int, per_post: int = 20, threads: int = 4) -> None:
        self.url, self.limit, self.per_post = url, limit, per_post
        self.answers: list[int] = []
        self.accepted = 0
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True)
                         for _ in range(threads)]

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60, headers={
                "authorization": f"Bearer {ALERT_TOKEN}"}) as client:
            while not self._stop.is_set():
                with self._lock:
                    start = self._next
                    if start >= self.limit:
                        return
                    self._next += self.per_post
                r = client.post("/api/v1/alerts/alertmanager",
                                json=storm_payload(start, self.per_post))
                with self._lock:
                    self.answers.append(r.status_code)
                    self.accepted += self.per_post if r.status_code == 200 else 0

    @property
    def sent(self) -> int:
        with self._lock:
            return self._next

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def __enter__(self) -> Storm:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(300)


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[Service]:
    s = start_job_service(tmp_path)
    yield s
    stop_service(s)


@pytest.mark.timeout(300)
def test_fatal_finding_is_ordered_during_an_alert_storm_and_alerts_are_deduplicated(
        svc: Service) -> None:
    with Storm(svc.server.url, limit=200_000) as storm:
        poll(lambda: storm.sent >= 2000, 60, 0.01)  # the storm is well under way
        fatal = Finding(check="gpu_lost", health=Health.UNHEALTHY,
                        action=SuggestedAction.RESET_GPU, time=time.time(),
                        subject=Subject(kind="gpu", node="node2", gpu=1),
                        reason="GPU fell off the bus")
        svc.push("node2", urgent=True, findings=[fatal])
        orders = {node: poll(functools.partial(svc.commands, node, wait=5), 60, 0)
                  for node in ("node1", "node2")}
        during = storm.running
    total = storm.accepted
    assert all(orders.values()), "the fatal finding produced no order during the storm"
    assert during, "the order came only after the storm was over"
    assert {c["order"]["job"] for cs in orders.values() for c in cs} == {"train-1"}
    assert set(storm.answers) == {200}, "every alert webhook was accepted"
    assert total >= 2000

    # thousands of alerts of 400 label sets: one finding each, one row each (updated)
    findings = poll(lambda: svc.store.scalar(
        "SELECT count(*) FROM findings WHERE check_name LIKE 'alert:Storm%'") >= DISTINCT, 30)
    assert findings and svc.store.scalar(
        "SELECT count(*) FROM findings WHERE check_name LIKE 'alert:Storm%'") == DISTINCT

    def settled() -> Any:
        rows = svc.store.query("SELECT count(*) AS n, sum(count) AS seen FROM alerts")[0]
        return rows if rows["seen"] == total else None

    rows = poll(settled, 30, 0.2) or svc.store.query(
        "SELECT count(*) AS n, sum(count) AS seen FROM alerts")[0]
    assert rows["n"] == DISTINCT and rows["seen"] == total, rows


def test_alert_rows_stay_within_max_rows_and_retention(tmp_path: Path) -> None:
    """More label sets than ``alert_max_rows``: the least recently seen rows go; rows older
    than the retention go at the next flush even when nothing new arrives."""
    store = Store(tmp_path / "collector.db")
    now = [1_000_000.0]
    book = AlertBook(ttl_s=7200, max_rows=50, retention_s=3600, clock=lambda: now[0])
    try:
        jobs = StoreJobView(store)
        for start in range(0, 200, 20):
            book.accept(parse_alerts(json.dumps(storm_payload(start, 20)).encode()),
                        "alertmanager", jobs, now[0])
            book.flush(store)
            now[0] += 1
        assert store.scalar("SELECT count(*) FROM alerts") == 50
        assert store.scalar("SELECT min(last_seen) FROM alerts") >= 1_000_000.0 + 7
        now[0] += 3600 + 120
        book.flush(store)  # nothing new: the retention still applies
        assert store.scalar("SELECT count(*) FROM alerts") == 0
    finally:
        store.close()
