"""Job peers live in the collector: the GPUs of a job spread over three nodes, the GPUs of
one node all replaying PCIe packets together (zero against their node peers). The
collector's scorer names each of them against the job's GPUs: stored ``models.job_peers``
findings (which the status page lists, reason and all) and a webhook decision for each.

A real collector over real HTTP on loopback with a real SQLite store and the shipped model
(tests/support/collector); agents' batches posted as agents post them, on a clock the test
moves a minute at a time (features live on a 60 s grid; a scoring is due at every clock
move)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from forewarn.models.persist import default_model_path
from forewarn.wire import AgentBatch, GpuSample, RankSummary, encode

from support.collector import TOKENS, Clock, serve
from support.polling import poll

pytestmark = [pytest.mark.system,
              pytest.mark.skipif(not default_model_path().exists(), reason="no shipped model")]

T0 = 1_750_000_020.0
JOB = "train-7"
NODES = ("node1", "node2", "node3")
BAD = "node2"


class _Fleet:
    def __init__(self, client: httpx.Client, clock: Clock) -> None:
        self.client, self.clock = client, clock
        self.seq = dict.fromkeys(NODES, 0)
        self.replays = dict.fromkeys(NODES, 0)

    def push(self, node: str, **kw: Any) -> None:
        b = AgentBatch(node=node, agent_id=f"agent-{node}", seq=self.seq[node],
                       created=self.clock(), **kw)
        self.seq[node] += 1
        r = self.client.post("/api/v1/ingest", content=encode(b), headers={
            "content-type": "application/msgpack", "authorization": f"Bearer {TOKENS[node]}"})
        assert r.status_code == 200, r.text

    def fed(self) -> float:
        text = self.client.get("/metrics").text
        line = next((x for x in text.splitlines() if x.startswith(
            'forewarn_collector_predictor_samples_total{result="fed"}')), None)
        return float(line.split()[-1]) if line else 0.0

    def minute(self, m: int) -> None:
        """Every node posts minute ``m``'s samples and its ranks; then the clock moves past
        the minute and a scoring runs."""
        start = T0 + m * 60
        self.clock.t = start + 30
        before = self.fed()
        for k, node in enumerate(NODES):
            if node == BAD and m >= 3:
                self.replays[node] += 40
            self.push(node, samples=[GpuSample(
                node=node, gpu=g, time=start + 1, source="test", temperature_c=60.0 + g,
                power_w=500.0, power_limit_w=700.0, ecc_corrected_volatile=0,
                pcie_replay_total=self.replays[node]) for g in range(4)],
                ranks=[RankSummary(job=JOB, rank=4 * k + g, world_size=12, node=node, gpu=g,
                                   pid=100 + g, last_step=m, last_step_time=start + 30,
                                   step_seconds_p50=1.0) for g in range(4)])
        assert poll(lambda: self.fed() >= before + 12), "samples not fed to the predictor"
        self.clock.t = start + 62
        self.push("node1")
        scored = poll(lambda: self.client.get("/api/v1/risk").json()["time"] == self.clock.t)
        assert scored, f"minute {m} not scored"


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[_Fleet]:
    clock = Clock(T0)
    server, store, client = serve(tmp_path, TOKENS, clock, model_path=default_model_path(),
                                  predict_interval_s=1.0, advise_hooks=False)
    yield _Fleet(client, clock)
    client.close()
    server.stop()
    store.close()


def test_a_node_drifting_as_a_whole_is_named_against_its_job(fleet: _Fleet) -> None:
    for m in range(8):
        fleet.minute(m)
    rows = fleet.client.get("/api/v1/findings",
                            params={"check_name": "models.job_peers"}).json()
    found = [r["finding"] for r in rows]
    assert {(f["subject"]["node"], f["subject"]["gpu"]) for f in found} == \
        {(BAD, g) for g in range(4)}, found
    f = found[0]
    assert f["subject"]["job"] == JOB and f["health"] == "degraded"
    assert "stands out from the 12 GPUs of job train-7: PCIe replays" in f["reason"]
    assert "vs its node peers +0.00" in f["reason"]
    assert f["evidence"]["signal"] == "PCIe replays" and f["evidence"]["z"] >= 6
    decisions = [{**d, "inputs": json.loads(d["inputs"])}
                 for d in fleet.client.get("/api/v1/decisions").json()]
    notified = {d["subject"] for d in decisions if d["decision"].startswith("webhook:")
                and d["inputs"].get("check") == "models.job_peers"}
    assert notified == {f"gpu:{BAD}/{g}" for g in range(4)}, decisions
