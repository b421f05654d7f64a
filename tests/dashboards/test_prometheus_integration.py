"""A real Prometheus (Debian package) scrapes a real ``forewarn agent --source sim``: its
HTTP API returns the agent's series, and the scenario's scripted XID 79 (a PCIe replay
storm ending off the bus) shows as an unhealthy GPU with its suggested action."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from support.polling import free_port

SCENARIO = """
name = "itest"
description = "GPU 1: PCIe replays from the start, off the bus (XID 79) at 20 s."
gpus = 2
seed = 7

[[faults]]
gpu = 1
kind = "pcie_replay"
start_s = 0
duration_s = 20
"""


def get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def wait_for(what: str, probe: Any, proc: subprocess.Popen[bytes], timeout: float = 90) -> Any:
    """Poll ``probe`` (returns a truthy result when done) every 0.25 s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{what}: process exited with {proc.returncode}")
        result = probe()
        if result:
            return result
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    (tmp_path / "scenario.toml").write_text(SCENARIO)
    (tmp_path / "agent.toml").write_text('node = "itest"\n')
    port = free_port()
    log = (tmp_path / "agent.log").open("wb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FOREWARN_")}
    env.pop("NOTIFY_SOCKET", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "forewarn", "agent", "--config", str(tmp_path / "agent.toml"),
         "--source", "sim", "--scenario", str(tmp_path / "scenario.toml"), "--sim-speed", "8",
         "--interval", "0.5", "--listen", f"127.0.0.1:{port}", "--no-kmsg",
         "--socket", str(tmp_path / "agent.sock")],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    address = f"127.0.0.1:{port}"
    try:
        wait_for("agent /healthz", lambda: get(f"http://{address}/healthz")[0] == 200, proc,
                 timeout=60)
        yield address, proc
    finally:
        rc = stop(proc)
        log.close()
        assert rc == 0, (tmp_path / "agent.log").read_text()[-3000:]


@pytest.fixture
def prometheus_binary(require_binary: Callable[[str], str]) -> str:
    """Debian's /usr/bin/prometheus; skips when missing (fails under CI, see conftest)."""
    return require_binary("prometheus")


@pytest.fixture
def prometheus(tmp_path: Path, prometheus_binary: str,
               agent: tuple[str, subprocess.Popen[bytes]]
               ) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    address, _ = agent
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: forewarn-agent\n    static_configs:\n"
        f"      - targets: ['{address}']\n")
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [prometheus_binary, f"--config.file={config}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for("prometheus ready", lambda: get(f"{base}/-/ready")[0] == 200, proc, timeout=60)
        yield base, proc
    finally:
        stop(proc)
        log.close()


def query(base: str, promql: str) -> list[dict[str, Any]]:
    status, body = get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
    if status != 200:
        return []
    data = json.loads(body)
    assert data["status"] == "success", data
    result: list[dict[str, Any]] = data["data"]["result"]
    return result


def test_prometheus_scrapes_agent_and_sees_xid79_unhealthy(
    prometheus_binary: str,
    agent: tuple[str, subprocess.Popen[bytes]],
    prometheus: tuple[str, subprocess.Popen[bytes]],
) -> None:
    base, proc = prometheus
    # Prometheus waits before its first scrape: poll its API until the target is up.
    wait_for("first scrape", lambda: query(base, 'up{job="forewarn-agent"} == 1'), proc)

    def gpu1_unhealthy() -> list[dict[str, Any]]:
        return query(base, 'forewarn_gpu_health{node="itest",gpu="1"} == 2')

    (series,) = wait_for("GPU 1 unhealthy", gpu1_unhealthy, proc, timeout=120)
    assert series["metric"]["simulated"] == "true"
    assert series["metric"]["uuid"].startswith("GPU-")

    # The suggested action comes with the finding.
    active = query(base, 'forewarn_finding_active{node="itest",gpu="1",check="xid"}')
    assert [s["metric"]["action"] for s in active] == ["reboot"]
    assert active[0]["metric"]["health"] == "unhealthy"
    lost = query(base, 'forewarn_finding_active{node="itest",gpu="1",check="gpu_lost"}')
    assert lost and lost[0]["metric"]["action"] == "reboot"
    xid = query(base, 'forewarn_gpu_xid_errors_total{node="itest",gpu="1",code="79"}')
    assert xid and xid[0]["metric"]["class"] == "bus" and float(xid[0]["value"][1]) >= 1
    assert query(base, 'forewarn_gpu_state{node="itest",gpu="1",state="lost"} == 1')

    # The healthy GPU stays healthy, with its telemetry.
    assert query(base, 'forewarn_gpu_health{node="itest",gpu="0"} == 0')
    for name in ("forewarn_gpu_temperature_celsius", "forewarn_gpu_power_watts",
                 "forewarn_gpu_memory_used_bytes", "forewarn_gpu_sm_clock_hertz"):
        rows = query(base, f'{name}{{node="itest",gpu="0"}}')
        assert len(rows) == 1, name
    assert len(query(base, 'forewarn_gpu_ecc_errors_total{node="itest",gpu="0"}')) == 4
    assert query(base, 'forewarn_gpu_pcie_replays_total{node="itest",gpu="0"}')

    # The agent's own health.
    checks = {s["metric"]["check"] for s in query(base, "forewarn_agent_check_success == 1")}
    assert {"xid", "ecc", "pcie", "gpu_lost", "thermal"} <= checks
    assert query(base, "forewarn_agent_check_duration_seconds")
    assert query(base, 'forewarn_agent_source_up{source="sim"} == 1')
    assert query(base, "forewarn_agent_build_info")
    assert query(base, "forewarn_agent_polls_total > 0")

    # The agent's debugging endpoint agrees.
    address, _ = agent
    findings = json.loads(get(f"http://{address}/api/v1/findings")[1])
    worst = [f for f in findings if f["subject"].get("gpu") == 1 and f["check"] == "xid"]
    assert worst and worst[0]["health"] == "unhealthy" and worst[0]["action"] == "reboot"
    assert "fallen off the bus" in worst[0]["reason"]
