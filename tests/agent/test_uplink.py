"""The agent's collector uplink: spool, replay, bounds, commands (real collector on loopback)."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from forewarn.agent.build import build_uplink
from forewarn.agent.config import AgentConfig
from forewarn.agent.spool import Spool
from forewarn.agent.uplink import Uplink
from forewarn.chaos.proxy import TcpProxy
from forewarn.collector.cli import ServerThread
from forewarn.collector.config import CollectorConfig
from forewarn.collector.http.app import create_app
from forewarn.collector.http.auth import TokenRegistry
from forewarn.collector.storage.store import Store
from forewarn.config import ConfigError
from forewarn.wire import (
    AgentBatch,
    CheckpointOrder,
    Command,
    Finding,
    GpuSample,
    Health,
    Subject,
    decode,
)

from support.metrics import value
from support.polling import free_port, wait_for

TOKEN = "node-a-token-0123456789"


def samples(node: str, t: float, gpus: int = 4) -> list[GpuSample]:
    return [GpuSample(node=node, gpu=g, time=t, source="sim", simulated=True,
                      temperature_c=50.0) for g in range(gpus)]


class Collector:
    """A real collector on a fixed loopback port that can be stopped and started again."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.cfg = CollectorConfig(listen=f"127.0.0.1:{self.port}", data_dir=tmp / "collector",
                                   tokens_file=tmp / "none.toml", command_redeliver_s=60)
        self.store = Store(self.cfg.db_path)
        self.server: ServerThread | None = None
        self.app: Any = None

    def start(self, wrap: Callable[[Any], Any] | None = None) -> None:
        self.app = create_app(self.cfg, self.store, tokens=TokenRegistry(tokens={"a": TOKEN}))
        served = self.app if wrap is None else wrap(self.app)
        self.server = ServerThread(served, self.cfg).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def seqs(self) -> list[int]:
        return [r["seq"] for r in self.store.query("SELECT seq FROM batches ORDER BY seq")]


def agent_config(tmp: Path, port: int, **kw: Any) -> AgentConfig:
    base: dict[str, Any] = {"node": "a", "collector_url": f"http://127.0.0.1:{port}",
                            "token": TOKEN, "spool_dir": tmp / "spool", "push_interval_s": 0.2}
    base.update(kw)
    return AgentConfig(**base)


