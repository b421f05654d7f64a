"""Inbound Alertmanager / Grafana webhooks: label parsing, and through the real collector
service (uvicorn on loopback, SQLite) to checkpoint orders on every node of the job."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from forewarn.collector.ingest.alerts import alert_findings, parse_alerts
from forewarn.collector.jobs.jobview import RankTable, node_of_instance
from forewarn.wire import CheckpointReport, Health, RankSummary

from support.collector import (
    ALERT_TOKEN,
    Service,
    start_job_service,
    start_service,
    stop_service,
)
from support.polling import poll

pytestmark = pytest.mark.usefixtures("state_backend")  # both state backends


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
        {"labels": {"alertname": "JobSlow", "training_job": "train-1", "job": "forewarn-agent"}},
        {"labels": {"alertname": "OldRule", "job": "train-1"}},
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
        ("alert:JobSlow", "job:train-1", Health.DEGRADED),  # training_job, not the scrape job
        ("alert:OldRule", "job:train-1", Health.DEGRADED),
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


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[Service]:
    s = start_job_service(tmp_path)
    yield s
    stop_service(s)


def test_alert_orders_checkpoint_on_every_node_of_the_job(svc: Service) -> None:
    payload = am_payload({"labels": {"alertname": "GpuXid79", "node": "node2", "gpu": "1",
                                     "severity": "critical"},
                          "annotations": {"summary": "GPU fell off the bus"}})
    r = svc.alert(content=json.dumps(payload).encode())
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["findings"] == 1 and body["duplicates"] == 0
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
    assert stored["job"] == "train-1"
    inputs = json.loads(stored["inputs"]) if isinstance(stored["inputs"], str) else stored[
        "inputs"]
    assert inputs["source"] == "alertmanager" and "bypassed" in inputs["cost_model"]
    assert inputs["gpus"] == 4
    # stored by the alert book's next flush (within half a second), off the request path
    findings = poll(lambda: svc.client.get("/api/v1/findings").json(), 10)
    assert [f["check_name"] for f in findings] == ["alert:GpuXid79"]
    # recorded just after the order's commands are queued (CI at 64a6e2f read it before)
    actions = poll(lambda: svc.client.get("/api/v1/actions",
                                          params={"kind": "checkpoint"}).json(), 10)
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
    grafana: dict[str, Any] = {
               "receiver": "forewarn", "status": "firing", "orgId": 1, "title": "[FIRING:1]",
               "state": "alerting", "message": "m",
               "alerts": [{"status": "firing", "labels": {"alertname": "HotGpu",
                                                          "instance": "node1:9403", "gpu": "0"},
                           "annotations": {}, "values": {"A": 95}}]}
    r = svc.alert(path="grafana", json=grafana)
    assert r.status_code == 200 and r.json()["findings"] == 1, r.text
    assert len(svc.commands("node2", wait=5)) == 1
    # Grafana re-sends the same firing alert: deduplicated, no second finding or order
    r = svc.alert(path="grafana", json=grafana)
    assert r.status_code == 200 and r.json()["duplicates"] == 1, r.text
    assert r.json()["findings"] == 0
    assert svc.commands("node2", wait=1) == []
    rows = poll(lambda: svc.store.query("SELECT status, count FROM alerts"), 10)
    assert [(x["status"], x["count"]) for x in rows] == [("firing", 2)]
    # resolved, then firing again: a new alert
    resolved = {**grafana, "alerts": [{**grafana["alerts"][0], "status": "resolved"}]}
    assert svc.alert(path="grafana", json=resolved).json()["resolved"] == 1
    assert svc.alert(path="grafana", json=grafana).json()["findings"] == 1


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
