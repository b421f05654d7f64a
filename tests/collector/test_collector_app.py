"""The collector service over real HTTP (uvicorn on loopback) with a real SQLite file."""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from forewarn.collector.cli import ServerThread
from forewarn.collector.config import CollectorConfig
from forewarn.collector.http.app import create_app
from forewarn.collector.http.auth import TokenRegistry, hash_token
from forewarn.collector.jobs.jobmap import StoreJobView
from forewarn.collector.storage.commands import NodeCommand
from forewarn.collector.storage.state import StateStore, open_state
from forewarn.wire import (
    AgentBatch,
    CheckpointOrder,
    CheckpointReport,
    Command,
    CommandAck,
    Finding,
    GpuSample,
    Health,
    RankSummary,
    Subject,
    SuggestedAction,
    XidEvent,
    encode,
    encode_json,
)

import support.collector
from support.polling import poll

pytestmark = pytest.mark.usefixtures("state_backend")  # both state backends

TOKENS = {"node1": "token-one-0123456789", "node2": "token-two-0123456789"}
MSGPACK = {"content-type": "application/msgpack"}


def auth(node: str) -> dict[str, str]:
    return {"authorization": f"Bearer {TOKENS[node]}"}


def sample(node: str, gpu: int, t: float, **kw: Any) -> GpuSample:
    return GpuSample(node=node, gpu=gpu, time=t, source="sim", simulated=True,
                     uuid=f"GPU-{node}-{gpu}", temperature_c=60.0 + gpu, power_w=300.0,
                     ecc_corrected_volatile=gpu, **kw)


def batch(node: str, seq: int, *, agent: str = "", n: int = 2, gpus: int = 2,
          t0: float | None = None, **kw: Any) -> AgentBatch:
    t0 = time.time() if t0 is None else t0
    samples = [sample(node, g, t0 + i) for i in range(n) for g in range(gpus)]
    return AgentBatch(node=node, agent_id=agent or f"agent-{node}", seq=seq, created=t0,
                      samples=samples, **kw)


@dataclasses.dataclass
class Running:
    url: str
    store: StateStore
    config: CollectorConfig
    app: Any
    client: httpx.Client

    def post(self, b: AgentBatch | bytes, node: str = "node1",
             headers: dict[str, str] | None = None) -> httpx.Response:
        body = b if isinstance(b, bytes) else encode(b)
        return self.client.post("/api/v1/ingest", content=body,
                                headers=headers if headers is not None else {**MSGPACK,
                                                                              **auth(node)})

    def count(self, table: str) -> int:
        return int(self.store.scalar(f"SELECT COUNT(*) FROM {table}"))


class RecordingPolicy:
    """A minimal real policy: checkpoint every job on an unhealthy GPU's node."""

    def __init__(self) -> None:
        self.seen: list[Finding] = []
        self.batches = 0
        self.acks: list[tuple[str, str]] = []
        self.ctx: Any = None

    def start(self, ctx: Any) -> None:
        self.ctx = ctx

    def on_batches(self, batches: Sequence[AgentBatch], now: float) -> None:
        self.batches += len(batches)

    def on_ack(self, ack: CommandAck, node: str) -> None:
        self.acks.append((ack.id, node))

    def on_findings(self, findings: Sequence[Finding], store: StateStore, now: float
                    ) -> list[NodeCommand]:
        self.seen.extend(findings)
        out = []
        for f in findings:
            if f.health != Health.UNHEALTHY:
                continue
            for job in StoreJobView(store).jobs_on(f.subject.node, f.subject.gpu):
                order = CheckpointOrder(request_id=f"r-{job}-{int(now * 1000)}", job=job,
                                        step=100, reason=f.reason, issued=now)
                for node in StoreJobView(store).job(job).nodes:  # type: ignore[union-attr]
                    out.append(NodeCommand(node=node, command=Command(
                        id=f"{order.request_id}@{node}", kind="checkpoint", order=order,
                        issued=now)))
        return out