def test_spool_persists_seq_bounds_size_and_orders_urgent_first(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s", max_bytes=10_000)

    def make(urgent: bool = False, n: int = 1) -> Callable[[str, int], AgentBatch]:
        return lambda aid, seq: AgentBatch(node="a", agent_id=aid, seq=seq, created=1.0,
                                           urgent=urgent, samples=samples("a", 1.0, n))

    spool.append(make())
    spool.append(make(urgent=True))
    spool.append(make())
    assert [s for s, _ in spool.pending()] == [1, 0, 2]
    agent_id = spool.agent_id
    (tmp_path / "s" / "junk.tmp").write_bytes(b"half a batch")
    again = Spool(tmp_path / "s", max_bytes=10_000)
    assert (again.agent_id, again.next_seq, len(again)) == (agent_id, 3, 3)
    assert not (tmp_path / "s" / "junk.tmp").exists()
    body = decode(again.pending()[0][1].read_bytes(), AgentBatch)
    assert (body.seq, body.urgent) == (1, True)
    # Emptied spool: the seq still goes on after a restart.
    for seq, _ in again.pending():
        again.remove(seq)
    assert Spool(tmp_path / "s", max_bytes=10_000).next_seq == 3
    # Bound: big batches push the oldest out, counted.
    small = Spool(tmp_path / "b", max_bytes=3000)
    for _ in range(6):
        small.append(make(n=1))
    assert small.bytes <= 3000 and small.dropped == 6 - len(small) > 0
    assert [s for s, _ in small.pending()] == list(range(6 - len(small), 6))


def test_batches_reach_the_collector_and_survive_a_cut_off(tmp_path: Path) -> None:
    col = Collector(tmp_path)
    col.start()
    reg = CollectorRegistry()
    up = Uplink(agent_config(tmp_path, col.port), registry=reg, poll_wait_s=1.0, retry_s=0.05)
    up.start()
    try:
        up.add(samples=samples("a", time.time()))
        wait_for(lambda: len(col.seqs()) >= 1)
        col.stop()  # cut off: batches go to the spool
        for _ in range(5):
            up.add(samples=samples("a", time.time()))
            time.sleep(0.1)
        wait_for(lambda: value(reg, "forewarn_uplink_spool_batches") >= 2)
        assert value(reg, "forewarn_uplink_push_errors_total") >= 1
        spooled = value(reg, "forewarn_uplink_spool_bytes")
        assert spooled > 0
        col.start()
        wait_for(lambda: value(reg, "forewarn_uplink_spool_batches") == 0)
        up.add(samples=samples("a", time.time()))
        produced = up.spool.next_seq
        wait_for(lambda: len(col.seqs()) >= produced - 1 and
                 value(reg, "forewarn_uplink_spool_batches") == 0)
    finally:
        up.stop()
    produced = up.spool.next_seq
    assert col.seqs() == list(range(produced))
    stored = col.store.scalar("SELECT SUM(samples) FROM batches")
    history = col.app.state.ctx.telemetry.read()  # Parquet (flushed at the stop) + staging
    assert stored == len(history) == 4 * 7
    assert not history.duplicated(["agent_id", "seq", "gpu", "time"]).any()
    assert value(reg, "forewarn_uplink_last_success_timestamp_seconds") > 0
    col.stop()
    col.store.close()


def test_urgent_finding_is_sent_at_once(tmp_path: Path) -> None:
    col = Collector(tmp_path)
    col.start()
    reg = CollectorRegistry()
    up = Uplink(agent_config(tmp_path, col.port, push_interval_s=3600), registry=reg,
                poll_wait_s=1.0)
    up.start()
    try:
        bad = Finding(check="ecc", health=Health.UNHEALTHY, reason="uncorrectable ECC",
                      subject=Subject(kind="gpu", node="a", gpu=1), time=time.time())
        started = time.monotonic()
        up.add(findings=[bad])
        wait_for(lambda: bool(col.store.query("SELECT * FROM findings")), timeout=10)
        assert time.monotonic() - started < 10  # the hour-long push interval was not waited
        row = col.store.query("SELECT urgent FROM batches")[0]
        assert row["urgent"] == 1
    finally:
        up.stop()
        col.stop()
        col.store.close()


def test_finding_transitions_replay_in_order_ahead_of_telemetry(tmp_path: Path) -> None:
    # A GPU failing, recovering and failing again while the collector is away: every
    # transition rides urgent, so the replay keeps them in order (the last one fires)
    # while still overtaking the telemetry sealed between them.
    up = Uplink(agent_config(tmp_path, 1, push_interval_s=3600), registry=CollectorRegistry())
    for health in (Health.UNHEALTHY, None, Health.HEALTHY, None, Health.UNHEALTHY):
        found = [] if health is None else [Finding(
            check="ecc", health=health, reason="ECC", time=time.time(),
            subject=Subject(kind="gpu", node="a", gpu=1))]
        up.add(samples=samples("a", time.time()), findings=found)
        up.seal()
    assert [seq for seq, _p in up.spool.pending()] == [0, 2, 4, 1, 3]


class HoldFirstAnswer:
    """ASGI wrapper around the real collector app: the first batch is stored, then its
    answer waits (``stored`` set) until ``release`` is set."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.state = app.state  # what ServerThread reads
        self.stored = threading.Event()
        self.release = threading.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/api/v1/ingest" or \
                self.stored.is_set():
            await self.app(scope, receive, send)
            return

        async def held(message: Any) -> None:
            if message["type"] == "http.response.start":
                self.stored.set()
                while not self.release.is_set():
                    await asyncio.sleep(0.01)
            await send(message)

        await self.app(scope, receive, held)


@pytest.mark.system
def test_a_batch_stored_whose_answer_was_lost_is_not_counted_as_dropped(
        tmp_path: Path) -> None:
    """The network drops the connection while the collector answers: the batch is stored
    but the agent does not know. The spool then overflows; the bound must keep that batch
    (sent again later: a duplicate), or the dropped count says it was lost (the chaos
    spool_full flake: 20 batches missing, 21 counted as dropped)."""
    col = Collector(tmp_path)
    held: list[HoldFirstAnswer] = []

    def wrap(app: Any) -> HoldFirstAnswer:
        held.append(HoldFirstAnswer(app))
        return held[0]

    col.start(wrap=wrap)
    proxy = TcpProxy(("127.0.0.1", col.port))
    reg = CollectorRegistry()
    up = Uplink(agent_config(tmp_path, proxy.port, spool_max_bytes=4096), registry=reg,
                poll_wait_s=1.0, retry_s=0.05)
    up.start()
    try:
        up.add(samples=samples("a", time.time(), gpus=8), urgent=True)
        wait_for(held[0].stored.is_set, what="the first batch stored")
        proxy.cut(refuse=True)  # the answer is lost with the connection
        held[0].release.set()
        in_doubt = col.seqs()
        assert len(in_doubt) == 1
        wait_for(lambda: value(reg, "forewarn_uplink_push_errors_total") >= 1)

        def overflow() -> bool:
            up.add(samples=samples("a", time.time(), gpus=8))
            return value(reg, "forewarn_uplink_dropped_batches_total") >= 3

        wait_for(overflow, what="the spool dropping batches", interval=0.1)
        proxy.restore()
        wait_for(lambda: in_doubt[0] in col.seqs() and len(up.spool) <= 1)
    finally:
        up.stop()
        proxy.close()
    missing = set(range(up.spool.next_seq)) - set(col.seqs())
    assert len(up.spool) == 0
    assert in_doubt[0] not in missing
    assert value(reg, "forewarn_uplink_dropped_batches_total") == len(missing) > 0
    col.stop()
    col.store.close()


@dataclasses.dataclass
class FakeOrders:
    """Stands in for the ranks component's order book (another engineer's module)."""

    calls: list[tuple[str, int | None, str, str | None]] = dataclasses.field(
        default_factory=list)

    def order_job(self, job: str, step: int | None = None, reason: str = "",
                  request_id: str | None = None) -> CheckpointOrder | None:
        self.calls.append((job, step, reason, request_id))
        return CheckpointOrder(request_id=request_id or "x", job=job, step=step or 0,
                               issued=time.time())

    def not_live(self, request_id: str) -> frozenset[int]:
        return frozenset()

    def order_waiting(self, request_id: str) -> frozenset[int]:
        return frozenset()


def test_checkpoint_command_reaches_order_job_and_is_acked_once(tmp_path: Path) -> None:
    col = Collector(tmp_path)
    col.start()
    reg = CollectorRegistry()
    orders = FakeOrders()
    up = Uplink(agent_config(tmp_path, col.port), registry=reg, poll_wait_s=2.0,
                orders=orders)
    up.start()
    try:
        order = CheckpointOrder(request_id="req-9", job="jobA", step=120, reason="ecc",
                                issued=time.time())
        col.app.state.ctx.commands.order_checkpoint(["a"], order)
        wait_for(lambda: bool(orders.calls))
        assert orders.calls == [("jobA", 120, "ecc", "req-9")]
        wait_for(lambda: col.store.scalar(
            "SELECT acked_at FROM commands WHERE id = 'req-9@a'") is not None)
        row = col.store.query("SELECT ok, detail FROM commands")[0]
        assert row["ok"] == 1 and "ordered step 120" in row["detail"]
        # A redelivered command is not executed twice.
        assert up.handle(Command(id="req-9@a", kind="checkpoint", order=order,
                                 issued=order.issued)) == (True, "ordered step 120")
        assert len(orders.calls) == 1
    finally:
        up.stop()
        col.stop()
        col.store.close()


def test_a_batch_answered_with_a_server_error_is_kept_by_the_bound(tmp_path: Path) -> None:
    """A 5xx may come after the batch was stored (503: stored, the series store slow):
    the bound drops the batches after it, not it."""
    seen: list[int] = []
    stored: list[int] = []
    ok = threading.Event()

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/v1/commands":
            return httpx.Response(200, json=[])
        seen.append(decode(request.content, AgentBatch).seq)
        if not ok.is_set():
            return httpx.Response(503, json={"error": "series_store"})
        stored.append(seen[-1])
        return httpx.Response(200, json={"result": "stored"})

    reg = CollectorRegistry()
    cfg = agent_config(tmp_path, 1, push_interval_s=3600, spool_max_bytes=4096)
    up = Uplink(cfg, transport=httpx.MockTransport(handler), registry=reg, retry_s=0.01)
    up.start()
    try:
        up.add(samples=samples("a", 1.0, gpus=8), urgent=True)
        wait_for(lambda: seen)

        def overflow() -> bool:
            up.add(samples=samples("a", 2.0, gpus=8), urgent=True)
            return value(reg, "forewarn_uplink_dropped_batches_total") >= 2

        wait_for(overflow, what="the spool dropping batches", interval=0.02)
        ok.set()
        wait_for(lambda: len(up.spool) == 0)
    finally:
        up.stop()
    assert seen[0] == 0 and stored[0] == 0  # kept and sent again, the others dropped
    assert value(reg, "forewarn_uplink_dropped_batches_total") >= 2


def test_refused_batch_is_dropped_and_server_errors_are_retried(tmp_path: Path) -> None:
    answers = [503, 413, 200]
    seen: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/v1/commands":
            return httpx.Response(200, json=[])
        seen.append(decode(request.content, AgentBatch).seq)
        status = answers.pop(0) if answers else 200
        return httpx.Response(status, json={"error": "test"})

    reg = CollectorRegistry()
    cfg = agent_config(tmp_path, 1, push_interval_s=3600)
    up = Uplink(cfg, transport=httpx.MockTransport(handler), registry=reg, retry_s=0.01)
    up.start()
    try:
        up.add(samples=samples("a", 1.0), urgent=True)
        wait_for(lambda: len(seen) >= 2)
        up.add(samples=samples("a", 2.0), urgent=True)
        wait_for(lambda: value(reg, "forewarn_uplink_batches_sent_total") >= 1)
    finally:
        up.stop()
    assert seen[:3] == [0, 0, 1]  # 503 kept and retried; 413 dropped; the next one sent
    assert value(reg, "forewarn_uplink_rejected_batches_total") == 1
    assert value(reg, "forewarn_uplink_push_errors_total") == 1
    assert len(up.spool) == 0


def test_a_refused_batch_is_moved_aside_and_a_bad_token_is_retried(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The real collector refuses a batch for good (403: node b's batch under node a's
    token): the agent moves it to ``rejected/`` with a log line, never sends it again, and
    keeps sending. A wrong token (401) may be fixed: those batches stay in the spool."""
    col = Collector(tmp_path)
    col.start()
    reg, reg_w = CollectorRegistry(), CollectorRegistry()
    impostor = Uplink(agent_config(tmp_path, col.port, node="b", spool_dir=tmp_path / "b"),
                      registry=reg, poll_wait_s=1.0, retry_s=0.05)
    bad_token = Uplink(agent_config(tmp_path, col.port, token="wrong-token-0123456789",
                                    spool_dir=tmp_path / "w"),
                       registry=reg_w, poll_wait_s=1.0, retry_s=0.05)
    for up in (impostor, bad_token):
        up.start()
    try:
        impostor.add(samples=samples("b", time.time()), urgent=True)
        bad_token.add(samples=samples("a", time.time()), urgent=True)
        wait_for(lambda: value(reg, "forewarn_uplink_rejected_batches_total") == 1)
        wait_for(lambda: value(reg_w, "forewarn_uplink_push_errors_total") >= 2)
    finally:
        for up in (impostor, bad_token):
            up.stop()
    # The urgent batch is set aside with its reason; a routine batch the uplink cut before it
    # stopped (named ``….n``) may follow it there, refused the same way.
    rejected = {p.name: p for p in (tmp_path / "b" / "rejected").iterdir()}
    assert {"00000000000000000000.u.msgpack", "00000000000000000000.u.txt"} <= rejected.keys()
    assert "403" in rejected["00000000000000000000.u.txt"].read_text()
    for name, path in rejected.items():
        if name.endswith(".msgpack"):
            assert decode(path.read_bytes(), AgentBatch).node == "b"
            assert "403" in rejected[name.removesuffix(".msgpack") + ".txt"].read_text()
    assert len(impostor.spool) == 0
    assert any("rejected" in r.getMessage() and "403" in r.getMessage()
               for r in caplog.records), caplog.text
    assert len(bad_token.spool) >= 1  # kept for a fixed token
    assert col.seqs() == []
    col.stop()
    col.store.close()


