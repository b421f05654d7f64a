"""Inbound Alertmanager / Grafana webhooks: label parsing, and through the real collector
service (uvicorn on loopback, SQLite) to checkpoint orders on every node of the job."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from forewarn.collector.alerts import alert_findings, parse_alerts
from forewarn.collector.app import create_app
from forewarn.collector.auth import TokenRegistry
from forewarn.collector.cli import ServerThread
from forewarn.collector.config import CollectorConfig
from forewarn.collector.jobview import RankTable, node_of_instance
from forewarn.collector.policy_service import PolicyService
from forewarn.collector.store import Store
from forewarn.wire import AgentBatch, CheckpointReport, Health, RankSummary, encode

ALERT_TOKEN = "alert-token-0123456789"
TOKENS = {"node1": "token-one-0123456789", "node2": "token-two-0123456789",
          "node3": "token-three-0123456789"}


def am_payload(*alerts: dict[str, Any], status: str = "firing") -> dict[str, Any]:
    """An Alertmanager webhook body (version 4)."""
    return {
        "version": "4", "groupKey": "{}:{}", "truncatedAlerts": 0, "status": status,
        "receiver": "forewarn", "groupLabels": {}, "commonLabels": {},
        "commonAnnotations": {}, "externalURL": "http://am:9093",
        "alerts": [{"status": a.pop("status", "firing"), "labels": a.pop("labels"),
                    "annotations": a.pop("annotations", {}), "startsAt": "2026-01-01T00:00:00Z",
                    "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "",
                    "fingerprint": "abc"} for a in alerts],
    }


def table() -> RankTable:
    t = RankTable()
    t.update([RankSummary(job="train-1", rank=r, world_size=4, node=f"node{r // 2 + 1}",
                          gpu=r % 2, pid=10 + r) for r in range(4)], now=0.0)
    t.add_gpu("node2", 1, "GPU-aaaa-bbbb")
    return t


def test_labels_to_subjects() -> None:
    payload = parse_alerts(json.dumps(am_payload(
        {"labels": {"alertname": "XidFatal", "node": "node2", "gpu": "1",
                    "severity": "critical"}, "annotations": {"summary": "XID 79"}},
        {"labels": {"alertname": "DcgmHot", "UUID": "GPU-aaaa-bbbb", "Hostname": "ignored"}},
        {"labels": {"alertname": "NodeDown", "instance": "node1:9403"}},
        {"labels": {"alertname": "JobSlow", "job": "train-1"}},
        {"labels": {"alertname": "Scrape", "job": "node-exporter", "instance": "[::1]:9100"}},
        {"labels": {"alertname": "Nothing"}},
        {"labels": {"alertname": "Old", "node": "node1"}, "status": "resolved"},
    )).encode())
    findings, skipped = alert_findings(payload, table(), "alertmanager", 5.0)
    got = [(f.check, f.subject.key(), f.health) for f in findings]
    assert got == [
        ("alert:XidFatal", "gpu:node2/1", Health.UNHEALTHY),
        ("alert:DcgmHot", "gpu:node2/1", Health.DEGRADED),  # UUID resolved via the GPU table
        ("alert:NodeDown", "node:node1", Health.DEGRADED),  # port removed from instance
        ("alert:JobSlow", "job:train-1", Health.DEGRADED),
        ("alert:Scrape", "node:::1", Health.DEGRADED),  # a scrape job is not a training job
    ]
    assert findings[0].reason == "alertmanager alert XidFatal: XID 79"
    assert findings[0].evidence["severity"] == "critical"
    assert len(skipped) == 2 and "not firing" in skipped[1] and "no node" in skipped[0]


def test_node_of_instance() -> None:
    assert node_of_instance("node7:9400") == "node7"
    assert node_of_instance("node7") == "node7"
    assert node_of_instance("[fe80::1]:9400") == "fe80::1"
    assert node_of_instance("10.0.0.1:80") == "10.0.0.1"


@pytest.mark.parametrize("body", [b"not json", b'{"alerts": 5}', b'{"alerts": [{"labels": 1}]}'])
def test_malformed_bodies(body: bytes) -> None:
    with pytest.raises(ValueError, match="invalid alert webhook body"):
        parse_alerts(body)


# -- through the service ---------------------------------------------------------------


@dataclasses.dataclass
class Service:
    server: ServerThread
    store: Store
    client: httpx.Client
    seq: dict[str, int]

    def push(self, node: str, **kw: Any) -> None:
        seq = self.seq.get(node, 0)
        self.seq[node] = seq + 1
        b = AgentBatch(node=node, agent_id=f"agent-{node}", seq=seq, created=time.time(), **kw)
        r = self.client.post("/api/v1/ingest", content=encode(b), headers={
            "content-type": "application/msgpack", "authorization": f"Bearer {TOKENS[node]}"})
        assert r.status_code == 200, r.text

    def commands(self, node: str, wait: float = 0.0) -> list[dict[str, Any]]:
        r = self.client.get("/api/v1/commands", params={"node": node, "wait": wait},
                            headers={"authorization": f"Bearer {TOKENS[node]}"})
        assert r.status_code == 200, r.text
        result: list[dict[str, Any]] = r.json()
        return result

    def alert(self, path: str = "alertmanager", token: str | None = ALERT_TOKEN,
              **kw: Any) -> httpx.Response:
        headers = {} if token is None else {"authorization": f"Bearer {token}"}
        return self.client.post(f"/api/v1/alerts/{path}", headers=headers, **kw)


def start_service(tmp_path: Path, **overrides: Any) -> Service:
    cfg = CollectorConfig(listen="127.0.0.1:0", data_dir=tmp_path / "data",
                          tokens_file=tmp_path / "none.toml", flush_interval_s=3600,
                          **{"alert_token": ALERT_TOKEN, **overrides})
    store = Store(cfg.db_path)
    app = create_app(cfg, store, policy=PolicyService.from_config(cfg),
                     tokens=TokenRegistry(tokens=TOKENS))
    server = ServerThread(app, cfg).start()
    return Service(server, store, httpx.Client(base_url=server.url, timeout=30), {})


def stop_service(svc: Service) -> None:
    svc.client.close()
    svc.server.stop()
    svc.store.close()


def ranks_on(node: str, first_rank: int, now: float) -> list[RankSummary]:
    """Two ranks of job train-1 on ``node``, last checkpointed an hour ago."""
    return [RankSummary(job="train-1", rank=first_rank + g, world_size=4, node=node, gpu=g,
                        pid=100 + first_rank + g, last_step=500, last_step_time=now,
                        step_seconds_p50=0.2, last_checkpoint_step=100,
                        last_checkpoint_time=now - 3600, checkpoint_seconds=30.0)
            for g in range(2)]


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[Service]:
    s = start_service(tmp_path)
    now = time.time()
    s.push("node1", ranks=ranks_on("node1", 0, now))
    s.push("node2", ranks=ranks_on("node2", 2, now))
    s.push("node3")  # a node without the job
    yield s
    stop_service(s)


def test_alert_orders_checkpoint_on_every_node_of_the_job(svc: Service) -> None:
    payload = am_payload({"labels": {"alertname": "GpuXid79", "node": "node2", "gpu": "1",
                                     "severity": "critical"},
                          "annotations": {"summary": "GPU fell off the bus"}})
    r = svc.alert(content=json.dumps(payload).encode())
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["findings"] == 1
    ckpt = [d for d in body["decisions"] if d["action"] == "checkpoint"]
    assert ckpt and ckpt[0]["outcome"] == "act" and ckpt[0]["target"] == "job:train-1"
    cmds = {node: svc.commands(node, wait=5) for node in ("node1", "node2")}
    orders = [c["order"] for cs in cmds.values() for c in cs]
    assert len(orders) == 2 and all(c["kind"] == "checkpoint" for cs in cmds.values()
                                    for c in cs)
    assert {o["job"] for o in orders} == {"train-1"}
    assert len({o["step"] for o in orders}) == 1 and orders[0]["step"] > 500
    assert len({o["request_id"] for o in orders}) == 1
    assert svc.commands("node3") == []
    # the decision is stored with its inputs, the finding and the action too
    decisions = svc.client.get("/api/v1/decisions", params={"job": "train-1"}).json()
    stored = next(d for d in decisions if d["decision"] == "checkpoint:act")
    inputs = json.loads(stored["inputs"]) if isinstance(stored["inputs"], str) else stored[
        "inputs"]
    assert inputs["source"] == "alertmanager" and "bypassed" in inputs["cost_model"]
    assert inputs["gpus"] == 4
    findings = svc.client.get("/api/v1/findings").json()
    assert [f["check_name"] for f in findings] == ["alert:GpuXid79"]
    actions = svc.client.get("/api/v1/actions", params={"kind": "checkpoint"}).json()
    assert [a["status"] for a in actions] == ["ordered"]

    # a rank that had passed S reports "missed": a new order with a later S goes out
    step = orders[0]["step"]
    rid = orders[0]["request_id"]
    svc.push("node1", checkpoints=[CheckpointReport(
        job="train-1", rank=0, host="node1", request_id=rid, step=step + 100, phase="missed",
        time=time.time())])
    again = [c["order"] for node in ("node1", "node2") for c in svc.commands(node, wait=5)]
    assert len(again) == 2 and {o["request_id"] for o in again} != {rid}
    assert len({o["step"] for o in again}) == 1 and again[0]["step"] > step + 100


def test_grafana_payload_and_dedup(svc: Service) -> None:
    grafana = {"receiver": "forewarn", "status": "firing", "orgId": 1, "title": "[FIRING:1]",
               "state": "alerting", "message": "m",
               "alerts": [{"status": "firing", "labels": {"alertname": "HotGpu",
                                                          "instance": "node1:9403", "gpu": "0"},
                           "annotations": {}, "values": {"A": 95}}]}
    r = svc.alert(path="grafana", json=grafana)
    assert r.status_code == 200, r.text
    assert any(d["action"] == "checkpoint" and d["outcome"] == "act"
               for d in r.json()["decisions"])
    assert len(svc.commands("node2", wait=5)) == 1
    # Grafana re-sends the same firing alert: deduplicated, no second order
    r = svc.alert(path="grafana", json=grafana)
    assert r.status_code == 200 and r.json()["decisions"] == []
    assert svc.commands("node2") == []


def test_alert_routes_reject_bad_requests_and_store_nothing(svc: Service) -> None:
    good = json.dumps(am_payload({"labels": {"alertname": "X", "node": "node1"}})).encode()
    cases = [
        (None, good, 401, "bearer token"),
        ("wrong-token", good, 401, "bearer token"),
        (ALERT_TOKEN, b"{not json", 400, "invalid alert webhook body"),
        (ALERT_TOKEN, b'{"alerts": "x"}', 400, "invalid alert webhook body"),
        (ALERT_TOKEN, b" " * (1024 * 1024 + 10), 413, "too large"),
    ]
    for token, body, status, message in cases:
        r = svc.alert(token=token, content=body)
        assert r.status_code == status, (token, r.text)
        assert message in r.json()["error"]
    assert svc.client.get("/api/v1/findings").json() == []
    assert svc.commands("node1") == []


def test_without_alert_token_the_routes_refuse(tmp_path: Path) -> None:
    s = start_service(tmp_path, alert_token="")
    try:
        r = s.alert(content=b"{}")
        assert r.status_code == 403 and "alert_token" in r.json()["error"]
    finally:
        stop_service(s)
