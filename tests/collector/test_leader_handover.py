"""Leadership that changes hands mid-decision loses no order and duplicates none (issue 16).

* A finding the leader's feed took just before its lease was lost must be decided by the
  next leader: the feed may save its cursor past a finding only once the finding was
  decided in the term it was taken in. Two collector services sharing a real PostgreSQL;
  the test holds the leader's policy thread busy, ends its lock session, and holds the
  lock itself until the old leader has given up.
* A finding decided twice (by the old leader and again by the new one, which cannot know
  how far the old one got) gives one order: its id comes from the finding and the job, so
  the second is the same command (the queue keeps it once, JetStream drops its copy by
  ``Nats-Msg-Id`` and agents apply a command id once).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from forewarn.collector.config import CollectorConfig
from forewarn.collector.decide.actions import ActionPipeline
from forewarn.collector.decide.orders import OrderBook
from forewarn.collector.decide.policy import Policy, PolicySettings
from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.commands import CommandQueue
from forewarn.collector.storage.state import StateStore, open_state
from forewarn.wire import SuggestedAction

from support.handover import Service, feed_waits, gpu_lost, leader_and_follower, lease_lost, rows
from support.policy import Clock, fleet, gpu_finding
from support.polling import wait_for


@pytest.mark.system
@pytest.mark.timeout(240)
def test_a_finding_taken_as_the_lease_is_lost_is_decided_by_the_next_leader(
        tmp_path: Path, services: tuple[str, list[Service]]) -> None:
    dsn, started = services
    a, b = leader_and_follower(tmp_path, dsn, started)

    # a's policy thread is busy (as with a long decision) when the finding arrives at b.
    busy, free = a.hold_policy()
    assert busy.wait(30)
    b.push("node1", findings=[gpu_lost("node1")])
    wait_for(lambda: feed_waits(dsn), 30, "a's feed to wait for its policy thread")
    with lease_lost(dsn, a):
        free.set()  # a's feed now hands the finding to a policy that no longer leads
        a.policy_idle()
    next_leader_orders_once(dsn, a, b, "gpu_lost")


@pytest.mark.system
@pytest.mark.timeout(240)
def test_an_alert_waiting_for_the_bulk_lane_as_the_lease_is_lost_is_decided_by_the_next(
        tmp_path: Path, services: tuple[str, list[Service]]) -> None:
    dsn, started = services
    a, b = leader_and_follower(tmp_path, dsn, started)

    busy, free = a.hold_policy()
    assert busy.wait(30)
    b.alert("train-1")  # b stores it; a's feed reads it and waits for the policy thread
    wait_for(lambda: feed_waits(dsn), 30, "a's feed to wait for its policy thread")
    # Behind the feed's turn, more decision work: the alert it queues for the bulk lane
    # waits, and meanwhile the feed saved its cursor (before the fix, past the alert).
    busy2, free2 = a.hold_policy(urgent=True)
    free.set()
    assert busy2.wait(30)
    wait_for(lambda: not feed_waits(dsn, 0.5), 30, "a's feed to go on")
    with lease_lost(dsn, a):
        free2.set()  # the alert's turn now finds a no longer leads
        a.policy_idle()
    next_leader_orders_once(dsn, a, b, "alert:LossSpike")


def next_leader_orders_once(dsn: str, a: Service, b: Service, check: str) -> None:
    """Whichever leads next orders node1's job once about the finding of ``check``."""
    wait_for(lambda: a.leads() or b.leads(), 30, "a new leader")

    def orders() -> int:
        return int(rows(dsn, "SELECT count(*) FROM commands WHERE node = 'node1'"
                             " AND kind = 'checkpoint'")[0][0])

    wait_for(lambda: orders() >= 1, 30, "the next leader to order the job")
    fed = ("SELECT (SELECT last_id FROM policy_cursor) >="
           " (SELECT MAX(id) FROM findings WHERE check_name = %s)")
    wait_for(lambda: rows(dsn, fed, check) == [(True,)], 30, "the feed to read past it")
    assert orders() == 1


def pipeline(store: StateStore, clock: Clock) -> ActionPipeline:
    """A leader's policy and order book (fresh: a new leader starts with empty ones)."""
    metrics = CollectorMetrics()
    policy = Policy(PolicySettings(), fleet(), clock=clock)
    return ActionPipeline(policy, OrderBook(CommandQueue(store, metrics), clock=clock))


def test_a_finding_decided_again_by_the_next_leader_orders_the_job_once(
        tmp_path: Path) -> None:
    store = open_state(CollectorConfig(data_dir=tmp_path / "data",
                                       tokens_file=tmp_path / "none.toml"))
    try:
        clock = Clock()
        finding = gpu_finding("n0", check="gpu_lost", action=SuggestedAction.DRAIN)
        old, new = pipeline(store, clock), pipeline(store, clock)
        first = old.handle_findings([finding])
        clock.t += 2.0  # the new leader decides it a moment later, with its own S
        second = new.handle_findings([finding])
        assert [d.outcome for d in first if d.action == "checkpoint"] == ["act"]
        assert [d.outcome for d in second if d.action == "checkpoint"] == ["act"]
        commands = store.query("SELECT id, node FROM commands WHERE kind = 'checkpoint'")
        assert [c["node"] for c in commands] == ["n0"], commands
    finally:
        store.close()
