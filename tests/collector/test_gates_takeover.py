"""The policy's gates survive a change of leader and a restart (issue 16): a new leader, or
a collector started again on its state, rebuilds its cooldowns, rate limits and circuit
breakers from the decisions and actions stored before it decides anything.

Two collector services on a real PostgreSQL (:mod:`support.handover`): the leader acts on
a fault, is stopped (its lock session ends), and the next finding of the same fault reaches
the new leader within the cooldown. Embedded: one collector on SQLite (and on
PostgreSQL), stopped and started again on the same state.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from forewarn.collector.decide.actions import ActionPipeline, store_decisions
from forewarn.collector.decide.gate_history import stored_acts, stored_events
from forewarn.collector.decide.orders import OrderBook
from forewarn.collector.decide.policy import Policy, PolicySettings
from forewarn.collector.decide.severity import ActionKind
from forewarn.collector.decide.webhooks import (
    IDEMPOTENCY_HEADER,
    WebhookEndpoint,
    WebhookSender,
    WebhookVerifier,
)
from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.commands import CommandQueue
from forewarn.collector.storage.state import StateStore
from forewarn.wire import Finding, Health, Subject, SuggestedAction

from support.collector import Service as CollectorService
from support.collector import ranks_on, start_service, stop_service
from support.handover import (
    Service,
    end_leader_session,
    gpu_lost,
    leader_and_follower,
    lock_checks_every,
    rows,
    take_over,
)
from support.policy import Clock, fleet, gpu_finding
from support.polling import wait_for
from support.webhooks import Receiver

ORDERS = "SELECT count(*) FROM commands WHERE node = 'node1' AND kind = 'checkpoint'"
DECIDED_SINCE = "SELECT decision, reason FROM decisions WHERE decision LIKE %s AND time > %s"


def decided_since(dsn: str, action: str, since: float) -> list[tuple[Any, ...]]:
    """The ``action`` decisions (``decision``, ``reason``) stored after ``since``."""
    return rows(dsn, DECIDED_SINCE, f"{action}:%", since)


@pytest.mark.system
@pytest.mark.timeout(240)
def test_the_next_leader_keeps_the_old_leaders_checkpoint_cooldown(
        tmp_path: Path, services: tuple[str, list[Service]]) -> None:
    dsn, started = services
    a, b = leader_and_follower(tmp_path, dsn, started)
    a.push("node1", findings=[gpu_lost("node1", gpu=0)])
    wait_for(lambda: rows(dsn, ORDERS) == [(1,)], 30, "a to order the job")
    wait_for(lambda: rows(dsn, "SELECT 1 FROM actions WHERE kind = 'checkpoint'"
                               " AND status = 'ordered'"), 30, "a to record its order")
    led = take_over(dsn, a, b)

    # the same fault's next finding (the job's other GPU lost) reaches the new leader
    b.push("node1", findings=[gpu_lost("node1", gpu=1)])
    wait_for(lambda: decided_since(dsn, "checkpoint", led), 30, "b to decide it")
    [(decision, reason)] = decided_since(dsn, "checkpoint", led)
    assert decision == "checkpoint:suppressed" and reason.startswith("cooldown"), reason
    assert rows(dsn, ORDERS) == [(1,)]


@pytest.mark.system
@pytest.mark.timeout(240)
def test_a_leader_that_leads_again_takes_over_what_the_leader_between_did(
        tmp_path: Path, services: tuple[str, list[Service]]) -> None:
    """a loses the lock, b leads and orders the job, b goes and a leads again, all while
    a's policy thread is busy (it never saw itself follow). a takes over b's memory as at
    any takeover. Before, it kept its own (it had led, and led again): the same fault's
    next finding ordered the job a second time."""
    dsn, started = services
    a, b = leader_and_follower(tmp_path, dsn, started)
    lock_checks_every(dsn, b, 0.05)  # b, not a again, takes the lock a loses
    busy, release = a.hold_policy()
    assert busy.wait(30)
    end_leader_session(dsn)
    wait_for(b.leads, 30, "b to take the lock")
    b.push("node1", findings=[gpu_lost("node1", gpu=0)])
    wait_for(lambda: rows(dsn, ORDERS) == [(1,)], 30, "b to order the job")
    wait_for(lambda: rows(dsn, "SELECT 1 FROM actions WHERE kind = 'checkpoint'"
                               " AND status = 'ordered'"), 30, "b to record its order")
    led = take_over(dsn, b, a)
    release.set()

    a.push("node1", findings=[gpu_lost("node1", gpu=1)])
    wait_for(lambda: decided_since(dsn, "checkpoint", led), 30, "a to decide it")
    [(decision, reason)] = decided_since(dsn, "checkpoint", led)
    assert decision == "checkpoint:suppressed", reason
    assert rows(dsn, ORDERS) == [(1,)]


@pytest.mark.system
@pytest.mark.timeout(240)
def test_the_drain_rate_limit_holds_across_a_takeover(
        tmp_path: Path, services: tuple[str, list[Service]]) -> None:
    dsn, started = services
    # 2 drains a minute (burst 2); the breaker and the cooldown out of the way
    a, b = leader_and_follower(tmp_path, dsn, started, policy_breaker_drain_share=1.0,
                               policy_rate_drain_per_min=2.0)
    for node in ("node2", "node3"):
        a.push(node)  # known nodes: the breaker's population
    t0 = time.time() - 60
    for node in ("node1", "node2"):
        a.push(node, findings=[gpu_lost(node)])
    wait_for(lambda: len(decided_since(dsn, "drain", t0)) == 2, 30, "a's two drains")
    assert {d for d, _ in decided_since(dsn, "drain", t0)} == {"drain:shadow"}
    led = take_over(dsn, a, b)

    b.push("node3", findings=[gpu_lost("node3")])
    wait_for(lambda: decided_since(dsn, "drain", led), 30, "b to decide the third drain")
    [(decision, reason)] = decided_since(dsn, "drain", led)
    assert decision == "drain:suppressed" and "rate limit" in reason, (decision, reason)


def started_again(tmp_path: Path, finding: Finding, acted: Callable[[CollectorService], bool],
                  what: str) -> tuple[CollectorService, float]:
    """A collector on ``tmp_path`` that saw train-1 (node1 and node2) and acted on
    ``finding`` (``acted`` says when), stopped and started again on its state; with the
    time it started again."""
    svc = start_service(tmp_path)
    try:
        now = time.time()
        svc.push("node1", ranks=ranks_on("node1", 0, now))
        svc.push("node2", ranks=ranks_on("node2", 2, now))
        svc.push("node1", findings=[finding])
        wait_for(lambda: acted(svc), 30, what)
    finally:
        stop_service(svc)
    restarted, seq = time.time(), svc.seq
    svc = start_service(tmp_path)
    svc.seq = seq  # the agents go on numbering their batches
    return svc, restarted


@pytest.mark.usefixtures("state_backend")
def test_a_collector_started_again_keeps_its_cooldowns(tmp_path: Path) -> None:
    svc, restarted = started_again(
        tmp_path, gpu_lost("node1"), lambda s: bool(s.commands("node1")), "the order")
    try:
        # the job's GPU on its other node is lost within the checkpoint cooldown
        svc.push("node2", findings=[gpu_lost("node2", gpu=1)])
        query = ("SELECT decision, reason FROM decisions WHERE decision LIKE 'checkpoint:%'"
                 " AND time > ?")
        wait_for(lambda: svc.store.query(query, (restarted,)), 30, "the second decision")
        [second] = svc.store.query(query, (restarted,))
        assert second["decision"] == "checkpoint:suppressed", second
        assert second["reason"].startswith("cooldown"), second
        assert svc.store.scalar("SELECT count(*) FROM commands WHERE kind = 'checkpoint'"
                                " AND node = 'node2'") == 1
    finally:
        stop_service(svc)


def next_leader(store: StateStore, settings: PolicySettings, clock: Clock) -> Policy:
    """A policy whose gates are rebuilt from ``store``, as a new leader's are."""
    policy = Policy(settings, fleet(), clock=clock, record=store_decisions(store))
    policy.gates.restore(stored_events(store, clock.t - policy.gates.window_s()), clock.t)
    return policy


