"""NVLink check: error rates of the per-link data-link counters
(nvmlDeviceGetNvLinkErrorCounter: NVML_NVLINK_ERROR_DL_CRC_FLIT, _CRC_DATA, _REPLAY,
_RECOVERY).

CRC errors are retried by the link (replay); recoveries retrain the link and stall
traffic. A growing error rate on one link precedes XID 74 (NVLink error), which kills
the collective running over it (REFERENCE.md: interconnect class). Judged per GPU, worst
link named.
"""

from __future__ import annotations

from collections.abc import Callable

from forewarn.agent.checks.common import counter_delta, gpu_finding, live_gpus, window_start
from forewarn.agent.state import AgentState
from forewarn.wire import Finding, GpuSample, Health, SuggestedAction

__all__ = ["NvlinkCheck"]


_GETTERS: dict[tuple[int, int, str], Callable[[GpuSample], int | None]] = {}


def _counter(pos: int, link: int, kind: str) -> Callable[[GpuSample], int | None]:
    """Reader of one link's counter. Links sit at the same position in every sample of a
    GPU, so the reader looks there first (O(1)) and searches only if the layout changed.
    Readers are cached: the check asks for 4 counters x 18 links x every GPU each poll."""
    key = (pos, link, kind)
    found = _GETTERS.get(key)
    if found is not None:
        return found

    def get(s: GpuSample) -> int | None:
        links = s.nvlink
        c = links[pos] if pos < len(links) and links[pos].link == link else next(
            (x for x in links if x.link == link), None)
        if c is None:
            return None
        if kind == "crc":
            if c.crc_flit is None and c.crc_data is None:
                return None
            return (c.crc_flit or 0) + (c.crc_data or 0)
        v: int | None = getattr(c, kind)
        return v

    _GETTERS[key] = get
    return get


class NvlinkCheck:
    """Judges every GPU that reports NVLink counters.

    Args:
        window_s: window for the rates (default 5 min).
        crc_degraded: CRC (flit + data) errors per link within the window (default 100).
        replay_degraded: replays per link within the window (default 10).
        recovery_degraded: recoveries per link within the window (default 1).
        recovery_unhealthy: recoveries per link within the window that make the GPU
            unhealthy (default 5: the link keeps retraining; checkpoint).
    """

    name = "nvlink"

    def __init__(self, window_s: float = 300.0, crc_degraded: int = 100,
                 replay_degraded: int = 10, recovery_degraded: int = 1,
                 recovery_unhealthy: int = 5) -> None:
        self.window_s = window_s
        self.thresholds = {"crc": crc_degraded, "replay": replay_degraded,
                           "recovery": recovery_degraded}
        self.recovery_unhealthy = recovery_unhealthy

    def applies(self, state: AgentState) -> bool:
        return any(h.last is not None and h.last.nvlink for h in state.gpus.values())

    def run(self, state: AgentState, now: float) -> list[Finding]:
        out = []
        for hist, last in live_gpus(state):
            if not last.nvlink:
                continue
            over: list[str] = []
            evidence: dict[str, float | int | str | bool | None] = {"links": len(last.nvlink)}
            worst_recovery = 0
            start = window_start(hist, now, self.window_s)
            for pos, link in sorted(((i, c.link) for i, c in enumerate(last.nvlink)),
                                    key=lambda t: t[1]):
                for kind, limit in self.thresholds.items():
                    d = counter_delta(hist, _counter(pos, link, kind), now, self.window_s,
                                      start=start)
                    if d is None:
                        continue
                    if d[0] > 0:
                        evidence[f"link{link}_{kind}"] = d[0]
                    if kind == "recovery":
                        worst_recovery = max(worst_recovery, d[0])
                    if d[0] >= limit:
                        over.append(f"link {link}: {d[0]} {kind} errors in {d[1]:.0f} s")
            if worst_recovery >= self.recovery_unhealthy:
                out.append(gpu_finding(
                    self.name, state, hist, now, Health.UNHEALTHY,
                    f"NVLink keeps retraining ({'; '.join(over)}): collectives over it will "
                    "stall or fail (XID 74); checkpoint, then reset the GPU",
                    SuggestedAction.CHECKPOINT, evidence))
            elif over:
                out.append(gpu_finding(
                    self.name, state, hist, now, Health.DEGRADED,
                    f"NVLink error rate above threshold ({'; '.join(over)})",
                    SuggestedAction.WATCH, evidence))
            else:
                out.append(gpu_finding(self.name, state, hist, now, Health.HEALTHY,
                                       f"NVLink error rates below thresholds on "
                                       f"{len(last.nvlink)} links", SuggestedAction.NONE,
                                       evidence))
        return out
