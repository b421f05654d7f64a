"""NVLink check: error rates of the per-link data-link counters
(nvmlDeviceGetNvLinkErrorCounter: NVML_NVLINK_ERROR_DL_CRC_FLIT, _CRC_DATA, _REPLAY,
_RECOVERY).

CRC errors are retried by the link (replay); recoveries retrain the link and stall
traffic. A growing error rate on one link precedes XID 74 (NVLink error), which kills
the collective running over it (docs/reference.md: interconnect class). Judged per GPU, worst
link named.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from forewarn.agent.checks.common import counter_delta, gpu_finding, live_gpus, window_start
from forewarn.agent.state import AgentState, GpuHistory
from forewarn.wire import Finding, GpuSample, Health, NvlinkCounters, SuggestedAction

__all__ = ["NvlinkCheck"]


_KINDS = ("crc", "replay", "recovery")


def _value(c: NvlinkCounters, kind: str) -> int | None:
    """One link's counter of a kind; CRC is flit + data errors."""
    if kind == "crc":
        if c.crc_flit is None and c.crc_data is None:
            return None
        return (c.crc_flit or 0) + (c.crc_data or 0)
    return c.replay if kind == "replay" else c.recovery


def _reader(link: int, kind: str) -> Callable[[GpuSample], int | None]:
    """Reader of one link's counter in any sample, for :func:`counter_delta`."""
    def get(s: GpuSample) -> int | None:
        c = next((x for x in s.nvlink if x.link == link), None)
        return None if c is None else _value(c, kind)
    return get


def _link_deltas(hist: GpuHistory, last: GpuSample, now: float, window_s: float
                 ) -> Iterator[tuple[int, str, tuple[int, float] | None]]:
    """(link, kind, :func:`counter_delta`) for every link of ``last`` and every kind.

    The usual case costs one comparison per counter: the window's base sample carries
    the same links and no counter went down, so the delta is last minus base. Anything
    else (a link missing from the base, a reset) takes :func:`counter_delta`'s full path.
    The check reads 3 kinds x 18 links x every GPU each poll (bench/agent_poll.py).
    """
    samples = hist.samples
    start = window_start(hist, now, window_s)
    base = samples[start] if len(samples) >= 2 else last
    span = last.time - base.time
    base_links = {c.link: c for c in base.nvlink} if base is not last else {}
    for c in sorted(last.nvlink, key=lambda x: x.link):
        b = base_links.get(c.link)
        for kind in _KINDS:
            v_last = _value(c, kind)
            if v_last is None:
                yield c.link, kind, None
                continue
            v_base = None if b is None else _value(b, kind)
            if v_base is not None and v_last >= v_base:
                yield c.link, kind, (v_last - v_base, span)
            else:
                yield c.link, kind, counter_delta(hist, _reader(c.link, kind), now, window_s,
                                                  start=start)


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
            for link, kind, d in _link_deltas(hist, last, now, self.window_s):
                if d is None:
                    continue
                if d[0] > 0:
                    evidence[f"link{link}_{kind}"] = d[0]
                if kind == "recovery":
                    worst_recovery = max(worst_recovery, d[0])
                if d[0] >= self.thresholds[kind]:
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
