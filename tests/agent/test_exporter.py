"""Prometheus exposition of the agent: a golden file for a fixed scripted scenario
(deterministic backend, fake clocks, fixed timer), plus targeted checks of names, units,
labels and health values. Regenerate the golden file only on purpose:

    FOREWARN_REGEN_GOLDEN=1 python -m pytest -q tests/agent/test_exporter.py
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from forewarn.agent.checks import default_checks
from forewarn.agent.checks.base import Check
from forewarn.agent.config import AgentConfig
from forewarn.agent.daemon import Agent
from forewarn.agent.exporter import HEALTH_VALUE
from forewarn.agent.testing import FakeClock, ScriptedBackend
from forewarn.chaos.exposition import matching
from forewarn.wire import GpuState, Health, NvlinkCounters

from support.paths import TESTS

GOLDEN = TESTS / "golden" / "agent_metrics.txt"
T0 = 1_700_000_000.0


def scenario(gpu: int, now: float) -> dict[str, Any]:
    """Four GPUs for 10 s: 0 healthy, 1 uncorrectable ECC at t=5, 2 off the bus at t=6
    (XID 79 queued separately), 3 HW thermal slowdown with PCIe/NVLink trouble and fields
    it does not support."""
    t = now - T0
    if gpu == 2 and t >= 6:
        return {"state": GpuState.LOST}
    v: dict[str, Any] = {
        "temperature_c": 40.0 + gpu, "slowdown_margin_c": 40.0 - gpu, "power_w": 300.0,
        "power_limit_w": 700.0, "sm_clock_mhz": 1980.0, "mem_clock_mhz": 2619.0,
        "gpu_util_pct": 97.0, "mem_util_pct": 40.0, "memory_used_bytes": 60 * 2**30,
        "memory_total_bytes": 80 * 2**30, "throttle_reasons": 0, "pstate": 0,
        "ecc_corrected_volatile": 3, "ecc_uncorrected_volatile": 0,
        "ecc_corrected_aggregate": 12, "ecc_uncorrected_aggregate": 0,
        "remapped_rows_correctable": 1, "remapped_rows_uncorrectable": 0,
        "remap_pending": False, "remap_failure": False, "pcie_replay_total": 0,
        "pcie_link_gen": 5, "pcie_link_gen_max": 5, "pcie_link_width": 16,
        "pcie_link_width_max": 16,
        "nvlink": (NvlinkCounters(link=0, crc_flit=0, crc_data=0, replay=0, recovery=0),),
        # 300 W for t seconds on top of what the GPU used before: NVML's millijoules.
        "energy_mj": 1_000_000_000 + int(300_000 * t),
    }
    if gpu == 0:  # profiling fields, as a DCGM source gives them
        v.update(sm_active=0.9, tensor_active=0.625, dram_active=0.375,
                 pcie_tx_bytes_per_s=2e9, pcie_rx_bytes_per_s=1e9,
                 nvlink_tx_bytes_per_s=1e11, nvlink_rx_bytes_per_s=9e10)
    if gpu == 1 and t >= 5:
        v.update(ecc_uncorrected_volatile=1, ecc_uncorrected_aggregate=1, remap_pending=True)
    if gpu == 3:
        v.update(
            temperature_c=88.0, slowdown_margin_c=2.0, throttle_reasons=0x48,
            pcie_replay_total=int(40 * t), pcie_link_width=8,
            nvlink=(NvlinkCounters(link=0, crc_flit=int(30 * t), crc_data=2, replay=1,
                                   recovery=0),
                    NvlinkCounters(link=1, crc_flit=0, crc_data=0, replay=0, recovery=0)),
            memory_temperature_c=None,
            unsupported=("memory_temperature_c", "retired_pages_sbe", "retired_pages_dbe",
                         "retired_pages_pending"),
            errors=("power_limit_w: Unknown Error",),
        )
        del v["power_limit_w"]
    return v


HARDWARE = {"gpu_lost", "xid", "ecc", "remap", "retired_pages", "thermal", "power_brake",
            "pcie", "nvlink"}


def hardware_checks() -> list[Check]:
    """The hardware checks only: the golden file must not change when others add checks."""
    return [c for c in default_checks() if c.name in HARDWARE]


def render_scenario() -> tuple[str, Agent]:
    clock = FakeClock(now=T0)
    mono = FakeClock(now=500.0)
    ticks = itertools.count()
    backend = ScriptedBackend(scenario, gpus=4, node="node-a", name="sim", simulated=True)
    config = AgentConfig(node="node-a", listen="127.0.0.1:0", kmsg=False)
    agent = Agent(config, backend, checks=hardware_checks(), clock=clock, monotonic=mono,
                  timer=lambda: next(ticks) * 2.0**-10, version="test")
    agent.start(serve=False)
    for second in range(11):
        if second == 6:
            backend.queue_xid(79, gpu=2, time=clock.now)
            backend.queue_xid(13, gpu=0, time=clock.now)
        agent.poll_once()
        clock.advance(1.0)
        mono.advance(1.0)
    text = generate_latest(agent.registry).decode()
    agent.stop()
    return text, agent


def test_golden_exposition() -> None:
    text, _ = render_scenario()
    if os.environ.get("FOREWARN_REGEN_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    assert GOLDEN.exists(), "golden file missing: run with FOREWARN_REGEN_GOLDEN=1"
    expected = GOLDEN.read_text()
    if text != expected:
        import difflib

        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                            "golden", "rendered", n=1))
        raise AssertionError(f"exposition differs from {GOLDEN}:\n{diff[:6000]}")


def samples_of(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(text: str, name: str, **labels: str) -> float:
    found = matching(text, name, **labels)
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_health_values_and_actions() -> None:
    text, agent = render_scenario()
    assert HEALTH_VALUE == {Health.HEALTHY: 0, Health.DEGRADED: 1, Health.UNHEALTHY: 2,
                            Health.UNKNOWN: 3}
    assert value(text, "forewarn_gpu_health", gpu="0") == 0
    assert value(text, "forewarn_gpu_health", gpu="1") == 2
    assert value(text, "forewarn_gpu_health", gpu="2") == 2
    assert value(text, "forewarn_gpu_health", gpu="3") == 2
    assert value(text, "forewarn_gpu_check_health", gpu="1", check="ecc") == 2
    assert value(text, "forewarn_gpu_check_health", gpu="1", check="remap") == 1
    assert value(text, "forewarn_gpu_check_health", gpu="2", check="gpu_lost") == 2
    assert value(text, "forewarn_gpu_check_health", gpu="0", check="xid") == 0  # XID 13: app
    assert value(text, "forewarn_finding_active", gpu="2", check="xid", action="reboot",
                 health="unhealthy") == 1
    assert value(text, "forewarn_finding_active", gpu="1", check="ecc",
                 action="checkpoint") == 1
    assert value(text, "forewarn_gpu_state", gpu="2", state="lost") == 1
    assert value(text, "forewarn_gpu_state", gpu="2", state="ok") == 0
    bad = {f.subject.gpu for f in agent.current_findings() if f.health != Health.HEALTHY}
    assert bad == {1, 2, 3}


def test_names_units_and_labels() -> None:
    text, _ = render_scenario()
    s = samples_of(text)
    # Base units: hertz, ratio, bytes, celsius, watts; counters end in _total.
    assert value(text, "forewarn_gpu_sm_clock_hertz", gpu="0") == 1980e6
    assert value(text, "forewarn_gpu_utilization_ratio", gpu="0") == 0.97
    assert value(text, "forewarn_gpu_memory_total_bytes", gpu="0") == 80 * 2**30
    assert value(text, "forewarn_gpu_temperature_celsius", gpu="3") == 88.0
    assert value(text, "forewarn_gpu_ecc_errors_total", gpu="1", type="uncorrected",
                 scope="volatile") == 1
    assert value(text, "forewarn_gpu_nvlink_errors_total", gpu="3", link="0",
                 type="crc_flit") == 300
    assert value(text, "forewarn_gpu_xid_errors_total", gpu="2", code="79", **{"class": "bus"}
                 ) == 1
    assert value(text, "forewarn_gpu_clock_event_reason_active", gpu="3",
                 reason="hw_thermal_slowdown") == 1
    assert value(text, "forewarn_gpu_field_supported", gpu="3",
                 field="memory_temperature_c") == 0
    assert value(text, "forewarn_gpu_field_supported", gpu="0", field="temperature_c") == 1
    assert value(text, "forewarn_gpu_field_errors_total", gpu="3", field="power_limit_w") == 11
    # Energy: NVML's millijoules as a counter in joules (t = 10 s at 300 W: +3000 J).
    assert value(text, "forewarn_gpu_energy_joules_total", gpu="0") == 1_000_000.0 + 3000.0
    assert value(text, "forewarn_gpu_field_supported", gpu="0", field="energy_mj") == 1
    # DCGM profiling fields, where the source gives them (GPU 0 only here).
    assert value(text, "forewarn_gpu_sm_active_ratio", gpu="0") == 0.9
    assert value(text, "forewarn_gpu_tensor_active_ratio", gpu="0") == 0.625
    assert value(text, "forewarn_gpu_dram_active_ratio", gpu="0") == 0.375
    assert value(text, "forewarn_gpu_pcie_tx_bytes_per_second", gpu="0") == 2e9
    assert value(text, "forewarn_gpu_pcie_rx_bytes_per_second", gpu="0") == 1e9
    assert value(text, "forewarn_gpu_nvlink_tx_bytes_per_second", gpu="0") == 1e11
    assert value(text, "forewarn_gpu_nvlink_rx_bytes_per_second", gpu="0") == 9e10
    assert not [lab for lab, _ in s.get("forewarn_gpu_sm_active_ratio", []) if lab["gpu"] != "0"]
    # Simulated data is plainly marked on every GPU series.
    for name, rows in s.items():
        if name.startswith("forewarn_gpu_") and name not in (
                "forewarn_gpu_field_errors_total",):
            assert all(lab.get("simulated") == "true" for lab, _ in rows), name
    # A lost GPU has no stale telemetry values.
    assert not [lab for lab, _ in s["forewarn_gpu_temperature_celsius"] if lab["gpu"] == "2"]
    # The agent reports on itself.
    assert value(text, "forewarn_agent_check_success", check="ecc") == 1
    assert value(text, "forewarn_agent_check_duration_seconds", check="ecc") == 2.0**-10
    assert value(text, "forewarn_agent_source_up", source="sim") == 1
    assert value(text, "forewarn_agent_polls_total") == 11
    assert value(text, "forewarn_agent_build_info", version="test") == 1
    for name in s:
        assert name.startswith("forewarn_"), name
