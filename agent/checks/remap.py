"""Row-remapping check (Ampere and later: nvmlDeviceGetRemappedRows).

``isPending``: a row was remapped but the remap takes effect only after a GPU reset; until
then the bad row may still be used, so reset at the next opportunity (degraded).
``isFailureOccurred``: a remap failed because the bank ran out of spare rows; the memory
can no longer heal itself and the GPU should be inspected / replaced (unhealthy). NCSA
Delta measured that remapping with containment absorbed 92% of H100 uncorrectable errors
(docs/reference.md), which is why pending remaps deserve a reset, not a drain.

The evidence's ``extent`` is the number of remapped rows: rows that keep growing while a
remap is pending use up the bank's spares, and each material growth is re-reported
(:mod:`forewarn.escalation`), so the collector can order another checkpoint before the remap
fails.
"""

from __future__ import annotations

from forewarn.agent.checks.common import counter_delta, gpu_finding, live_gpus
from forewarn.agent.state import AgentState
from forewarn.escalation import EXTENT
from forewarn.wire import Finding, Health, SuggestedAction

__all__ = ["RemapCheck"]


class RemapCheck:
    """Judges every GPU that reports row remapping.

    Args:
        window_s: window in which growth of remapped rows is reported (default 1 h).
    """

    name = "remap"

    def __init__(self, window_s: float = 3600.0) -> None:
        self.window_s = window_s

    def applies(self, state: AgentState) -> bool:
        return True

    def run(self, state: AgentState, now: float) -> list[Finding]:
        out = []
        for hist, last in live_gpus(state):
            if last.remap_pending is None and last.remap_failure is None:
                continue
            grown = counter_delta(
                hist,
                lambda s: None if s.remapped_rows_correctable is None else (
                    s.remapped_rows_correctable + (s.remapped_rows_uncorrectable or 0)),
                now, self.window_s)
            evidence: dict[str, float | int | str | bool | None] = {
                "correctable_rows": last.remapped_rows_correctable,
                "uncorrectable_rows": last.remapped_rows_uncorrectable,
                "pending": last.remap_pending, "failure": last.remap_failure,
                "rows_remapped_in_window": grown[0] if grown else None,
                # every remapped row uses up a spare of its bank: growth under an unchanged
                # "pending" is re-reported and may order another checkpoint
                EXTENT: (last.remapped_rows_correctable or 0)
                + (last.remapped_rows_uncorrectable or 0),
            }
            if last.remap_failure:
                out.append(gpu_finding(
                    self.name, state, hist, now, Health.UNHEALTHY,
                    "row remapping failed (no spare rows left in a bank): the memory can no "
                    "longer repair itself; drain and inspect/replace the GPU",
                    SuggestedAction.INSPECT_HARDWARE, evidence))
            elif last.remap_pending:
                out.append(gpu_finding(
                    self.name, state, hist, now, Health.DEGRADED,
                    "a row remap is pending: it takes effect at the next GPU reset; reset at "
                    "the next opportunity (after a checkpoint)", SuggestedAction.RESET_GPU,
                    evidence))
            elif grown is not None and grown[0] > 0:
                out.append(gpu_finding(
                    self.name, state, hist, now, Health.HEALTHY,
                    f"{grown[0]} row(s) remapped in the last {grown[1]:.0f} s (applied)",
                    SuggestedAction.WATCH, evidence))
            else:
                out.append(gpu_finding(self.name, state, hist, now, Health.HEALTHY,
                                       "no pending or failed row remaps",
                                       SuggestedAction.NONE, evidence))
        return out