def test_uploads_carry_the_agent_clock_for_the_skew_metric(tmp_path: Path) -> None:
    col = Collector(tmp_path)
    col.start()
    up = Uplink(agent_config(tmp_path, col.port), registry=CollectorRegistry(),
                clock=lambda: time.time() + 100.0, poll_wait_s=1.0, retry_s=0.05)
    up.start()
    try:
        up.add(samples=samples("a", time.time()), urgent=True)
        wait_for(lambda: len(col.seqs()) >= 1)
    finally:
        up.stop()
    skew = col.app.state.ctx.metrics.registry.get_sample_value(
        "forewarn_collector_agent_clock_skew_seconds", {"node": "a"})
    assert skew is not None and 95 < skew < 101
    col.stop()
    col.store.close()


def test_build_is_off_without_collector_url_and_checks_config(tmp_path: Path) -> None:
    assert build_uplink(AgentConfig(node="a", spool_dir=tmp_path)) is None
    with pytest.raises(ConfigError, match="collector_url"):
        build_uplink(AgentConfig(node="a", collector_url="ftp://x", spool_dir=tmp_path))
    with pytest.raises(ConfigError, match="token"):
        build_uplink(AgentConfig(node="a", collector_url="http://127.0.0.1:1", spool_dir=tmp_path))
    with pytest.raises(ConfigError, match="token_file"):
        build_uplink(AgentConfig(node="a", collector_url="http://127.0.0.1:1", spool_dir=tmp_path,
                          token_file=tmp_path / "missing"))
    token_file = tmp_path / "tok"
    token_file.write_text("  secret-token\n")
    up = build_uplink(AgentConfig(node="a", collector_url="http://127.0.0.1:1", spool_dir=tmp_path,
                           token_file=token_file))
    assert up is not None and up.token == "secret-token"
    assert threading.active_count() >= 1