def start(tmp_path: Path, policy: Any = None, **overrides: Any) -> tuple[ServerThread, Running]:
    cfg = CollectorConfig(listen="127.0.0.1:0", data_dir=tmp_path / "data",
                          tokens_file=tmp_path / "none.toml", flush_interval_s=3600,
                          command_redeliver_s=overrides.pop("command_redeliver_s", 30.0),
                          **{**support.collector.STATE, **overrides})
    store = open_state(cfg)
    app = create_app(cfg, store, policy=policy, tokens=TokenRegistry(tokens=TOKENS))
    server = ServerThread(app, cfg).start()
    client = httpx.Client(base_url=server.url, timeout=30)
    return server, Running(server.url, store, cfg, app, client)


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[Running]:
    server, running = start(tmp_path, max_body_bytes=64 * 1024, max_batch_items=50)
    yield running
    running.client.close()
    server.stop()
    running.store.close()


def test_ingest_stores_once_and_read_api_shows_it(svc: Running) -> None:
    b = batch("node1", 0, xids=[XidEvent(node="node1", gpu=1, code=79, time=time.time(),
                                         source="kmsg", text="fallen off the bus")])
    r = svc.post(b)
    assert r.status_code == 200, r.text
    assert r.json() == {"result": "stored", "seq": 0}
    again = svc.post(b)
    assert again.json() == {"result": "duplicate", "seq": 0}
    assert svc.count("batches") == 1
    assert svc.count("xids") == 1
    assert svc.store.scalar("SELECT SUM(samples) FROM staged_samples") == 4
    nodes = svc.client.get("/api/v1/nodes").json()
    assert [(n["node"], n["batches"], n["samples"]) for n in nodes] == [("node1", 1, 4)]
    gpus = svc.client.get("/api/v1/gpus", params={"node": "node1"}).json()
    assert [(g["gpu"], g["uuid"], g["temperature_c"]) for g in gpus] == [
        (0, "GPU-node1-0", 60.0), (1, "GPU-node1-1", 61.0)]
    xids = svc.client.get("/api/v1/xids").json()
    assert xids[0]["code"] == 79
    metrics = svc.client.get("/metrics").text
    assert 'forewarn_collector_ingest_batches_total{result="stored"} 1.0' in metrics
    assert 'forewarn_collector_ingest_batches_total{result="duplicate"} 1.0' in metrics
    assert "forewarn_collector_ingest_samples_total 4.0" in metrics


def test_bad_requests_get_4xx_naming_the_problem_and_store_nothing(svc: Running) -> None:
    good = encode(batch("node1", 1))
    cases = [
        ({**MSGPACK}, good, 401, "missing bearer token"),
        ({**MSGPACK, "authorization": "Bearer nope"}, good, 401, "not recognised"),
        ({**MSGPACK, "authorization": "Basic abc"}, good, 401, "not recognised"),
        ({"content-type": "application/json", **auth("node1")}, good, 415, "application/msgpack"),
        ({**MSGPACK, **auth("node2")}, good, 403, "token is for node 'node2'"),
        ({**MSGPACK, **auth("node1")}, b"\xc1garbage", 400, "invalid AgentBatch"),
        ({**MSGPACK, **auth("node1")}, encode({"node": "node1", "agent_id": "a", "seq": "x",
                                               "created": 1.0}), 400, "$.seq"),
        ({**MSGPACK, **auth("node1")}, encode({"node": "node1", "agent_id": "a", "seq": -1,
                                               "created": 1.0}), 400, "$.seq"),
        ({**MSGPACK, **auth("node1")}, b"\x00" * (65 * 1024), 413, "exceeds the limit"),
        ({**MSGPACK, **auth("node1")}, encode(batch("node1", 2, n=30)), 413,
         "$.samples: 60 items"),
    ]
    for headers, body, status, words in cases:
        r = svc.post(body, headers=headers)
        assert r.status_code == status, (words, r.text)
        assert words in r.json()["error"], (words, r.text)
    # A sample claiming another node inside node1's batch.
    b = batch("node1", 3)
    forged = msgspec.structs.replace(b, samples=[*b.samples, sample("node2", 0, time.time())])
    r = svc.post(forged)
    assert r.status_code == 403 and "$.samples[4].node" in r.json()["error"]
    # A finding about another node's GPU (it would order checkpoints or drains there).
    alien = Finding(check="xid", health=Health.UNHEALTHY, reason="XID 79", time=time.time(),
                    subject=Subject(kind="gpu", node="node2", gpu=0))
    r = svc.post(batch("node1", 4, findings=[alien]))
    assert r.status_code == 403 and "$.findings[0].subject.node" in r.json()["error"]
    for table in ("batches", "staged_samples", "nodes", "gpus", "findings", "xids"):
        assert svc.count(table) == 0, table
    metrics = svc.client.get("/metrics").text
    assert 'forewarn_collector_ingest_rejected_total{reason="auth"} 3.0' in metrics


