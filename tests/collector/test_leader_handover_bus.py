"""The leader's decide consumer across a lost lease (issue 16): a batch the leader pulled
from ``decide`` and handed to its policy just as its lease was lost (the policy skips it
then) must not be acknowledged: it goes back to the stream and the next leader decides on
it. Two collector services in this process on a real PostgreSQL and a real nats-server;
the test holds the leader's policy thread and takes its lease away
(:mod:`support.handover`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
import pytest

from forewarn import bus
from forewarn.demo.servers import PostgresServer

from support.bus_stack import COLLECTOR_PASSWORD, TOKENS, send_one_batch
from support.handover import Service, lease_lost, rows
from support.nats_server import NatsServer
from support.polling import wait_for

pytestmark = pytest.mark.system

NODE = "gpu.a"


def decide_unacked(url: str) -> int:
    """Batches the ``decide`` consumer handed out and nobody acknowledged yet."""

    async def ask() -> int:
        nc = await nats.connect(url, user=bus.COLLECTOR_USER, password=COLLECTOR_PASSWORD)
        try:
            info = await nc.jetstream().consumer_info(bus.BATCH_STREAM, bus.DECIDE_CONSUMER)
            return int(info.num_ack_pending)
        finally:
            await nc.close()

    return asyncio.run(ask())


def fed(service: Service) -> float:
    return service.ctx.metrics.registry.get_sample_value(
        "forewarn_collector_decide_batches_total", {"result": "fed"}) or 0.0


@pytest.mark.timeout(240)
def test_a_batch_handed_to_the_policy_as_the_lease_is_lost_reaches_the_next_leader(
        tmp_path: Path, postgres_server: PostgresServer, bus_nats: NatsServer) -> None:
    dsn = postgres_server.database()
    keys = {"bus_url": bus_nats.url, "bus_password": COLLECTOR_PASSWORD,
            "bus_ack_wait_s": 2.0}
    a = Service(tmp_path / "a", dsn, TOKENS, **keys)
    b: Service | None = None
    try:
        wait_for(a.leads, 60, "a leads")
        assert a.ctx.bus is not None
        wait_for(lambda: all(f.status()["pulling"] for f in a.ctx.bus.decide), 60,
                 "a pulls the decide consumers")
        b = Service(tmp_path / "b", dsn, TOKENS, **keys)
        assert not b.leads()

        busy, free = a.hold_policy()
        assert busy.wait(30)
        send_one_batch(bus_nats.url, NODE, tmp_path / "spool", lambda: rows(
            dsn, "SELECT 1 FROM batches WHERE node = %s", NODE))
        # a's decide feed found it stored (none waits for its ingest) and waits for its
        # policy thread with it, unacknowledged.
        lane = a.ctx.bus.decide[0]
        wait_for(lambda: decide_unacked(bus_nats.url) == 1
                 and lane.status()["waiting"] == 0, 30, "a's feed to hand it over")
        with lease_lost(dsn, a):
            free.set()  # a's feed hands the batch to a policy that no longer leads
            a.policy_idle()
            wait_for(lambda: not lane.status()["pulling"], 30,
                     "a's feed to finish with it and let go of the consumer")
            a.stop()  # the next leader is b
        wait_for(b.leads, 30, "b leads")
        # Before the fix a acknowledged the batch it never decided on: b never got it.
        wait_for(lambda: fed(b) >= 1, 30, "the batch fed to b's policy")
    finally:
        a.stop()
        if b is not None:
            b.stop()
