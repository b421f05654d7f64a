"""Power-brake check: the HW power brake clock-event reason
(NVML ``HW_POWER_BRAKE_SLOWDOWN``, 0x80).

The power brake is an external signal from the baseboard / system (power supply trouble,
over-current protection) that drops the GPU's clocks hard. Unlike the software power cap
(0x04, the GPU at its configured limit, benign) it points at node power hardware: a
sustained brake is worth inspecting ("power supply" is 0.7% of Llama 3's interruptions,
docs/reference.md).
"""

from __future__ import annotations

from forewarn.agent.checks.common import WindowFraction, gpu_finding, live_gpus
from forewarn.agent.state import AgentState
from forewarn.gpu import HW_POWER_BRAKE_SLOWDOWN
from forewarn.wire import Finding, Health, SuggestedAction

__all__ = ["PowerBrakeCheck"]


class PowerBrakeCheck:
    """Judges every GPU reporting clock-event reasons.

    Args:
        window_s: window for the brake fraction (default 60 s).
        degraded_fraction: share of samples braked that makes the GPU degraded (0.05).
        unhealthy_fraction: share that makes it unhealthy (default 0.5).
    """

    name = "power_brake"

    def __init__(self, window_s: float = 60.0, degraded_fraction: float = 0.05,
                 unhealthy_fraction: float = 0.5) -> None:
        self.window_s = window_s
        self.degraded_fraction = degraded_fraction
        self.unhealthy_fraction = unhealthy_fraction
        self._brake = WindowFraction(
            lambda s: None if s.throttle_reasons is None else bool(
                s.throttle_reasons & HW_POWER_BRAKE_SLOWDOWN), window_s)

    def applies(self, state: AgentState) -> bool:
        return True

    def run(self, state: AgentState, now: float) -> list[Finding]:
        out = []
        for hist, last in live_gpus(state):
            if last.throttle_reasons is None:
                continue
            frac, judged = self._brake(hist, now)
            evidence: dict[str, float | int | str | bool | None] = {
                "brake_fraction": round(frac, 3), "samples": judged,
                "power_w": last.power_w, "power_limit_w": last.power_limit_w,
            }
            pct = f"{frac:.0%} of the last {self.window_s:.0f} s"
            if frac >= self.unhealthy_fraction:
                out.append(gpu_finding(
                    self.name, state, hist, now, Health.UNHEALTHY,
                    f"HW power brake active {pct}: the node's power hardware is cutting the "
                    "GPU's clocks; checkpoint and inspect the power supply / baseboard",
                    SuggestedAction.INSPECT_HARDWARE, evidence))
            elif frac >= self.degraded_fraction:
                out.append(gpu_finding(
                    self.name, state, hist, now, Health.DEGRADED,
                    f"HW power brake active {pct}", SuggestedAction.WATCH, evidence))
            else:
                out.append(gpu_finding(self.name, state, hist, now, Health.HEALTHY,
                                       f"HW power brake active {pct}", SuggestedAction.NONE,
                                       evidence))
        return out