def test_chunked_oversized_body_is_refused(svc: Running) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(100):
            yield b"\x90" * 1024

    r = svc.client.post("/api/v1/ingest", content=chunks(), headers={**MSGPACK, **auth("node1")})
    assert r.status_code == 413
    assert svc.count("batches") == 0


def test_long_poll_delivers_acks_and_survives_restart(tmp_path: Path) -> None:
    server, svc = start(tmp_path, command_redeliver_s=0.5)
    try:
        got: list[Any] = []

        def poll() -> None:
            got.append(svc.client.get("/api/v1/commands", params={"node": "node2", "wait": 20},
                                      headers=auth("node2")))

        t = threading.Thread(target=poll)
        started = time.monotonic()
        t.start()
        time.sleep(0.3)  # the poll is parked on the server
        order = CheckpointOrder(request_id="req-1", job="jobA", step=42, issued=time.time())
        queued = svc.app.state.ctx.commands.order_checkpoint(["node2"], order)
        assert [c.node for c in queued] == ["node2"]
        t.join(10)
        assert time.monotonic() - started < 10
        commands = got[0].json()
        assert [c["id"] for c in commands] == ["req-1@node2"]
        assert commands[0]["order"]["step"] == 42
        # Not acked: delivered again after redeliver_s, not before.
        r = svc.client.get("/api/v1/commands", params={"node": "node2", "wait": 0},
                           headers=auth("node2"))
        assert r.json() == []
        # Another node's agent may not poll or ack for node2.
        r = svc.client.get("/api/v1/commands", params={"node": "node2"}, headers=auth("node1"))
        assert r.status_code == 403
        ack = CommandAck(id="req-1@node2", node="node2", time=time.time(), detail="passed on")
        r = svc.client.post("/api/v1/commands/req-1@node2/ack", content=encode_json(ack),
                            headers=auth("node1"))
        assert r.status_code == 403
    finally:
        svc.client.close()
        server.stop()
        svc.store.close()
    # Restart on the same database: the unacknowledged order is still there.
    server, svc = start(tmp_path, command_redeliver_s=0.5)
    try:
        r = svc.client.get("/api/v1/commands", params={"node": "node2", "wait": 5},
                           headers=auth("node2"))
        assert [c["id"] for c in r.json()] == ["req-1@node2"]
        ack = CommandAck(id="req-1@node2", node="node2", time=time.time())
        r = svc.client.post("/api/v1/commands/req-1@node2/ack", content=encode_json(ack),
                            headers=auth("node2"))
        assert r.json() == {"result": "acked"}
        r = svc.client.post("/api/v1/commands/req-1@node2/ack", content=encode_json(ack),
                            headers=auth("node2"))
        assert r.json() == {"result": "already"}
        r = svc.client.get("/api/v1/commands", params={"node": "node2", "wait": 1},
                           headers=auth("node2"))
        assert r.json() == []
        log = svc.client.get("/api/v1/commands/log").json()
        assert log[0]["acked_at"] is not None and log[0]["deliveries"] == 2
    finally:
        svc.client.close()
        server.stop()
        svc.store.close()


