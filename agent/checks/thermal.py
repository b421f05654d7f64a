"""Thermal check: slowdown margin and hardware thermal slowdown over a window.

``slowdown_margin_c`` is nvmlDeviceGetMarginTemperature (degrees left before the GPU's
slowdown threshold, NVML_TEMPERATURE_THRESHOLD_SLOWDOWN). The clock-event reasons
(nvmlDeviceGetCurrentClocksEventReasons) say whether clocks are being cut:
``HW_THERMAL_SLOWDOWN`` (0x40) and ``HW_SLOWDOWN`` (0x08) are the hardware protecting
itself, unlike ``SW_THERMAL_SLOWDOWN`` (0x20), the driver's normal temperature targeting.
A thermal runaway (failing fan, cooling, thermal interface — "GPU thermal
interface/sensor" is 1.4% of Llama 3's interruptions, docs/reference.md) shows as a shrinking
margin and a growing share of time in HW slowdown.
"""

from __future__ import annotations

from forewarn.agent.checks.common import WindowFraction, gpu_finding, live_gpus
from forewarn.agent.state import AgentState
from forewarn.gpu import HW_POWER_BRAKE_SLOWDOWN, HW_SLOWDOWN, HW_THERMAL_SLOWDOWN
from forewarn.wire import Finding, Health, SuggestedAction

__all__ = ["ThermalCheck"]

HW_POWER_BRAKE = HW_POWER_BRAKE_SLOWDOWN
"""NVML sets HW_SLOWDOWN (0x08) for the external power brake too: with 0x80 set it is the
power brake's (checks/power_brake.py), not heat."""


def _hw_thermal(reasons: int) -> bool:
    if reasons & HW_THERMAL_SLOWDOWN:
        return True
    return bool(reasons & HW_SLOWDOWN) and not reasons & HW_POWER_BRAKE


class ThermalCheck:
    """Judges every GPU reporting a slowdown margin or clock-event reasons.

    Args:
        margin_c: slowdown margin (°C) below which the GPU is degraded (default 5).
        window_s: window for the slowdown fraction (default 60 s).
        degraded_fraction: share of samples with HW (thermal) slowdown that makes the
            GPU degraded (default 0.2).
        unhealthy_fraction: share that makes it unhealthy: throughput is collapsing and
            a thermal shutdown may follow (default 0.5; checkpoint).
    """

    name = "thermal"

    def __init__(self, margin_c: float = 5.0, window_s: float = 60.0,
                 degraded_fraction: float = 0.2, unhealthy_fraction: float = 0.5) -> None:
        self.margin_c = margin_c
        self.window_s = window_s
        self.degraded_fraction = degraded_fraction
        self.unhealthy_fraction = unhealthy_fraction
        self._slowdown = WindowFraction(
            lambda s: None if s.throttle_reasons is None else _hw_thermal(s.throttle_reasons),
            window_s)

    def applies(self, state: AgentState) -> bool:
        return True

    def run(self, state: AgentState, now: float) -> list[Finding]:
        out = []
        for hist, last in live_gpus(state):
            if last.slowdown_margin_c is None and last.throttle_reasons is None:
                continue
            frac, judged = self._slowdown(hist, now)
            thermal_now = bool((last.throttle_reasons or 0) & HW_THERMAL_SLOWDOWN)
            margin = last.slowdown_margin_c
            evidence: dict[str, float | int | str | bool | None] = {
                "margin_c": margin, "temperature_c": last.temperature_c,
                "hw_slowdown_fraction": round(frac, 3), "samples": judged,
                "hw_thermal_slowdown_now": thermal_now,
            }
            pct = f"{frac:.0%} of the last {self.window_s:.0f} s"
            if judged and frac >= self.unhealthy_fraction:
                out.append(gpu_finding(
                    self.name, state, hist, now, Health.UNHEALTHY,
                    f"hardware slowdown active {pct} (margin {margin} °C): clocks are being cut "
                    "to protect the GPU; checkpoint and check the cooling",
                    SuggestedAction.CHECKPOINT, evidence))
            elif (judged and frac >= self.degraded_fraction) or (
                    margin is not None and margin < self.margin_c):
                out.append(gpu_finding(
                    self.name, state, hist, now, Health.DEGRADED,
                    f"slowdown margin {margin} °C (threshold {self.margin_c:g}), hardware "
                    f"slowdown {pct}", SuggestedAction.WATCH, evidence))
            else:
                out.append(gpu_finding(
                    self.name, state, hist, now, Health.HEALTHY,
                    f"slowdown margin {margin} °C, hardware slowdown {pct}",
                    SuggestedAction.NONE, evidence))
        return out
