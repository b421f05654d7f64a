"""A replica that does not lead queues nothing, and a refused leader-only write is said once
(:mod:`forewarn.collector.storage.fence`), on the paths that write besides the policy's
orders: goodput's interval advice (``GET /api/v1/goodput`` answers on any replica), the
leader feed's cursor, and the commands a plain policy (no feed hook) returns.

Real PostgreSQL, two collector services in this process (:class:`support.handover.Service`);
the test ends the leader's lock session as a network cut would. A leader that must not
notice in time checks its lock next in an hour (:func:`~support.handover.lock_checks_every`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import psycopg
import pytest

from forewarn.collector.storage.commands import NodeCommand
from forewarn.collector.storage.state import StateStore
from forewarn.wire import AgentBatch, Command, Finding, encode

from support.collector import TOKENS, Clock, serve
from support.handover import (
    Service,
    end_leader_session,
    feed_waits,
    gpu_lost,
    lock_checks_every,
    ranks,
    rows,
)
from support.polling import wait_for

ADVICE = "SELECT id FROM commands WHERE kind = 'advice'"


def goodput(service: Service) -> httpx.Response:
    return httpx.get(f"{service.server.url}/api/v1/goodput", timeout=30)


def fenced(service: Service) -> float:
    """Leader-only writes of ``service`` refused so far."""
    return float(service.ctx.metrics.fenced_writes._value.get())


def tracebacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.exc_info]


def advised_leader(tmp_path: Path, dsn: str, started: list[Service]
                   ) -> tuple[Service, Service, Clock]:
    """a leads and sent train-1's interval advice (once, at the clock's time), then heard
    the job's step time double, so its advice is due again 300 s later; b follows."""
    clock = Clock(time.time())
    a = Service(tmp_path / "a", dsn, clock=clock, advise_hooks=True)
    started.append(a)
    wait_for(a.leads, 60, "a leads")
    b = Service(tmp_path / "b", dsn, clock=clock, advise_hooks=True)
    started.append(b)
    lock_checks_every(dsn, b, 0.05)  # b, not a again, takes the lock a loses
    a.push("node1", ranks=ranks("train-1", "node1", clock()))
    wait_for(lambda: goodput(a).json() != [], 30, "a's goodput to know train-1")
    wait_for(lambda: len(rows(dsn, ADVICE)) == 1, 30, "a's advice to be queued")
    a.push("node1", ranks=ranks("train-1", "node1", clock(), step_s=0.4))
    a.policy_idle()
    assert len(rows(dsn, ADVICE)) == 1  # held back: sent less than 300 s ago
    return a, b, clock


@pytest.mark.system
def test_an_ex_leaders_goodput_answers_and_queues_no_advice(
        tmp_path: Path, services: tuple[str, list[Service]]) -> None:
    """Before: the ex-leader's GET queued advice beside the real leader's (since the fence,
    the write was refused, counted, and the GET failed); and the advice counted as sent,
    so when it led again it held back what it never sent."""
    dsn, started = services
    a, b, clock = advised_leader(tmp_path, dsn, started)
    end_leader_session(dsn)
    wait_for(b.leads, 30, "b to take the lock")
    wait_for(lambda: not a.leads(), 30, "a to notice it lost the lock")
    refused = fenced(a)  # its feed's cursor save may have been, before it noticed
    clock.t += 301.0  # a's advice is due again
    r = goodput(a)
    assert r.status_code == 200, r.text
    assert r.json()[0]["job"] == "train-1"
    assert len(rows(dsn, ADVICE)) == 1
    assert fenced(a) == refused
    b.stop()  # a leads again: it sends the advice it did not send as a follower
    wait_for(a.leads, 30, "a to lead again")
    assert goodput(a).status_code == 200
    wait_for(lambda: len(rows(dsn, ADVICE)) == 1 + 1, 30, "a's advice, due, to be queued")


@contextlib.contextmanager
def feed_stuck(dsn: str) -> Iterator[None]:
    """The leader's feed stuck in its read of the findings (the test's transaction holds
    the table) until the block ends: it saves no cursor meanwhile."""
    with psycopg.connect(dsn) as conn:
        conn.execute("LOCK TABLE findings IN ACCESS EXCLUSIVE MODE")
        try:
            wait_for(lambda: rows(dsn, FEED_WAITS) == [(1,)], 30,
                     "the leader's feed to wait for the findings")
            yield
        finally:
            conn.rollback()


