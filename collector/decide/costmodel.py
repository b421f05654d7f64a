"""Cost-aware checkpoint decisions: checkpoint when the work expected to be lost is worth more
than the checkpoint costs.

    expected loss (GPU-s) = P(failure within horizon) x work since last checkpoint (s) x GPUs
    checkpoint cost (GPU-s) = measured checkpoint seconds x GPUs

and act when ``expected loss > cost``. This is the one-shot form of the trade-off behind
Young's interval T = sqrt(2 C M) (docs/reference.md, "Checkpointing"): with a failure expected
soon, every second of unsaved work is worth P x GPUs, and one checkpoint costs C x GPUs.
Precision alone misleads (the SC20 DRAM study in docs/reference.md cut lost compute 57% by being
cost-aware), so the inputs of every decision are kept in :class:`CostDecision`.

``P`` comes from :attr:`Finding.probability` when a predictor set it. Otherwise it comes
from :data:`CHECK_PROBABILITY` (per check), else :data:`HEALTH_PROBABILITY` (per health).
Those are priors, not measurements; where they come from:

* ``unhealthy`` 0.5: an unhealthy finding means a fault is present now. Llama 3 lost a job
  to hardware about every 3 h on 16k GPUs with ~78% of interruptions hardware (docs/reference.md);
  many faults (e.g. contained ECC errors, 92% absorbed by row remapping on H100 per NCSA
  Delta) do not kill the job, so an even prior within the hour is a middle ground.
* ``degraded`` 0.05: trends and soft signals (correctable-ECC rate, PCIe replays, thermal
  drift) precede failures (SC20 DRAM analog) but most degraded GPUs keep running for days.
* ``unknown`` 0.01 and ``healthy`` 0.0.
* Per check (the agent's check names, unhealthy findings only): ``gpu_lost`` (XID 79
  "fallen off the bus", NVML_ERROR_GPU_IS_LOST) takes the job down almost surely, 0.95;
  ``xid`` is unhealthy only for the fatal classes of NVIDIA's catalog (48 DBE, 64 remap
  failure, 74 NVLink, 79, 95 uncontained ECC, 119/120 GSP; docs/reference.md "XID classes"),
  0.9; ``ecc`` unhealthy means new uncorrectable errors the job may have read, 0.8 (lower
  than XID 48 itself: NCSA Delta saw H100 row remapping and containment absorb 92% of
  uncorrectable errors); a hung or gone rank stops the job at the NCCL timeout (10 min
  PyTorch default, docs/reference.md "Detection"), 0.9; NaN/Inf loss ruins the run from that
  step on, 0.8 (a checkpoint *before* it is the useful one, so the agent's fast path
  handles it; this value matters for the collector's view only).

Operators override any of these with the ``policy_probability`` config table.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Mapping
from typing import Any

from forewarn.wire import CheckpointReport, Finding, Health

from ..jobs.jobview import JobInfo

__all__ = [
    "CHECK_PROBABILITY",
    "DEFAULT_CHECKPOINT_S",
    "DEFAULT_HORIZON_S",
    "DEGRADED_CHECK_PROBABILITY",
    "HEALTH_PROBABILITY",
    "CheckpointCostTracker",
    "CostDecision",
    "decide_checkpoint",
    "failure_probability",
]

DEFAULT_CHECKPOINT_S = 60.0
"""Checkpoint seconds assumed before any checkpoint of the job was measured: a few-minute
synchronous save is common for large models; 60 s errs towards checkpointing."""

DEFAULT_HORIZON_S = 3600.0
"""Horizon of the table priors: P(failure within the next hour)."""

HEALTH_PROBABILITY: Mapping[str, float] = {
    Health.UNHEALTHY.value: 0.5,
    Health.DEGRADED.value: 0.05,
    Health.UNKNOWN.value: 0.01,
    Health.HEALTHY.value: 0.0,
}
"""P(failure within :data:`DEFAULT_HORIZON_S`) by health when nothing better is known."""

CHECK_PROBABILITY: Mapping[str, float] = {
    "gpu_lost": 0.95,
    "xid": 0.9,
    "ecc": 0.8,
    "rank_hang": 0.9,
    "rank_gone": 0.9,
    "nan_loss": 0.8,
}
"""P(failure within :data:`DEFAULT_HORIZON_S`) per check name, for unhealthy findings."""

DEGRADED_CHECK_PROBABILITY: Mapping[str, float] = {
    "ecc": 0.3,
    "xid": 0.3,
    "remap": 0.2,
    "pcie": 0.2,
    "nvlink": 0.2,
}
"""P(failure within the horizon) for degraded findings of checks whose degraded state is a
known precursor: a correctable-ECC storm or XID 92 before a double-bit error (docs/reference.md,
the SC20 DRAM analog: correctable errors predict uncorrectable ones), pending remaps before
a remap failure, PCIe replay growth before XID 79, NVLink CRC growth before XID 74. These
priors are heuristics, not published rates: tune them per fleet with ``policy_probability``
or let the trained predictor (``Finding.probability``) speak."""

_MEASURED_KEEP = 20


def failure_probability(
    finding: Finding, overrides: Mapping[str, float] | None = None
) -> tuple[float, str]:
    """P(failure within the horizon) for ``finding`` and where it came from.

    Order: the finding's own ``probability`` (a predictor), ``overrides`` by check name
    (config), :data:`CHECK_PROBABILITY` (unhealthy findings),
    :data:`DEGRADED_CHECK_PROBABILITY` (degraded precursors), then
    :data:`HEALTH_PROBABILITY`.
    """
    if finding.probability is not None:
        return finding.probability, "finding"
    if overrides and finding.check in overrides:
        return float(overrides[finding.check]), "config"
    if finding.health == Health.UNHEALTHY and finding.check in CHECK_PROBABILITY:
        return CHECK_PROBABILITY[finding.check], "check-table"
    if finding.health == Health.DEGRADED and finding.check in DEGRADED_CHECK_PROBABILITY:
        return DEGRADED_CHECK_PROBABILITY[finding.check], "check-table"
    return HEALTH_PROBABILITY.get(finding.health.value, 0.0), "health-table"


class CheckpointCostTracker:
    """Measured checkpoint seconds per job, from ``done`` :class:`CheckpointReport`\\ s.

    A job's checkpoint takes as long as its slowest rank, so the cost of one checkpoint
    (one request id) is the longest rank duration; the job's cost is the median of its
    last 20 checkpoints.
    """

    def __init__(self, default_s: float = DEFAULT_CHECKPOINT_S) -> None:
        self.default_s = default_s
        self._per_request: dict[tuple[str, str], float] = {}
        self._done: dict[str, collections.deque[tuple[str, float]]] = {}
        self._last_done: dict[str, float] = {}

    def observe(self, report: CheckpointReport) -> None:
        """Take one rank's report into account (non-``done`` phases are ignored)."""
        if report.phase != "done" or report.seconds is None:
            return
        key = (report.job, report.request_id or f"step-{report.step}")
        slowest = max(self._per_request.get(key, 0.0), report.seconds)
        self._per_request[key] = slowest
        done = self._done.setdefault(report.job, collections.deque(maxlen=_MEASURED_KEEP))
        for i, (rid, _) in enumerate(done):
            if rid == key[1]:
                done[i] = (rid, slowest)
                break
        else:
            done.append((key[1], slowest))
            if len(self._per_request) > 64 * _MEASURED_KEEP:
                self._per_request.pop(next(iter(self._per_request)))
        self._last_done[report.job] = max(self._last_done.get(report.job, 0.0), report.time)

    def seconds(self, job: str) -> float | None:
        """Median measured checkpoint seconds of ``job``, or ``None`` when not measured."""
        done = self._done.get(job)
        if not done:
            return None
        return float(statistics.median(s for _, s in done))

    def samples(self, job: str) -> int:
        """How many checkpoints of ``job`` were measured."""
        return len(self._done.get(job, ()))

    def last_done(self, job: str) -> float | None:
        """Newest time a rank of ``job`` reported a finished checkpoint."""
        return self._last_done.get(job)


