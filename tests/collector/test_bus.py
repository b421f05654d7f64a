"""The NATS JetStream bus: agent uplink, collector consumer, commands, permissions
(a real nats-server on loopback, the real collector app, the real agent uplink)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import nats.errors
import pytest
from prometheus_client import CollectorRegistry

from forewarn import bus
from forewarn.agent.build import build_uplink
from forewarn.agent.bus import NatsUplink
from forewarn.agent.config import AgentConfig
from forewarn.collector.cli import ServerThread
from forewarn.collector.config import CollectorConfig
from forewarn.collector.http.app import create_app
from forewarn.collector.http.auth import TokenRegistry, hash_token
from forewarn.collector.http.context import CollectorContext
from forewarn.collector.storage.store import Store
from forewarn.config import ConfigError
from forewarn.wire import AgentBatch, CheckpointOrder, Command, GpuSample, encode

from support.bus_stack import COLLECTOR_PASSWORD, TOKENS, auth_block
from support.nats_server import NatsServer, start_server
from support.polling import wait_for


def samples(node: str, t: float, gpus: int = 2) -> list[GpuSample]:
    return [GpuSample(node=node, gpu=g, time=t, source="sim", simulated=True,
                      temperature_c=50.0) for g in range(gpus)]


@dataclasses.dataclass
class Replica:
    """The collector app in bus mode, served on loopback."""

    server: ServerThread
    store: Store
    ctx: CollectorContext

    def seqs(self, node: str) -> list[int]:
        return [r["seq"] for r in self.store.query(
            "SELECT seq FROM batches WHERE node = ? ORDER BY seq", (node,))]

    def stop(self) -> None:
        self.server.stop()
        self.store.close()


def start_replica(tmp: Path, url: str, **overrides: Any) -> Replica:
    cfg = CollectorConfig(listen="127.0.0.1:0", data_dir=tmp / "collector",
                          tokens_file=tmp / "none.toml", flush_interval_s=3600, bus_url=url,
                          bus_password=COLLECTOR_PASSWORD, bus_ack_wait_s=2.0, **overrides)
    store = Store(cfg.db_path)
    app = create_app(cfg, store, tokens=TokenRegistry(tokens=dict(TOKENS)))
    return Replica(ServerThread(app, cfg).start(), store, app.state.ctx)


def agent(tmp: Path, url: str, node: str = "gpu.a", **kw: Any) -> NatsUplink:
    cfg = AgentConfig(node=node, uplink="nats", nats_url=url, token=TOKENS[node],
                      spool_dir=tmp / f"spool-{node}", push_interval_s=0.2, **kw)
    return NatsUplink(cfg, registry=CollectorRegistry(), retry_s=0.05, publish_timeout_s=2.0,
                      fetch_wait_s=0.5)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = start_server(tmp_path / "nats", authorization=auth_block())
    yield server
    server.stop()


def test_node_token_is_one_subject_token_and_round_trips() -> None:
    for node in ("gpu-07", "gpu.a", "gpu_b", "x_2E", "a%b", "nœud 7", "a.*>"):
        token = bus.node_token(node)
        assert all(c.isascii() and (c.isalnum() or c in "-_") for c in token), token
        assert bus.node_of(token) == node
    assert bus.node_token("gpu.a") != bus.node_token("gpu_2Ea")
    for bad in ("a.b", "a_2", "a_zz", "", "a_C3"):
        with pytest.raises(ValueError):
            bus.node_of(bad)


def test_agent_config_picks_the_nats_transport_and_names_bad_keys(tmp_path: Path) -> None:
    base = {"node": "gpu.a", "token": "t", "spool_dir": tmp_path / "s"}
    with pytest.raises(ConfigError, match="uplink"):
        AgentConfig(uplink="kafka", **base)
    with pytest.raises(ConfigError, match="nats_url"):
        build_uplink(AgentConfig(uplink="nats", nats_url="http://x:1", **base))
    up = build_uplink(AgentConfig(uplink="nats", nats_url="nats://127.0.0.1:4222", **base))
    assert isinstance(up, NatsUplink)
    # HTTP stays the default and is unchanged.
    assert build_uplink(AgentConfig(**base)) is None
    with pytest.raises(ConfigError, match="bus_url"):
        CollectorConfig(bus_url="localhost")


def test_batches_flow_through_nats_and_are_stored_once(tmp_path: Path,
                                                       nats_server: NatsServer) -> None:
    replica = start_replica(tmp_path, nats_server.url)
    up = agent(tmp_path, nats_server.url)
    up.start()

    def stored_samples() -> int:
        return int(replica.store.scalar(
            "SELECT COALESCE(SUM(samples), 0) FROM batches WHERE node = 'gpu.a'"))

    try:
        for i in range(5):
            up.add(samples=samples("gpu.a", time.time() + i * 0.01))
            time.sleep(0.25)
        # Every sample stored, not just an empty spool: the last samples may not be sealed
        # into a batch yet, and would then arrive after the republished one below.
        wait_for(lambda: stored_samples() == 10 and len(up.spool) == 0, 30,
                 "batches stored")
        # Publish an already stored batch again (an agent that lost the publish ack):
        # JetStream drops it inside its window, and under another id the store does.
        seq = replica.seqs("gpu.a")[0]
        again = AgentBatch(node="gpu.a", agent_id=up.spool.agent_id, seq=seq,
                           created=time.time(), samples=samples("gpu.a", time.time()))
        for msg_id in (f"{up.spool.agent_id}:{seq}", "other-id"):
            up._run(up._publish(bus.subject(bus.BATCH_PREFIX, "gpu.a"), encode(again),
                                msg_id), 5)
        wait_for(lambda: replica.ctx.metrics.batches.labels("duplicate")._value.get() >= 1,
                 20, "the republished batch answered as a duplicate")
        seqs = replica.seqs("gpu.a")
        assert len(seqs) == len(set(seqs))
        assert stored_samples() == 10
    finally:
        up.stop()
        replica.stop()


def test_a_batch_refused_over_the_bus_is_counted_and_not_redelivered(
        tmp_path: Path, nats_server: NatsServer) -> None:
    replica = start_replica(tmp_path, nats_server.url)
    up = agent(tmp_path, nats_server.url)
    up.start()
    try:
        # Node gpu.a's user publishing a batch that claims to be gpu_b's: its subject
        # says gpu.a, so it is refused whole (403 node_mismatch), as over HTTP.
        forged = AgentBatch(node="gpu_b", agent_id="x", seq=1, created=time.time(),
                            samples=samples("gpu_b", time.time()))
        up._run(up._publish(bus.subject(bus.BATCH_PREFIX, "gpu.a"), encode(forged), "f1"), 5)
        rejected = replica.ctx.metrics.rejected.labels("node_mismatch")
        wait_for(lambda: rejected._value.get() == 1, 20, "the forged batch refused")
        time.sleep(2 * replica.ctx.config.bus_ack_wait_s + 0.5)
        assert rejected._value.get() == 1  # terminated: never delivered again
        assert replica.seqs("gpu_b") == []
    finally:
        up.stop()
        replica.stop()


def test_a_node_cannot_publish_or_pull_as_another_node(nats_server: NatsServer,
                                                       tmp_path: Path) -> None:
    replica = start_replica(tmp_path, nats_server.url)

    async def attempt() -> list[str]:
        nc = await nats.connect(nats_server.url, user=bus.node_token("gpu.a"),
                                password=bus.nats_password(TOKENS["gpu.a"]),
                                inbox_prefix=bus.inbox_prefix("gpu.a"))
        js = nc.jetstream(timeout=1.0)
        outcomes = []
        batch = AgentBatch(node="gpu_b", agent_id="evil", seq=1, created=time.time())
        try:
            await js.publish(bus.subject(bus.BATCH_PREFIX, "gpu_b"), encode(batch))
            outcomes.append("published as gpu_b")
        except nats.errors.TimeoutError:
            outcomes.append("publish refused")
        try:
            sub = await js.pull_subscribe(bus.subject(bus.COMMAND_PREFIX, "gpu_b"),
                                          durable=bus.command_consumer("gpu_b"),
                                          stream=bus.COMMAND_STREAM)
            await sub.fetch(1, timeout=1.0)
            outcomes.append("pulled gpu_b's commands")
        except (nats.errors.TimeoutError, nats.errors.Error):
            outcomes.append("pull refused")
        # A subscription the server refuses fails asynchronously: look at what arrives.
        sniffed = await nc.subscribe("forewarn.>")
        await nc.flush(timeout=1.0)
        col = await nats.connect(nats_server.url, user=bus.COLLECTOR_USER,
                                 password=COLLECTOR_PASSWORD)
        await col.publish(bus.subject(bus.COMMAND_PREFIX, "gpu_b"), b"secret order")
        await col.flush()
        try:
            await sniffed.next_msg(timeout=1.0)
            outcomes.append("read gpu_b's commands")
        except nats.errors.TimeoutError:
            outcomes.append("nothing read")
        await col.close()
        await nc.close()
        bad_password = None
        try:
            await nats.connect(nats_server.url, user=bus.node_token("gpu_b"),
                               password=bus.nats_password(TOKENS["gpu.a"]),
                               max_reconnect_attempts=0, connect_timeout=2,
                               allow_reconnect=False)
            bad_password = "connected"
        except Exception:
            bad_password = "refused"
        outcomes.append(f"gpu_b with gpu.a's password {bad_password}")
        return outcomes

    try:
        outcomes = asyncio.run(attempt())
        assert outcomes == ["publish refused", "pull refused", "nothing read",
                            "gpu_b with gpu.a's password refused"]
        assert "Publish Violation" in nats_server.log_tail()
        assert replica.seqs("gpu_b") == []
    finally:
        replica.stop()


def test_orders_reach_the_agent_once_and_come_again_until_answered(
        tmp_path: Path, nats_server: NatsServer) -> None:
    replica = start_replica(tmp_path, nats_server.url, command_redeliver_s=60)
    seen: list[str] = []

    def on_command(command: Command) -> tuple[bool, str]:
        seen.append(command.id)
        return True, "ordered"

    up = agent(tmp_path, nats_server.url)
    up.on_command = on_command
    up.start()
    try:
        up.add(samples=samples("gpu.a", time.time()))
        wait_for(lambda: replica.seqs("gpu.a"), 20, "the node seen on the bus")
        order = CheckpointOrder(job="j1", step=100, reason="test", request_id="r1",
                                issued=time.time())
        replica.ctx.commands.order_checkpoint(["gpu.a"], order)
        row = wait_for(lambda: replica.store.query(
            "SELECT * FROM commands WHERE acked_at IS NOT NULL"), 20, "the order answered")
        assert row[0]["id"] == "r1@gpu.a" and row[0]["ok"] == 1
        assert seen == ["r1@gpu.a"]
    finally:
        up.stop()
    # An agent that took a command and died before answering: it comes again (ack_wait),
    # and the new agent applies it once.
    replica.ctx.commands.order_checkpoint(
        ["gpu.a"], CheckpointOrder(job="j1", step=200, reason="t", request_id="r2",
                                   issued=time.time()))

    async def take_and_die() -> bytes:
        nc = await nats.connect(nats_server.url, user=bus.node_token("gpu.a"),
                                password=bus.nats_password(TOKENS["gpu.a"]),
                                inbox_prefix=bus.inbox_prefix("gpu.a"))
        js = nc.jetstream()
        sub = await js.pull_subscribe(bus.subject(bus.COMMAND_PREFIX, "gpu.a"),
                                      durable=bus.command_consumer("gpu.a"),
                                      stream=bus.COMMAND_STREAM)
        msgs = await sub.fetch(1, timeout=10)
        await nc.close()  # no ack, no answer
        return bytes(msgs[0].data)

    assert b"r2@gpu.a" in asyncio.run(take_and_die())
    again = agent(tmp_path, nats_server.url)
    again.on_command = on_command
    again.start()
    try:
        wait_for(lambda: replica.store.scalar(
            "SELECT acked_at FROM commands WHERE id = 'r2@gpu.a'"), 30, "r2 redelivered")
        assert seen == ["r1@gpu.a", "r2@gpu.a"]
    finally:
        again.stop()
        replica.stop()


def test_a_batch_over_the_servers_max_payload_is_set_aside_not_retried(
        tmp_path: Path) -> None:
    server = start_server(tmp_path / "nats", authorization=auth_block(),
                          extra="max_payload: 4096\n")
    replica = start_replica(tmp_path, server.url)
    up = agent(tmp_path, server.url)
    up.start()
    try:
        up.add(samples=samples("gpu.a", time.time(), gpus=2))  # small: fits
        wait_for(lambda: replica.seqs("gpu.a"), 20, "the small batch stored")
        up.add(samples=samples("gpu.a", time.time(), gpus=64))  # ~10 KB: never fits
        rejected = wait_for(lambda: list((up.spool.root / "rejected").glob("*.txt")), 20,
                            "the large batch set aside")
        assert "max_payload" in rejected[0].read_text()
        up.add(samples=samples("gpu.a", time.time(), gpus=2))  # the spool keeps going
        n = len(replica.seqs("gpu.a"))
        wait_for(lambda: len(replica.seqs("gpu.a")) > n, 20, "later batches stored")
    finally:
        up.stop()
        replica.stop()
        server.stop()


def test_streams_are_created_with_the_configured_limits_and_updated_at_start(
        tmp_path: Path, nats_server: NatsServer) -> None:
    async def limits() -> list[tuple[float, int, int]]:
        nc = await nats.connect(nats_server.url, user=bus.COLLECTOR_USER,
                                password=COLLECTOR_PASSWORD)
        try:
            js = nc.jetstream()
            out = []
            for name in (bus.BATCH_STREAM, bus.COMMAND_STREAM):
                c = (await js.stream_info(name)).config
                out.append((float(c.max_age or 0), int(c.max_bytes or 0),
                            int(c.num_replicas or 0)))
            return out
        finally:
            await nc.close()

    replica = start_replica(tmp_path / "a", nats_server.url, bus_stream_max_age_s=3600.0,
                            bus_stream_max_bytes=2 * 1024**2, command_ttl_s=600.0)
    replica.stop()
    assert asyncio.run(limits()) == [(3600.0, 2 * 1024**2, 1), (600.0, -1, 1)]
    # A collector started with other limits brings the existing streams to them.
    replica = start_replica(tmp_path / "b", nats_server.url, bus_stream_max_age_s=7200.0,
                            bus_stream_max_bytes=4 * 1024**2)
    replica.stop()
    assert asyncio.run(limits())[0] == (7200.0, 4 * 1024**2, 1)


def test_a_batch_taken_while_the_writer_shuts_down_comes_back_to_another_replica(
        tmp_path: Path, nats_server: NatsServer) -> None:
    """The writer refuses with 503 while stopping: the batch is not stored, so it must be
    negatively acknowledged (delivered again), never terminated."""
    from forewarn.collector.ingest.batch import IngestWriter
    from forewarn.collector.ingest.bus import BusConsumer
    from forewarn.collector.metrics import CollectorMetrics
    from forewarn.collector.storage.commands import CommandQueue

    cfg = CollectorConfig(data_dir=tmp_path / "stopping", tokens_file=tmp_path / "none.toml",
                          bus_url=nats_server.url, bus_password=COLLECTOR_PASSWORD,
                          bus_ack_wait_s=2.0)
    store = Store(cfg.db_path)
    metrics = CollectorMetrics()
    writer = IngestWriter(store, metrics)
    writer.stop()  # shutting down: every submit is refused with 503

    async def stopping_replica() -> None:
        consumer = BusConsumer(cfg, writer, metrics, CommandQueue(store, metrics),
                               on_ack=lambda ack, node: "unknown")
        await consumer.start()
        nc = await nats.connect(nats_server.url, user=bus.node_token("gpu.a"),
                                password=bus.nats_password(TOKENS["gpu.a"]),
                                inbox_prefix=bus.inbox_prefix("gpu.a"))
        batch = AgentBatch(node="gpu.a", agent_id="a1", seq=0, created=time.time(),
                           samples=samples("gpu.a", time.time()))
        await nc.jetstream().publish(bus.subject(bus.BATCH_PREFIX, "gpu.a"), encode(batch))
        await nc.close()
        for _ in range(100):
            if metrics.rejected.labels("store")._value.get() or \
                    metrics.batches.labels("rejected")._value.get():
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        await consumer.stop()

    asyncio.run(stopping_replica())
    store.close()
    replica = start_replica(tmp_path, nats_server.url)
    try:
        wait_for(lambda: replica.seqs("gpu.a") == [0], 20, "the batch stored by the next replica")
    finally:
        replica.stop()


def test_the_agent_command_pull_does_not_pile_up_subscriptions_across_outages(
        tmp_path: Path, nats_server: NatsServer) -> None:
    replica = start_replica(tmp_path, nats_server.url)
    up = agent(tmp_path, nats_server.url)
    up.start()
    try:
        wait_for(lambda: up._nc is not None and up._nc.is_connected, 20, "connected")
        time.sleep(1.0)
        before = len(up._nc._subs)
        for _ in range(2):
            nats_server.stop()
            time.sleep(2.0)  # the pull fails and is set up again
            nats_server.start()
            wait_for(lambda: up._nc is not None and up._nc.is_connected, 30, "reconnected")
            time.sleep(2.0)
        assert len(up._nc._subs) == before
    finally:
        up.stop()
        replica.stop()


def test_a_collector_whose_nats_is_unreachable_at_start_stops_with_a_clear_error(
        tmp_path: Path) -> None:
    from forewarn.collector.ingest.batch import IngestWriter
    from forewarn.collector.ingest.bus import BusConsumer, BusError
    from forewarn.collector.metrics import CollectorMetrics
    from forewarn.collector.storage.commands import CommandQueue

    from support.polling import free_port

    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = CollectorConfig(data_dir=tmp_path, tokens_file=tmp_path / "none.toml", bus_url=url)
    store = Store(cfg.db_path)
    metrics = CollectorMetrics()
    consumer = BusConsumer(cfg, IngestWriter(store, metrics), metrics,
                           CommandQueue(store, metrics), on_ack=lambda ack, node: "unknown",
                           startup_wait_s=2.0)
    with pytest.raises(BusError, match=url):
        asyncio.run(asyncio.wait_for(consumer.start(), 20))
    store.close()


def test_readyz_reports_the_bus_and_recovers_when_nats_is_back(
        tmp_path: Path, nats_server: NatsServer) -> None:
    replica = start_replica(tmp_path, nats_server.url)

    def bus_part() -> dict[str, Any]:
        r = httpx.get(replica.server.url + "/readyz", timeout=10)
        part: dict[str, Any] = r.json()["components"]["bus"]
        part["status"] = r.status_code
        return part

    try:
        assert bus_part()["ready"] is True
        nats_server.stop()
        down = wait_for(lambda: (p := bus_part())["status"] == 503 and p, 20, "bus not ready")
        assert down["ready"] is False and nats_server.url.rsplit(":", 1)[1] in down["detail"]
        nats_server.start()
        wait_for(lambda: bus_part()["ready"], 30, "bus ready again")
    finally:
        replica.stop()


def test_nats_auth_command_prints_the_authorization_block(tmp_path: Path) -> None:
    from forewarn.cli import main

    tokens = tmp_path / "tokens.toml"
    tokens.write_text("".join(f'"{n}" = "{hash_token(t)}"\n' for n, t in TOKENS.items()))
    out = tmp_path / "auth.conf"
    password = tmp_path / "pw"
    password.write_text(COLLECTOR_PASSWORD + "\n")
    (tmp_path / "none.toml").touch()
    assert main(["collector", "nats-auth", "--config", str(tmp_path / "none.toml"),
                 "--tokens-file", str(tokens), "--bus-password-file", str(password),
                 "--output", str(out)]) == 0
    assert out.read_text() == auth_block()
    assert out.stat().st_mode & 0o077 == 0


def run_on_a_busy_loop(tmp_path: Path, url: str, *, settle_s: float) -> bool:
    """Start a real bus consumer, keep its event loop busy elsewhere (1.2 s at a time, a
    loaded collector), wait ``settle_s``, stop it; on a thread of its own. Returns whether
    all that ended within 30 s."""
    from forewarn.collector.ingest.batch import IngestWriter
    from forewarn.collector.ingest.bus import BusConsumer
    from forewarn.collector.metrics import CollectorMetrics
    from forewarn.collector.storage.commands import CommandQueue

    cfg = CollectorConfig(data_dir=tmp_path, tokens_file=tmp_path / "none.toml",
                          bus_url=url, bus_password=COLLECTOR_PASSWORD)
    store = Store(cfg.db_path)
    metrics = CollectorMetrics()
    consumer = BusConsumer(cfg, IngestWriter(store, metrics), metrics,
                           CommandQueue(store, metrics), on_ack=lambda ack, node: "unknown")

    async def busy_loop() -> None:
        await consumer.start()
        try:
            for _ in range(4):
                await asyncio.sleep(0)  # the bus tasks take their turn, then
                time.sleep(1.2)  # the loop is busy elsewhere for longer than a fetch
            await asyncio.sleep(settle_s)
        finally:
            await consumer.stop()

    # A thread, so that a stop() that never returns fails the test instead of hanging it.
    thread = threading.Thread(target=asyncio.run, args=(busy_loop(),), daemon=True)
    thread.start()
    thread.join(30)
    if not thread.is_alive():
        store.close()
    return not thread.is_alive()


@pytest.mark.system
def test_an_idle_bus_on_a_busy_event_loop_stays_ready(
        tmp_path: Path, nats_server: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    """nats-py's fetch raises the builtin TimeoutError (not nats.errors.TimeoutError)
    when its no-messages answer is read after its deadline: a loop busy elsewhere. That is
    an empty fetch, not a bus failure: no "bus: TimeoutError" error (which /readyz shows
    as not ready) and no backoff."""
    with caplog.at_level("WARNING", logger="forewarn.collector.ingest.bus"):
        assert run_on_a_busy_loop(tmp_path, nats_server.url, settle_s=1.5)
    assert [r.getMessage() for r in caplog.records
            if r.name == "forewarn.collector.ingest.bus"] == []


@pytest.mark.system
def test_the_bus_consumer_stops_right_after_its_loop_was_busy(
        tmp_path: Path, nats_server: NatsServer) -> None:
    """The fetches' timers fire together once the loop is free again; Python 3.11's
    wait_for (inside nats-py's fetch) can then swallow stop()'s cancel, and a consumer
    that cancels once would wait for its pull loops for ever (the collector never exits)."""
    assert run_on_a_busy_loop(tmp_path, nats_server.url, settle_s=0.0), \
        "BusConsumer.stop() did not return"
