"""Every hardware check on scripted sample histories (built directly into AgentState: the
checks' input seam), healthy, degraded and unhealthy paths, thresholds, not-supported
fields, counter resets, and the runner containing a broken check."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forewarn.agent.backend import GpuInfo
from forewarn.agent.checks import ALL_CHECKS, default_checks
from forewarn.agent.checks.base import run_checks
from forewarn.agent.checks.common import WindowFraction, counter_delta
from forewarn.agent.checks.ecc import EccCheck
from forewarn.agent.checks.gpu_lost import GpuLostCheck
from forewarn.agent.checks.nvlink import NvlinkCheck, _link_deltas, _reader
from forewarn.agent.checks.pcie import PcieCheck
from forewarn.agent.checks.power_brake import PowerBrakeCheck
from forewarn.agent.checks.remap import RemapCheck
from forewarn.agent.checks.retired_pages import RetiredPagesCheck
from forewarn.agent.checks.thermal import ThermalCheck
from forewarn.agent.checks.xid import XidCheck
from forewarn.agent.state import AgentState, GpuHistory
from forewarn.gpu import classify_xid
from forewarn.wire import (
    Finding,
    GpuSample,
    GpuState,
    Health,
    NvlinkCounters,
    SuggestedAction,
    XidEvent,
)

T0 = 1_700_000_000.0


def history(
    fields: Callable[[int, float], dict[str, Any]], *, gpus: int = 1, seconds: int = 60,
    step: float = 1.0,
) -> tuple[AgentState, float]:
    """An AgentState with ``seconds`` of samples per GPU; returns (state, time of last)."""
    state = AgentState(node="n1")
    state.add_inventory([GpuInfo(index=i, pci_bus_id=f"0000:{0x10 + i:02x}:00.0")
                         for i in range(gpus)])
    t = T0
    for k in range(int(seconds / step) + 1):
        t = T0 + k * step
        state.add_samples([GpuSample(node="n1", gpu=i, time=t, source="scripted",
                                     **fields(i, t - T0)) for i in range(gpus)])
    return state, t


def by_gpu(findings: list[Finding]) -> dict[int | None, Finding]:
    return {f.subject.gpu: f for f in findings}


# -- xid -----------------------------------------------------------------------------------


def xid(code: int, t: float, gpu: int | None = 0) -> XidEvent:
    return XidEvent(node="n1", gpu=gpu, code=code, time=t, source="scripted")


@pytest.mark.parametrize(("code", "cls", "health"), [
    (13, "application", Health.HEALTHY), (31, "application", Health.HEALTHY),
    (43, "application", Health.HEALTHY), (45, "application", Health.HEALTHY),
    (48, "memory", Health.UNHEALTHY), (63, "memory", Health.DEGRADED),
    (64, "memory", Health.UNHEALTHY), (92, "memory", Health.DEGRADED),
    (94, "memory", Health.DEGRADED), (95, "memory", Health.UNHEALTHY),
    (74, "interconnect", Health.UNHEALTHY), (79, "bus", Health.UNHEALTHY),
    (119, "gsp", Health.UNHEALTHY), (120, "gsp", Health.UNHEALTHY),
    (9999, "other", Health.DEGRADED),
])
def test_xid_classes(code: int, cls: str, health: Health) -> None:
    assert classify_xid(code).cls == cls
    state, now = history(lambda i, t: {}, gpus=2, seconds=1)
    state.add_xids([xid(code, now)], now)
    f = by_gpu(XidCheck().run(state, now))
    assert f[0].health == health
    assert f[1].health == Health.HEALTHY  # the other GPU is judged too, and clear
    assert f"XID {code}" in f[0].reason


def test_xid_79_suggests_reboot_and_application_xids_blame_the_job() -> None:
    state, now = history(lambda i, t: {}, gpus=2, seconds=1)
    state.add_xids([xid(79, now, 0), xid(13, now, 1)], now)
    f = by_gpu(XidCheck().run(state, now))
    assert f[0].action == SuggestedAction.REBOOT and "fallen off the bus" in f[0].reason
    assert f[1].health == Health.HEALTHY and "application" in f[1].reason


def test_xid_escalates_repeats_within_a_day_and_ages_out() -> None:
    state, now = history(lambda i, t: {}, seconds=1)
    # Four fatal XIDs spread over the day: the latest decides, no escalation yet.
    state.add_xids([xid(48, now - 20 * 3600 + k * 3600) for k in range(4)], now)
    check = XidCheck()
    f = by_gpu(check.run(state, now))[0]
    assert f.health == Health.HEALTHY, "all four are older than active_s"
    assert f.evidence["fatal_24h"] == 4
    state.add_xids([xid(95, now)], now)
    f = by_gpu(check.run(state, now))[0]
    assert f.health == Health.UNHEALTHY and f.action == SuggestedAction.INSPECT_HARDWARE
    assert "5 fatal XIDs" in f.reason
    # A day later they no longer count.
    later = now + 25 * 3600
    assert by_gpu(check.run(state, later))[0].health == Health.HEALTHY
    # The threshold is a constructor argument.
    state2, now2 = history(lambda i, t: {}, seconds=1)
    state2.add_xids([xid(74, now2 - 2 * 3600), xid(74, now2 - 3600 * 1.5)], now2)
    assert by_gpu(XidCheck(repeat_fatal=2).run(state2, now2))[0].action == (
        SuggestedAction.INSPECT_HARDWARE)


def test_xid_on_unmapped_gpu_is_judged_on_the_node() -> None:
    state, now = history(lambda i, t: {}, seconds=1)
    state.add_xids([xid(79, now, gpu=None)], now)
    findings = XidCheck().run(state, now)
    node = [f for f in findings if f.subject.kind == "node"]
    assert node and node[0].health == Health.UNHEALTHY
    assert "could not map" in node[0].reason


# -- ecc -----------------------------------------------------------------------------------


def test_ecc_healthy_then_storm_then_uncorrectable() -> None:
    state, now = history(lambda i, t: {"ecc_corrected_volatile": int(t),
                                       "ecc_uncorrected_volatile": 0})
    assert by_gpu(EccCheck().run(state, now))[0].health == Health.HEALTHY
    # 60 correctable errors in 60 s: over a threshold of 50 per window.
    f = by_gpu(EccCheck(corrected_threshold=50).run(state, now))[0]
    assert f.health == Health.DEGRADED and f.action == SuggestedAction.CHECKPOINT
    state, now = history(lambda i, t: {"ecc_corrected_volatile": 5,
                                       "ecc_uncorrected_volatile": 1 if t >= 50 else 0})
    f = by_gpu(EccCheck().run(state, now))[0]
    assert f.health == Health.UNHEALTHY and f.action == SuggestedAction.CHECKPOINT
    assert "uncorrectable" in f.reason
    # Long after the error (outside the window) the GPU still needs a reset.
    f = by_gpu(EccCheck(window_s=5).run(state, now))[0]
    assert f.health == Health.UNHEALTHY and f.action == SuggestedAction.RESET_GPU


def test_ecc_counter_reset_is_not_an_increase_and_unsupported_is_not_judged() -> None:
    # Volatile counters drop to zero at a GPU reset; that is not a negative/huge delta.
    state, now = history(lambda i, t: {"ecc_corrected_volatile": 900 if t < 30 else int(t - 30),
                                       "ecc_uncorrected_volatile": 0})
    f = by_gpu(EccCheck(corrected_threshold=100).run(state, now))[0]
    assert f.health == Health.HEALTHY and f.evidence["corrected_in_window"] == 30
    state, now = history(lambda i, t: {"unsupported": ("ecc_corrected_volatile",)})
    assert EccCheck().run(state, now) == []


# -- remap / retired pages --------------------------------------------------------------


def test_remap_pending_then_failure() -> None:
    def rows(pending: bool, failure: bool) -> Callable[[int, float], dict[str, Any]]:
        return lambda i, t: {"remapped_rows_correctable": int(t // 20),
                             "remapped_rows_uncorrectable": 0,
                             "remap_pending": pending, "remap_failure": failure}

    state, now = history(rows(False, False))
    f = by_gpu(RemapCheck().run(state, now))[0]
    assert f.health == Health.HEALTHY and f.action == SuggestedAction.WATCH  # rows grew
    state, now = history(rows(True, False))
    f = by_gpu(RemapCheck().run(state, now))[0]
    assert f.health == Health.DEGRADED and f.action == SuggestedAction.RESET_GPU
    state, now = history(rows(True, True))
    f = by_gpu(RemapCheck().run(state, now))[0]
    assert f.health == Health.UNHEALTHY and f.action == SuggestedAction.INSPECT_HARDWARE


def test_retired_pages() -> None:
    state, now = history(lambda i, t: {"retired_pages_sbe": 2, "retired_pages_dbe": 0,
                                       "retired_pages_pending": False})
    assert by_gpu(RetiredPagesCheck().run(state, now))[0].health == Health.HEALTHY
    state, now = history(lambda i, t: {"retired_pages_sbe": 2, "retired_pages_dbe": 0,
                                       "retired_pages_pending": True})
    f = by_gpu(RetiredPagesCheck().run(state, now))[0]
    assert f.health == Health.DEGRADED and f.action == SuggestedAction.RESET_GPU
    state, now = history(lambda i, t: {"retired_pages_sbe": 2,
                                       "retired_pages_dbe": 1 if t > 30 else 0,
                                       "retired_pages_pending": False})
    assert by_gpu(RetiredPagesCheck().run(state, now))[0].health == Health.DEGRADED
    state, now = history(lambda i, t: {"retired_pages_sbe": 50, "retired_pages_dbe": 12,
                                       "retired_pages_pending": False})
    f = by_gpu(RetiredPagesCheck().run(state, now))[0]
    assert f.health == Health.UNHEALTHY and f.action == SuggestedAction.INSPECT_HARDWARE
    assert by_gpu(RetiredPagesCheck(max_pages=100).run(state, now))[0].health == Health.HEALTHY


# -- thermal / power brake --------------------------------------------------------------


def test_thermal_margin_and_slowdown_fraction() -> None:
    state, now = history(lambda i, t: {"slowdown_margin_c": 20.0, "throttle_reasons": 0x20})
    f = by_gpu(ThermalCheck().run(state, now))[0]
    assert f.health == Health.HEALTHY, "SW thermal slowdown alone is normal"
    state, now = history(lambda i, t: {"slowdown_margin_c": 3.0, "throttle_reasons": 0})
    assert by_gpu(ThermalCheck().run(state, now))[0].health == Health.DEGRADED
    # HW thermal slowdown in the last 20 of 60 s: 1/3 of the window -> degraded.
    state, now = history(lambda i, t: {"slowdown_margin_c": 1.0,
                                       "throttle_reasons": 0x40 if t > 40 else 0})
    f = by_gpu(ThermalCheck().run(state, now))[0]
    fraction = f.evidence["hw_slowdown_fraction"]
    assert isinstance(fraction, float) and 0.3 <= fraction <= 0.35
    assert f.health == Health.DEGRADED
    state, now = history(lambda i, t: {"slowdown_margin_c": 0.0,
                                       "throttle_reasons": 0x48 if t > 10 else 0})
    f = by_gpu(ThermalCheck().run(state, now))[0]
    assert f.health == Health.UNHEALTHY and f.action == SuggestedAction.CHECKPOINT


def test_power_brake() -> None:
    state, now = history(lambda i, t: {"throttle_reasons": 0x4})  # SW power cap: benign
    assert by_gpu(PowerBrakeCheck().run(state, now))[0].health == Health.HEALTHY
    state, now = history(lambda i, t: {"throttle_reasons": 0x88 if t > 50 else 0x0})
    assert by_gpu(PowerBrakeCheck().run(state, now))[0].health == Health.DEGRADED
    state, now = history(lambda i, t: {"throttle_reasons": 0x88})
    f = by_gpu(PowerBrakeCheck().run(state, now))[0]
    assert f.health == Health.UNHEALTHY and f.action == SuggestedAction.INSPECT_HARDWARE


# -- pcie / nvlink ------------------------------------------------------------------------


def link(width: int = 16, gen: int = 5, util: float = 90.0, pstate: int = 0) -> dict[str, Any]:
    return {"pcie_link_width": width, "pcie_link_width_max": 16, "pcie_link_gen": gen,
            "pcie_link_gen_max": 5, "gpu_util_pct": util, "pstate": pstate}


def test_pcie_replay_rate() -> None:
    state, now = history(lambda i, t: {"pcie_replay_total": 7, **link()})
    assert by_gpu(PcieCheck().run(state, now))[0].health == Health.HEALTHY
    state, now = history(lambda i, t: {"pcie_replay_total": int(t * 5), **link()})
    f = by_gpu(PcieCheck().run(state, now))[0]
    assert f.health == Health.DEGRADED and f.evidence["replays_in_window"] == 300
    state, now = history(lambda i, t: {"pcie_replay_total": int(t * 500), **link()})
    f = by_gpu(PcieCheck().run(state, now))[0]
    assert f.health == Health.UNHEALTHY and f.action == SuggestedAction.CHECKPOINT


def test_pcie_link_downgrade_width_always_generation_only_under_load() -> None:
    state, now = history(lambda i, t: {"pcie_replay_total": 0, **link(width=8)})
    f = by_gpu(PcieCheck().run(state, now))[0]
    assert f.health == Health.DEGRADED and f.action == SuggestedAction.INSPECT_HARDWARE
    # Idle GPUs drop link generation to save power: not a finding.
    state, now = history(lambda i, t: {"pcie_replay_total": 0,
                                       **link(gen=1, util=0.0, pstate=8)})
    assert by_gpu(PcieCheck().run(state, now))[0].health == Health.HEALTHY
    state, now = history(lambda i, t: {"pcie_replay_total": 0, **link(gen=3)})
    assert by_gpu(PcieCheck().run(state, now))[0].health == Health.DEGRADED


def test_nvlink_error_rates_per_link() -> None:
    def links(crc_rate: float, recovery_rate: float) -> Callable[[int, float], dict[str, Any]]:
        return lambda i, t: {"nvlink": (
            NvlinkCounters(link=0, crc_flit=0, crc_data=0, replay=0, recovery=0),
            NvlinkCounters(link=3, crc_flit=int(t * crc_rate), crc_data=0, replay=0,
                           recovery=int(t * recovery_rate)),
        )}

    state, now = history(links(0, 0))
    assert NvlinkCheck().applies(state)
    assert by_gpu(NvlinkCheck().run(state, now))[0].health == Health.HEALTHY
    state, now = history(links(10, 0))
    f = by_gpu(NvlinkCheck().run(state, now))[0]
    assert f.health == Health.DEGRADED and "link 3" in f.reason and "link 0" not in f.reason
    state, now = history(links(10, 0.5))
    f = by_gpu(NvlinkCheck().run(state, now))[0]
    assert f.health == Health.UNHEALTHY and f.action == SuggestedAction.CHECKPOINT
    state, now = history(lambda i, t: {})
    assert not NvlinkCheck().applies(state)


# -- gpu lost ---------------------------------------------------------------------------


def test_gpu_lost_and_other_checks_stop_judging_it() -> None:
    state, now = history(lambda i, t: {
        "state": GpuState.LOST if (i == 1 and t > 30) else GpuState.OK,
        **({} if (i == 1 and t > 30) else {"ecc_corrected_volatile": 0,
                                           "ecc_uncorrected_volatile": 0}),
    }, gpus=3)
    f = by_gpu(GpuLostCheck().run(state, now))
    assert f[0].health == Health.HEALTHY and f[2].health == Health.HEALTHY
    assert f[1].health == Health.UNHEALTHY and f[1].action == SuggestedAction.REBOOT
    assert f[1].evidence["since"] == T0 + 31
    assert set(by_gpu(EccCheck().run(state, now))) == {0, 2}
    state, now = history(lambda i, t: {"state": GpuState.RESET_REQUIRED})
    assert by_gpu(GpuLostCheck().run(state, now))[0].action == SuggestedAction.RESET_GPU


# -- registry and runner ----------------------------------------------------------------


def test_all_checks_listed_unique_and_constructible() -> None:
    names = [c.name for c in ALL_CHECKS]
    assert len(names) == len(set(names))
    for expected in ("xid", "ecc", "remap", "retired_pages", "thermal", "power_brake", "pcie",
                     "nvlink", "gpu_lost"):
        assert expected in names
    assert len(default_checks()) == len(ALL_CHECKS)


def test_every_hardware_check_survives_empty_and_all_unsupported_state() -> None:
    state, now = history(lambda i, t: {"unsupported": ("temperature_c",)}, gpus=2, seconds=3)
    empty = AgentState(node="n1")
    hw = [c for c in default_checks() if c.name in {
        "xid", "ecc", "remap", "retired_pages", "thermal", "power_brake", "pcie", "nvlink",
        "gpu_lost"}]
    for s in (state, empty):
        runs = run_checks(hw, s, now)
        assert all(r.ok for r in runs)


def test_runner_turns_a_raising_check_into_unknown() -> None:
    class Broken:
        name = "broken"

        def applies(self, state: AgentState) -> bool:
            return True

        def run(self, state: AgentState, now: float) -> list[Finding]:
            raise ZeroDivisionError("bad data")

    state, now = history(lambda i, t: {}, seconds=1)
    ticks = iter([1.0, 1.25, 2.0, 2.5])
    runs = run_checks([Broken(), XidCheck()], state, now, timer=lambda: next(ticks))
    assert [r.ok for r in runs] == [False, True]
    assert runs[0].findings[0].health == Health.UNKNOWN
    assert "ZeroDivisionError" in runs[0].findings[0].reason
    assert runs[0].seconds == 0.25 and runs[1].seconds == 0.5


# -- the incremental paths agree with a plain walk over the window ------------------------

_opt_count = st.none() | st.integers(min_value=0, max_value=50)


@st.composite
def _nvlink_history(draw: st.DrawFn) -> list[tuple[float, tuple[NvlinkCounters, ...]]]:
    """Samples with links that come and go, counters that reset and fields unsupported."""
    out = []
    t = T0
    for _ in range(draw(st.integers(min_value=0, max_value=40))):
        t += draw(st.sampled_from([0.5, 1.0, 7.0, 30.0]))
        ids = draw(st.lists(st.integers(min_value=0, max_value=3), unique=True, max_size=4))
        out.append((t, tuple(
            NvlinkCounters(link=k, crc_flit=draw(_opt_count), crc_data=draw(_opt_count),
                           replay=draw(_opt_count), recovery=draw(_opt_count))
            for k in ids)))
    return out


@given(_nvlink_history(), st.sampled_from([10.0, 60.0, 300.0]))
@settings(max_examples=300, deadline=None)
def test_nvlink_link_deltas_equal_counter_delta(
        samples: list[tuple[float, tuple[NvlinkCounters, ...]]], window_s: float) -> None:
    state = AgentState(node="n1")
    for t, links in samples:
        state.add_samples([GpuSample(node="n1", gpu=0, time=t, source="scripted",
                                     nvlink=links)])
    if not samples:
        return
    hist = state.gpus[0]
    last = hist.samples[-1]
    now = last.time
    for link_id, kind, got in _link_deltas(hist, last, now, window_s):
        assert got == counter_delta(hist, _reader(link_id, kind), now, window_s), (
            link_id, kind)


def _naive_fraction(hist: GpuHistory, test: Callable[[GpuSample], bool | None], now: float,
                    window_s: float) -> tuple[float, int]:
    hits = judged = 0
    for s in reversed(hist.samples):
        if s.time < now - window_s:
            break
        v = test(s)
        if v is not None:
            judged += 1
            hits += bool(v)
    return (hits / judged if judged else 0.0), judged


@given(st.lists(st.tuples(st.sampled_from([1.0, 1.0, 5.0, 40.0, -3.0, -70.0, 1000.0]),
                          st.integers(min_value=0, max_value=4), st.booleans(),
                          st.sampled_from([0.0, 0.0, 0.5, -2.0, -90.0])),
                max_size=120),
       st.sampled_from([60.0, 1200.0]))
@settings(max_examples=300, deadline=None)
def test_window_fraction_equals_a_walk_over_the_window(
        steps: list[tuple[float, int, bool, float]], window_s: float) -> None:
    """Polls with samples added in between (the clock sometimes stepping back, gaps
    longer than the history, a history replaced, ``now`` off the newest sample): every
    answer is the plain walk's."""
    def test(s: GpuSample) -> bool | None:
        return None if s.throttle_reasons is None else bool(s.throttle_reasons & 0x40)

    fraction = WindowFraction(test, window_s)
    state = AgentState(node="n1")
    state.add_inventory([GpuInfo(index=0)])
    t = T0
    for dt, added, replace, skew in steps:
        if replace and added == 4:
            state.gpus[0] = GpuHistory(info=GpuInfo(index=0))
        for k in range(added):
            t += dt
            reasons = None if k == 3 else (0x40 if (int(t) + k) % 3 == 0 else 0)
            state.add_samples([GpuSample(node="n1", gpu=0, time=t, source="scripted",
                                         throttle_reasons=reasons)])
        hist = state.gpus[0]
        if hist.samples:
            assert fraction(hist, t + skew) == _naive_fraction(hist, test, t + skew, window_s)


def test_window_fraction_tests_only_new_samples_once_the_clock_is_steady_again() -> None:
    calls: list[float] = []

    def test(s: GpuSample) -> bool:
        calls.append(s.time)
        return True

    fraction = WindowFraction(test, 10.0)
    state = AgentState(node="n1")
    state.add_inventory([GpuInfo(index=0)])
    for t in [1.0, 2.0, 3.0, 2.5, 4.0]:  # the clock steps back once
        state.add_samples([GpuSample(node="n1", gpu=0, time=T0 + t, source="scripted")])
        fraction(state.gpus[0], T0 + t)
    for t in range(5, 30):  # the step back leaves the window, then one test per poll
        state.add_samples([GpuSample(node="n1", gpu=0, time=T0 + t, source="scripted")])
        calls.clear()
        got = fraction(state.gpus[0], T0 + t)
        assert got == _naive_fraction(state.gpus[0], lambda s: True, T0 + t, 10.0)
        if t >= 14:  # 2.5 s (the step back) is out of the window from t = 13 on
            assert calls == [T0 + t]
