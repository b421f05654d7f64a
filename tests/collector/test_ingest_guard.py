"""The collector under hostile or broken agent data (issue 14, points 1, 2, 9, 10, 13):
real HTTP on loopback, a real SQLite file, real Parquet flushes, real staging log.

The rule: one bad record is refused with an error naming its field and counted; every
other record and every other agent's data keeps flowing."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from forewarn.collector.ingest.batch import IngestResult, IngestWriter
from forewarn.collector.ingest.validate import IngestError
from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.staging import StagingLog
from forewarn.collector.storage.store import Store
from forewarn.collector.storage.telemetry import TelemetryWriter
from forewarn.wire import AgentBatch, CommandAck, GpuSample, encode, encode_json

from support.collector import TOKENS, Service, start_service, stop_service

MSGPACK = {"content-type": "application/msgpack"}


def auth(node: str) -> dict[str, str]:
    return {"authorization": f"Bearer {TOKENS[node]}"}


def sample(node: str, gpu: int, t: float, **kw: Any) -> GpuSample:
    return GpuSample(node=node, gpu=gpu, time=t, source="sim", simulated=True,
                     temperature_c=60.0, power_w=300.0, ecc_corrected_volatile=1, **kw)


def post(svc: Service, node: str, batch: AgentBatch | bytes,
         headers: dict[str, str] | None = None) -> httpx.Response:
    body = batch if isinstance(batch, bytes) else encode(batch)
    return svc.client.post("/api/v1/ingest", content=body,
                           headers={**MSGPACK, **auth(node), **(headers or {})})


def ctx(svc: Service) -> Any:
    app: Any = svc.server.server.config.app
    return app.state.ctx


def parquet_rows(svc: Service) -> list[tuple[str, int, float]]:
    df = ctx(svc).telemetry.read(include_staged=False)
    return sorted(zip(df["node"], df["gpu"], df["time"], strict=True))


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[Service]:
    s = start_service(tmp_path)
    yield s
    stop_service(s)


# -- point 1: a poisoned sample -------------------------------------------------------

POISONS = {
    "millisecond time": ({"time": time.time() * 1000}, "time"),
    "+Inf power": ({"power_w": math.inf}, "power_w"),
    "NaN temperature": ({"temperature_c": math.nan}, "temperature_c"),
    "NVML 2^64-1 counter": ({"ecc_corrected_volatile": 2**64 - 1}, "ecc_corrected_volatile"),
    "counter 2^63": ({"pcie_replay_total": 2**63}, "pcie_replay_total"),
}


@pytest.mark.parametrize("poison", sorted(POISONS))
def test_a_poisoned_sample_is_refused_by_field_and_every_other_row_is_flushed(
        svc: Service, poison: str) -> None:
    fields, name = POISONS[poison]
    now = time.time()
    raw = msgspec.to_builtins(sample("node1", 1, now))
    raw.update(fields)
    good = msgspec.to_builtins(sample("node1", 0, now))
    body = msgspec.msgpack.encode({"node": "node1", "agent_id": "agent-node1", "seq": 0,
                                   "created": now, "samples": [good, raw]})
    r = post(svc, "node1", body)
    assert r.status_code == 200, r.text
    refused = r.json()["refused"]
    assert [f["field"] for f in refused] == [f"$.samples[1].{name}"], refused
    assert refused[0]["reason"]
    svc.push("node2", samples=[sample("node2", 0, now)])

    ctx(svc).telemetry.flush()
    assert parquet_rows(svc) == [("node1", 0, now), ("node2", 0, now)]
    assert sum(svc.metric("forewarn_collector_ingest_refused_records_total",
                      record="samples", reason=reason)
               for reason in ("time", "non_finite", "range")) == 1
    # later flushes keep working
    svc.push("node2", samples=[sample("node2", 0, now + 1)])
    assert ctx(svc).telemetry.flush() == 1


def test_refusals_name_each_record_by_its_index_in_the_request(svc: Service) -> None:
    now = time.time()
    raw = [msgspec.to_builtins(sample("node1", g, now)) for g in range(4)]
    raw[0]["power_w"] = "hot"
    raw[2]["time"] = now + 3600
    raw[3]["time"] = now - 30 * 86400
    body = msgspec.msgpack.encode({"node": "node1", "agent_id": "agent-node1", "seq": 0,
                                   "created": now, "samples": raw})
    r = post(svc, "node1", body)
    assert r.status_code == 200, r.text
    assert [(f["field"], f["reason"]) for f in r.json()["refused"]] == [
        ("$.samples[0].power_w", "type"), ("$.samples[2].time", "time"),
        ("$.samples[3].time", "time")]
    assert "older" in r.json()["refused"][2]["error"]
    assert svc.store.scalar("SELECT samples FROM batches") == 1


@pytest.mark.parametrize("restarted", [False, True])
def test_bad_rows_already_staged_are_isolated_by_the_flush(tmp_path: Path,
                                                           restarted: bool) -> None:
    """Staged before validation existed (or by any other path): the flush leaves out and
    counts each bad row, writes the rest of its batch and the other batches, and keeps
    working; both from the samples kept in memory and, after a restart, from the log."""
    store = Store(tmp_path / "collector.db")
    metrics = CollectorMetrics()
    staging = StagingLog(tmp_path / "staging")
    telemetry = TelemetryWriter(store, tmp_path / "telemetry", metrics, staging=staging)
    writer = IngestWriter(store, metrics, staging=staging, on_staged=telemetry.remember)
    now = time.time()
    poisoned = AgentBatch(node="n1", agent_id="a1", seq=0, created=now, samples=[
        sample("n1", 0, now), sample("n1", 1, now * 1000),
        sample("n1", 2, now, pcie_replay_total=2**64 - 1), sample("n1", 3, now)])
    other = AgentBatch(node="n2", agent_id="a2", seq=0, created=now,
                       samples=[sample("n2", 0, now)])
    writer.start()
    try:
        for b in (poisoned, other):
            assert writer.submit(b, encode(b)).result(30) is IngestResult.STORED
    finally:
        writer.stop()
    if restarted:  # nothing decoded in memory: bodies are read from the staging log
        telemetry = TelemetryWriter(store, tmp_path / "telemetry", metrics, staging=staging)
    assert telemetry.flush() == 3
    df = telemetry.read(include_staged=False)
    assert sorted(zip(df["node"], df["gpu"], strict=True)) == [("n1", 0), ("n1", 3), ("n2", 0)]
    assert metrics.bad_rows._value.get() == 2
    assert metrics.flush_errors._value.get() == 0
    assert telemetry.staged_samples() == 0
    store.close()


# -- point 2: an impostor agent -------------------------------------------------------

def test_another_node_posting_with_my_agent_id_is_refused_and_burns_nothing(
        svc: Service) -> None:
    now = time.time()

    def batch(node: str, seq: int) -> AgentBatch:
        return AgentBatch(node=node, agent_id="agent-node1", seq=seq, created=now,
                          samples=[sample(node, 0, now + seq)])

    for seq in range(3):
        assert post(svc, "node1", batch("node1", seq)).json()["result"] == "stored"
    for seq in range(3, 8):  # node2's token, node1's agent id: would burn node1's seqs
        r = post(svc, "node2", batch("node2", seq))
        assert r.status_code == 403, r.text
        assert "agent_id" in r.json()["error"]
    for seq in range(3, 8):
        assert post(svc, "node1", batch("node1", seq)).json()["result"] == "stored"
    assert svc.metric("forewarn_collector_ingest_rejected_total",
                  reason="identity_mismatch") == 5
    rows = svc.store.query("SELECT node, COUNT(*) AS n FROM batches GROUP BY node")
    assert [(r["node"], r["n"]) for r in rows] == [("node1", 8)]


# -- point 9: one poison batch in a group commit --------------------------------------

def test_one_poison_batch_is_quarantined_and_the_rest_of_its_group_is_stored(
        tmp_path: Path) -> None:
    store = Store(tmp_path / "collector.db")
    quarantine = tmp_path / "quarantine"
    metrics = CollectorMetrics()
    writer = IngestWriter(store, metrics, staging=StagingLog(tmp_path / "staging"),
                          quarantine_dir=quarantine)
    now = time.time()
    # Built in Python, so no decoder checked it: a seq SQLite cannot hold (OverflowError).
    poison = AgentBatch(node="n2", agent_id="a2", seq=2**63, created=now,
                        samples=[sample("n2", 0, now)])
    good = [AgentBatch(node=f"n{i}", agent_id=f"a{i}", seq=0, created=now,
                       samples=[sample(f"n{i}", 0, now)]) for i in (1, 3)]
    group = [good[0], poison, good[1]]
    futures = [writer.submit(b, encode(b)) for b in group]  # queued: one group at start
    writer.start()
    try:
        assert futures[0].result(30) is IngestResult.STORED
        assert futures[2].result(30) is IngestResult.STORED
        with pytest.raises(IngestError) as err:
            futures[1].result(30)
        assert 400 <= err.value.status < 500 and "quarantine" in str(err.value)
        # sent again: refused again at once, never retried into a wedge
        with pytest.raises(IngestError):
            writer.submit(poison, encode(poison)).result(30)
    finally:
        writer.stop()
    kept = sorted(p.name for p in quarantine.iterdir())
    assert any(name.endswith(".msgpack") for name in kept), kept
    body = next(p for p in quarantine.iterdir() if p.suffix == ".msgpack").read_bytes()
    assert body == encode(poison)
    assert store.scalar("SELECT COUNT(*) FROM batches") == 2
    assert metrics.quarantined.labels("poison_batch")._value.get() == 2  # sent twice
    store.close()


# -- point 10: deeply nested or oversized JSON ----------------------------------------

def ack(svc: Service, body: bytes) -> httpx.Response:
    return svc.client.post("/api/v1/commands/x/ack", content=body,
                           headers={"content-type": "application/json", **auth("node1")})


@pytest.mark.parametrize("depth", [3_000, 20_000])
def test_deeply_nested_json_is_a_400_naming_the_problem(svc: Service, depth: int) -> None:
    # inside a field the decoder skips (unknown to the record), where msgspec recurses
    nested = b'{"extra": ' + b"[" * depth + b"]" * depth + b"}"
    r = ack(svc, nested)
    assert r.status_code == 400 and "nest" in r.json()["error"], r.text
    r = svc.alert(content=nested)
    assert r.status_code == 400 and "nest" in r.json()["error"], r.text
    r = post(svc, "node1", b"\x81\xa5extra" + b"\x91" * depth + b"\xc0")  # msgpack
    assert r.status_code == 400 and "nest" in r.json()["error"], r.text
    r = ack(svc, b" " * (65 * 1024))
    assert r.status_code == 413, r.text
    # the service still answers
    assert ack(svc, encode_json(CommandAck(id="x", node="node1", time=time.time()))
               ).status_code == 404


def test_a_string_that_is_not_utf8_is_a_400_naming_the_problem(svc: Service) -> None:
    """Found by the property test: msgspec raises UnicodeDecodeError, not DecodeError."""
    r = post(svc, "node1", b"\x81\xa4node\xa1\xa4")  # {"node": <the byte 0xa4>}
    assert r.status_code == 400 and "utf-8" in r.json()["error"], r.text
    r = ack(svc, b'{"id": "x", "node": "\xa4", "time": 1.0}')
    assert r.status_code == 400, r.text


# -- point 13: future-stamped samples and clock skew ----------------------------------

def test_a_future_sample_is_refused_and_cannot_freeze_the_gpu_row(svc: Service) -> None:
    now = time.time()
    r = post(svc, "node1", AgentBatch(node="node1", agent_id="agent-node1", seq=0, created=now,
                                      samples=[sample("node1", 0, now + 86400 * 365)]))
    assert r.status_code == 200, r.text
    assert [f["field"] for f in r.json()["refused"]] == ["$.samples[0].time"]
    assert "future" in r.json()["refused"][0]["error"]
    for seq, t in ((1, now), (2, now + 1)):
        post(svc, "node1", AgentBatch(node="node1", agent_id="agent-node1", seq=seq,
                                      created=t, samples=[sample("node1", 0, t)]))
    assert svc.store.scalar("SELECT last_seen FROM gpus WHERE node='node1' AND gpu=0") == now + 1


def test_clock_skew_is_measured_per_agent(svc: Service) -> None:
    now = time.time()
    for node, skew in (("node1", 120.0), ("node2", -30.0)):
        r = post(svc, node, AgentBatch(node=node, agent_id=f"agent-{node}", seq=0,
                                       created=now + skew, samples=[sample(node, 0, now)]),
                 headers={"forewarn-sent-at": repr(time.time() + skew)})
        assert r.status_code == 200, r.text
    got1 = svc.metric("forewarn_collector_agent_clock_skew_seconds", node="node1")
    got2 = svc.metric("forewarn_collector_agent_clock_skew_seconds", node="node2")
    assert 115 < got1 < 121 and -35 < got2 < -29, (got1, got2)
    r = post(svc, "node3", AgentBatch(node="node3", agent_id="agent-node3", seq=0,
                                      created=now), headers={"forewarn-sent-at": "nan"})
    assert r.status_code == 400 and "forewarn-sent-at" in r.json()["error"], r.text


def test_nvlink_counters_whose_sum_leaves_int64_do_not_fail_the_flush(tmp_path: Path) -> None:
    """Each link's counter fits int64, their sum over links need not (the hypothesis test
    found it): the Parquet column saturates at int64's maximum instead of failing the flush."""
    from forewarn.wire import INT64_MAX, NvlinkCounters

    store = Store(tmp_path / "collector.db")
    metrics = CollectorMetrics()
    staging = StagingLog(tmp_path / "staging")
    telemetry = TelemetryWriter(store, tmp_path / "telemetry", metrics, staging=staging)
    writer = IngestWriter(store, metrics, staging=staging, on_staged=telemetry.remember)
    now = time.time()
    links = [NvlinkCounters(link=i, crc_flit=INT64_MAX, replay=1) for i in range(2)]
    batch = AgentBatch(node="n1", agent_id="a1", seq=0, created=now,
                       samples=[sample("n1", 0, now, nvlink=links), sample("n1", 1, now)])
    writer.start()
    try:
        assert writer.submit(batch, encode(batch)).result(30) is IngestResult.STORED
    finally:
        writer.stop()
    assert telemetry.flush() == 2
    assert metrics.flush_errors._value.get() == 0
    df = telemetry.read(include_staged=False).sort_values("gpu")
    # (read back as float64: the other GPU has no NVLink, a missing value)
    assert df["nvlink_crc_flit"].iloc[0] == float(INT64_MAX)
    assert df["nvlink_replay"].iloc[0] == 2
    store.close()
