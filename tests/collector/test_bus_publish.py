"""The bus publisher sends a decision's commands together (issue 16: order latency): each
publish waits for its own JetStream acknowledgement, not for the one before it. A real
nats-server behind a loopback proxy that can hold the server's answers; the real bus
consumer and command queue; order of events only."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from forewarn.collector.config import CollectorConfig
from forewarn.collector.ingest.batch import IngestWriter
from forewarn.collector.ingest.bus import BusConsumer
from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.commands import CommandQueue
from forewarn.collector.storage.store import Store
from forewarn.wire import CheckpointOrder

from support.nats_server import NatsServer, start_server

NODES = [f"gpu.n{i}" for i in range(8)]
COMMAND_PUB = b"PUB forewarn.cmd."
"""What a command's publish (``HPUB``, with its ``Nats-Msg-Id``) looks like on the wire."""


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = start_server(tmp_path / "nats")
    yield server
    server.stop()


class AnswerHold:
    """A loopback TCP proxy in front of nats-server: the client's bytes always go through
    (counting command publishes); the server's (publish acknowledgements among them) wait
    while :attr:`flowing` is clear."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.command_publishes = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"nats://127.0.0.1:{port}"

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        await asyncio.gather(self._to_server(reader, up_writer),
                             self._to_client(up_reader, writer), return_exceptions=True)
        for w in (writer, up_writer):
            w.close()

    async def _to_server(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                         ) -> None:
        tail = b""
        while data := await reader.read(65536):
            seen = tail + data  # a frame split between two reads is still counted once
            self.command_publishes += seen.count(COMMAND_PUB) - tail.count(COMMAND_PUB)
            tail = seen[-len(COMMAND_PUB):]
            writer.write(data)
            await writer.drain()

    async def _to_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                         ) -> None:
        while data := await reader.read(65536):
            await self.flowing.wait()
            writer.write(data)
            await writer.drain()


@pytest.mark.system
def test_a_decisions_commands_are_all_published_before_any_acknowledgement_returns(
        tmp_path: Path, nats_server: NatsServer) -> None:
    """With the server's answers held, every node's command of one decision still goes out:
    the publisher does not wait for the first node's acknowledgement to send the second
    node's. A node's own commands stay in their order: its second (``r2``) waits for the
    first's acknowledgement. (Per command nothing changed: one not acknowledged stays
    delivered and falls due again.)"""
    store = Store(tmp_path / "collector.db")
    metrics = CollectorMetrics()
    queue = CommandQueue(store, metrics)
    sent: list[int] = []

    async def scenario() -> None:
        proxy = AnswerHold(nats_server.port)
        cfg = CollectorConfig(data_dir=tmp_path / "collector", tokens_file=tmp_path / "none",
                              bus_url=await proxy.start())
        consumer = BusConsumer(cfg, IngestWriter(store, metrics), metrics, queue,
                               on_ack=lambda ack, node: "unknown")
        await consumer.start()
        try:
            consumer.nodes.update(NODES)  # their batches came over the bus
            proxy.flowing.clear()
            before = proxy.command_publishes
            for request_id, nodes in (("r1", NODES), ("r2", NODES[:1])):
                order = CheckpointOrder(request_id=request_id, job="job1", step=10,
                                        issued=time.time())
                await asyncio.to_thread(queue.order_checkpoint, nodes, order)
            # Less than the JetStream publish timeout (10 s): one publish waiting for its
            # acknowledgement is still waiting when this ends.
            deadline = time.monotonic() + 5.0
            while proxy.command_publishes - before < len(NODES) and \
                    time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            sent.append(proxy.command_publishes - before)
        finally:
            proxy.flowing.set()
            await consumer.stop()
            await proxy.close()

    try:
        asyncio.run(scenario())
    finally:
        store.close()
    assert sent == [len(NODES)], f"{sent} commands sent before any answer (one per node)"
