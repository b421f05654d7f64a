"""A replica that lost the lead and has not noticed yet cannot write what only the leader
may write (fencing, :mod:`forewarn.collector.storage.fence`).

Real PostgreSQL; two replicas' stores and lock elections in this process. Replica a leads
with a lock check due only in an hour, so it cannot notice in the test; the test ends its
lock session (``pg_terminate_backend``, as a network cut would) and replica b takes the
lock and leads. Then a, still believing it leads, writes. Without the fence a's order was
stored and delivered to an agent polling b: two leaders' orders for one job."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from forewarn.collector.decide.actions import ActionPipeline, store_decisions
from forewarn.collector.decide.drain import DrainRunner
from forewarn.collector.decide.orders import JobOrder, OrderBook
from forewarn.collector.decide.policy import Policy, PolicySettings
from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.commands import CommandQueue, NodeCommand
from forewarn.collector.storage.fence import NotLeaderError
from forewarn.collector.storage.leader import AdvisoryLockLeader, FindingsFeed
from forewarn.collector.storage.postgres import PostgresStore
from forewarn.wire import (
    CheckpointOrder,
    CheckpointReport,
    Command,
    SaveHold,
    SuggestedAction,
)

from support.handover import end_leader_session, rows
from support.policy import Clock, fleet, gpu_finding
from support.polling import wait_for

pytestmark = pytest.mark.system


class Replica:
    """One replica's state store, command queue and lock election."""

    def __init__(self, dsn: str, interval_s: float) -> None:
        self.store = PostgresStore(dsn)
        self.metrics = CollectorMetrics()
        self.store.fence.on_refused = self.metrics.fenced_writes.inc  # as the app wires it
        self.leader = AdvisoryLockLeader(dsn, interval_s=interval_s, fence=self.store.fence)
        self.commands = CommandQueue(self.store, self.metrics)
        self.leader.start()

    def stop(self) -> None:
        self.leader.stop()
        self.store.close()


@pytest.fixture
def split(postgres_server: Any) -> Iterator[tuple[str, Replica, Replica]]:
    """(dsn, a, b): b leads; a lost the lock and still believes it leads."""
    dsn = postgres_server.database()
    a = Replica(dsn, interval_s=3600.0)  # its one check runs at start: it takes the lock
    started = [a]
    try:
        wait_for(lambda: a.leader.is_leader, 30, "a to lead")
        b = Replica(dsn, interval_s=0.05)
        started.append(b)
        end_leader_session(dsn)
        wait_for(lambda: b.leader.is_leader, 30, "b to take the lock")
        assert a.leader.is_leader, "a noticed: the window this test is about is gone"
        yield dsn, a, b
    finally:
        for r in started:
            r.stop()


def _order(now: float) -> CheckpointOrder:
    return CheckpointOrder(request_id="fence-order-1", job="train-1", step=500,
                           reason="GPU 0 lost", issued=now)


def _action(now: float) -> dict[str, Any]:
    return {"time": now, "kind": "checkpoint", "subject": "job:train-1", "job": "train-1",
            "status": "ordered", "detail": {"request_id": "fence-order-1"}}


WRITES: dict[str, Callable[[Replica, float], object]] = {
    "order": lambda r, now: r.commands.order_checkpoint(["node1"], _order(now), _action(now)),
    "hold": lambda r, now: r.commands.hold_saves(
        ["node1"], SaveHold(request_id="fence-hold-1", job="train-1", onset_step=480,
                            step=500, issued=now), _action(now)),
    "advice": lambda r, now: r.commands.enqueue_many([NodeCommand(
        node="node1", command=Command(id="fence-order-1@node1", kind="checkpoint",
                                      issued=now, order=_order(now)))]),
    "cursor": lambda r, now: _cursor(r),
    "webhook row": lambda r, now: r.store.record_action(**_action(now), lead=True),
}


def _cursor(r: Replica) -> None:
    feed = FindingsFeed(r.store)
    feed.resume()
    feed.save()


@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_leader_that_lost_the_lock_is_refused_and_steps_down(
        split: tuple[str, Replica, Replica], write: str,
        caplog: pytest.LogCaptureFixture) -> None:
    dsn, a, b = split
    caplog.set_level(logging.WARNING, "forewarn.collector.storage.fence")
    with pytest.raises(NotLeaderError, match="another took the lead"):
        WRITES[write](a, time.time())
    # nothing of it is stored, nor delivered to an agent polling the new leader
    assert rows(dsn, "SELECT id FROM commands") == []
    assert rows(dsn, "SELECT id FROM actions") == []
    assert rows(dsn, "SELECT name FROM policy_cursor") == []
    assert b.commands.take("node1") == []
    # a steps down at once; the refusal is counted and said once, naming why
    assert not a.leader.is_leader
    assert a.metrics.fenced_writes._value.get() == 1
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1 and "another took the lead" in refusals[0], refusals
    # a later write of a is refused too (counted, not logged again); b's own writes land
    with pytest.raises(NotLeaderError):
        WRITES[write](a, time.time())
    assert a.metrics.fenced_writes._value.get() == 2
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1
    WRITES[write](b, time.time())
    assert rows(dsn, "SELECT count(*) FROM commands UNION ALL SELECT count(*) FROM actions"
                " UNION ALL SELECT count(*) FROM policy_cursor") != [(0,), (0,), (0,)]


