"""A checkpoint order or a save hold whose commands could not be queued (the store failed)
does not count as the incident's order or hold of the job: a later finding of the incident
orders the job after the cooldown, and the NaN reported again holds it, as the next leader
would (it counts only the orders and holds carried out, :mod:`.gate_history`); a
replacement hold that could not be queued leaves the missed hold to the rank's next miss.
Real SQLite and PostgreSQL; the store's failure is injected at its write."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import msgspec
import pytest

from forewarn.collector.decide.actions import ActionPipeline
from forewarn.collector.decide.orders import OrderBook
from forewarn.collector.decide.policy import Policy, PolicySettings
from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.commands import CommandQueue
from forewarn.collector.storage.state import StateStore, Transaction
from forewarn.collector.storage.store import StoreError
from forewarn.wire import CheckpointReport, Finding, Health, SaveHold, Subject, SuggestedAction

from support.policy import T0, Clock, fleet


class FailsOnce:
    """``store`` whose next write fails (the database locked, the server gone) while
    ``armed``; every other call is the store's."""

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self.armed = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    @contextlib.contextmanager
    def write(self, *, lead: bool = False) -> Iterator[Transaction]:
        if self.armed:
            self.armed = False
            raise StoreError("database is locked")
        with self._store.write(lead=lead) as conn:
            yield conn


NAN = Finding(check="nan_loss", health=Health.UNHEALTHY, action=SuggestedAction.RESTART_JOB,
              subject=Subject(kind="rank", node="n1", job="job1", rank=0), time=T0,
              reason="loss is NaN", evidence={"bad_step": 480})


def test_a_hold_not_queued_leaves_the_incidents_hold_to_the_next_report(
        backend_state: StateStore) -> None:
    failing, clock = FailsOnce(backend_state), Clock()
    store = cast(StateStore, failing)
    decided: list[Any] = []
    policy = Policy(PolicySettings(), fleet(), clock=clock, record=decided.append)
    pipeline = ActionPipeline(policy, OrderBook(CommandQueue(store, CollectorMetrics()),
                                                clock=clock), actions=backend_state)
    pipeline.handle_findings([NAN])  # its hold fails to be queued
    assert backend_state.scalar("SELECT count(*) FROM commands WHERE kind = 'hold'") == 0
    clock.t += 400.0  # past the dedup: the NaN fires still, in the same incident
    pipeline.handle_findings([msgspec.structs.replace(NAN, time=clock.t)])
    holds = [(str(d.outcome), d.reason) for d in decided if d.action == "hold"]
    assert [o for o, _ in holds] == ["act", "act"], holds
    assert backend_state.scalar("SELECT count(*) FROM commands WHERE kind = 'hold'") == 1


def test_a_later_report_of_an_earlier_onset_moves_the_incidents_hold_back(
        backend_state: StateStore) -> None:
    """One hold per job and incident, unless a finding of the incident says the state went
    bad earlier: the ranks' two NaN reports may reach the collector in either order (rank
    1's at step 21 first: CI at d8f6e52, tests/e2e/test_numerics_e2e.py), and the job's
    onset is the earliest."""
    clock = Clock()
    decided: list[Any] = []
    policy = Policy(PolicySettings(), fleet(), clock=clock, record=decided.append)
    pipeline = ActionPipeline(policy, OrderBook(CommandQueue(backend_state, CollectorMetrics()),
                                                clock=clock), actions=backend_state)
    later = msgspec.structs.replace(NAN, evidence={"bad_step": 481})
    pipeline.handle_findings([later])
    clock.t += 400.0  # past the dedup
    pipeline.handle_findings([msgspec.structs.replace(NAN, time=clock.t)])  # step 480
    clock.t += 400.0
    pipeline.handle_findings([msgspec.structs.replace(later, time=clock.t)])  # 481 again
    holds = [(str(d.outcome), d.inputs.get("onset_step")) for d in decided
             if d.action == "hold"]
    assert holds == [("act", 481), ("act", 480), ("suppressed", 481)], holds


GPU_LOST = Finding(check="gpu_lost", health=Health.UNHEALTHY, action=SuggestedAction.DRAIN,
                   subject=Subject(kind="gpu", node="n1", gpu=0), time=T0,
                   reason="GPU 0 lost")


def test_an_order_not_queued_leaves_the_incidents_order_to_its_next_finding(
        backend_state: StateStore) -> None:
    failing, clock = FailsOnce(backend_state), Clock()
    decided: list[Any] = []
    policy = Policy(PolicySettings(), fleet(), clock=clock, record=decided.append)
    pipeline = ActionPipeline(policy, OrderBook(CommandQueue(cast(StateStore, failing),
                                                             CollectorMetrics()),
                                                clock=clock), actions=backend_state)
    pipeline.handle_findings([GPU_LOST])  # its order fails to be queued
    assert backend_state.scalar("SELECT count(*) FROM commands WHERE kind = 'checkpoint'") == 0
    clock.t += 700.0  # past the cooldown: the GPU is still lost, in the same incident
    pipeline.handle_findings([msgspec.structs.replace(GPU_LOST, time=clock.t)])
    orders = [(str(d.outcome), d.reason) for d in decided if d.action == "checkpoint"]
    assert [o for o, _ in orders] == ["act", "act"], orders
    assert backend_state.scalar("SELECT count(*) FROM commands WHERE kind = 'checkpoint'") > 0


def test_a_replacement_hold_not_queued_leaves_the_hold_to_the_ranks_next_miss(
        backend_state: StateStore) -> None:
    failing, clock = FailsOnce(backend_state), Clock()
    failing.armed = False
    book = OrderBook(CommandQueue(cast(StateStore, failing), CollectorMetrics()), clock=clock)
    job = fleet().job("job1")
    assert job is not None
    hold = book.hold(job, 480, "loss is NaN")
    failing.armed = True  # the store fails as the replacement is queued
    with pytest.raises(StoreError):
        book.on_hold_report(missed(hold, hold.step + 4))
    clock.t += 1
    replacement = book.on_hold_report(missed(hold, hold.step + 6))  # the rank asks again
    assert replacement is not None and replacement.replaces == hold.request_id
    assert replacement.step == hold.step + 7


def missed(hold: SaveHold, step: int) -> CheckpointReport:
    """Rank 0 of the hold's job passed its step: at ``step``, it saved no more."""
    return CheckpointReport(job=hold.job, rank=0, request_id=hold.request_id, step=step,
                            phase="missed", time=T0)