def test_a_decision_whose_order_was_not_queued_leaves_the_finding_to_the_next_leader(
        sqlite_state: StateStore) -> None:
    store = sqlite_state
    clock, settings = Clock(), PolicySettings()
    finding = gpu_finding("n0", check="gpu_lost", action=SuggestedAction.DRAIN)
    # decided and stored; the leader died before it queued the order or the webhook
    Policy(settings, fleet(), clock=clock, record=store_decisions(store)).evaluate(finding)
    clock.t += 2
    planned = next_leader(store, settings, clock).evaluate(finding)
    outcomes = {p.kind: p.decision.outcome for p in planned}
    # the order and the webhook again (the same order id and idempotency key); the drain
    # counted from its decision: its node is cooling down
    assert outcomes == {ActionKind.CHECKPOINT: "act", ActionKind.WEBHOOK: "act"}


def test_an_order_stored_ahead_of_the_next_leaders_clock_gates_from_its_takeover(
        sqlite_state: StateStore, caplog: pytest.LogCaptureFixture) -> None:
    """Clock skew between replicas: the old leader's clock ran an hour ahead, so its order
    is stored an hour in the next leader's future. Its cooldown counts from the takeover
    at the latest: it held the job's next order back for the skew as well (an hour more
    than the cooldown: the order of the job's next fault was suppressed, lost)."""
    store = sqlite_state
    settings = PolicySettings(shadow_actions=frozenset())
    ahead = Clock()
    ahead.t += 3600.0
    old = Policy(settings, fleet(), clock=ahead, record=store_decisions(store))
    ActionPipeline(old, OrderBook(CommandQueue(store, CollectorMetrics()), clock=ahead),
                   actions=store).handle_findings([gpu_finding("n0", gpu=0, check="gpu_lost")])
    assert store.scalar("SELECT count(*) FROM actions WHERE kind = 'checkpoint'") == 1
    clock = Clock()
    clock.t += 1.0
    policy = next_leader(store, settings, clock)
    clock.t += 600.0 + 1.0  # the checkpoint cooldown, from the takeover, is over
    planned = policy.evaluate(gpu_finding("n0", gpu=1, check="gpu_lost"))
    outcomes = {p.kind: p.decision.outcome for p in planned}
    assert outcomes.get(ActionKind.CHECKPOINT) == "act", policy.decisions
    assert any("ahead of this replica's clock" in r.getMessage() for r in caplog.records)


