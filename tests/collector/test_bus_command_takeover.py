"""An order whose publication is in doubt survives the replica that published it (issue
16). A replica takes a command from the shared queue (marks it delivered: durable) and
then publishes it to the node's command subject; if it dies in between, or the publish
gets no answer, the publication is in doubt. The queue makes the command due again after
``command_redeliver_s``, and the next replica must publish it then, knowing from the
shared state, not from its own memory, that the node takes its commands over the bus (its
batches came over NATS: ``nodes.address``). The agent applies a command id once, so a
copy that did get through is harmless. Real nats-server, the real collector app, SQLite
state shared by the two replicas one after the other."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats
import pytest

from forewarn import bus
from forewarn.collector.cli import ServerThread
from forewarn.collector.config import CollectorConfig
from forewarn.collector.http.app import create_app
from forewarn.collector.http.auth import TokenRegistry
from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.commands import CommandQueue
from forewarn.collector.storage.store import Store
from forewarn.wire import CheckpointOrder, Command, decode_json

from support.bus_stack import COLLECTOR_PASSWORD, TOKENS, send_one_batch
from support.nats_server import NatsServer

pytestmark = pytest.mark.system

NODE = "gpu.a"


def replica(tmp: Path, url: str) -> tuple[ServerThread, Store]:
    """A collector on the bus; every replica started here shares one state database."""
    cfg = CollectorConfig(listen="127.0.0.1:0", data_dir=tmp / "collector",
                          tokens_file=tmp / "none.toml", flush_interval_s=3600, bus_url=url,
                          bus_password=COLLECTOR_PASSWORD, bus_ack_wait_s=2.0,
                          command_redeliver_s=1.0)
    store = Store(cfg.db_path)
    app = create_app(cfg, store, tokens=TokenRegistry(tokens=dict(TOKENS)))
    return ServerThread(app, cfg).start(), store


def pull_commands(url: str, wait_s: float) -> list[Command]:
    """What the node's agent would pull from its command consumer within ``wait_s``."""

    async def pull() -> list[Command]:
        nc = await nats.connect(url, user=bus.node_token(NODE),
                                password=bus.nats_password(TOKENS[NODE]),
                                inbox_prefix=bus.inbox_prefix(NODE))
        try:
            sub = await nc.jetstream().pull_subscribe(
                bus.subject(bus.COMMAND_PREFIX, NODE), durable=bus.command_consumer(NODE),
                stream=bus.COMMAND_STREAM)
            try:
                msgs = await sub.fetch(4, timeout=wait_s)
            except TimeoutError:  # nats.errors.TimeoutError, or the builtin one under load
                return []
            for msg in msgs:
                await msg.ack()
            return [decode_json(m.data, Command) for m in msgs]
        finally:
            await nc.close()

    return asyncio.run(pull())


def test_an_order_in_doubt_is_published_by_the_next_replica(
        tmp_path: Path, bus_nats: NatsServer) -> None:
    first, store = replica(tmp_path, bus_nats.url)
    # One batch over the bus, then the node says nothing more (nothing reminds a
    # replica of it).
    send_one_batch(bus_nats.url, NODE, tmp_path / "spool", lambda: store.query(
        "SELECT 1 FROM batches WHERE node = ?", (NODE,)))
    first.stop()
    store.close()

    # The replica that published the order died between marking it delivered and the
    # publish's answer: the shared queue has it delivered and not acknowledged.
    store = Store(tmp_path / "collector" / "collector.db")
    queue = CommandQueue(store, CollectorMetrics())
    order = CheckpointOrder(job="j1", step=100, reason="test", request_id="r1",
                            issued=time.time())
    queue.order_checkpoint([NODE], order)
    assert [c.id for c in queue.take(NODE)] == ["r1@gpu.a"]
    store.close()
    assert pull_commands(bus_nats.url, 0.5) == []  # it never reached the stream

    second, store = replica(tmp_path, bus_nats.url)
    try:
        # Due again after command_redeliver_s (1 s): the next replica publishes it.
        # (Before the fix it never did: only nodes whose batches reached this process
        # were served over the bus.)
        got = pull_commands(bus_nats.url, 15.0)
        assert [c.id for c in got] == ["r1@gpu.a"]
    finally:
        second.stop()
        store.close()
