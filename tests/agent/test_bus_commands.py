"""The agent's command pull over NATS (:mod:`forewarn.agent.bus`) against a real
nats-server on loopback: a pull that finds no command is not a failure."""

from __future__ import annotations

import asyncio
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
from forewarn.wire import CheckpointOrder, Command, encode_json

from support.nats_server import start_server
from support.polling import wait_for

NODE = "gpu.a"


async def _add_streams(url: str) -> None:
    """The collector's streams, as a collector replica creates them."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    for config in stream_configs(CollectorConfig()):
        await js.add_stream(config)
    await nc.close()


async def _send_command(url: str, command: Command) -> None:
    nc = await nats.connect(url)
    await nc.jetstream().publish(bus.subject(bus.COMMAND_PREFIX, NODE), encode_json(command),
                                 headers={"Nats-Msg-Id": command.id})
    await nc.close()


@pytest.mark.system
def test_a_command_pull_that_finds_nothing_is_not_a_failure(tmp_path: Path) -> None:
    # nats-py 2.16's fetch ends an empty pull with nats.errors.TimeoutError, or with
    # asyncio's own TimeoutError when the server's "request timeout" answer lands within
    # 0.1 ms of the deadline (measured on loopback: 2 of 20 empty pulls at a 1 s wait, 1
    # of 50 at 0.2 s, about 1 in 5 at 1 ms). Neither is a failed pull: no error counted,
    # no resubscription. A 1 ms wait makes hundreds of empty pulls in a second or two.
    server = start_server(tmp_path / "nats")
    registry = CollectorRegistry()
    seen: list[str] = []

    def carry_out(command: Command) -> tuple[bool, str]:
        seen.append(command.id)
        return True, "ok"

    up = NatsUplink(AgentConfig(node=NODE, uplink="nats", nats_url=server.url, token="t" * 16,
                                spool_dir=tmp_path / "spool", push_interval_s=3600.0),
                    registry=registry, on_command=carry_out,
                    retry_s=0.01, fetch_wait_s=0.001)
    try:
        asyncio.run(_add_streams(server.url))
        up.start()
        wait_for(lambda: up._nc is not None and up._nc.stats["out_msgs"] >= 400, 60,
                 "hundreds of empty pulls")
        assert registry.get_sample_value("forewarn_uplink_command_poll_errors_total") == 0
        order = CheckpointOrder(job="j1", step=10, reason="test", request_id="r1",
                                issued=time.time())
        asyncio.run(_send_command(server.url, Command(id="r1@gpu.a", kind="checkpoint",
                                                      order=order, issued=time.time())))
        wait_for(lambda: seen, 30, "the command carried out")
        assert seen == ["r1@gpu.a"]
    finally:
        up.stop()
        server.stop()
