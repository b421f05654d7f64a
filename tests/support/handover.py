"""Leadership taken away mid-decision, on purpose: collector services in the test's own
process on a shared PostgreSQL (so a test can hold a service's policy thread with test
code, as a long decision would), and the test's own session that ends the leader's lock
session and holds the lock until the old leader has noticed (nobody leads meanwhile)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import psycopg

from forewarn.collector.cli import ServerThread
from forewarn.collector.config import CollectorConfig
from forewarn.collector.decide.policy_service import PolicyService
from forewarn.collector.http.app import create_app
from forewarn.collector.http.auth import TokenRegistry
from forewarn.collector.http.context import CollectorContext
from forewarn.collector.storage.leader import POLICY_LOCK, AdvisoryLockLeader
from forewarn.collector.storage.state import StateStore, open_state
from forewarn.wire import AgentBatch, Finding, Health, RankSummary, Subject, SuggestedAction, encode

from support.collector import TOKENS
from support.polling import wait_for

__all__ = ["ALERT_TOKEN", "LockHolder", "Service", "end_leader_session", "feed_waits",
           "gpu_lost", "leader_and_follower", "lease_lost", "lock_checks_every", "ranks",
           "rows", "take_over"]


ALERT_TOKEN = "alert-token-handover-test"


class Service:
    """One collector service in this process, on shared PostgreSQL state; ``clock``: the
    collector's (a test's :class:`~support.collector.Clock`), ``policy``: another policy
    than the product's."""

    def __init__(self, root: Path, dsn: str, tokens: Mapping[str, str] = TOKENS, *,
                 clock: Callable[[], float] = time.time, policy: Any = None,
                 **keys: Any) -> None:
        cfg = CollectorConfig(**{
            "listen": "127.0.0.1:0", "data_dir": root / "data", "tokens_file": root / "none.toml",
            "flush_interval_s": 3600, "state": "postgresql", "postgres_dsn": dsn,
            "advise_hooks": False, "predictor_enabled": False, "alert_token": ALERT_TOKEN,
            **keys})
        self.tokens = dict(tokens)
        self.store: StateStore = open_state(cfg)
        app = create_app(cfg, self.store,
                         policy=PolicyService.from_config(cfg) if policy is None else policy,
                         tokens=TokenRegistry(tokens=self.tokens), clock=clock)
        self.ctx: CollectorContext = app.state.ctx
        self.server = ServerThread(app, cfg).start()
        self.seq = 0
        self._releases: list[threading.Event] = []
        self._running = True

    def push(self, node: str, **kw: Any) -> None:
        self.seq += 1
        batch = AgentBatch(node=node, agent_id=f"agent-{node}-{id(self)}", seq=self.seq,
                           created=time.time(), **kw)
        r = httpx.post(f"{self.server.url}/api/v1/ingest", content=encode(batch), timeout=30,
                       headers={"content-type": "application/msgpack",
                                "authorization": f"Bearer {self.tokens[node]}"})
        assert r.status_code == 200, r.text

    def alert(self, job: str) -> None:
        """An Alertmanager alert naming ``job``, firing."""
        body = {"version": "4", "status": "firing", "receiver": "forewarn",
                "groupLabels": {}, "commonLabels": {}, "alerts": [{
                    "status": "firing", "annotations": {"summary": "loss spikes"},
                    "labels": {"alertname": "LossSpike", "job": job, "severity": "critical"},
                    "startsAt": "2026-01-01T00:00:00Z", "fingerprint": "00000000000000aa"}]}
        r = httpx.post(f"{self.server.url}/api/v1/alerts/alertmanager", json=body,
                       headers={"authorization": f"Bearer {ALERT_TOKEN}"}, timeout=30)
        assert r.status_code == 200, r.text

    def hold_policy(self, urgent: bool = False) -> tuple[threading.Event, threading.Event]:
        """Occupy the policy thread with test code (as a long decision would): returns
        (started, release). ``urgent``: queued on the urgent lane, behind what waits
        there; else on the bulk lane."""
        started, release = threading.Event(), threading.Event()
        self._releases.append(release)

        def long_decision() -> None:
            started.set()
            release.wait(120)

        if urgent:
            assert self.ctx.loop is not None
            asyncio.run_coroutine_threadsafe(
                self.ctx.run_policy(long_decision, urgent=True), self.ctx.loop)
        else:
            self.ctx.submit_bulk(long_decision)
        return started, release

    def leads(self) -> bool:
        return self.ctx.leader.is_leader

    def policy_idle(self) -> None:
        """Return once everything queued on the policy thread before this call ran."""
        self.ctx.submit_bulk(lambda: None).result(60)

    def stop(self) -> None:
        """Stop it (again: nothing)."""
        for release in self._releases:
            release.set()
        if self._running:
            self._running = False
            self.server.stop()
            self.store.close()


