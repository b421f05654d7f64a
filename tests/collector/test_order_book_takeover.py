"""The order book survives a change of leader and a restart (issue 16): the orders in flight
are rebuilt from the stored commands, actions and checkpoint reports, so a rank that
reports the old leader's step missed gets the order again from the new leader.

Two collector services on a real PostgreSQL (:mod:`support.handover`), and one collector
stopped and started again on its state (SQLite and PostgreSQL).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from forewarn.collector.decide.actions import ActionPipeline
from forewarn.collector.decide.order_history import RESTORE_WINDOW_S, stored_orders
from forewarn.collector.decide.orders import OrderBook
from forewarn.collector.decide.policy import Policy, PolicySettings
from forewarn.collector.jobs.jobmap import apply_checkpoints
from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.commands import CommandQueue, NodeCommand
from forewarn.collector.storage.state import StateStore
from forewarn.wire import (
    CheckpointOrder,
    CheckpointReport,
    Command,
    Finding,
    Health,
    Subject,
    SuggestedAction,
    decode,
)

from support.collector import ranks_on, start_service, stop_service
from support.handover import Service, gpu_lost, leader_and_follower, rows, take_over
from support.policy import T0, Clock, fleet, gpu_finding
from support.polling import wait_for

ORDERS = ("SELECT body FROM commands WHERE node = 'node1' AND kind = 'checkpoint'"
          " ORDER BY created")


def orders_in(bodies: list[Any]) -> list[CheckpointOrder]:
    """The checkpoint orders of these command bodies, oldest first."""
    out = []
    for body in bodies:
        order = decode(bytes(body), Command).order
        assert order is not None
        out.append(order)
    return out


def missed(order: CheckpointOrder, rank: int, step: int) -> CheckpointReport:
    """``rank`` had passed the order's step: it is at ``step``."""
    return CheckpointReport(job=order.job, rank=rank, request_id=order.request_id,
                            step=step, phase="missed", time=time.time())


@pytest.mark.system
@pytest.mark.timeout(240)
def test_the_next_leader_reissues_an_order_of_the_old_leader_that_a_rank_missed(
        tmp_path: Path, services: tuple[str, list[Service]]) -> None:
    dsn, started = services
    a, b = leader_and_follower(tmp_path, dsn, started)
    a.push("node1", findings=[gpu_lost("node1")])

    def ordered() -> list[CheckpointOrder]:
        return orders_in([r[0] for r in rows(dsn, ORDERS)])

    wait_for(ordered, 30, "a to order the job")
    [first] = ordered()
    take_over(dsn, a, b)

    b.push("node1", checkpoints=[missed(first, 0, first.step + 50)])
    wait_for(lambda: len(ordered()) == 2, 30, "b to reissue the order")
    again = ordered()[1]
    assert again.request_id != first.request_id and again.step > first.step + 50


@pytest.mark.usefixtures("state_backend")
def test_a_collector_started_again_reissues_an_order_a_rank_missed(tmp_path: Path) -> None:
    svc = start_service(tmp_path)
    query = "SELECT body FROM commands WHERE node = 'node1' AND kind = 'checkpoint'"

    def ordered() -> list[CheckpointOrder]:
        return sorted(orders_in([r["body"] for r in svc.store.query(query)]),
                      key=lambda o: o.issued)

    try:
        now = time.time()
        svc.push("node1", ranks=ranks_on("node1", 0, now))
        svc.push("node2", ranks=ranks_on("node2", 2, now))
        svc.push("node1", findings=[gpu_lost("node1")])
        wait_for(ordered, 30, "the order")
        [first] = ordered()
    finally:
        stop_service(svc)
    seq = svc.seq
    svc = start_service(tmp_path)
    svc.seq = seq  # the agents go on numbering their batches
    try:
        svc.push("node1", checkpoints=[missed(first, 1, first.step + 50)])
        wait_for(lambda: len(ordered()) == 2, 30, "the order again")
        again = ordered()[1]
        assert again.request_id != first.request_id and again.step > first.step + 50
    finally:
        stop_service(svc)


def leader(store: StateStore, clock: Clock) -> ActionPipeline:
    """A leader's pipeline with its order book rebuilt from ``store``."""
    policy = Policy(PolicySettings(dedup_s=0), fleet(), clock=clock)
    orders = OrderBook(CommandQueue(store, CollectorMetrics()), clock=clock)
    stored = stored_orders(store, policy.jobs, clock.t - RESTORE_WINDOW_S)
    orders.restore(stored.orders.values(), stored.holds, stored.misses)
    return ActionPipeline(policy, orders, actions=store)


