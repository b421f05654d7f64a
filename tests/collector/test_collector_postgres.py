"""The scale-out state on a real PostgreSQL: versioned migrations, two collector replicas
sharing one database with the policy on the elected leader (SIGKILL the leader: the other
decides within 5 s), and a real PostgreSQL restart (``pg_ctl stop -m fast``, then start) while
agents push (retried, nothing lost)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from prometheus_client import CollectorRegistry

from forewarn.agent.config import AgentConfig
from forewarn.agent.uplink import Uplink
from forewarn.chaos.exposition import sample
from forewarn.collector.storage.leader import POLICY_LOCK
from forewarn.collector.storage.postgres import PostgresStore, migrations
from forewarn.collector.storage.store import StoreError
from forewarn.demo.servers import PostgresServer
from forewarn.wire import Finding, GpuSample, Health, RankSummary, Subject, SuggestedAction

from support.collector import TOKENS
from support.polling import wait_for
from support.replicas import Replica, write_tokens


def ranks(job: str, node: str, first_rank: int, now: float) -> list[RankSummary]:
    """Two ranks of ``job`` (world size 4) on ``node``, last checkpointed an hour ago."""
    return [RankSummary(job=job, rank=first_rank + g, world_size=4, node=node, gpu=g,
                        pid=100 + first_rank + g, last_step=500, last_step_time=now,
                        step_seconds_p50=0.2, last_checkpoint_step=100,
                        last_checkpoint_time=now - 3600, checkpoint_seconds=30.0)
            for g in range(2)]


def gpu_lost(node: str, gpu: int) -> Finding:
    return Finding(check="gpu_lost", health=Health.UNHEALTHY, action=SuggestedAction.DRAIN,
                   subject=Subject(kind="gpu", node=node, gpu=gpu), time=time.time(),
                   reason=f"GPU {gpu} lost (NVML_ERROR_GPU_IS_LOST)")


def test_migrations_run_once_in_order_and_a_newer_schema_is_refused(
        postgres_server: PostgresServer) -> None:
    dsn = postgres_server.database()
    store = PostgresStore(dsn)
    store.close()
    PostgresStore(dsn).close()  # a second start runs nothing again
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT version, name FROM schema_version ORDER BY version"
                            ).fetchall()
        assert rows == [(n, name) for n, name, _sql in migrations()]
        conn.execute("INSERT INTO schema_version VALUES (999, '0999_future.sql', 0)")
    with pytest.raises(StoreError, match="schema version 999 is newer"):
        PostgresStore(dsn)


@pytest.fixture
def replicas(tmp_path: Path, postgres_server: PostgresServer) -> Iterator[list[Replica]]:
    dsn = postgres_server.database()
    tokens = write_tokens(tmp_path / "tokens.toml")
    # Two jobs, each ordered once: the default breaker (half the jobs per 600 s) would
    # refuse the second; these tests are about failover, not the breaker.
    started = [Replica(tmp_path, name, dsn, tokens, policy_breaker_checkpoint_share=1.0)
               for name in ("a", "b")]
    try:
        yield started
    finally:
        for r in started:
            r.stop()


@pytest.mark.timeout(180)
def test_sigkill_the_leader_and_the_follower_decides_within_5_s(
        replicas: list[Replica]) -> None:
    a, b = replicas
    a.start()
    assert wait_for(lambda: a.role() == "leader", what="a leads")
    b.start()
    time.sleep(1.5)  # several election rounds: the lock is a's
    assert b.role() == "follower"

    # The leader decides on a finding that reached the follower: orders for both nodes
    # of the job, served to each agent by either replica (the queues are shared).
    now = time.time()
    assert a.push("node1", ranks=ranks("train-1", "node1", 0, now)).status_code == 200
    assert b.push("node2", ranks=ranks("train-1", "node2", 2, now)).status_code == 200
    assert b.push("node2", urgent=True, findings=[gpu_lost("node2", 1)]).status_code == 200
    first = [c["order"] for node, r in (("node1", b), ("node2", a))
             for c in r.commands(node, wait=10)]
    assert len(first) == 2 and len({o["request_id"] for o in first}) == 1

    # SIGKILL the leader; a finding about another job, sent to the survivor meanwhile,
    # is decided once it has taken over.
    assert b.push("node3", ranks=ranks("train-2", "node3", 0, now)).status_code == 200
    a.kill()
    killed, killed_at = time.monotonic(), time.time()
    assert b.push("node3", urgent=True, findings=[gpu_lost("node3", 0)]).status_code == 200
    pushed = time.monotonic() - killed
    second = b.commands("node3", wait=10)
    took = time.monotonic() - killed
    assert [c["order"]["job"] for c in second] == ["train-2"]
    assert took < 5.0, (f"the follower decided {took:.1f} s after the leader was killed "
                        f"({_failover_times(b, 'node3', killed_at, pushed)})")
    print(f"failover: the follower decided {took:.2f} s after the leader was killed")
    assert b.role() == "leader"


def _failover_times(replica: Replica, node: str, killed_at: float, pushed: float) -> str:
    """Where a slow failover's time went, in seconds after the kill: the test's push, the
    replica's election, the order's queueing (so a CI failure says which part was slow)."""
    since = replica.client.get("/readyz").json()["components"]["leader"].get("since", 0.0)
    queued = [float(c["created"]) - killed_at for c in replica.client.get(
        "/api/v1/commands/log", params={"node": node}).json()]
    return (f"the finding pushed at {pushed:.2f}, {replica.dir.name} leads from "
            f"{float(since) - killed_at:.2f}, its order queued at {max(queued, default=-1):.2f}")


def one_job_on_both(replicas: list[Replica]) -> tuple[Replica, Replica]:
    """Start ``a`` (it leads), then ``b``; job train-1's ranks on node1 (reported to a)
    and node2 (reported to b)."""
    a, b = replicas
    a.start()
    assert wait_for(lambda: a.role() == "leader", what="a leads")
    b.start()
    now = time.time()
    assert a.push("node1", ranks=ranks("train-1", "node1", 0, now)).status_code == 200
    assert b.push("node2", ranks=ranks("train-1", "node2", 2, now)).status_code == 200
    return a, b


@pytest.mark.timeout(180)
def test_a_leader_killed_before_saving_leaves_its_finding_to_the_next(
        replicas: list[Replica]) -> None:
    """SIGKILL right after the leader queued its orders, before it saved its incident and
    feed cursor (the failover test's interleaving now and then, made certain here: the
    test holds the election lock across the kill and rewinds what was not saved yet).
    The next leader decides that finding again, as one order, and a new one too."""
    a, b = one_job_on_both(replicas)
    assert b.push("node2", urgent=True, findings=[gpu_lost("node2", 1)]).status_code == 200
    assert len(b.commands("node1", wait=10)) == 1
    assert b.push("node3", ranks=ranks("train-2", "node3", 0, time.time())).status_code == 200
    with psycopg.connect(a.dsn, autocommit=True) as lock:
        lock_pid = lock.info.backend_pid
        taken = threading.Thread(target=lambda: lock.execute(
            "SELECT pg_advisory_lock(%s)", (POLICY_LOCK,)))
        taken.start()  # queued behind a's session: b cannot take the lock in between
        with psycopg.connect(a.dsn) as watch:
            wait_for(lambda: watch.execute(
                "SELECT 1 FROM pg_locks WHERE pid = %s AND NOT granted",
                (lock_pid,)).fetchone() is not None, what="the test queued for the lock")
        a.kill()
        taken.join()
        lock.execute("UPDATE policy_cursor SET last_id = 0")
        lock.execute("DELETE FROM incidents")
        lock.execute("SELECT pg_advisory_unlock(%s)", (POLICY_LOCK,))
    assert b.push("node3", urgent=True, findings=[gpu_lost("node3", 0)]).status_code == 200
    assert [c["order"]["job"] for c in b.commands("node3", wait=10)] == ["train-2"]
    with psycopg.connect(a.dsn) as conn:  # train-1's order decided twice is one order
        assert conn.execute("SELECT node FROM commands WHERE kind = 'checkpoint'"
                            " ORDER BY node").fetchall() == [("node1",), ("node2",), ("node3",)]


@pytest.mark.timeout(240)
def test_postgresql_restart_while_agents_push_loses_nothing(
        tmp_path: Path, postgres_server: PostgresServer) -> None:
    server = PostgresServer(postgres_server.bin)  # its own: this test restarts it
    dsn = server.database()
    tokens = write_tokens(tmp_path / "tokens.toml")
    replicas = [Replica(tmp_path, name, dsn, tokens, flush_interval_s=0.5).start()
                for name in ("a", "b")]
    agents = [Uplink(AgentConfig(node=node, collector_url=r.url, token=TOKENS[node],
                                 spool_dir=tmp_path / f"spool-{node}", push_interval_s=0.05),
                     registry=CollectorRegistry(), retry_s=0.1, poll_wait_s=1.0)
              for node, r in (("node1", replicas[0]), ("node2", replicas[1]))]
    sent = {"node1": 0, "node2": 0}
    try:
        for agent in agents:
            agent.start()

        def push(rounds: int) -> None:
            for _ in range(rounds):
                t = time.time()
                for agent in agents:
                    agent.add(samples=[GpuSample(node=agent.node, gpu=g, time=t,
                                                 source="sim", simulated=True,
                                                 temperature_c=50.0) for g in range(4)])
                    sent[agent.node] += 4
                time.sleep(0.02)

        def met() -> bool:
            # A group commit retried, or given up (503: the agent keeps the batch), in the
            # replicas' logs: their /metrics reads the database too, and waits for it.
            return any("group commit" in (r.dir / "log").read_text(errors="replace")
                       for r in replicas)

        push(50)
        # Down until a group commit has met the outage (a restart in one go can fall
        # between two pushes of agents short of CPU, and go unnoticed); the agents push on.
        server.halt()
        wait_for(lambda: push(2) or met(), what="a group commit meeting PostgreSQL down")
        server.start()
        push(50)

        def stored() -> dict[str, int]:
            with psycopg.connect(dsn) as conn:
                return {str(n): int(v) for n, v in conn.execute(
                    "SELECT node, SUM(samples) FROM batches GROUP BY node").fetchall()}

        # Wait for the samples themselves, not for empty spools: a push thread short of
        # CPU (or still sending after the restart) has not sealed the last ones yet, and
        # an empty spool then says nothing about them.
        wait_for(lambda: all(stored().get(n, 0) >= k for n, k in sent.items()),
                 what=f"{sent} samples stored")
        assert stored() == sent  # every sample, once
        for agent in agents:
            wait_for(lambda a=agent: len(a.spool) == 0,  # type: ignore[misc]
                     what=f"{agent.node}'s spool acknowledged")
        for r in replicas:
            wait_for(r.ready, what=f"{r.url} ready again")
    finally:
        for agent in agents:
            agent.stop()
        for r in replicas:
            r.stop()
        server.stop()


@pytest.mark.timeout(180)
def test_an_order_reaches_an_agent_polling_another_replica_at_once(
        replicas: list[Replica]) -> None:
    a, b = one_job_on_both(replicas)
    got: list[list[dict[str, object]]] = []
    poll = threading.Thread(target=lambda: got.append(b.commands("node2", wait=20)))
    poll.start()  # node2's agent waits on the follower ...
    time.sleep(1.0)
    sent = time.monotonic()
    # ... while the leader queues the order (the finding came in through the leader)
    assert a.push("node1", urgent=True, findings=[gpu_lost("node1", 0)]).status_code == 200
    poll.join()
    took = time.monotonic() - sent
    assert [c["kind"] for c in got[0]] == ["checkpoint"]
    assert took < 3.0, f"the follower's long poll answered {took:.1f} s after the finding"
    print(f"cross-replica order: answered {took:.2f} s after the finding")


@pytest.mark.timeout(180)
def test_metrics_answer_while_postgresql_is_down(
        tmp_path: Path, postgres_server: PostgresServer) -> None:
    """A scrape is when an operator needs the collector's figures most, and /metrics read
    the staged-sample count from PostgreSQL on every scrape: with the server down, the
    scrape waited for the connection pool (30 s) past Prometheus's timeout (10 s by
    default). It renders what the collector already knows, staged samples included."""
    server = PostgresServer(postgres_server.bin)  # its own: this test stops it
    replica = Replica(tmp_path, "a", server.database(), write_tokens(tmp_path / "tokens.toml"),
                      flush_interval_s=3600.0).start()  # nothing flushes: samples stay staged
    try:
        t = time.time()
        assert replica.push("node1", samples=[
            GpuSample(node="node1", gpu=g, time=t, source="sim", simulated=True,
                      temperature_c=50.0) for g in range(4)]).status_code == 200
        staged = "forewarn_collector_telemetry_staged_samples"
        wait_for(lambda: replica.metric(staged) == 4, what="4 staged samples")
        server.halt()
        text = replica.client.get("/metrics", timeout=10).text  # Prometheus's default
        assert sample(text, staged) == 4
    finally:
        replica.stop()
        server.stop()