def rows(dsn: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(sql, params).fetchall()


class LockHolder:
    """The test's own session waiting for the policy lock (``pg_advisory_lock`` queues: it
    gets the lock the moment the holder's session ends, before any replica's next try)."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.held = threading.Event()
        self._thread = threading.Thread(target=self._wait, daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        self.conn.execute("SELECT pg_advisory_lock(%s)", (POLICY_LOCK,))
        self.held.set()

    def release(self) -> None:
        self.conn.close()  # the session ends: the lock is free


def end_leader_session(dsn: str) -> None:
    """End the session that holds the policy lock, as a lost connection would."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        pids = conn.execute("SELECT l.pid FROM pg_locks l JOIN pg_stat_activity a"
                            " ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.granted"
                            " AND a.application_name = 'forewarn-leader'").fetchall()
        assert len(pids) == 1, pids
        conn.execute("SELECT pg_terminate_backend(%s)", (pids[0][0],))


def lock_checks_every(dsn: str, service: Service, interval_s: float) -> None:
    """``service``'s election checks its lock (leading) or tries to take it (following)
    every ``interval_s`` from now on: an hour, and a leader cannot notice losing the lock
    (only a refused fenced write tells it, as on a stalled machine); a short one, and a
    follower takes a lock set free first. Returns once a round of the election ended after
    the change (its wait is the new one). At most one follower: the session of the
    election that does not hold the lock."""
    election = service.ctx.leader
    assert isinstance(election, AdvisoryLockLeader)
    election.interval_s = interval_s
    since = rows(dsn, "SELECT clock_timestamp()")[0][0]
    holds = "" if election.is_leader else "NOT "
    ended = ("SELECT a.state = 'idle' AND a.state_change > %s FROM pg_stat_activity a"
             " WHERE a.application_name = 'forewarn-leader'"
             " AND a.datname = current_database() AND " + holds + "EXISTS (SELECT 1"
             " FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'advisory' AND l.granted)")
    wait_for(lambda: rows(dsn, ended, since) == [(True,)], 30,
             "a round of the election after its interval changed")


def feed_waits(dsn: str, for_s: float = 1.5) -> bool:
    """Whether the leader's feed has not saved its cursor for ``for_s`` (it saves every
    0.2 s unless it waits for its policy thread)."""
    late = rows(dsn, "SELECT extract(epoch FROM now()) - updated FROM policy_cursor")
    return bool(late) and float(late[0][0]) > for_s


@contextlib.contextmanager
def lease_lost(dsn: str, leader: Service) -> Iterator[None]:
    """``leader``'s lock session ends and nobody leads until the block ends (the test's
    session holds the lock meanwhile)."""
    holder = LockHolder(dsn)
    try:
        end_leader_session(dsn)
        assert holder.held.wait(30), "the test's session did not get the lock"
        wait_for(lambda: not leader.leads(), 30, "the leader to notice it lost the lock")
        yield
    finally:
        holder.release()


def ranks(job: str, node: str, now: float, step_s: float = 0.2) -> list[RankSummary]:
    """Two ranks of ``job`` on ``node`` (GPUs 0 and 1, a step in ``step_s``), last
    checkpointed an hour ago."""
    return [RankSummary(job=job, rank=g, world_size=2, node=node, gpu=g, pid=100 + g,
                        last_step=500, last_step_time=now, step_seconds_p50=step_s,
                        last_checkpoint_step=100, last_checkpoint_time=now - 3600,
                        checkpoint_seconds=30.0) for g in range(2)]


def gpu_lost(node: str, gpu: int = 0) -> Finding:
    """An agent's finding that ``node``'s GPU ``gpu`` is lost (checkpoint, webhook, drain)."""
    return Finding(check="gpu_lost", health=Health.UNHEALTHY, action=SuggestedAction.DRAIN,
                   subject=Subject(kind="gpu", node=node, gpu=gpu), time=time.time(),
                   reason=f"GPU {gpu} lost (NVML_ERROR_GPU_IS_LOST)")


def leader_and_follower(tmp_path: Path, dsn: str, started: list[Service], **keys: Any
                        ) -> tuple[Service, Service]:
    """a leads, b follows (both with the config ``keys``); the job train-1 runs on node1
    (two ranks)."""
    a = Service(tmp_path / "a", dsn, **keys)
    started.append(a)
    wait_for(a.leads, 60, "a leads")
    # Its feed runs (it saves its cursor every turn): feed_waits can tell when it stops.
    wait_for(lambda: rows(dsn, "SELECT 1 FROM policy_cursor"), 60, "a's feed to run")
    b = Service(tmp_path / "b", dsn, **keys)
    started.append(b)
    assert not b.leads()
    a.push("node1", ranks=ranks("train-1", "node1", time.time()))
    return a, b


def take_over(dsn: str, a: Service, b: Service) -> float:
    """Stop the leader ``a`` once its feed read every stored finding; ``b`` leads. Returns
    the time b led from."""
    fed = ("SELECT (SELECT last_id FROM policy_cursor) >= (SELECT MAX(id) FROM findings)")
    wait_for(lambda: rows(dsn, fed) == [(True,)], 30, "a's feed to read every finding")
    a.stop()  # its sessions end: the lock is free
    wait_for(b.leads, 30, "b to lead")
    return time.time()
