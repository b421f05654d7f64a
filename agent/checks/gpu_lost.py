"""GPU-lost check: a GPU that stopped answering is a finding, not a crash.

NVML_ERROR_GPU_IS_LOST (typically with XID 79, "fallen off the bus") needs a node reboot
(or at least a PCIe rescan / driver reload) before the GPU answers again;
NVML_ERROR_RESET_REQUIRED needs a GPU reset. The backend maps both to
:class:`forewarn.wire.GpuState`.
"""

from __future__ import annotations

from forewarn.agent.checks.common import gpu_finding
from forewarn.agent.state import AgentState
from forewarn.wire import Finding, GpuState, Health, SuggestedAction

__all__ = ["GpuLostCheck"]


class GpuLostCheck:
    """Judges every GPU with at least one sample: ok, lost, or reset required."""

    name = "gpu_lost"

    def applies(self, state: AgentState) -> bool:
        return True

    def run(self, state: AgentState, now: float) -> list[Finding]:
        out = []
        for _index, hist in sorted(state.gpus.items()):
            last = hist.last
            if last is None:
                continue
            since = None
            if last.state != GpuState.OK:  # when it went away (walks only a lost GPU)
                for s in reversed(hist.samples):
                    if s.state != last.state:
                        break
                    since = s.time
            evidence: dict[str, float | int | str | bool | None] = {
                "state": last.state.value, "since": since}
            if last.state == GpuState.LOST:
                out.append(gpu_finding(
                    self.name, state, hist, now, Health.UNHEALTHY,
                    "GPU is lost (stopped answering, e.g. fallen off the bus): the job on it is "
                    "dead; reboot the node (and inspect the GPU if it recurs)",
                    SuggestedAction.REBOOT, evidence))
            elif last.state == GpuState.RESET_REQUIRED:
                out.append(gpu_finding(
                    self.name, state, hist, now, Health.UNHEALTHY,
                    "GPU requires a reset before it can be used", SuggestedAction.RESET_GPU,
                    evidence))
            else:
                out.append(gpu_finding(self.name, state, hist, now, Health.HEALTHY,
                                       "GPU answers", SuggestedAction.NONE, evidence))
        return out