def test_job_map_and_policy_seam_turn_a_gpu_finding_into_orders_for_every_node(
        tmp_path: Path) -> None:
    policy = RecordingPolicy()
    server, svc = start(tmp_path, policy=policy)
    try:
        now = time.time()
        for i, node in enumerate(("node1", "node2")):
            ranks = [RankSummary(job="jobA", rank=2 * i + lr, local_rank=lr, world_size=4,
                                 node=node, gpu=lr, pid=100 + lr, last_step=50,
                                 last_step_time=now, step_seconds_p50=0.5)
                     for lr in range(2)]
            assert svc.post(batch(node, 0, ranks=ranks), node=node).status_code == 200
        job = svc.client.get("/api/v1/jobs/jobA").json()
        assert job["nodes"] == ["node1", "node2"]
        assert [(r["rank"], r["node"], r["gpu"]) for r in job["ranks"]] == [
            (0, "node1", 0), (1, "node1", 1), (2, "node2", 0), (3, "node2", 1)]
        assert svc.client.get("/api/v1/jobs/nope").status_code == 404
        view = StoreJobView(svc.store)
        assert view.jobs_on("node2", 1) == ["jobA"]
        assert view.jobs_on("node2", 5) == []
        assert view.job("jobA").gpu_count == 4  # type: ignore[union-attr]
        assert view.resolve_uuid("GPU-node2-1") == ("node2", 1)
        finding = Finding(check="xid", health=Health.UNHEALTHY,
                          subject=Subject(kind="gpu", node="node2", gpu=1),
                          reason="XID 79: GPU has fallen off the bus",
                          action=SuggestedAction.CHECKPOINT, time=now)
        r = svc.post(batch("node2", 1, n=0, urgent=True, findings=[finding]), node="node2")
        assert r.status_code == 200
        for node in ("node1", "node2"):
            got = svc.client.get("/api/v1/commands", params={"node": node, "wait": 10},
                                 headers=auth(node)).json()
            assert len(got) == 1 and got[0]["order"]["job"] == "jobA", node
            ack = CommandAck(id=got[0]["id"], node=node, time=time.time())
            assert svc.client.post(f"/api/v1/commands/{got[0]['id']}/ack",
                                   content=encode_json(ack), headers=auth(node)).status_code == 200
        gpus = svc.client.get("/api/v1/gpus", params={"node": "node2"}).json()
        assert gpus[1]["health"] == "unhealthy"
        findings = svc.client.get("/api/v1/findings").json()
        assert findings[0]["finding"]["reason"].startswith("XID 79")
        assert policy.batches == 3
        poll(lambda: len(policy.acks) >= 2, timeout=60)
        assert sorted(n for _, n in policy.acks) == ["node1", "node2"]
        # Checkpoint reports advance the job's last checkpoint.
        rep = CheckpointReport(job="jobA", rank=2, request_id="r", step=100, phase="done",
                               seconds=3.5, bytes=1000, time=time.time())
        svc.post(batch("node2", 2, n=0, checkpoints=[rep]), node="node2")
        job = svc.client.get("/api/v1/jobs/jobA").json()
        assert job["last_checkpoint_step"] == 100 and job["checkpoint_seconds"] == 3.5
        assert svc.client.get("/api/v1/checkpoints", params={"job": "jobA"}).json()[0][
            "phase"] == "done"
        # Collector-side findings use the same path.
        assert policy.ctx is svc.app.state.ctx
    finally:
        svc.client.close()
        server.stop()
        svc.store.close()


def test_openapi_metrics_healthz_and_read_token(tmp_path: Path) -> None:
    server, svc = start(tmp_path, api_token="reader-secret")
    try:
        doc = svc.client.get("/openapi.json").json()
        assert doc["openapi"].startswith("3.")
        assert "/api/v1/ingest" in doc["paths"] and "AgentBatch" in doc["components"]["schemas"]
        assert svc.client.get("/healthz").json()["ok"] is True
        assert svc.client.get("/api/v1/nodes").status_code == 401
        r = svc.client.get("/api/v1/nodes", headers={"authorization": "Bearer reader-secret"})
        assert r.status_code == 200
        assert svc.client.get("/api/v1/findings", params={"limit": "x"},
                              headers={"authorization": "Bearer reader-secret"}
                              ).status_code == 400
    finally:
        svc.client.close()
        server.stop()
        svc.store.close()