def test_a_tripped_breaker_stays_tripped_for_the_next_leader(sqlite_state: StateStore) -> None:
    store = sqlite_state
    clock = Clock()
    settings = PolicySettings(breaker_share={"drain": 0.2}, shadow_actions=frozenset(),
                              rate_per_minute={"drain": 1000.0}, burst={"drain": 1000.0})
    old = Policy(settings, fleet(nodes=10, jobs=0), clock=clock,
                 record=store_decisions(store))
    for i in range(3):  # 20 % of 10 nodes: two drains, the third refused (and alerted)
        clock.t += 1
        old.evaluate(gpu_finding(node=f"n{i}", action=SuggestedAction.DRAIN))
    clock.t += 1
    new = next_leader(store, settings, clock)
    planned = new.evaluate(gpu_finding(node="n3", action=SuggestedAction.DRAIN))
    drains = [d for d in new.decisions if d.action == "drain"]
    assert [d.outcome for d in drains] == ["refused"], drains
    assert not [p for p in planned if p.decision.target == "breaker:drain"], "alerted twice"


async def deliver(events: list[dict[str, Any]], receiver: Receiver, secret: bytes) -> None:
    """Send ``events`` to ``receiver`` through a real sender, signed with ``secret``."""
    sender = WebhookSender([WebhookEndpoint(receiver.url, "json", secret)])
    await sender.start()
    try:
        for event in events:
            sender.send(event)
        assert await sender.drain(20.0)
    finally:
        await sender.stop()


def test_a_finding_decided_again_by_the_next_leader_sends_webhooks_with_one_key(
        sqlite_state: StateStore) -> None:
    store = sqlite_state
    clock, secret = Clock(), b"webhook-secret-for-tests"
    events: list[dict[str, Any]] = []

    def leader() -> ActionPipeline:
        """A leader's pipeline (its gates empty: the old leader had not recorded what it
        queued when it died, so the next one decides the finding again)."""
        policy = Policy(PolicySettings(), fleet(), clock=clock)
        orders = OrderBook(CommandQueue(store, CollectorMetrics()), clock=clock)
        return ActionPipeline(policy, orders, send_webhook=events.append)

    finding = gpu_finding("n0", check="gpu_lost", action=SuggestedAction.DRAIN)
    leader().handle_findings([finding])
    clock.t += 2.0
    leader().handle_findings([finding])
    leader().handle_findings([gpu_finding("n0", gpu=2, check="gpu_lost")])  # another one
    receiver = Receiver()
    try:
        asyncio.run(deliver(events, receiver, secret))
    finally:
        receiver.close()
    keys = [{k.lower(): v for k, v in headers.items()}[IDEMPOTENCY_HEADER.lower()]
            for headers, _ in receiver.requests]
    bodies = [json.loads(body) for _, body in receiver.requests]
    assert len(keys) == 3 and keys[0] == keys[1] != keys[2], keys
    assert bodies[0]["id"] != bodies[1]["id"]  # two decisions, one event for the receiver
    for (headers, body), key in zip(receiver.requests, keys, strict=True):
        WebhookVerifier(secret).verify(body, headers)  # the signature covers the key:
        assert json.loads(body)["idempotency_key"] == key  # it is in the signed body too


