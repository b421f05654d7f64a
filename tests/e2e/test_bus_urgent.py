"""The urgent lane on the bus, with real processes: a fatal finding overtakes a telemetry
backlog already in the stream. nats-server, one ``forewarn collector`` process (it leads;
policy gates open) on each state backend (embedded SQLite: the finding reaches the policy
from ingest; PostgreSQL: from the leader's findings feed, the batch from its decide
consumers), the real NATS uplink of the agent that reports the finding and pulls its
commands, and a fleet's telemetry published while the collector is stopped (SIGSTOP)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from prometheus_client import CollectorRegistry

from forewarn import bus
from forewarn.agent.bus import NatsUplink
from forewarn.agent.config import AgentConfig
from forewarn.collector.http.auth import hash_token
from forewarn.wire import (
    AgentBatch,
    CheckpointReport,
    Command,
    Finding,
    GpuSample,
    Health,
    RankSummary,
    Subject,
    SuggestedAction,
    encode,
)

from support.bus_stack import COLLECTOR_PASSWORD
from support.collector import TOKENS, ranks_on
from support.nats_server import NatsServer, start_server
from support.polling import wait_for
from support.replicas import Replica, write_tokens

pytestmark = pytest.mark.system

AGENT, FLEET = "node1", "node2"
BACKLOG = 400
"""Telemetry batches in the stream before the fatal finding."""
POLICY = {"policy_dedup_s": 0, "policy_cooldown_checkpoint_s": 0,
          "policy_rate_checkpoint_per_min": 1_000_000, "policy_breaker_checkpoint_share": 1.0,
          "incident_window_s": 0.001}
"""Policy gates open: the fatal finding orders."""


class Ranks:
    """The agent's rank table: two ranks of job ``train-1`` (the uplink's ``feed``)."""

    def summaries(self, node: str, now: float) -> list[RankSummary]:
        return ranks_on(node, 0, now)

    def drain_reports(self) -> list[CheckpointReport]:
        return []


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    auth = bus.authorization({n: hash_token(t) for n, t in TOKENS.items()},
                             COLLECTOR_PASSWORD)
    server = start_server(tmp_path / "nats", authorization=auth)
    yield server
    server.stop()


def stored(collector: Replica, node: str) -> int:
    """Batches of ``node`` the collector has committed (its nodes API)."""
    nodes = collector.client.get("/api/v1/nodes").json()
    return sum(int(n["batches"]) for n in nodes if n["node"] == node)


def publish_backlog(url: str, node: str, count: int) -> None:
    """``count`` telemetry batches of ``node`` (8 GPUs x 5 s), as its agent publishes."""

    async def send() -> None:
        nc = await nats.connect(url, user=bus.node_token(node),
                                password=bus.nats_password(TOKENS[node]),
                                inbox_prefix=bus.inbox_prefix(node))
        js = nc.jetstream(timeout=30)
        now = time.time()
        for seq in range(count):
            samples = [GpuSample(node=node, gpu=g, time=now - 5 + i, source="sim",
                                 simulated=True, temperature_c=50.0)
                       for i in range(5) for g in range(8)]
            batch = AgentBatch(node=node, agent_id=f"agent-{node}", seq=seq,
                               created=now, samples=samples)
            await js.publish(bus.subject(bus.BATCH_PREFIX, node), encode(batch),
                             headers={"Nats-Msg-Id": f"agent-{node}:{seq}"})
        await nc.close()

    asyncio.run(send())


def lane_taken(url: str, consumer: str) -> tuple[int, int]:
    """(messages acknowledged, messages pending) of a consumer of the batch stream."""

    async def ask() -> tuple[int, int]:
        nc = await nats.connect(url, user=bus.COLLECTOR_USER, password=COLLECTOR_PASSWORD)
        info = await nc.jetstream(timeout=30).consumer_info(bus.BATCH_STREAM, consumer)
        await nc.close()
        return (int(info.ack_floor.consumer_seq or 0),
                int(info.num_pending or 0) + int(info.num_ack_pending or 0))

    return asyncio.run(ask())


@pytest.mark.timeout(300)
def test_a_fatal_finding_is_ordered_before_the_telemetry_backlog_is_drained(
        tmp_path: Path, nats_server: NatsServer, state_backend: dict[str, Any]) -> None:
    tokens = write_tokens(tmp_path / "tokens.toml")
    collector = Replica(tmp_path, "c", state_backend.get("postgres_dsn", ""), tokens,
                        **{"state": "sqlite", **state_backend}, bus_url=nats_server.url,
                        bus_password=COLLECTOR_PASSWORD, bus_fetch_max=16, **POLICY)
    ordered: list[int] = []  # the fleet's batches stored when the order arrived
    got_order = threading.Event()

    def on_command(command: Command) -> tuple[bool, str]:
        if command.kind == "checkpoint" and not got_order.is_set():
            ordered.append(stored(collector, FLEET))
            got_order.set()
        return True, "ok"

    cfg = AgentConfig(node=AGENT, uplink="nats", nats_url=nats_server.url,
                      token=TOKENS[AGENT], spool_dir=tmp_path / "spool", push_interval_s=0.5)
    agent = NatsUplink(cfg, registry=CollectorRegistry(), on_command=on_command,
                       feed=Ranks(), retry_s=0.1, publish_timeout_s=5.0, fetch_wait_s=0.5)
    collector.start()
    try:
        agent.start()
        wait_for(lambda: collector.client.get("/api/v1/jobs").json(), 60,
                 "the agent's job known to the collector")
        # A read answered on the policy thread, behind the batches queued there: the
        # policy's one-off work on its first batches (lazy imports) is done.
        assert collector.client.get("/api/v1/goodput").status_code == 200
        os.kill(collector.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
        try:
            publish_backlog(nats_server.url, FLEET, BACKLOG)
            agent.add(findings=[Finding(
                check="gpu_lost", health=Health.UNHEALTHY, action=SuggestedAction.RESET_GPU,
                time=time.time(), subject=Subject(kind="gpu", node=AGENT, gpu=0),
                reason="fell off the bus")])
            wait_for(lambda: len(agent.spool) == 0 and not agent._findings, 30,
                     "the urgent batch in the stream")
        finally:
            os.kill(collector.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
        assert got_order.wait(120), "no checkpoint order reached the agent"
        # The order overtook the backlog: it reached the agent's command consumer while
        # telemetry published before the finding was still waiting in the stream.
        assert ordered[0] < BACKLOG, f"{ordered[0]} of {BACKLOG} backlog batches first"
        # And the backlog is all stored, once (the last seq is the last published).
        wait_for(lambda: stored(collector, FLEET) == BACKLOG, 120, "the backlog stored")
        [fleet] = [n for n in collector.client.get("/api/v1/nodes").json()
                   if n["node"] == FLEET]
        assert (fleet["batches"], fleet["samples"]) == (BACKLOG, 40 * BACKLOG)
        if state_backend:  # shared state: the leader took the urgent batch on its lane
            wait_for(lambda: lane_taken(nats_server.url, bus.DECIDE_URGENT_CONSUMER)[1] == 0,
                     60, "the leader's urgent lane drained")
            assert lane_taken(nats_server.url, bus.DECIDE_URGENT_CONSUMER)[0] >= 1
    finally:
        agent.stop()
        collector.stop()
