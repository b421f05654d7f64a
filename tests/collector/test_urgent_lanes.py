"""Urgent batches (a finding or a checkpoint report in them) overtake telemetry inside the
collector, and stay in order among themselves: the ingest writer's queue (a real SQLite
store) and the policy thread's lanes."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from forewarn.collector.decide.policy_thread import PolicyThread
from forewarn.collector.ingest.batch import IngestWriter
from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.store import Store
from forewarn.wire import AgentBatch, Finding, Health, Subject, encode


def finding(health: Health) -> Finding:
    return Finding(check="xid", health=health, subject=Subject(kind="gpu", node="n1", gpu=0),
                   reason="test", time=time.time())


def test_the_writer_stores_urgent_batches_first_and_in_the_order_they_came(
        tmp_path: Path) -> None:
    stored: list[int] = []
    store = Store(tmp_path / "collector.db")
    writer = IngestWriter(store, CollectorMetrics(),
                          on_stored=lambda batches, _a: stored.extend(b.seq for b in batches))
    # A GPU failing, recovering and failing again, queued behind telemetry: the policy
    # must hear unhealthy, healthy, unhealthy (it ends firing), not the two unhealthy first.
    health = {1: Health.UNHEALTHY, 2: Health.HEALTHY, 3: Health.UNHEALTHY}
    batches = [AgentBatch(node="n1", agent_id="a1", seq=seq, created=time.time(),
                          urgent=seq in health,
                          findings=[finding(health[seq])] if seq in health else [])
               for seq in range(5)]
    try:
        futures = [writer.submit(b, encode(b)) for b in batches]  # queued: not started
        writer.start()
        for f in futures:
            f.result(30)
    finally:
        writer.stop()
        store.close()
    assert stored == [1, 2, 3, 0, 4]


def test_the_policy_thread_runs_urgent_work_first_each_lane_in_order() -> None:
    pool = PolicyThread()
    ran: list[str] = []
    busy, release = threading.Event(), threading.Event()

    def block() -> None:
        busy.set()
        release.wait(30)

    try:
        pool.submit(block)
        assert busy.wait(30)
        futures = [pool.submit(ran.append, "telemetry 1"), pool.submit_bulk(ran.append, "alert"),
                   pool.submit_urgent(ran.append, "urgent 1"),
                   pool.submit(ran.append, "telemetry 2"),
                   pool.submit_urgent(ran.append, "urgent 2")]
        release.set()
        for f in futures:
            f.result(30)
    finally:
        release.set()
        pool.shutdown()
    assert ran == ["urgent 1", "urgent 2", "telemetry 1", "telemetry 2", "alert"]
