"""Retention: the running collector prunes every record older than ``retention_days`` on
its own (a periodic task), never live state (a node or job still reporting, an open
finding), and reports the rows pruned and the size of its data as metrics."""

from __future__ import annotations

import time
from pathlib import Path

from forewarn.wire import Finding, GpuSample, Health, RankSummary, Subject, XidEvent

from support.collector import TOKENS, Clock, Service, serve, stop_service
from support.polling import wait_for

DAY = 86400.0


def ranks(job: str, node: str, now: float) -> list[RankSummary]:
    return [RankSummary(job=job, rank=0, world_size=1, node=node, gpu=0, pid=100,
                        last_step=10, last_step_time=now, step_seconds_p50=0.2)]


def samples(node: str, t: float) -> list[GpuSample]:
    return [GpuSample(node=node, gpu=0, time=t, source="sim", temperature_c=50.0)]


def finding(node: str, check: str, health: Health, t: float) -> Finding:
    return Finding(check=check, health=health, reason=f"{check} {health.value}", time=t,
                   subject=Subject(kind="gpu", node=node, gpu=0))


def count(svc: Service, sql: str) -> int:
    return int(svc.store.scalar(sql))


def test_the_running_collector_prunes_old_records_but_never_live_state(
        tmp_path: Path) -> None:
    start = time.time() - 10 * DAY
    clock = Clock(start)
    svc = Service(*serve(tmp_path, TOKENS, clock, retention_days=2,
                         retention_interval_s=0.1, alert_token="a" * 20), {})
    try:
        svc.push("node1", ranks=ranks("old-job", "node1", start), samples=samples("node1", start),
                 findings=[finding("node1", "ecc", Health.UNHEALTHY, start)],
                 xids=[XidEvent(node="node1", gpu=0, code=79, text="fell off", time=start,
                                    source="kmsg")])
        svc.push("node2", ranks=ranks("live-job", "node2", start),
                 findings=[finding("node2", "ecc", Health.UNHEALTHY, start),   # open
                           finding("node2", "thermal", Health.DEGRADED, start),
                           finding("node2", "thermal", Health.HEALTHY, start + 1)])
        svc.store.record_action(time=start, kind="webhook", status="sent")
        svc.store.record_decision(time=start, decision="none", reason="old", inputs={})
        assert count(svc, "SELECT COUNT(*) FROM nodes") == 2
        # Five days on, only node2 and its job still report.
        clock.t = start + 5 * DAY
        svc.push("node2", ranks=ranks("live-job", "node2", clock.t),
                 samples=samples("node2", clock.t))
        wait_for(lambda: svc.metric("forewarn_collector_pruned_rows_total", table="nodes"),
                 timeout=30, what="a retention pass")
        assert [r["node"] for r in svc.store.query("SELECT node FROM nodes")] == ["node2"]
        assert [r["job"] for r in svc.store.query("SELECT job FROM jobs")] == ["live-job"]
        assert [r["job"] for r in svc.store.query("SELECT job FROM ranks")] == ["live-job"]
        assert [r["node"] for r in svc.store.query("SELECT node FROM gpus")] == ["node2"]
        # The open finding stays (its GPU is still unhealthy); the rest are older than
        # the retention and gone, with node1's XID, action and decision.
        left = svc.store.query("SELECT node, check_name, health FROM findings")
        assert left == [{"node": "node2", "check_name": "ecc", "health": "unhealthy"}]
        assert count(svc, "SELECT COUNT(*) FROM xids") == 0
        assert count(svc, f"SELECT COUNT(*) FROM actions WHERE time < {start + DAY}") == 0
        assert count(svc, "SELECT COUNT(*) FROM decisions WHERE reason = 'old'") == 0
        assert count(svc, "SELECT COUNT(*) FROM batches") == 1  # node2's newest
        assert svc.metric("forewarn_collector_pruned_rows_total", table="findings") == 3
        size = svc.metric("forewarn_collector_data_bytes", part="sqlite")
        assert size is not None and size > 0
        # Live state keeps working after a pass: node1 comes back and is stored again.
        svc.push("node1")
        assert count(svc, "SELECT COUNT(*) FROM nodes") == 2
    finally:
        stop_service(svc)


def test_a_large_prune_runs_in_chunks_and_removes_everything_old(tmp_path: Path) -> None:
    from forewarn.collector.storage.store import Store

    store = Store(tmp_path / "c.db")
    try:
        for i in range(23):
            store.record_decision(time=1000.0 + i, decision="none", reason="old", inputs={})
        store.record_decision(time=5000.0, decision="none", reason="new", inputs={})
        counts = store.prune(2000.0, chunk=5)
        assert counts["decisions"] == 23
        assert [r["reason"] for r in store.query("SELECT reason FROM decisions")] == ["new"]
    finally:
        store.close()
