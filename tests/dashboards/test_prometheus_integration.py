"""A real Prometheus (Debian package) scrapes a real ``forewarn agent --source sim``: its
HTTP API returns the agent's series, and the scenario's scripted XID 79 (a PCIe replay
storm ending off the bus) shows as an unhealthy GPU with its suggested action."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from support.stack import Processes, http_get, start_agent, start_prometheus

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


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    p = Processes(tmp_path)
    yield p
    codes = p.close()
    assert codes.get("agent", 0) == 0, p.log_tail("agent")


@pytest.fixture
def agent(procs: Processes) -> str:
    return start_agent(procs, "itest", SCENARIO, name="agent", sim_speed=8, interval=0.5,
                       socket=procs.tmp / "agent.sock")


@pytest.fixture
def prometheus_binary(require_binary: Callable[[str], str]) -> str:
    """Debian's /usr/bin/prometheus; skips when missing (fails under CI, see conftest)."""
    return require_binary("prometheus")


@pytest.fixture
def prometheus(procs: Processes, prometheus_binary: str, agent: str) -> str:
    return start_prometheus(procs, prometheus_binary, {"forewarn-agent": agent})


def query(base: str, promql: str) -> list[dict[str, Any]]:
    status, body = http_get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
    if status != 200:
        return []
    data = json.loads(body)
    assert data["status"] == "success", data
    result: list[dict[str, Any]] = data["data"]["result"]
    return result


def test_prometheus_scrapes_agent_and_sees_xid79_unhealthy(
    procs: Processes, agent: str, prometheus: str,
) -> None:
    base = prometheus
    # Prometheus waits before its first scrape: poll its API until the target is up.
    procs.wait_for("first scrape", lambda: query(base, 'up{job="forewarn-agent"} == 1'), 90)

    def gpu1_unhealthy() -> list[dict[str, Any]]:
        return query(base, 'forewarn_gpu_health{node="itest",gpu="1"} == 2')

    (series,) = procs.wait_for("GPU 1 unhealthy", gpu1_unhealthy, timeout=120)
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
    findings = json.loads(http_get(f"http://{agent}/api/v1/findings")[1])
    worst = [f for f in findings if f["subject"].get("gpu") == 1 and f["check"] == "xid"]
    assert worst and worst[0]["health"] == "unhealthy" and worst[0]["action"] == "reboot"
    assert "fallen off the bus" in worst[0]["reason"]
