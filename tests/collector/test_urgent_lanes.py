"""Urgent batches (a finding or a checkpoint report in them) overtake telemetry inside the
collector, and stay in order among themselves: the ingest writer's queue (a real SQLite
store) and the policy thread's lanes."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

from forewarn.collector.config import CollectorConfig
from forewarn.collector.decide.policy_thread import PolicyThread
from forewarn.collector.http.app import create_app
from forewarn.collector.ingest.batch import POLICY_PART, IngestWriter
from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.state import open_state
from forewarn.collector.storage.store import Store
from forewarn.wire import AgentBatch, Finding, Health, Subject, encode


def finding(health: Health) -> Finding:
    return Finding(check="xid", health=health, subject=Subject(kind="gpu", node="n1", gpu=0),
                   reason="test", time=time.time())


def store_queued(store: Store, writer: IngestWriter, batches: list[AgentBatch]) -> None:
    """Queue every batch before the writer starts, then let it store them all."""
    try:
        futures = [writer.submit(b, encode(b)) for b in batches]  # queued: not started
        writer.start()
        for f in futures:
            f.result(30)
    finally:
        writer.stop()
        store.close()


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
    store_queued(store, writer, batches)
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
                   pool.submit_next(ran.append, "next part"),
                   pool.submit_urgent(ran.append, "urgent 2")]
        release.set()
        for f in futures:
            f.result(30)
    finally:
        release.set()
        pool.shutdown()
    # the next part of the item in progress: after urgent work, before other decision work
    assert ran == ["urgent 1", "urgent 2", "next part", "telemetry 1", "telemetry 2", "alert"]


class _Recorder:
    """A policy that records what the policy thread hands it and holds its first
    telemetry call until released (so work can be queued while it runs)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.busy, self.release = threading.Event(), threading.Event()

    def on_batches(self, batches: Sequence[AgentBatch], now: float) -> None:
        urgent = [b for b in batches if b.urgent]
        self.calls.append(("urgent" if urgent else "telemetry", len(batches)))
        if not urgent and not self.busy.is_set():
            self.busy.set()
            self.release.wait(30)

    def on_findings(self, findings: Sequence[Finding], store: object, now: float) -> None:
        self.calls.append(("decided", len(findings)))


def test_an_urgent_batch_stored_while_the_policy_works_on_a_telemetry_group_waits_for_one_part(
        tmp_path: Path) -> None:
    """The ingest writer hands the policy thread what one group commit stored (up to
    ``group_commit_max`` = 256 batches): it goes to the policy in parts, so an urgent batch
    stored meanwhile is decided after the part in progress, not after the whole group."""
    policy = _Recorder()
    cfg = CollectorConfig(listen="127.0.0.1:0", data_dir=tmp_path / "data",
                          tokens_file=tmp_path / "none.toml")
    store = open_state(cfg)
    ctx = create_app(cfg, store, policy=policy).state.ctx
    now = time.time()
    group = [AgentBatch(node="t1", agent_id="t1", seq=i, created=now) for i in range(256)]
    urgent = AgentBatch(node="n1", agent_id="a1", seq=0, created=now, urgent=True,
                        findings=[finding(Health.UNHEALTHY)])
    try:
        ctx.on_stored(group, [""] * len(group))
        assert policy.busy.wait(30)  # the policy thread is inside the group's first call
        ctx.on_stored([urgent], [""])
        policy.release.set()
    finally:
        policy.release.set()
        ctx.stop_policy_thread()
        store.close()
    first = policy.calls.index(("urgent", 1))
    before = sum(n for kind, n in policy.calls[:first] if kind == "telemetry")
    assert policy.calls[first + 1] == ("decided", 1), policy.calls
    assert sum(n for kind, n in policy.calls if kind == "telemetry") == len(group)
    assert before <= POLICY_PART, f"the urgent batch waited for {before} telemetry batches"


def test_urgent_batches_are_committed_in_a_group_of_their_own(tmp_path: Path) -> None:
    """An urgent batch is handed to the policy once its own small commit is durable, not
    after the telemetry queued behind it was written in the same group commit."""
    calls: list[list[int]] = []
    store = Store(tmp_path / "collector.db")
    writer = IngestWriter(store, CollectorMetrics(),
                          on_stored=lambda batches, _a: calls.append([b.seq for b in batches]))
    now = time.time()
    batches = [AgentBatch(node="n1", agent_id="a1", seq=seq, created=now, urgent=seq == 3,
                          findings=[finding(Health.UNHEALTHY)] if seq == 3 else [])
               for seq in range(64)]
    store_queued(store, writer, batches)
    assert calls[0] == [3], calls
    assert [s for c in calls[1:] for s in c] == [s for s in range(64) if s != 3]
