"""PCIe check: replay rate and link downgrade.

``pcie_replay_total`` is nvmlDeviceGetPcieReplayCounter: link-level retransmissions after
bad TLPs. A few are normal; a growing rate means a marginal link (riser, slot, cable,
retimer) and precedes the GPU falling off the bus (XID 79). The link's current width /
generation (nvmlDeviceGetCurrPcieLinkWidth / ...Generation) below its maximum
(...MaxPcieLinkWidth / ...Generation) is a trained-down link. Idle GPUs lower their link
generation to save power, so a generation downgrade is judged only under load (P0 or
utilization >= ``busy_util_pct``); a width downgrade is judged always.
"""

from __future__ import annotations

from forewarn.agent.checks.common import counter_delta, gpu_finding, live_gpus
from forewarn.agent.state import AgentState
from forewarn.wire import Finding, Health, SuggestedAction

__all__ = ["PcieCheck"]


class PcieCheck:
    """Judges every GPU reporting the replay counter or link state.

    Args:
        window_s: window for the replay rate (default 5 min).
        replay_degraded: replays within the window that make the GPU degraded (100).
        replay_unhealthy: replays within the window that make it unhealthy (default
            10,000: the link is failing; checkpoint before it drops off the bus).
        busy_util_pct: utilization above which a generation downgrade counts (50).
    """

    name = "pcie"

    def __init__(self, window_s: float = 300.0, replay_degraded: int = 100,
                 replay_unhealthy: int = 10_000, busy_util_pct: float = 50.0) -> None:
        self.window_s = window_s
        self.replay_degraded = replay_degraded
        self.replay_unhealthy = replay_unhealthy
        self.busy_util_pct = busy_util_pct

    def applies(self, state: AgentState) -> bool:
        return True

    def run(self, state: AgentState, now: float) -> list[Finding]:
        out = []
        for hist, last in live_gpus(state):
            if last.pcie_replay_total is None and last.pcie_link_width is None:
                continue
            replays = counter_delta(hist, lambda s: s.pcie_replay_total, now, self.window_s)
            n = replays[0] if replays else 0
            busy = last.pstate == 0 or (last.gpu_util_pct or 0.0) >= self.busy_util_pct
            width_down = (last.pcie_link_width is not None and last.pcie_link_width_max
                          is not None and last.pcie_link_width < last.pcie_link_width_max)
            gen_down = (busy and last.pcie_link_gen is not None and last.pcie_link_gen_max
                        is not None and last.pcie_link_gen < last.pcie_link_gen_max)
            evidence: dict[str, float | int | str | bool | None] = {
                "replays_in_window": n, "window_s": self.window_s,
                "replay_total": last.pcie_replay_total,
                "link_width": last.pcie_link_width, "link_width_max": last.pcie_link_width_max,
                "link_gen": last.pcie_link_gen, "link_gen_max": last.pcie_link_gen_max,
            }
            link = (f"link x{last.pcie_link_width}/x{last.pcie_link_width_max} "
                    f"gen{last.pcie_link_gen}/{last.pcie_link_gen_max}")
            rate = f"{n} PCIe replays in {replays[1] if replays else 0:.0f} s"
            if n >= self.replay_unhealthy:
                out.append(gpu_finding(
                    self.name, state, hist, now, Health.UNHEALTHY,
                    f"{rate} (>= {self.replay_unhealthy}): the link is failing and the GPU may "
                    f"fall off the bus; checkpoint now ({link})", SuggestedAction.CHECKPOINT,
                    evidence))
            elif n >= self.replay_degraded or width_down or gen_down:
                what = []
                if n >= self.replay_degraded:
                    what.append(f"{rate} (>= {self.replay_degraded})")
                if width_down:
                    what.append("link width below its maximum")
                if gen_down:
                    what.append("link generation below its maximum under load")
                out.append(gpu_finding(
                    self.name, state, hist, now, Health.DEGRADED,
                    f"{'; '.join(what)} ({link}): check the riser/slot/cabling",
                    SuggestedAction.INSPECT_HARDWARE if width_down else SuggestedAction.WATCH,
                    evidence))
            else:
                out.append(gpu_finding(self.name, state, hist, now, Health.HEALTHY,
                                       f"{rate}, {link}", SuggestedAction.NONE, evidence))
        return out