def test_token_add_cli_enrols_a_node(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    out = subprocess.run([sys.executable, "-m", "forewarn", "collector", "--tokens-file",
                          str(tokens), "--config", "/dev/null", "token", "add", "gpu-node-7"],
                         capture_output=True, text=True, check=True)
    token = out.stdout.strip()
    assert len(token) >= 40
    assert stat.S_IMODE(os.stat(tokens).st_mode) == 0o600
    assert token not in tokens.read_text() and hash_token(token) in tokens.read_text()
    reg = TokenRegistry(tokens, reload_s=0.0)
    assert reg.authenticate(f"Bearer {token}") == "gpu-node-7"
    assert reg.authenticate("Bearer wrong") is None
    # A second node; the registry picks up the change without a restart.
    out2 = subprocess.run([sys.executable, "-m", "forewarn", "collector", "--tokens-file",
                           str(tokens), "--config", "/dev/null", "token", "add", "node.b"],
                          capture_output=True, text=True, check=True)
    time.sleep(0.01)
    os.utime(tokens, (time.time() + 1, time.time() + 1))
    assert reg.authenticate(f"Bearer {out2.stdout.strip()}") == "node.b"
    assert reg.nodes() == ["gpu-node-7", "node.b"]


class FailingPolicy:
    """A policy whose hook raises, and which can be held up to build a backlog."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.batches = 0

    def on_batches(self, batches: Sequence[AgentBatch], now: float) -> None:
        self.release.wait(30)
        self.batches += len(batches)

    def on_findings(self, findings: Sequence[Finding], store: StateStore, now: float) -> None:
        raise RuntimeError("policy bug")


def test_a_failing_or_slow_policy_never_blocks_ingest(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import forewarn.collector.http.context as context_module

    monkeypatch.setattr(context_module, "POLICY_BACKLOG_MAX", 2)
    policy = FailingPolicy()
    server, svc = start(tmp_path, policy=policy)
    try:
        finding = Finding(check="ecc", health=Health.UNHEALTHY, reason="x",
                          subject=Subject(kind="gpu", node="node1", gpu=0), time=time.time())
        for seq in range(8):  # the policy thread is stuck: these must still be stored
            found = [finding] if seq == 7 else []
            assert svc.post(batch("node1", seq, findings=found)).status_code == 200
        assert svc.count("batches") == 8
        policy.release.set()
        deadline = time.monotonic() + 20
        text = ""
        while time.monotonic() < deadline:
            text = svc.client.get("/metrics").text
            if "forewarn_collector_policy_errors_total 1.0" in text:
                break
            time.sleep(0.05)
        assert "forewarn_collector_policy_errors_total 1.0" in text
        skipped = [line for line in text.splitlines()
                   if line.startswith("forewarn_collector_policy_skipped_batches_total")]
        assert skipped and float(skipped[0].split()[1]) >= 1
        # The batch with a finding was never skipped.
        assert policy.batches + float(skipped[0].split()[1]) == 8
    finally:
        svc.client.close()
        server.stop()
        svc.store.close()


def test_gpu_health_is_its_worst_current_check(svc: Running) -> None:
    now = time.time()

    def finding(check: str, health: Health, t: float) -> Finding:
        return Finding(check=check, health=health, reason=f"{check} {health.value}", time=t,
                       subject=Subject(kind="gpu", node="node1", gpu=1))

    assert svc.post(batch("node1", 1, findings=[
        finding("xid", Health.UNHEALTHY, now), finding("thermal", Health.HEALTHY, now + 1),
        finding("pcie", Health.UNKNOWN, now + 2)])).status_code == 200
    gpu = {g["gpu"]: g for g in svc.client.get("/api/v1/gpus").json()}[1]
    assert (gpu["health"], gpu["health_reason"]) == ("unhealthy", "xid unhealthy")
    # The XID check clears; the degraded ECC finding is now the worst.
    assert svc.post(batch("node1", 2, findings=[
        finding("ecc", Health.DEGRADED, now + 3), finding("xid", Health.HEALTHY, now + 4)])
    ).status_code == 200
    gpu = {g["gpu"]: g for g in svc.client.get("/api/v1/gpus").json()}[1]
    assert (gpu["health"], gpu["health_reason"]) == ("degraded", "ecc degraded")