def report(request_id: str, rank: int, step: int, job: str = "job0") -> CheckpointReport:
    return CheckpointReport(job=job, rank=rank, request_id=request_id, step=step,
                            phase="missed", time=T0)


def test_an_order_the_old_leader_reissued_is_not_reissued_again(sqlite_state: StateStore) -> None:
    store = sqlite_state
    clock = Clock()
    old = leader(store, clock)
    old.handle_findings([gpu_finding("n0")])
    [first] = old.orders.orders()
    second = old.on_report(report(first.request_id, 0, first.step + 10))
    assert second is not None and second.attempt == 1
    clock.t += 1

    new = leader(store, clock)  # the old leader died
    assert new.orders.get(first.request_id) is not None
    assert new.orders.get(first.request_id).status == "reissued"  # type: ignore[union-attr]
    # another rank missed the first order too: its reissue already went out
    assert new.on_report(report(first.request_id, 1, first.step + 12)) is None
    # a rank missed the reissue: the third attempt
    third = new.on_report(report(second.request_id, 2, second.step + 5))
    assert third is not None and third.attempt == 2 and third.step > second.step + 5


NAN = Finding(check="nan_loss", health=Health.UNHEALTHY, action=SuggestedAction.RESTART_JOB,
              subject=Subject(kind="rank", node="n0", job="job0", rank=0), time=T0,
              reason="loss is NaN", evidence={"bad_step": 480})


def test_a_hold_is_taken_over_and_replaced_when_a_rank_missed_it(sqlite_state: StateStore) -> None:
    store = sqlite_state
    clock = Clock()
    leader(store, clock).handle_findings([NAN])
    [hold] = [c.command.hold for c in store_commands(store) if c.command.hold is not None]
    clock.t += 1
    new = leader(store, clock)
    replacement = new.orders.on_hold_report(report(hold.request_id, 3, hold.step + 4))
    assert replacement is not None and replacement.replaces == hold.request_id
    assert replacement.step == hold.step + 5


def store_commands(store: StateStore) -> list[NodeCommand]:
    return [NodeCommand(node=r["node"], command=decode(bytes(r["body"]), Command))
            for r in store.query("SELECT node, body FROM commands ORDER BY created")]


def test_a_command_that_cannot_be_read_is_skipped_and_counted(
        sqlite_state: StateStore) -> None:
    store, clock = sqlite_state, Clock()
    leader(store, clock).handle_findings([gpu_finding("n0")])
    with store.write() as conn:
        conn.execute("INSERT INTO commands (id, node, kind, body, created, expires)"
                     " VALUES ('bad@n1', 'n1', 'checkpoint', ?, ?, ?)",
                     (b"\xc1 not msgpack", time.time(), time.time() + 60))
    skipped: list[int] = []
    stored = stored_orders(store, fleet(), clock.t - RESTORE_WINDOW_S,
                           lambda: skipped.append(1))
    assert [o.job for o, _ in stored.orders.values()] == ["job0"] and skipped == [1]


def test_a_miss_the_old_leader_had_not_answered_is_answered_at_takeover(
        backend_state: StateStore) -> None:
    store, clock = backend_state, Clock()
    old = leader(store, clock)
    old.handle_findings([gpu_finding("n0")])
    [first] = old.orders.orders()
    # rank 2's miss is stored (ingest), then the old leader died before it answered it
    with store.write() as conn:
        apply_checkpoints(conn, "n0", [report(first.request_id, 2, first.step + 30)])
    clock.t += 1

    new = leader(store, clock)
    assert new.reissue_missed() == 1
    [again] = [o for o in new.orders.orders() if o.attempt == 1]
    assert again.step > first.step + 30
    [row] = store.query("SELECT detail FROM actions WHERE status = 'reissued'")
    assert first.request_id in row["detail"] and again.request_id in row["detail"]
    clock.t += 1
    assert leader(store, clock).reissue_missed() == 0  # answered: not again


def test_a_missed_hold_the_old_leader_had_not_replaced_is_replaced_at_takeover(
        backend_state: StateStore) -> None:
    store, clock = backend_state, Clock()
    leader(store, clock).handle_findings([NAN])
    [hold] = [c.command.hold for c in store_commands(store) if c.command.hold is not None]
    with store.write() as conn:  # rank 3 missed it; the old leader died before it answered
        apply_checkpoints(conn, "n0", [report(hold.request_id, 3, hold.step + 4)])
    clock.t += 1
    assert leader(store, clock).reissue_missed() == 1
    [replacement] = [c.command.hold for c in store_commands(store)
                     if c.command.hold is not None and c.command.hold.replaces]
    assert replacement.replaces == hold.request_id and replacement.step == hold.step + 5
    clock.t += 1
    assert leader(store, clock).reissue_missed() == 0  # replaced: not again
