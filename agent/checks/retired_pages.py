"""Page-retirement check (pre-Ampere dynamic page retirement: nvmlDeviceGetRetiredPages,
nvmlDeviceGetRetiredPagesPendingStatus).

A pending retirement takes effect at the next reboot / GPU reset (degraded, reset). Pages
retired for double-bit errors mean uncorrectable errors happened; their growth is reported
as degraded. A large total means the GPU is wearing out: NVIDIA's dynamic page retirement
notes describe a GPU with many retired pages (on the order of 60) as a candidate for
replacement; ``max_pages`` makes that an explicit, tunable threshold (unhealthy, inspect).
"""

from __future__ import annotations

from forewarn.agent.checks.common import counter_delta, gpu_finding, live_gpus
from forewarn.agent.state import AgentState
from forewarn.wire import Finding, Health, SuggestedAction

__all__ = ["RetiredPagesCheck"]


class RetiredPagesCheck:
    """Judges every GPU that reports retired pages.

    Args:
        window_s: window in which new DBE retirements are reported (default 1 h).
        max_pages: total retired pages (SBE + DBE) at which the GPU is unhealthy
            (default 60, see the module docstring).
    """

    name = "retired_pages"

    def __init__(self, window_s: float = 3600.0, max_pages: int = 60) -> None:
        self.window_s = window_s
        self.max_pages = max_pages

    def applies(self, state: AgentState) -> bool:
        return True

    def run(self, state: AgentState, now: float) -> list[Finding]:
        out = []
        for hist, last in live_gpus(state):
            if (last.retired_pages_pending is None and last.retired_pages_dbe is None
                    and last.retired_pages_sbe is None):
                continue
            total = (last.retired_pages_sbe or 0) + (last.retired_pages_dbe or 0)
            new_dbe = counter_delta(hist, lambda s: s.retired_pages_dbe, now, self.window_s)
            evidence: dict[str, float | int | str | bool | None] = {
                "sbe": last.retired_pages_sbe, "dbe": last.retired_pages_dbe,
                "pending": last.retired_pages_pending, "total": total,
            }
            if total >= self.max_pages:
                out.append(gpu_finding(
                    self.name, state, hist, now, Health.UNHEALTHY,
                    f"{total} retired pages (>= {self.max_pages}): the memory is wearing out; "
                    "inspect / replace the GPU", SuggestedAction.INSPECT_HARDWARE, evidence))
            elif last.retired_pages_pending:
                out.append(gpu_finding(
                    self.name, state, hist, now, Health.DEGRADED,
                    "a page retirement is pending: it takes effect at the next GPU reset; "
                    "reset at the next opportunity", SuggestedAction.RESET_GPU, evidence))
            elif new_dbe is not None and new_dbe[0] > 0:
                out.append(gpu_finding(
                    self.name, state, hist, now, Health.DEGRADED,
                    f"{new_dbe[0]} page(s) retired for double-bit errors in the last "
                    f"{new_dbe[1]:.0f} s", SuggestedAction.WATCH, evidence))
            else:
                out.append(gpu_finding(self.name, state, hist, now, Health.HEALTHY,
                                       f"{total} retired pages, none pending",
                                       SuggestedAction.NONE, evidence))
        return out
