"""Only the leader decides (issue 16): two real replicas sharing a real PostgreSQL. A
follower's timers expire nothing while the leader hears the sources; alerts and operator
orders sent to a follower are decided once, by the leader, with the force flag they would
have had there; a follower that takes over runs the timers from the shared state; the
collector's own findings (expiry, job peers) are decided once, by the leader that made them,
not again when its feed reads them back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from forewarn.demo.servers import PostgresServer
from forewarn.wire import Finding, Health, RankSummary, Subject, SuggestedAction

from support.polling import wait_for
from support.replicas import Replica, write_tokens
from support.webhooks import Receiver

pytestmark = pytest.mark.system

ALERT_TOKEN = "alert-token-follower-test"
OPERATOR_TOKEN = "operator-token-follower-test"


def ranks(job: str, node: str, now: float) -> list[RankSummary]:
    """Two ranks of ``job`` on ``node``, last checkpointed an hour ago."""
    return [RankSummary(job=job, rank=g, world_size=2, node=node, gpu=g, pid=100 + g,
                        last_step=500, last_step_time=now, step_seconds_p50=0.2,
                        last_checkpoint_step=100, last_checkpoint_time=now - 3600,
                        checkpoint_seconds=30.0) for g in range(2)]


def hot(node: str) -> Finding:
    """A degraded GPU finding that asks for nothing: it stays open while its agent talks."""
    return Finding(check="gpu_temperature", health=Health.DEGRADED,
                   action=SuggestedAction.NONE, subject=Subject(kind="gpu", node=node, gpu=0),
                   time=time.time(), reason="GPU 0 at 91 C")


def rows(dsn: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(sql, params).fetchall()


@pytest.fixture
def cluster(tmp_path: Path, postgres_server: PostgresServer
            ) -> Iterator[tuple[str, Path, list[Replica]]]:
    """The DSN, the tokens file and the replicas a test starts (stopped at the end)."""
    started: list[Replica] = []
    try:
        yield postgres_server.database(), write_tokens(tmp_path / "tokens.toml"), started
    finally:
        for r in started:
            r.stop()


def leader_and_follower(tmp_path: Path, dsn: str, tokens: Path, started: list[Replica],
                        **keys: Any) -> tuple[Replica, Replica]:
    a = Replica(tmp_path, "a", dsn, tokens, **keys)
    started.append(a.start())
    assert wait_for(lambda: a.role() == "leader", what="a leads")
    b = Replica(tmp_path, "b", dsn, tokens, **keys)
    started.append(b.start())
    assert b.role() == "follower"
    return a, b


@pytest.mark.timeout(180)
def test_a_follower_expires_nothing_and_expires_once_it_leads(
        tmp_path: Path, cluster: tuple[str, Path, list[Replica]]) -> None:
    dsn, tokens, started = cluster
    a = Replica(tmp_path, "a", dsn, tokens, finding_ttl_s=4)
    started.append(a.start())
    assert wait_for(lambda: a.role() == "leader", what="a leads")
    assert a.push("node1", findings=[hot("node1")]).status_code == 200
    assert wait_for(lambda: rows(dsn, "SELECT id FROM incidents WHERE state = 'open'"),
                    what="the incident stored")
    b = Replica(tmp_path, "b", dsn, tokens, finding_ttl_s=4)
    started.append(b.start())  # loads the open incident, never hears its agent
    assert b.role() == "follower"

    # The agent talks to the leader every 0.5 s for three times the TTL: nothing expires.
    # (Before the fix the follower's own expiry timer stored an "expiry" finding for it.)
    until = time.monotonic() + 13.0
    while time.monotonic() < until:
        assert a.push("node1").status_code == 200
        time.sleep(0.5)  # the agent's cadence, not a wait for a result
    expiry = "SELECT count(*) FROM findings WHERE origin = 'expiry'"
    assert rows(dsn, expiry) == [(0,)]
    assert rows(dsn, "SELECT count(*) FROM incidents WHERE state = 'open'") == [(1,)]

    # The leader dies; the follower takes over, its timers run from the shared state: the
    # agent is silent now, so its finding expires once, by the new leader.
    a.kill()
    assert wait_for(lambda: b.role() == "leader", what="b leads")
    assert wait_for(lambda: rows(dsn, expiry) == [(1,)], 30, "the new leader expires it")
    # ... and its feed, reading the expiry finding back, does not run it through the
    # policy again (as an agent's "unknown" finding).
    last = "SELECT (SELECT last_id FROM policy_cursor) >= (SELECT MAX(id) FROM findings)"
    assert wait_for(lambda: rows(dsn, last) == [(True,)], 30, "the feed read it")
    assert b.metric("forewarn_collector_policy_findings_total", result="healthy") == 0


def alert(job: str) -> dict[str, Any]:
    return {"version": "4", "status": "firing", "receiver": "forewarn", "groupLabels": {},
            "commonLabels": {}, "alerts": [{
                "status": "firing", "annotations": {"summary": "loss spikes"},
                "labels": {"alertname": "LossSpike", "job": job, "severity": "critical"},
                "startsAt": "2026-01-01T00:00:00Z", "fingerprint": "00000000000000aa"}]}


@pytest.mark.timeout(180)
def test_alerts_and_orders_sent_to_a_follower_are_decided_once_by_the_leader(
        tmp_path: Path, cluster: tuple[str, Path, list[Replica]]) -> None:
    dsn, tokens, started = cluster
    hooks = Receiver()
    try:
        a, b = leader_and_follower(
            tmp_path, dsn, tokens, started, alert_token=ALERT_TOKEN,
            operator_token=OPERATOR_TOKEN, webhook_urls=[hooks.url], webhook_secret="s" * 32,
            policy_breaker_checkpoint_share=1.0)
        now = time.time()
        assert a.push("node1", ranks=ranks("train-1", "node1", now)).status_code == 200
        assert b.push("node2", ranks=ranks("train-2", "node2", now)).status_code == 200

        def orders(node: str) -> int:
            return int(rows(dsn, "SELECT count(*) FROM commands WHERE node = %s"
                                 " AND kind = 'checkpoint'", node)[0][0])

        def fed(check: str) -> bool:
            """``check``'s finding is stored and the leader's feed has read past it."""
            stored = rows(dsn, "SELECT MAX(id) FROM findings WHERE check_name = %s", check)
            cursor = rows(dsn, "SELECT last_id FROM policy_cursor")
            return stored[0][0] is not None and bool(cursor) and cursor[0][0] >= stored[0][0]

        def checkpoint_decisions(check: str) -> set[tuple[str, str]]:
            """(source, cost model) of the checkpoint decisions about ``check``."""
            return set(rows(dsn, "SELECT inputs::json->>'source',"
                                 " COALESCE(inputs::json->>'cost_model', '') FROM decisions"
                                 " WHERE decision LIKE 'checkpoint:%%'"
                                 " AND inputs::json->>'check' = %s", check))

        def sent_to_the_follower(path: str, body: dict[str, Any], token: str, node: str,
                                 check: str, source: str) -> None:
            """POST to the follower: one order for ``node``'s job, decided by the leader
            with ``source`` and the cost model bypassed, once the feed read it."""
            r = b.client.post(path, json=body, headers={"authorization": f"Bearer {token}"})
            assert r.status_code == 200, r.text
            assert wait_for(lambda: orders(node) >= 1, 30, f"the order of {check}")
            assert wait_for(lambda: fed(check), 30, f"the leader's feed read {check}")
            assert orders(node) == 1
            assert checkpoint_decisions(check) == {
                (source, "bypassed: the alert rule asked for a checkpoint")}

        # An Alertmanager alert: decided by the leader as an alert, not again (as an
        # agent's finding, the cost model asked) when its feed reads it.
        sent_to_the_follower("/api/v1/alerts/alertmanager", alert("train-1"), ALERT_TOKEN,
                             "node1", "alert:LossSpike", "alertmanager")
        # An operator's order: the follower's own policy decides nothing.
        sent_to_the_follower("/api/v1/orders", {"job": "train-2", "reason": "drill"},
                             OPERATOR_TOKEN, "node2", "operator:order", "operator")
        for replica, decided in ((a, True), (b, False)):
            counts = replica.client.get("/metrics").text
            assert ('forewarn_collector_decisions_total{action="checkpoint"' in counts) \
                == decided, replica.url
        assert wait_for(lambda: len(hooks.requests) >= 2, 30, "the webhooks")
        events = [body for _h, body in hooks.requests]
        assert sum(b"LossSpike" in e for e in events) == 1, events
    finally:
        hooks.close()


def straggling(now: float, slow: bool) -> list[RankSummary]:
    """Four ranks of ``train-3`` on node1; rank 3 computes 45% slower when ``slow``."""
    return [RankSummary(job="train-3", rank=g, world_size=4, node="node1", gpu=g,
                        pid=100 + g, last_step=int(now * 4), last_step_time=now,
                        step_seconds_p50=0.3,
                        compute_seconds_p50=0.29 if slow and g == 3 else 0.2)
            for g in range(4)]


@pytest.mark.timeout(180)
def test_the_leaders_own_findings_are_decided_once_not_again_from_its_feed(
        tmp_path: Path, cluster: tuple[str, Path, list[Replica]]) -> None:
    dsn, tokens, started = cluster
    # A short dedup, so that a second pass through the policy shows as a decision (the
    # default 300 s would drop it as a duplicate, but still track it under another source).
    a, _b = leader_and_follower(tmp_path, dsn, tokens, started, straggler_bucket_s=0.5,
                                policy_dedup_s=0.05)

    def found() -> list[tuple[Any, ...]]:
        return rows(dsn, "SELECT id, origin FROM findings WHERE check_name = 'job_straggler'")

    def fed() -> bool:
        cursor = rows(dsn, "SELECT last_id FROM policy_cursor")
        return bool(cursor) and cursor[0][0] >= max(i for i, _o in found())

    # The agent of node1 talks to the leader: its collector compares the ranks' pace
    # (the job-peers detector) and stores a straggler finding with the origin "peers".
    start = time.monotonic()
    while not found() and time.monotonic() < start + 30.0:
        slow = time.monotonic() > start + 3.0  # its peers' pace learned first
        assert a.push("node1", ranks=straggling(time.time(), slow)).status_code == 200
        time.sleep(0.1)  # the agent's cadence, not a wait for a result
    assert found(), "no straggler finding"
    assert {o for _i, o in found()} == {"peers"}
    assert wait_for(fed, 30, "the leader's feed read the straggler findings")
    # Every finding stored went through the leader's policy once (before the fix twice:
    # from the detector, then from the feed as an agent's) ...
    seen = sum(a.metric("forewarn_collector_policy_findings_total", result=r)
               for r in ("evaluated", "duplicate", "healthy"))
    assert seen == rows(dsn, "SELECT count(*) FROM findings")[0][0]
    # ... so each decision about it is the detector's, none an agent's.
    sources = rows(dsn, "SELECT DISTINCT inputs::json->>'source' FROM decisions"
                        " WHERE inputs::json->>'check' = 'job_straggler'")
    assert sources == [("peers",)]


@pytest.mark.timeout(180)
def test_a_firing_alert_re_sent_only_to_a_follower_does_not_expire_on_the_leader(
        tmp_path: Path, cluster: tuple[str, Path, list[Replica]]) -> None:
    dsn, tokens, started = cluster
    a, b = leader_and_follower(tmp_path, dsn, tokens, started, alert_token=ALERT_TOKEN,
                               finding_ttl_s=4, policy_breaker_checkpoint_share=1.0)
    assert a.push("node1", ranks=ranks("train-1", "node1", time.time())).status_code == 200

    def send_to_the_follower() -> None:
        r = b.client.post("/api/v1/alerts/alertmanager", json=alert("train-1"),
                          headers={"authorization": f"Bearer {ALERT_TOKEN}"})
        assert r.status_code == 200, r.text

    send_to_the_follower()
    decided = ("SELECT count(*) FROM decisions WHERE inputs::json->>'check' ="
               " 'alert:LossSpike'")
    assert wait_for(lambda: rows(dsn, decided)[0][0] >= 1, 30, "the leader decides it")
    # Alertmanager re-sends the firing alert every 0.5 s for three times the TTL, always
    # to the follower. (Before the fix the leader never heard of the re-sends and stored
    # an "expiry" finding for it after the TTL.)
    until = time.monotonic() + 13.0
    while time.monotonic() < until:
        send_to_the_follower()
        time.sleep(0.5)  # the sender's cadence, not a wait for a result
    expiry = "SELECT count(*) FROM findings WHERE origin = 'expiry'"
    assert rows(dsn, expiry) == [(0,)]
    # Once the re-sends stop, the alert's source is silent: it expires, once.
    assert wait_for(lambda: rows(dsn, expiry) == [(1,)], 30, "the silent alert to expire")
