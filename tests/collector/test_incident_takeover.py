"""One checkpoint order and one save hold per job and incident hold across a takeover even
when the old leader died after it queued the order (or the hold) and before it stored the
incident (issue 16).

The leader writes an order with its ``actions`` row in one transaction, and the incidents
that changed after the policy's turn, in another. A leader SIGKILLed between the two leaves
an order whose incident the ``incidents`` table never had. The next leader, on SQLite and
on PostgreSQL (``backend_state``), takes the incident over from the order's decision: the
same fault's next finding joins it and is ``suppressed`` there, as it would have been on
the old leader, instead of opening a new incident that orders the job a second time with
another order id.
"""

from __future__ import annotations

import pytest

from forewarn.collector.decide.actions import ActionPipeline, store_decisions
from forewarn.collector.decide.gate_history import restore_incident_actions, stored_events
from forewarn.collector.decide.incidents import IncidentBook, save_incidents
from forewarn.collector.decide.orders import OrderBook
from forewarn.collector.decide.policy import Policy, PolicySettings
from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.commands import CommandQueue
from forewarn.collector.storage.state import StateStore
from forewarn.wire import Finding, Health, Subject, SuggestedAction

from support.policy import T0, Clock, fleet, gpu_finding

OPEN = "SELECT * FROM incidents WHERE state = 'open'"
COMMANDS = "SELECT count(*) FROM commands WHERE kind = ? AND node = 'n0'"


def leader(store: StateStore, clock: Clock) -> ActionPipeline:
    """A leader as the service builds it: its incidents taken over from the store, its
    gates and which jobs each incident ordered or held rebuilt from the stored decisions
    and actions (what a replica that starts to lead does first)."""
    book = IncidentBook(clock=clock)
    book.load(store.query(OPEN), clock.t)
    policy = Policy(PolicySettings(), fleet(), clock=clock, record=store_decisions(store),
                    incidents=book)
    since = clock.t - policy.gates.window_s()
    policy.gates.restore(stored_events(store, since), clock.t)
    restore_incident_actions(book, store, since)
    return ActionPipeline(policy, OrderBook(CommandQueue(store, CollectorMetrics()),
                                            clock=clock), actions=store)


@pytest.mark.usefixtures("state_backend")
def test_an_order_whose_incident_was_not_stored_still_counts_for_its_incident(
        backend_state: StateStore) -> None:
    store, clock = backend_state, Clock()
    old = leader(store, clock)
    old.handle_findings([gpu_finding("n0", gpu=1, check="gpu_lost")])  # job0 ordered
    assert store.scalar(COMMANDS, ("checkpoint",)) == 1
    # ... and the old leader is SIGKILLed before it stores the incidents that changed

    clock.t += 1.0
    new = leader(store, clock)
    # its feed resumes before the finding (the old leader had not saved its cursor)
    new.handle_findings([gpu_finding("n0", gpu=1, check="gpu_lost")])
    clock.t += 700.0  # past the checkpoint cooldown; the GPU is still lost
    xid = gpu_finding("n0", gpu=1, check="xid")
    new.handle_findings([xid])
    [last] = [d for d in new.policy.decisions if d.action == "checkpoint"][-1:]
    assert last.check == "xid" and last.outcome == "suppressed", last
    assert "already ordered this job" in last.reason, last.reason
    assert store.scalar(COMMANDS, ("checkpoint",)) == 1  # one order, one id
    # the incident it took over is stored now, once, with its order
    save_incidents(store, new.policy.incidents.take_changed())
    [row] = store.query(OPEN)
    assert row["orders"] == 1 and row["checks"] == "gpu_lost,xid", row


def nan_loss(at: float, bad_step: int) -> Finding:
    """Rank 0 of job0 (on n0) reports a NaN loss since ``bad_step``."""
    return Finding(check="nan_loss", health=Health.UNHEALTHY,
                   action=SuggestedAction.RESTART_JOB,
                   subject=Subject(kind="rank", node="n0", job="job0", rank=0), time=at,
                   reason="loss is NaN", evidence={"bad_step": bad_step})


@pytest.mark.usefixtures("state_backend")
def test_a_hold_whose_incident_was_not_stored_still_counts_for_its_incident(
        backend_state: StateStore) -> None:
    store, clock = backend_state, Clock()
    leader(store, clock).handle_findings([nan_loss(T0, 480)])
    assert store.scalar(COMMANDS, ("hold",)) == 1
    # the old leader is SIGKILLed before it stores the incident

    clock.t += 30.0
    new = leader(store, clock)
    new.handle_findings([nan_loss(clock.t, 481)])  # a later report of the same NaN
    [hold] = [d for d in new.policy.decisions if d.action == "hold"]
    assert hold.outcome == "suppressed" and "already held" in hold.reason, hold
    assert store.scalar(COMMANDS, ("hold",)) == 1


@pytest.mark.usefixtures("state_backend")
def test_an_incident_the_store_has_closed_is_not_opened_again(
        backend_state: StateStore) -> None:
    store, clock = backend_state, Clock()
    old = leader(store, clock)
    old.handle_findings([gpu_finding("n0", gpu=1, check="gpu_lost")])
    clock.t += 60.0
    old.handle_findings([gpu_finding("n0", gpu=1, check="gpu_lost", health=Health.HEALTHY)])
    save_incidents(store, old.policy.incidents.take_changed())  # stored: resolved
    clock.t += 1.0
    new = leader(store, clock)
    assert new.policy.incidents.incidents() == []
