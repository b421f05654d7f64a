"""The bus tasks share the collector's event loop: a task working through a large fetched
group of telemetry batches gives the others (the urgent lane's) a turn between batches
instead of decoding the whole group at once (issue 16). A real nats-server; the real
bus consumer, ingest writer and the leader's decide feed; order of events only."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import msgspec
import nats
import pytest
from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry

from forewarn import bus
from forewarn.collector.config import CollectorConfig
from forewarn.collector.decide.policy_thread import PolicyThread
from forewarn.collector.ingest import bus_decide
from forewarn.collector.ingest.batch import IngestWriter
from forewarn.collector.ingest.bus import BusConsumer, stream_configs
from forewarn.collector.ingest.bus_decide import decide_feeds
from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.commands import CommandQueue
from forewarn.collector.storage.leader import SoleLeader
from forewarn.collector.storage.store import Store
from forewarn.wire import AgentBatch, GpuSample, encode

from support.nats_server import NatsServer, start_server

GROUP = 64
NODE = "gpu.a"


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = start_server(tmp_path / "nats")
    yield server
    server.stop()


def config(tmp: Path, url: str) -> CollectorConfig:
    return CollectorConfig(data_dir=tmp / "collector", tokens_file=tmp / "none.toml",
                           bus_url=url, bus_fetch_max=GROUP)


async def publish_group(js: JetStreamContext, cfg: CollectorConfig) -> None:
    """The streams, and ``GROUP`` telemetry batches of one node in them."""
    for stream in stream_configs(cfg):
        await js.add_stream(stream)
    now = time.time()
    for seq in range(GROUP):
        batch = AgentBatch(node=NODE, agent_id=NODE, seq=seq, created=now,
                           samples=[GpuSample(node=NODE, gpu=g, time=now, source="sim",
                                              simulated=True, temperature_c=50.0)
                                    for g in range(8)])
        await js.publish(bus.subject(bus.BATCH_PREFIX, NODE), encode(batch))


def watched(url: str, cfg: CollectorConfig,
            work: Callable[[JetStreamContext], Awaitable[None]],
            progress: Callable[[], int]) -> set[int]:
    """With ``GROUP`` batches in the stream, run ``work(js)`` beside another task that
    notes ``progress()`` at each of its turns; returns what it noted."""
    seen: set[int] = set()

    async def scenario() -> None:
        nc = await nats.connect(url)
        done = asyncio.Event()

        async def other_task() -> None:
            while not done.is_set():
                seen.add(progress())
                await asyncio.sleep(0)

        try:
            js = nc.jetstream()
            await publish_group(js, cfg)
            other = asyncio.create_task(other_task())
            try:
                await work(js)
            finally:
                done.set()
                await other
        finally:
            await nc.close()

    asyncio.run(scenario())
    return seen


@pytest.mark.system
def test_an_urgent_batch_is_queued_before_a_large_fetched_group_is_decoded(
        tmp_path: Path, nats_server: NatsServer) -> None:
    """The telemetry task checks its group a batch at a time, giving the urgent lane's
    task a turn: the urgent batch reaches the writer first. The group still reaches the
    writer at once (one group commit, not one fsync per batch)."""
    cfg = config(tmp_path, nats_server.url)
    store = Store(cfg.db_path)
    metrics = CollectorMetrics()
    writer = IngestWriter(store, metrics)  # started once everything is queued
    consumer = BusConsumer(cfg, writer, metrics, CommandQueue(store, metrics),
                           on_ack=lambda ack, node: "unknown")

    async def ingest_both(js: JetStreamContext) -> None:
        now = time.time()
        urgent = AgentBatch(node=NODE, agent_id=NODE, seq=GROUP, created=now, urgent=True,
                            checkpoints=[])
        await js.publish(bus.subject(bus.URGENT_PREFIX, NODE), encode(urgent))
        lanes = [await js.pull_subscribe(f"{prefix}.*", durable=f"test-{n}",
                                         stream=bus.BATCH_STREAM)
                 for n, prefix in enumerate((bus.BATCH_PREFIX, bus.URGENT_PREFIX))]
        group, one = [await sub.fetch(n, timeout=10) for sub, n in zip(lanes, (GROUP, 1),
                                                                       strict=True)]
        assert (len(group), len(one)) == (GROUP, 1)
        # The telemetry task takes its turn first, as when its fetch came in first.
        tasks = [asyncio.create_task(consumer.ingest(m)) for m in (group, one)]
        while writer.queued < GROUP + 1:
            await asyncio.sleep(0)
        writer.start()
        await asyncio.gather(*tasks)

    try:
        seen = watched(nats_server.url, cfg, ingest_both, lambda: writer.queued)
    finally:
        writer.stop()
        store.close()
    assert 1 in seen, f"the urgent batch was not queued alone first: {sorted(seen)}"
    # GROUP alone: the writer took the urgent batch in a group of its own first.
    assert not seen & set(range(2, GROUP)), f"the group came piecemeal: {sorted(seen)}"


@pytest.mark.system
def test_the_leaders_telemetry_lane_gives_other_tasks_a_turn_within_a_fetched_group(
        tmp_path: Path, nats_server: NatsServer) -> None:
    cfg = config(tmp_path, nats_server.url)
    store = Store(cfg.db_path)

    async def deliver(_batches: list[AgentBatch], _urgent: bool) -> None:
        raise AssertionError("nothing was stored: nothing is handed to the policy")

    feed = decide_feeds(cfg, store, SoleLeader(), deliver, CollectorRegistry())[0]
    assert not feed.lane.urgent

    async def hold_group(js: JetStreamContext) -> None:
        while feed.status()["waiting"] < GROUP:  # not stored: they wait for their ingest
            await feed.step(js)

    try:
        seen = watched(nats_server.url, cfg, hold_group, lambda: feed.status()["waiting"])
    finally:
        store.close()
    assert seen & set(range(1, GROUP)), sorted(seen)


@pytest.mark.system
def test_urgent_policy_work_runs_before_the_rest_of_a_large_telemetry_group(
        tmp_path: Path, nats_server: NatsServer) -> None:
    """The leader's telemetry lane hands a large stored group to the policy thread in
    parts: urgent work that arrives while the policy runs the first part goes before the
    rest, not after the whole group."""
    cfg = config(tmp_path, nats_server.url)
    store = Store(cfg.db_path)
    writer = IngestWriter(store, CollectorMetrics())
    writer.start()
    pool = PolicyThread()
    ran: list[str] = []

    def on_batches(batches: list[AgentBatch]) -> None:  # on the policy thread
        if not ran:
            pool.submit_urgent(ran.append, "urgent")  # a fatal finding comes in
        ran.extend(f"telemetry {b.seq}" for b in batches)

    async def deliver(batches: list[AgentBatch], urgent: bool) -> None:
        assert not urgent
        await asyncio.wrap_future(pool.submit(on_batches, batches))

    feed = decide_feeds(cfg, store, SoleLeader(), deliver, CollectorRegistry())[0]

    async def feed_group(js: JetStreamContext) -> None:
        sub = await js.pull_subscribe(f"{bus.BATCH_PREFIX}.*", durable="ingest",
                                      stream=bus.BATCH_STREAM)
        msgs = await sub.fetch(GROUP, timeout=10)
        for m in msgs:  # stored first: the feed hands on only what ingest stored
            b = msgspec.msgpack.decode(m.data, type=AgentBatch)
            await asyncio.wrap_future(writer.submit(b, m.data))
        while len(ran) < GROUP + 1:
            await feed.step(js)

    try:
        watched(nats_server.url, cfg, feed_group, lambda: 0)
    finally:
        pool.shutdown()
        writer.stop()
        store.close()
    assert ran.index("urgent") < GROUP, f"urgent work ran after all {GROUP} batches"


@pytest.mark.system
def test_the_urgent_lane_hands_a_batch_over_once_told_it_is_stored_without_a_poll(
        tmp_path: Path, nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """An urgent batch the leader fetched before its ingest stored it is handed to the
    policy once this process's writer has committed it (the writer tells the urgent
    lane), not at the next lookup of held batches: those are an hour apart here."""
    monkeypatch.setattr(bus_decide, "RECHECK_S", 3600.0)
    cfg = config(tmp_path, nats_server.url)
    store = Store(cfg.db_path)
    handed: list[int] = []

    async def deliver(batches: list[AgentBatch], urgent: bool) -> None:
        assert urgent
        handed.extend(b.seq for b in batches)

    feed = decide_feeds(cfg, store, SoleLeader(), deliver, CollectorRegistry())[1]
    assert feed.lane.urgent
    writer = IngestWriter(store, CollectorMetrics(),
                          on_stored=lambda _batches, _addresses: feed.stored())
    writer.start()

    async def fetched_then_stored(js: JetStreamContext) -> None:
        for stream in stream_configs(cfg):
            await js.add_stream(stream)
        urgent = AgentBatch(node=NODE, agent_id=NODE, seq=7, created=time.time(),
                            urgent=True, checkpoints=[])
        await js.publish(bus.subject(bus.URGENT_PREFIX, NODE), encode(urgent))
        while feed.status()["waiting"] < 1:  # fetched, not stored yet: held
            await feed.step(js)
        await asyncio.wrap_future(writer.submit(urgent, encode(urgent)))
        await asyncio.wait_for(feed.step(js), 30)  # one turn, far short of a lookup's

    try:
        asyncio.run(on_bus(nats_server.url, fetched_then_stored))
    finally:
        writer.stop()
        store.close()
    assert handed == [7]


async def on_bus(url: str, work: Callable[[JetStreamContext], Awaitable[None]]) -> None:
    nc = await nats.connect(url)
    try:
        await work(nc.jetstream())
    finally:
        await nc.close()