def test_a_decision_row_that_cannot_be_read_is_skipped_and_counted(
        sqlite_state: StateStore) -> None:
    store, clock = sqlite_state, Clock()
    settings = PolicySettings(shadow_actions=frozenset({"drain"}))
    old = Policy(settings, fleet(), clock=clock, record=store_decisions(store))
    old.evaluate(gpu_finding("n1", action=SuggestedAction.DRAIN))  # a shadow drain of n1
    store.record_decision(time=clock.t, decision="drain:act", reason="r",
                          inputs={"id": "x", "node": "n2"})  # no target
    store.record_decision(time=clock.t, decision="reboot:act", reason="r",
                          inputs={"id": "y", "target": "node:n3"})  # no such action
    skipped: list[int] = []
    events = stored_events(store, clock.t - 3600, lambda: skipped.append(1))
    assert [(e.kind, e.target) for e in events] == [(ActionKind.DRAIN, "node:n1")]
    assert len(skipped) == 2


def test_stored_acts_return_each_stored_check_as_it_is(sqlite_state: StateStore) -> None:
    store, clock = sqlite_state, Clock()
    for n, check in enumerate(["xid", None]):
        store.record_decision(time=clock.t, job="train-1", decision="checkpoint:act",
                              reason="r", inputs={"id": f"d{n}", "incident": "i1",
                                                  "check": check})
        store.record_action(time=clock.t, kind="checkpoint", job="train-1",
                            status="queued", detail={"decision": f"d{n}"})
    since = clock.t - 60
    assert sorted(((a.incident, a.job, a.check) for a in stored_acts(store, since)),
                  key=str) == [("i1", "train-1", "xid"), ("i1", "train-1", None)]  # not "None"


@pytest.mark.system
@pytest.mark.timeout(240)
def test_the_next_leader_knows_which_jobs_an_incident_ordered(
        tmp_path: Path, services: tuple[str, list[Service]]) -> None:
    dsn, started = services
    # no cooldown: only "one checkpoint order per job and incident" holds a second one back
    a, b = leader_and_follower(tmp_path, dsn, started, policy_cooldown_checkpoint_s=0.0)
    a.push("node1", findings=[gpu_lost("node1", gpu=0)])
    wait_for(lambda: rows(dsn, ORDERS) == [(1,)], 30, "a to order the job")
    wait_for(lambda: rows(dsn, "SELECT 1 FROM incidents WHERE orders = 1"), 30,
             "a to store the incident")
    led = take_over(dsn, a, b)

    # another finding about the same GPU, no worse: the same incident, not escalated
    xid = Finding(check="xid", health=Health.UNHEALTHY, action=SuggestedAction.CHECKPOINT,
                  subject=Subject(kind="gpu", node="node1", gpu=0), time=time.time(),
                  reason="XID 48 on GPU 0")
    b.push("node1", findings=[xid])
    wait_for(lambda: decided_since(dsn, "checkpoint", led), 30, "b to decide it")
    [(decision, reason)] = decided_since(dsn, "checkpoint", led)
    assert decision == "checkpoint:suppressed" and "already ordered this job" in reason, reason
    assert rows(dsn, ORDERS) == [(1,)]


def test_the_gates_window_is_the_longest_of_theirs() -> None:
    gates = Policy(PolicySettings(), fleet()).gates
    assert gates.window_s() == 3600.0  # the drain cooldown
    off = PolicySettings(cooldown_s={}, rate_per_minute={"drain": 0.0, "checkpoint": 6.0},
                         burst={"checkpoint": 100.0})
    # checkpoint's bucket takes 1,000 s to fill; a drain bucket that never fills is no limit
    assert Policy(off, fleet()).gates.window_s() == 1000.0


def nan_loss(at: float) -> Finding:
    """Rank 0 of train-1 (on node1) reports a NaN loss at step 480 (reported at ``at``)."""
    return Finding(check="nan_loss", health=Health.UNHEALTHY,
                   action=SuggestedAction.RESTART_JOB,
                   subject=Subject(kind="rank", node="node1", job="train-1", rank=0), time=at,
                   reason="loss is NaN", evidence={"bad_step": 480})


@pytest.mark.usefixtures("state_backend")
def test_a_collector_started_again_does_not_hold_a_job_twice_for_one_incident(
        tmp_path: Path) -> None:
    holds = "SELECT count(*) FROM commands WHERE kind = 'hold'"
    svc, restarted = started_again(
        tmp_path, nan_loss(time.time()), lambda s: s.store.scalar(holds) == 2,
        "the hold (one per node)")
    try:
        # the same NaN reported again, later: a repeat the first run would have dropped
        svc.push("node1", findings=[nan_loss(time.time())])
        query = "SELECT decision, reason FROM decisions WHERE decision LIKE 'hold:%' AND time > ?"
        wait_for(lambda: svc.store.query(query, (restarted,)), 30, "the second decision")
        [second] = svc.store.query(query, (restarted,))
        assert second["decision"] == "hold:suppressed", second
        assert svc.store.scalar(holds) == 2
    finally:
        stop_service(svc)
