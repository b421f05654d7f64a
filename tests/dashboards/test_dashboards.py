"""Dashboards as code: regenerating changes nothing, panels are configured, and ``push``
talks to a (loopback stand-in for the) Grafana HTTP API correctly."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from forewarn.cli import main
from forewarn.dashboards.build import DASHBOARDS, render
from forewarn.dashboards.cli import PushError, push

from support.paths import REPO

ROOT = REPO


def test_checked_in_json_matches_the_code() -> None:
    for name in DASHBOARDS:
        path = ROOT / "dashboards" / f"{name}.json"
        assert path.read_text() == render(name), f"{path} is stale: forewarn dashboards generate"
    assert main(["dashboards", "generate", "--check"]) == 0


def _panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dash["panels"] if p["type"] != "row"]


def test_every_panel_is_configured_not_left_on_defaults() -> None:
    for name, build in DASHBOARDS.items():
        dash = build()
        names = {v["name"] for v in dash["templating"]["list"]}
        assert {"datasource", "cluster"} <= names, name
        assert len(_panels(dash)) >= 3
        for p in _panels(dash):
            where = f"{name}/{p['title']}"
            assert p.get("description"), where
            assert p["fieldConfig"]["defaults"].get("unit"), where
            assert p["fieldConfig"]["defaults"].get("thresholds"), where
            assert p["datasource"]["uid"] == "${datasource}", where
            assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"]), where


# What users of NVIDIA's dcgm-exporter dashboard (Grafana 12239) look for first (issue
# 13.13): (dashboard, metric the panel must query, what the panel shows).
COMPARED_WITH_DCGM = [
    ("node", "forewarn_gpu_energy_joules_total", "energy per GPU"),
    ("training", "forewarn_gpu_energy_joules_total", "energy per job"),
    ("fleet", "forewarn_gpu_power_limit_watts", "power against limit per node"),
    ("node", "forewarn_gpu_sm_active_ratio", "SM active"),
    ("node", "forewarn_gpu_tensor_active_ratio", "tensor pipe active"),
    ("node", "forewarn_gpu_dram_active_ratio", "DRAM active"),
    ("node", "forewarn_gpu_nvlink_tx_bytes_per_second", "NVLink bandwidth"),
    ("node", "forewarn_gpu_pcie_rx_bytes_per_second", "PCIe bandwidth"),
]


@pytest.mark.parametrize(("name", "metric", "what"), COMPARED_WITH_DCGM)
def test_panels_dcgm_exporter_users_look_for(name: str, metric: str, what: str) -> None:
    exprs = [t["expr"] for p in _panels(DASHBOARDS[name]()) for t in p["targets"]]
    assert any(metric in e for e in exprs), f"{name}: no panel shows {what} ({metric})"
    if what == "energy per job":
        assert any(metric in e and "sum by (training_job)" in e for e in exprs)
    if what == "power against limit per node":
        assert any("forewarn_gpu_power_watts" in e and "by (node)" in e and " / " in e
                   for e in exprs)


def test_stale_file_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dashboards", "generate", "--out", str(tmp_path)]) == 0
    (tmp_path / "fleet.json").write_text("{}")
    assert main(["dashboards", "generate", "--out", str(tmp_path), "--check"]) == 1
    assert "fleet.json" in capsys.readouterr().err


class FakeGrafana(http.server.BaseHTTPRequestHandler):
    """A loopback stand-in for Grafana's HTTP API (no Grafana can be installed here)."""

    calls: ClassVar[list[tuple[str, str, str, Any]]] = []
    fail_dashboard = False

    def log_message(self, *args: Any) -> None:
        pass

    def _reply(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.calls.append(("GET", self.path, self.headers.get("Authorization", ""), None))
        if self.headers.get("Authorization") != "Bearer s3cret":
            return self._reply(401, {"message": "invalid API key"})
        if self.path.startswith("/api/folders"):
            return self._reply(200, [])
        self._reply(404, {"message": "not found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.calls.append(("POST", self.path, self.headers.get("Authorization", ""), body))
        if self.path == "/api/folders":
            return self._reply(200, {"uid": "fw-folder", "title": body["title"]})
        if self.path == "/api/dashboards/db":
            if self.fail_dashboard:
                return self._reply(412, {"message": "version-mismatch"})
            uid = body["dashboard"]["uid"]
            return self._reply(200, {"uid": uid, "url": f"/d/{uid}", "status": "success"})
        self._reply(404, {"message": "not found"})


@pytest.fixture
def grafana() -> Iterator[str]:
    FakeGrafana.calls = []
    FakeGrafana.fail_dashboard = False
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeGrafana)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_push_sends_every_dashboard_with_the_token(grafana: str) -> None:
    urls = push(grafana, "s3cret")
    assert urls == [f"/d/{DASHBOARDS[n]()['uid']}" for n in DASHBOARDS]
    posts = [c for c in FakeGrafana.calls if c[0] == "POST"]
    assert posts[0][1] == "/api/folders" and posts[0][3] == {"title": "forewarn"}
    dash_posts = [c for c in posts if c[1] == "/api/dashboards/db"]
    assert len(dash_posts) == len(DASHBOARDS)
    for _, _, auth, body in dash_posts:
        assert auth == "Bearer s3cret"
        assert body["folderUid"] == "fw-folder" and body["overwrite"] is True
        assert body["dashboard"]["uid"].startswith("forewarn-")


def test_push_reports_errors_the_server_returns(grafana: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(PushError, match="folder 'forewarn': HTTP 401"):
        push(grafana, "wrong")
    FakeGrafana.fail_dashboard = True
    with pytest.raises(PushError, match=r"dashboard .fleet.: HTTP 412.*version-mismatch"):
        push(grafana, "s3cret")
    assert main(["dashboards", "push", "--url", grafana, "--token", "wrong"]) == 1
    assert "HTTP 401" in capsys.readouterr().err