FEED_WAITS = ("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
              " AND starts_with(query, 'SELECT id, origin, body FROM findings')")


@pytest.mark.system
def test_a_stale_leaders_refused_advice_is_said_once_and_the_goodput_answers(
        tmp_path: Path, services: tuple[str, list[Service]],
        caplog: pytest.LogCaptureFixture) -> None:
    """a has not noticed that b leads, and nothing else of it writes (its feed is stuck),
    so its advice is its first leader-only write: refused, said once, the GET answered."""
    dsn, started = services
    caplog.set_level(logging.WARNING)
    a, b, clock = advised_leader(tmp_path, dsn, started)
    lock_checks_every(dsn, a, 3600.0)
    with feed_stuck(dsn):
        end_leader_session(dsn)
        wait_for(b.leads, 30, "b to take the lock")
        assert a.leads(), "a noticed: the window this test is about is gone"
        clock.t += 301.0  # a's advice is due again
        r = goodput(a)
        assert r.status_code == 200, r.text
        assert r.json()[0]["job"] == "train-1"
    assert len(rows(dsn, ADVICE)) == 1
    assert not a.leads()
    assert fenced(a) == 1
    refusals = [m for m in (r.getMessage() for r in caplog.records) if "refused" in m]
    assert len(refusals) == 1 and "another took the lead" in refusals[0], refusals
    assert tracebacks(caplog) == []


@pytest.mark.system
def test_a_refused_cursor_save_is_said_once_without_a_traceback(
        tmp_path: Path, services: tuple[str, list[Service]],
        caplog: pytest.LogCaptureFixture) -> None:
    """Before: the feed logged "leader feed failed" with a full traceback for every
    refused cursor save, beside the fence's own line."""
    dsn, started = services
    caplog.set_level(logging.WARNING)
    a = Service(tmp_path / "a", dsn)
    started.append(a)
    wait_for(a.leads, 60, "a leads")
    wait_for(lambda: rows(dsn, "SELECT 1 FROM policy_cursor"), 60, "a's feed to run")
    b = Service(tmp_path / "b", dsn)
    started.append(b)
    lock_checks_every(dsn, a, 3600.0)
    end_leader_session(dsn)
    wait_for(b.leads, 30, "b to take the lock")
    wait_for(lambda: not a.leads(), 30, "a's cursor save to be refused")
    assert fenced(a) == 1
    refusals = [m for m in (r.getMessage() for r in caplog.records) if "refused" in m]
    assert len(refusals) == 1 and "another took the lead" in refusals[0], refusals
    assert tracebacks(caplog) == []


class ProbePolicy:
    """A policy with ``on_findings`` alone (no feed hook): a probe of the finding's node,
    its id from the finding, so every replica deciding it queues the same command."""

    def on_findings(self, findings: Sequence[Finding], store: StateStore, now: float
                    ) -> list[NodeCommand]:
        return [NodeCommand(node=f.subject.node, command=Command(
            id=f"probe-{f.check}@{f.subject.node}", kind="probe", issued=now))
            for f in findings if f.subject.node]


@pytest.mark.system
def test_a_plain_policys_refused_commands_are_said_once_and_left_to_the_leader(
        tmp_path: Path, services: tuple[str, list[Service]],
        caplog: pytest.LogCaptureFixture) -> None:
    """A stale leader's feed hands a finding to a policy without the feed hook; the probe
    it returns is refused: said once, no traceback, no policy error, and the finding left
    to the new leader, which queues the probe."""
    dsn, started = services
    caplog.set_level(logging.WARNING)
    a = Service(tmp_path / "a", dsn, policy=ProbePolicy())
    started.append(a)
    wait_for(a.leads, 60, "a leads")
    wait_for(lambda: rows(dsn, "SELECT 1 FROM policy_cursor"), 60, "a's feed to run")
    b = Service(tmp_path / "b", dsn, policy=ProbePolicy())
    started.append(b)
    lock_checks_every(dsn, a, 3600.0)
    started_, release = a.hold_policy()
    assert started_.wait(30)
    a.push("node1", findings=[gpu_lost("node1")])
    wait_for(lambda: feed_waits(dsn, 0.5), 30, "a's feed to hand the finding over")
    end_leader_session(dsn)
    wait_for(b.leads, 30, "b to take the lock")
    assert a.leads(), "a noticed: the window this test is about is gone"
    release.set()
    wait_for(lambda: not a.leads(), 30, "a's probe to be refused")
    wait_for(lambda: rows(dsn, "SELECT id FROM commands") == [("probe-gpu_lost@node1",)], 30,
             "b to decide the finding a left")
    assert fenced(a) == 1
    assert a.ctx.metrics.policy_errors._value.get() == 0
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1
    assert tracebacks(caplog) == []


