"""ECC check: uncorrectable errors are critical; a high correctable rate is a warning.

NVML counters (nvmlDeviceGetTotalEccErrors): ``NVML_MEMORY_ERROR_TYPE_UNCORRECTED`` /
``_CORRECTED``, ``NVML_VOLATILE_ECC`` (since the last driver load or GPU reset) and
``NVML_AGGREGATE_ECC`` (lifetime). A volatile uncorrectable count above zero means the GPU
took a double-bit error since its last reset: its memory may hold corrupt data until it is
reset (and, on Ampere and later, until the row remap the error triggered is applied).
Correctable errors predict uncorrectable ones (docs/reference.md, the SC20 DRAM analog), so a
correctable *rate* above a threshold is reported as degraded; isolated bursts are not.
"""

from __future__ import annotations

from forewarn.agent.checks.common import counter_delta, gpu_finding, live_gpus
from forewarn.agent.state import AgentState
from forewarn.wire import Finding, GpuSample, Health, SuggestedAction

__all__ = ["EccCheck"]


def _uncorrected(s: GpuSample) -> int | None:
    return s.ecc_uncorrected_volatile if s.ecc_uncorrected_volatile is not None else (
        s.ecc_uncorrected_aggregate)


def _corrected(s: GpuSample) -> int | None:
    return s.ecc_corrected_volatile if s.ecc_corrected_volatile is not None else (
        s.ecc_corrected_aggregate)


class EccCheck:
    """Judges every GPU that reports ECC counters.

    Args:
        window_s: window for the correctable rate and for "a new uncorrectable error"
            (default 10 min).
        corrected_threshold: correctable errors within ``window_s`` that make the GPU
            degraded (default 1000 — a heuristic: isolated bursts of tens to hundreds are
            common and benign; a sustained storm is not. Tune per fleet.)
    """

    name = "ecc"

    def __init__(self, window_s: float = 600.0, corrected_threshold: int = 1000) -> None:
        self.window_s = window_s
        self.corrected_threshold = corrected_threshold

    def applies(self, state: AgentState) -> bool:
        return True

    def run(self, state: AgentState, now: float) -> list[Finding]:
        out = []
        for hist, last in live_gpus(state):
            unc = _uncorrected(last)
            cor = _corrected(last)
            if unc is None and cor is None:
                continue  # ECC off or not supported: nothing to judge
            new_unc = counter_delta(hist, _uncorrected, now, self.window_s)
            new_cor = counter_delta(hist, _corrected, now, self.window_s)
            evidence: dict[str, float | int | str | bool | None] = {
                "uncorrected_volatile": last.ecc_uncorrected_volatile,
                "uncorrected_aggregate": last.ecc_uncorrected_aggregate,
                "corrected_volatile": last.ecc_corrected_volatile,
                "corrected_in_window": new_cor[0] if new_cor else None,
                "window_s": self.window_s,
            }
            if new_unc is not None and new_unc[0] > 0:
                out.append(gpu_finding(
                    self.name, state, hist, now, Health.UNHEALTHY,
                    f"{new_unc[0]} new uncorrectable ECC error(s) in the last "
                    f"{new_unc[1]:.0f} s: the running job may have read corrupt memory; "
                    "checkpoint now, then reset the GPU", SuggestedAction.CHECKPOINT, evidence))
            elif last.ecc_uncorrected_volatile:
                out.append(gpu_finding(
                    self.name, state, hist, now, Health.UNHEALTHY,
                    f"{last.ecc_uncorrected_volatile} uncorrectable ECC error(s) since the last "
                    "GPU reset: reset the GPU to clear them and apply pending remaps",
                    SuggestedAction.RESET_GPU, evidence))
            elif new_cor is not None and new_cor[0] >= self.corrected_threshold:
                out.append(gpu_finding(
                    self.name, state, hist, now, Health.DEGRADED,
                    f"{new_cor[0]} correctable ECC errors in {new_cor[1]:.0f} s (threshold "
                    f"{self.corrected_threshold} per {self.window_s:.0f} s): correctable storms "
                    "precede uncorrectable errors: checkpoint while it is cheap",
                    SuggestedAction.CHECKPOINT, evidence))
            else:
                n = new_cor[0] if new_cor else 0
                out.append(gpu_finding(
                    self.name, state, hist, now, Health.HEALTHY,
                    f"no uncorrectable ECC errors; {n} correctable in the window",
                    SuggestedAction.NONE, evidence))
        return out