def test_an_unwritable_spool_keeps_records_in_memory_until_it_works(tmp_path: Path) -> None:
    reg = CollectorRegistry()
    up = Uplink(agent_config(tmp_path, 1), registry=reg)
    from forewarn.agent import uplink as uplink_module

    up.metrics = uplink_module._Metrics(reg)  # driven by hand: no threads started
    up.add(samples=samples("a", 1.0), findings=[Finding(
        check="ecc", health=Health.UNHEALTHY, reason="x", subject=Subject(kind="gpu", node="a",
                                                                          gpu=0), time=1.0)])
    spool_dir = tmp_path / "spool"
    real_append = up.spool.append

    def full(*_a: Any, **_k: Any) -> AgentBatch:
        raise OSError(28, "No space left on device")

    up.spool.append = full  # type: ignore[method-assign]
    with pytest.raises(OSError):
        up.seal()
    assert value(reg, "forewarn_uplink_spool_write_errors_total") == 1
    assert not list(spool_dir.glob("*.msgpack"))
    up.spool.append = real_append  # type: ignore[method-assign]
    up.add(samples=samples("a", 2.0))
    got = up.seal()
    assert got is not None and got.urgent
    assert [s.time for s in got.samples] == [1.0] * 4 + [2.0] * 4 and len(got.findings) == 1


_SHORT_WRITE_CHILD = """
import resource, signal, sys
from pathlib import Path
from forewarn.agent.spool import Spool
from forewarn.wire import AgentBatch, GpuSample
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit returns short, then EFBIG
spool = Spool(Path(sys.argv[1]), max_bytes=1 << 30)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
batch = AgentBatch(node="a", agent_id=spool.agent_id, seq=0, created=1.0, samples=[
    GpuSample(node="a", gpu=g % 8, time=float(g), source="sim", simulated=True,
              temperature_c=50.0) for g in range(4000)])
try:
    spool.append(lambda aid, seq: batch)
except OSError as exc:
    print("refused", exc.errno)
else:
    print("sealed")
"""


def test_a_batch_the_disk_takes_only_part_of_is_refused_not_sealed_torn(tmp_path: Path) -> None:
    # A full disk (or a file-size limit) makes write() return short before it fails: the spool
    # must not seal the torn part as a batch, it must raise so the uplink keeps it in memory.
    out = subprocess.run([sys.executable, "-c", _SHORT_WRITE_CHILD, str(tmp_path / "s")],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split()[0] == "refused", out
    assert not list((tmp_path / "s").glob("*.msgpack"))