class BrokenCommandPolicy:
    """A policy whose command cannot be encoded (a bug of a plugged-in policy)."""

    def on_findings(self, findings: Sequence[Finding], store: StateStore, now: float
                    ) -> list[NodeCommand]:
        return [NodeCommand(node="node1", command=Command(
            id="probe-1", kind="probe", issued=now, order=object()))]  # type: ignore[arg-type]


def test_a_command_that_cannot_be_queued_is_a_counted_policy_error(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Embedded state: the findings reach the policy on an item nobody waits for. Before,
    an error queuing its commands was lost with that item: neither counted nor logged."""
    server, store, client = serve(tmp_path, TOKENS, policy=BrokenCommandPolicy())
    try:
        batch = AgentBatch(node="node1", agent_id="agent-1", seq=0, created=time.time(),
                           findings=[gpu_lost("node1")])
        r = client.post("/api/v1/ingest", content=encode(batch), headers={
            "content-type": "application/msgpack",
            "authorization": f"Bearer {TOKENS['node1']}"})
        assert r.status_code == 200, r.text
        wait_for(lambda: any("queuing" in r.getMessage() and r.exc_info
                             for r in caplog.records), 30, "the error to be logged")
        assert "forewarn_collector_policy_errors_total 1.0" in client.get("/metrics").text
    finally:
        client.close()
        server.stop()
        store.close()


OPERATOR_TOKEN = "operator-token-fence-paths-test"


@pytest.mark.system
def test_an_operators_order_a_stale_leader_could_not_queue_goes_to_the_leader(
        tmp_path: Path, services: tuple[str, list[Service]]) -> None:
    """An operator's order reaches a, which has not noticed that b leads: its order is
    refused by the fence. Before, a answered with its decisions (the checkpoint ``act``,
    never queued) and had stored the order's finding under its own origin, which no feed
    hands on: no replica ordered the job. Now a relays it, as a follower does: b orders."""
    dsn, started = services
    a = Service(tmp_path / "a", dsn, operator_token=OPERATOR_TOKEN)
    started.append(a)
    wait_for(a.leads, 60, "a leads")
    wait_for(lambda: rows(dsn, "SELECT 1 FROM policy_cursor"), 60, "a's feed to run")
    b = Service(tmp_path / "b", dsn, operator_token=OPERATOR_TOKEN)
    started.append(b)
    lock_checks_every(dsn, b, 0.05)
    a.push("node1", ranks=ranks("train-1", "node1", time.time()))
    lock_checks_every(dsn, a, 3600.0)
    busy, release = a.hold_policy()
    assert busy.wait(30)
    a.push("node3", findings=[gpu_lost("node3")])  # no job there: no order, no fenced write
    wait_for(lambda: feed_waits(dsn, 0.5), 30, "a's feed to wait for its policy thread")
    end_leader_session(dsn)
    wait_for(b.leads, 30, "b to take the lock")
    assert a.leads(), "a noticed: the window this test is about is gone"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, f"{a.server.url}/api/v1/orders",
                             json={"job": "train-1", "reason": "drill"}, timeout=60,
                             headers={"authorization": f"Bearer {OPERATOR_TOKEN}"})
        wait_for(lambda: rows(dsn, "SELECT 1 FROM findings WHERE origin = 'operator'"), 30,
                 "a to store the operator's order")
        release.set()
        r = answer.result(60)
    assert r.status_code == 200, r.text
    assert r.json()["decisions"] == [] and r.json()["relayed"] == "leader", r.json()
    wait_for(lambda: rows(dsn, "SELECT count(*) FROM commands WHERE kind = 'checkpoint'")
             == [(1,)], 30, "b to order the job")
    assert not a.leads()
