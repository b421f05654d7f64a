"""A real Alertmanager (Debian package prometheus-alertmanager) sends an alert to the real
collector, which orders a checkpoint of the job on the node named in the alert's labels.

Uses the shipped example config ``deploy/alertmanager.yml`` with only the collector URL and
the token file path replaced, so the example is what gets tested.
"""

from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from forewarn.wire import GpuSample

from support.collector import ALERT_TOKEN, ranks_on, start_service, stop_service
from support.paths import REPO
from support.polling import free_port, poll

ALERTMANAGER = shutil.which("prometheus-alertmanager") or "/usr/bin/prometheus-alertmanager"
EXAMPLE = REPO / "deploy" / "alertmanager.yml"

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


class _Condition(http.server.BaseHTTPRequestHandler):
    """A scrape target whose one series the test switches on and off."""

    value = 0

    def do_GET(self) -> None:
        body = (f'forewarn_test_condition{{node="node2",gpu="1"}} {type(self).value}\n'
                ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.timeout(240)
def test_prometheus_alert_fires_and_resolves_through_alertmanager(
        alertmanager: tuple[str, Any], tmp_path: Path,
        require_binary: Callable[[str], str]) -> None:
    """Issue 13.4 with every real part: a condition appears in a scraped series, the real
    Prometheus fires its rule into the real Alertmanager (the shipped example config), which
    sends it to the collector: the finding shows. The condition goes: Prometheus resolves
    the alert, Alertmanager sends it resolved, and the finding clears within the resolve
    timeout (Alertmanager's group_interval, 30 s in the example, plus the book's flush)."""
    prometheus = require_binary("prometheus")
    url, svc = alertmanager
    now = time.time()
    svc.push("node2", ranks=ranks_on("node2", 2, now),
             samples=[GpuSample(node="node2", gpu=g, time=now, source="test") for g in (0, 1)])
    target = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Condition)
    threading.Thread(target=target.serve_forever, daemon=True).start()
    (tmp_path / "rules.yml").write_text(
        "groups:\n  - name: test\n    rules:\n      - alert: TestGpuCondition\n"
        "        expr: forewarn_test_condition == 1\n"
        "        labels: {severity: critical, forewarn_action: checkpoint}\n"
        "        annotations: {summary: the test's condition}\n")
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: ['{tmp_path / 'rules.yml'}']\n"
        "alerting:\n  alertmanagers:\n    - static_configs:\n"
        f"        - targets: ['{url.removeprefix('http://')}']\n"
        "scrape_configs:\n  - job_name: condition\n    honor_labels: true\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{target.server_address[1]}']}}]\n")
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
         "--rules.alert.resend-delay=1s"], stdout=subprocess.DEVNULL, stderr=log, cwd=tmp_path)
    try:
        def incident(state: str) -> dict[str, Any] | None:
            rows = svc.client.get("/api/v1/incidents", params={"state": state}).json()
            return rows[0] if rows else None

        _Condition.value = 1  # the condition appears
        opened = poll(lambda: incident("open"), 60)
        assert opened, "the alert never reached the collector:\n" + (
            tmp_path / "prometheus.log").read_text()[-2000:]
        assert opened["scope"] == "gpu:node2/1"
        assert opened["findings"][0]["check"] == "alert:TestGpuCondition"
        assert poll(lambda: _gpu_health(svc, "node2", 1) == "unhealthy", 10)

        _Condition.value = 0  # the condition goes
        gone = time.time()
        resolved = poll(lambda: incident("resolved"), 75)
        assert resolved and resolved["id"] == opened["id"], svc.client.get(
            "/api/v1/incidents").json()
        assert time.time() - gone < 75
        assert poll(lambda: _gpu_health(svc, "node2", 1) != "unhealthy", 10)
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
        target.shutdown()
