"""A real Alertmanager (Debian package prometheus-alertmanager) sends an alert to the real
collector, which orders a checkpoint of the job on the node named in the alert's labels.

Uses the shipped example config ``deploy/alertmanager.yml`` with only the collector URL and
the token file path replaced, so the example is what gets tested.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.collector import ALERT_TOKEN, ranks_on, start_service, stop_service
from support.polling import free_port, poll

ALERTMANAGER = shutil.which("prometheus-alertmanager") or "/usr/bin/prometheus-alertmanager"
EXAMPLE = Path(__file__).resolve().parent.parent / "deploy" / "alertmanager.yml"

pytestmark = pytest.mark.skipif(
    not Path(ALERTMANAGER).exists(), reason="prometheus-alertmanager is not installed"
)


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[tuple[str, Any]]:
    svc = start_service(tmp_path)
    token_file = tmp_path / "forewarn-alert-token"
    token_file.write_text(ALERT_TOKEN + "\n")
    token_file.chmod(0o600)
    config = EXAMPLE.read_text()
    assert "http://forewarn-collector:9404" in config
    config = config.replace("http://forewarn-collector:9404", svc.server.url)
    config = config.replace("/etc/alertmanager/forewarn-alert-token", str(token_file))
    (tmp_path / "am.yml").write_text(config)
    port = free_port()
    log = (tmp_path / "am.log").open("wb")
    proc = subprocess.Popen(
        [ALERTMANAGER, f"--config.file={tmp_path / 'am.yml'}",
         f"--storage.path={tmp_path / 'am-data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--cluster.listen-address=", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("alertmanager did not start: "
                                   + (tmp_path / "am.log").read_text()[-2000:])
            time.sleep(0.1)
        yield url, svc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        stop_service(svc)


def test_alertmanager_alert_becomes_checkpoint_order(alertmanager: tuple[str, Any]) -> None:
    url, svc = alertmanager
    now = time.time()
    svc.push("node1", ranks=ranks_on("node1", 0, now))
    svc.push("node2", ranks=ranks_on("node2", 2, now))
    svc.push("node3")
    alert = [{
        "labels": {"alertname": "ForewarnGpuXidFatal", "node": "node2", "gpu": "1",
                   "severity": "critical", "forewarn_action": "checkpoint"},
        "annotations": {"summary": "XID 79 on node2 GPU 1"},
    }]
    r = httpx.post(f"{url}/api/v2/alerts", json=alert, timeout=10)
    assert r.status_code == 200, r.text
    # the agents' long polls: the order reaches every node of the job
    orders = {}
    for node in ("node1", "node2"):
        cmds = svc.commands(node, wait=30)
        assert len(cmds) == 1, (node, cmds)
        assert cmds[0]["kind"] == "checkpoint"
        orders[node] = cmds[0]["order"]
    assert {o["job"] for o in orders.values()} == {"train-1"}
    assert orders["node1"]["step"] == orders["node2"]["step"] > 500
    assert "ForewarnGpuXidFatal" in orders["node1"]["reason"]
    assert svc.commands("node3") == []
    # the finding is stored by the alert book's next flush (within half a second)
    findings = poll(lambda: svc.client.get("/api/v1/findings").json(), 10)
    assert [(f["check_name"], f["origin"]) for f in findings] == [
        ("alert:ForewarnGpuXidFatal", "alertmanager")]
    decisions = svc.client.get("/api/v1/decisions", params={"job": "train-1"}).json()
    inputs = [json.loads(d["inputs"]) if isinstance(d["inputs"], str) else d["inputs"]
              for d in decisions if d["decision"] == "checkpoint:act"]
    assert inputs and inputs[0]["source"] == "alertmanager"


def _gpu_health(svc: Any, node: str, gpu: int) -> str:
    rows = svc.client.get("/api/v1/gpus", params={"node": node}).json()
    return str(next(g["health"] for g in rows if g["gpu"] == gpu))


@pytest.mark.timeout(180)
def test_a_resolved_alert_clears_its_finding(alertmanager: tuple[str, Any]) -> None:
    """Issue 13.4: the alert fires, the finding shows (GPU red, incident open); the alert
    resolves, Alertmanager sends it resolved (send_resolved in the shipped example, at the
    next group_interval: 30 s), and the finding clears (GPU no longer red, incident
    resolved, the active-findings gauge back to 0)."""
    from forewarn.wire import GpuSample

    url, svc = alertmanager
    now = time.time()
    svc.push("node2", ranks=ranks_on("node2", 2, now),
             samples=[GpuSample(node="node2", gpu=g, time=now, source="test") for g in (0, 1)])
    labels = {"alertname": "ForewarnGpuXidFatal", "node": "node2", "gpu": "1",
              "severity": "critical", "forewarn_action": "checkpoint"}
    r = httpx.post(f"{url}/api/v2/alerts", json=[{"labels": labels}], timeout=10)
    assert r.status_code == 200, r.text

    def incident() -> dict[str, Any] | None:
        rows = svc.client.get("/api/v1/incidents").json()
        return rows[0] if rows else None

    opened = poll(lambda: (i := incident()) and i["state"] == "open" and i, 30)
    assert opened["scope"] == "gpu:node2/1" and opened["health"] == "unhealthy"
    (tracked,) = opened["findings"]
    assert tracked["state"] == "firing" and tracked["source"] == "alertmanager"
    assert tracked["key"] == "alertmanager|gpu:node2/1|alert:ForewarnGpuXidFatal"
    poll(lambda: _gpu_health(svc, "node2", 1) == "unhealthy", 10)
    assert 'forewarn_collector_findings_active{source="alertmanager"} 1.0' in svc.client.get(
        "/metrics").text

    ended = time.time()
    r = httpx.post(f"{url}/api/v2/alerts", timeout=10, json=[{
        "labels": labels, "endsAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ended))}])
    assert r.status_code == 200, r.text
    resolved = poll(lambda: (i := incident()) and i["state"] == "resolved" and i, 90)
    assert resolved["id"] == opened["id"] and resolved["findings"][0]["state"] == "resolved"
    assert time.time() - ended < 60  # within group_interval (30 s) and the book's flush
    poll(lambda: _gpu_health(svc, "node2", 1) != "unhealthy", 10)
    metrics = svc.client.get("/metrics").text
    assert 'forewarn_collector_findings_active{source="alertmanager"} 0.0' in metrics
    assert 'forewarn_collector_findings_closed_total{state="resolved"} 1.0' in metrics