@pytest.mark.parametrize("node", ["n0", "n7"])  # n0 runs a job (an order first); n7 none
def test_a_leader_that_lost_the_lock_sends_no_webhook_and_drains_nothing(
        split: tuple[str, Replica, Replica], node: str, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    dsn, a, _b = split
    caplog.set_level(logging.WARNING, "forewarn.collector.storage.fence")
    clock = Clock()
    sent: list[dict[str, Any]] = []
    drained = tmp_path / f"drained-{node}"
    policy = Policy(PolicySettings(shadow_actions=frozenset()), fleet(jobs=5), clock=clock,
                    record=store_decisions(a.store))
    pipeline = ActionPipeline(
        policy, OrderBook(a.commands, clock=clock), send_webhook=sent.append,
        drain=DrainRunner(["touch", str(tmp_path / "drained-{node}")], enabled=True),
        actions=a.store)
    decided = pipeline.handle_findings(
        [gpu_finding(node, check="gpu_lost", action=SuggestedAction.DRAIN)])
    # n0: the order is refused and nothing after it is tried; n7: webhook and drain are
    assert {d.action for d in decided} == (
        {"checkpoint"} if node == "n0" else {"webhook", "drain"})
    assert sent == [] and not drained.exists()
    assert rows(dsn, "SELECT id FROM commands") == []
    assert rows(dsn, "SELECT kind, status FROM actions") == []
    assert not a.leader.is_leader
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1


def test_a_leader_that_lost_the_lock_answers_a_missed_order_with_nothing(
        split: tuple[str, Replica, Replica], caplog: pytest.LogCaptureFixture) -> None:
    """A rank's miss reaches the stale leader: its reissue is refused, and that is no error
    of the policy (the caller counted it in ``policy_errors`` and logged a traceback): the
    order stays issued, so the next leader answers the stored miss (``reissue_missed``)."""
    dsn, a, _b = split
    caplog.set_level(logging.WARNING)
    clock = Clock()
    policy = Policy(PolicySettings(shadow_actions=frozenset()), fleet(jobs=1), clock=clock,
                    record=store_decisions(a.store))
    job = policy.jobs.job("job0")
    assert job is not None
    book = OrderBook(a.commands, clock=clock)
    book.restore([(JobOrder(request_id="fence-order-1", job="job0", step=600, reason="xid",
                            issued=clock(), nodes=job.nodes, world_size=4, inputs={}), job)],
                 [])
    pipeline = ActionPipeline(policy, book, actions=a.store)
    missed = CheckpointReport(job="job0", rank=0, request_id="fence-order-1", step=700,
                              phase="missed", time=clock())
    assert pipeline.on_report(missed) is None
    order = book.get("fence-order-1")
    assert order is not None and order.status == "issued"
    assert rows(dsn, "SELECT id FROM commands") == []
    assert not a.leader.is_leader
    assert [r.exc_info for r in caplog.records if r.exc_info] == []


def test_the_next_leader_leads_only_after_a_fenced_write_in_flight_ended(
        postgres_server: Any) -> None:
    """The row lock makes the fence exact: a write that passed the fence before the
    takeover holds the next leader's epoch increment until it commits, so the next leader
    reads it at its takeover; every later write of the old leader is refused."""
    dsn = postgres_server.database()
    a = Replica(dsn, interval_s=3600.0)
    b: Replica | None = None
    waiting = ("SELECT count(*) FROM pg_stat_activity WHERE application_name ="
               " 'forewarn-leader' AND wait_event_type = 'Lock'")
    try:
        wait_for(lambda: a.leader.is_leader, 30, "a to lead")
        b = Replica(dsn, interval_s=0.05)
        with a.store.write(lead=True) as tx:  # passed the fence: a still leads
            tx.execute("INSERT INTO actions (time, kind, subject, job, node, status, shadow,"
                       " detail) VALUES (?, 'checkpoint', '', '', '', 'ordered', 0, '{}')",
                       (time.time(),))
            end_leader_session(dsn)
            wait_for(lambda: rows(dsn, waiting) == [(1,)], 30,
                     "b's epoch increment to wait for a's write")
            assert b is not None and not b.leader.is_leader
        wait_for(lambda: b is not None and b.leader.is_leader, 30, "b to lead")
        assert len(rows(dsn, "SELECT id FROM actions")) == 1
        with pytest.raises(NotLeaderError):
            a.commands.order_checkpoint(["node1"], _order(time.time()), _action(time.time()))
        assert len(rows(dsn, "SELECT id FROM actions")) == 1
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_a_fenced_write_left_idle_by_a_stalled_leader_does_not_hold_the_takeover_forever(
        postgres_server: Any) -> None:
    """A leader that stalls (SIGSTOP, a swap storm) inside a fenced write keeps the
    ``leadership`` row share-locked; the next leader's epoch increment waits for it. The
    server ends such a transaction once it sits idle for the fence's ``idle_s``, so the
    takeover goes on and the stalled write is not stored."""
    dsn = postgres_server.database()
    a = Replica(dsn, interval_s=3600.0)
    b: Replica | None = None
    try:
        wait_for(lambda: a.leader.is_leader, 30, "a to lead")
        a.store.fence.idle_s = 1.0
        b = Replica(dsn, interval_s=0.05)
        write = a.store.write(lead=True)
        tx = write.__enter__()  # passed the fence; the leader stalls before its commit
        tx.execute("INSERT INTO actions (time, kind, subject, job, node, status, shadow,"
                   " detail) VALUES (?, 'checkpoint', '', '', '', 'ordered', 0, '{}')",
                   (time.time(),))
        end_leader_session(dsn)
        wait_for(lambda: b is not None and b.leader.is_leader, 30,
                 "b to lead while a's fenced write sits idle")
        with pytest.raises(psycopg.Error):  # the server ended a's stalled transaction
            write.__exit__(None, None, None)
        assert rows(dsn, "SELECT id FROM actions") == []
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_a_replica_leads_and_writes_when_the_leadership_row_is_missing(
        postgres_server: Any) -> None:
    """The ``leadership`` row deleted (a hand-edited or partly restored database): the
    replica that takes the lock makes the row again and leads; its election thread used to
    die on the row its epoch increment did not return, and nobody ever led."""
    dsn = postgres_server.database()
    PostgresStore(dsn).close()  # migrated: the row is there
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM leadership")
    a = Replica(dsn, interval_s=0.05)
    try:
        wait_for(lambda: a.leader.is_leader, 30, "a to lead")
        WRITES["order"](a, time.time())
        assert rows(dsn, "SELECT id FROM commands") == [("fence-order-1@node1",)]
    finally:
        a.stop()


def test_the_election_survives_an_error_it_did_not_foresee(postgres_server: Any) -> None:
    """A replica's election thread goes on whatever one round raises: an error other than
    the database's (here the leadership callback's, once) used to end the thread, and the
    replica then never led again nor stepped down."""
    dsn = postgres_server.database()
    calls: list[bool] = []

    def on_change(leading: bool) -> None:
        calls.append(leading)
        if len(calls) == 1:
            raise ValueError("a metrics callback that fails once")

    leader = AdvisoryLockLeader(dsn, interval_s=0.05, on_change=on_change)
    leader.start()
    try:
        wait_for(lambda: calls[-2:] == [False, True] and leader.is_leader, 30,
                 "the replica to lead again after the failed round")
    finally:
        leader.stop()


def test_a_lead_epoch_the_database_lost_is_not_handed_out_again(postgres_server: Any) -> None:
    """The last epoch increment lost by the database (a failover to an asynchronous standby,
    a crash with ``synchronous_commit = off``: the row holds an earlier epoch than the
    leader took). The next replica to take the lock must not get the epoch the old leader
    still holds: it got it (the row plus one), and the old leader, not yet aware, wrote as
    leader beside it, both passing the fence."""
    dsn = postgres_server.database()
    a = Replica(dsn, interval_s=3600.0)
    b: Replica | None = None
    try:
        wait_for(lambda: a.leader.is_leader, 30, "a to lead")
        held = a.store.fence.epoch
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("UPDATE leadership SET epoch = %s WHERE name = 'policy'", (held - 1,))
        b = Replica(dsn, interval_s=0.05)
        end_leader_session(dsn)
        wait_for(lambda: b is not None and b.leader.is_leader, 30, "b to take the lock")
        assert a.leader.is_leader, "a noticed: the window this test is about is gone"
        assert b.store.fence.epoch != held
        with pytest.raises(NotLeaderError, match="another took the lead"):
            WRITES["order"](a, time.time())
        assert rows(dsn, "SELECT id FROM commands") == []
        assert not a.leader.is_leader
    finally:
        a.stop()
        if b is not None:
            b.stop()