@dataclasses.dataclass(frozen=True)
class CostDecision:
    """The checkpoint trade-off for one job and one finding, with every input."""

    act: bool
    probability: float
    probability_source: str
    horizon_s: float
    work_s: float
    work_origin: str
    gpus: int
    checkpoint_s: float
    checkpoint_source: str
    expected_loss_gpu_s: float
    cost_gpu_s: float

    def inputs(self) -> dict[str, Any]:
        """The decision's inputs and result as a flat JSON-ready dict."""
        return dataclasses.asdict(self)


def decide_checkpoint(
    finding: Finding,
    job: JobInfo,
    now: float,
    tracker: CheckpointCostTracker,
    overrides: Mapping[str, float] | None = None,
) -> CostDecision:
    """Weigh expected GPU-seconds lost against the job's checkpoint cost.

    Work at risk runs from the job's last complete checkpoint (the ranks' reports or the
    tracker, whichever is newer), else from when the collector first saw the job.
    """
    p, p_source = failure_probability(finding, overrides)
    horizon = finding.horizon_s if finding.horizon_s is not None else DEFAULT_HORIZON_S
    candidates = ((job.last_checkpoint_time, "ranks"), (tracker.last_done(job.job), "reports"))
    origins = [(t, name) for t, name in candidates if t is not None]
    if origins:
        since, origin = max(origins)
    else:
        since, origin = job.first_seen, "first-seen"
    work = max(0.0, now - since)
    measured = tracker.seconds(job.job)
    if measured is not None:
        ckpt, ckpt_source = measured, f"measured({tracker.samples(job.job)})"
    elif job.checkpoint_seconds is not None:
        ckpt, ckpt_source = job.checkpoint_seconds, "ranks"
    else:
        ckpt, ckpt_source = tracker.default_s, "default"
    gpus = job.gpu_count
    loss = p * work * gpus
    cost = ckpt * gpus
    return CostDecision(
        act=loss > cost,
        probability=p,
        probability_source=p_source,
        horizon_s=horizon,
        work_s=work,
        work_origin=origin,
        gpus=gpus,
        checkpoint_s=ckpt,
        checkpoint_source=ckpt_source,
        expected_loss_gpu_s=loss,
        cost_gpu_s=cost,
    )
