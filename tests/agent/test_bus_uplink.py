"""The agent's NATS uplink (:mod:`forewarn.agent.bus`) against a real nats-server on
loopback: what the spool's bound may drop while the server does not answer."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import nats
import pytest
from prometheus_client import CollectorRegistry

from forewarn import bus
from forewarn.agent.bus import NatsUplink
from forewarn.agent.config import AgentConfig
from forewarn.collector.config import CollectorConfig
from forewarn.collector.ingest.bus import stream_configs
from forewarn.wire import GpuSample

from support.metrics import value
from support.nats_server import start_server
from support.polling import wait_for

NODE = "gpu.a"


async def _add_streams(url: str) -> None:
    nc = await nats.connect(url)
    for config in stream_configs(CollectorConfig()):
        await nc.jetstream().add_stream(config)
    await nc.close()


async def _stored_seqs(url: str) -> set[int]:
    """The agent seqs the batch stream holds (from each message's ``Nats-Msg-Id``)."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    info = await js.stream_info(bus.BATCH_STREAM)
    seqs = set()
    for n in range(info.state.first_seq, info.state.last_seq + 1 if info.state.messages else 0):
        msg = await js.get_msg(bus.BATCH_STREAM, n)
        seqs.add(int((msg.headers or {})["Nats-Msg-Id"].rsplit(":", 1)[1]))
    await nc.close()
    return seqs


def _samples() -> list[GpuSample]:
    return [GpuSample(node=NODE, gpu=g, time=time.time(), source="sim", simulated=True,
                      temperature_c=50.0) for g in range(8)]


@pytest.mark.system
def test_a_batch_published_to_a_stalled_server_is_not_counted_as_dropped(
        tmp_path: Path) -> None:
    # The server takes the publish but does not answer in time (here: SIGSTOPped; in life,
    # a slow or partitioned server): the stream may hold the batch. While the spool
    # overflows, its bound must keep that batch, or the dropped count names it lost.
    server = start_server(tmp_path / "nats")
    asyncio.run(_add_streams(server.url))
    reg = CollectorRegistry()
    up = NatsUplink(AgentConfig(node=NODE, uplink="nats", nats_url=server.url, token="t" * 16,
                                spool_dir=tmp_path / "spool", push_interval_s=3600.0,
                                spool_max_bytes=4096),
                    registry=reg, publish_timeout_s=1.0, retry_s=0.05)
    assert server.proc is not None
    up.start()
    try:
        up.add(samples=_samples(), urgent=True)
        wait_for(lambda: asyncio.run(_stored_seqs(server.url)) == {0}, 30,
                 "the first batch stored")
        server.proc.send_signal(signal.SIGSTOP)
        try:
            up.add(samples=_samples(), urgent=True)  # written to the socket, never answered
            wait_for(lambda: value(reg, "forewarn_uplink_push_errors_total") >= 1, 60,
                     "the publish timing out")

            def overflow() -> bool:
                up.add(samples=_samples())
                return value(reg, "forewarn_uplink_dropped_batches_total") >= 3

            wait_for(overflow, 30, "the spool dropping batches", interval=0.1)
        finally:
            server.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: len(up.spool) == 0, 60, "the spool drained")
    finally:
        up.stop()
    stored = asyncio.run(_stored_seqs(server.url))
    server.stop()
    missing = set(range(up.spool.next_seq)) - stored
    assert 1 in stored  # the batch the stalled server took
    assert value(reg, "forewarn_uplink_dropped_batches_total") == len(missing) > 0
