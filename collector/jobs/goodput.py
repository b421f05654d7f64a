"""Goodput accounting per job, and checkpoint interval advice.

Effective training time is wall time spent on steps that move the job past the furthest step
it ever reached. The rest is lost, and broken down:

* ``checkpoint``: time the ranks stalled saving (CheckpointReport durations; per order, the
  slowest rank, since the others wait for it at the next collective);
* ``rework``: steps computed again after a restart rolled the job back to a checkpoint;
* ``detection``: from the job's last progress before a failure until something noticed it
  (a forewarn hang/gone finding, or the restart itself when nothing did — NCCL's timeout);
* ``restart``: from detection until the job made progress again.

Progress may come step by step (``step_seconds`` per step) or as summaries (the latest step
of a rank every few seconds, with its median step time): steps between two observations
count with the step time given, capped by the wall time between the observations; a
rollback (the step going back, or ``restarted=True`` when the caller saw the process
change) resumes from ``resumed_from`` (the checkpoint step) when known. Time the step
times do not explain (stalls nobody reported, step-time spread) stays in neither bucket:
``wall_s - useful_s - sum(lost())`` (:meth:`JobGoodput.unaccounted_s`).

Interval advice follows Daly's higher-order estimate (J. T. Daly, "A higher order estimate of
the optimum checkpoint interval for restart dumps", FGCS 22(3), 2006), which refines Young's
first-order ``T = sqrt(2·C·M)`` where the checkpoint cost C is not small against the job's
mean time between failures M: the job's measured checkpoint cost C, and M the fleet's
observed per-GPU failure rate scaled to the job's GPU count, shortened while the job is at
risk. :func:`expected_goodput` is Daly's model of the share of wall time left for progress at
an interval, with the job's restart time R (docs/reference.md, "Checkpointing").
"""

from __future__ import annotations

import dataclasses
import math

__all__ = [
    "GoodputTracker",
    "JobGoodput",
    "advise_interval",
    "daly_interval",
    "expected_goodput",
    "job_mtbf_s",
]

DEFAULT_RESTART_S = 600.0
"""Restart time R (rescheduling, process start, checkpoint load) before a job's first measured
restart."""

DEFAULT_GPU_MTBF_H = 24.0 * 1000.0 / 6.5 * 8
"""Per-GPU mean time between failures before the fleet has history: 6.5 failures per 1,000
node-days of 8 GPUs (Meta, HPCA 2025), i.e. about 29,500 GPU-hours."""


@dataclasses.dataclass
class JobGoodput:
    """Running totals of one job, in seconds."""

    job: str
    first_seen: float
    last_seen: float
    useful_s: float = 0.0
    checkpoint_s: float = 0.0
    rework_s: float = 0.0
    detection_s: float = 0.0
    restart_s: float = 0.0
    restarts: int = 0
    high_water_step: int = -1
    last_step: int = -1
    last_progress: float = 0.0
    failure_noticed: float | None = None
    _checkpoints: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def wall_s(self) -> float:
        return max(0.0, self.last_seen - self.first_seen)

    @property
    def goodput(self) -> float:
        """Effective training time ratio in [0, 1] (1.0 before there is any wall time)."""
        wall = self.wall_s
        return min(1.0, self.useful_s / wall) if wall > 0 else 1.0

    @property
    def unaccounted_s(self) -> float:
        """Wall time neither useful nor in a loss bucket (unreported stalls, step-time
        spread around the median of summaries); never negative."""
        return max(0.0, self.wall_s - self.useful_s - sum(self.lost().values()))

    def lost(self) -> dict[str, float]:
        return {
            "checkpoint": self.checkpoint_s,
            "rework": self.rework_s,
            "detection": self.detection_s,
            "restart": self.restart_s,
        }


class GoodputTracker:
    """Feeds on the job's step progress, checkpoint reports and failure findings.

    Steps may arrive from many ranks; only the job's furthest step counts, so calls with the
    same step from several ranks are harmless.
    """

    def __init__(self) -> None:
        self.jobs: dict[str, JobGoodput] = {}

    def _job(self, job: str, now: float) -> JobGoodput:
        g = self.jobs.get(job)
        if g is None:
            g = self.jobs[job] = JobGoodput(job=job, first_seen=now, last_seen=now,
                                            last_progress=now)
        g.last_seen = max(g.last_seen, now)
        return g

    def observe_step(self, job: str, step: int, time: float, step_seconds: float | None,
                     *, restarted: bool = False, resumed_from: int | None = None) -> None:
        """A rank of ``job`` finished ``step`` at ``time``, each step since the previous
        observation taking ``step_seconds``.

        ``restarted``: the caller knows the job restarted before this step (a new process,
        a rank's own step going back) even if ``step`` is past the job's last step;
        ``resumed_from``: the checkpoint step it restarted from, when known (else the
        restart is placed one step before ``step``).
        """
        g = self._job(job, time)
        if g.last_step < 0:  # first sight: what ran before we watched is not ours to judge
            g.last_step = g.high_water_step = step
            g.last_progress = time
            return
        secs = step_seconds if step_seconds is not None and math.isfinite(step_seconds) else 0.0
        secs = max(0.0, secs)
        if restarted or step < g.last_step:  # rolled back: restarted from a checkpoint
            base = resumed_from if resumed_from is not None and resumed_from < step else step - 1
            self._close_outage(g, max(g.last_progress, time - (step - base) * secs),
                               restart=True)
            g.last_step = base
        elif step == g.last_step:
            return  # another rank of the same step
        done = step - g.last_step
        if g.failure_noticed is not None:  # progress again without a rollback
            self._close_outage(g, max(g.last_progress, time - done * secs), restart=False)
        if time > g.last_progress:  # steps cannot have taken longer than the wall time
            secs = min(secs, (time - g.last_progress) / done)
        new = min(done, max(0, step - g.high_water_step))
        g.useful_s += new * secs
        g.rework_s += (done - new) * secs
        g.high_water_step = max(g.high_water_step, step)
        g.last_step = step
        g.last_progress = max(g.last_progress, time)

    def _close_outage(self, g: JobGoodput, now: float, *, restart: bool) -> None:
        noticed = g.failure_noticed if g.failure_noticed is not None else now
        noticed = min(max(noticed, g.last_progress), now)
        g.detection_s += noticed - g.last_progress
        g.restart_s += now - noticed
        g.restarts += int(restart)
        g.failure_noticed = None
        g.last_progress = max(g.last_progress, now)

    def observe_failure(self, job: str, noticed: float) -> None:
        """Something noticed the job failing (hang, dead rank, fatal GPU error)."""
        g = self._job(job, noticed)
        if g.failure_noticed is None:
            g.failure_noticed = noticed

    def observe_checkpoint(self, job: str, request_id: str, seconds: float, now: float,
                           *, in_step_time: bool = True) -> None:
        """A rank reported a finished checkpoint; the slowest rank of an order counts.

        ``in_step_time``: the step durations given to :meth:`observe_step` include the save
        (per-step reports), so it is taken out of useful time; summaries carrying a median
        step time do not include it (pass ``False``).
        """
        g = self._job(job, now)
        key = request_id or f"t{now:.0f}"
        prev = g._checkpoints.get(key, 0.0)
        if seconds > prev:
            g.checkpoint_s += seconds - prev
            g._checkpoints[key] = seconds
            if len(g._checkpoints) > 256:
                g._checkpoints.pop(next(iter(g._checkpoints)))
            if in_step_time:
                # The stall is wall time the step clock also saw: take it out of useful time.
                g.useful_s = max(0.0, g.useful_s - (seconds - prev))

    def touch(self, job: str, now: float) -> None:
        """Advance the job's wall clock (a report without progress)."""
        self._job(job, now)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's optimum of compute time between checkpoints for checkpoint cost ``checkpoint_s``
    (δ) and mean time between failures ``mtbf_s`` (M)::

        τ = sqrt(2δM) · (1 + (1/3)·sqrt(δ/2M) + (1/9)·(δ/2M)) − δ   for δ < 2M
        τ = M                                                      otherwise

    Young's ``sqrt(2δM)`` is its first term; the correction matters when δ/M is not small
    (large jobs, slow storage): at δ = 10 min and M = 2 h Young's interval is 15 % longer
    than the optimum of Daly's exact model (:func:`expected_goodput`), Daly's within 0.1 %.
    """
    if checkpoint_s <= 0 or mtbf_s <= 0:
        raise ValueError("checkpoint_s and mtbf_s must be positive")
    if checkpoint_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = checkpoint_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * checkpoint_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) \
        - checkpoint_s


def expected_goodput(interval_s: float, checkpoint_s: float, restart_s: float,
                     mtbf_s: float) -> float:
    """Share of wall time that makes progress when checkpointing every ``interval_s`` of
    compute, in Daly's model (exponential failures, a failure during a checkpoint or a
    restart counts too): wall time per unit of work is ``M·e^(R/M)·(e^((τ+δ)/M) − 1)/τ``."""
    if interval_s <= 0 or mtbf_s <= 0:
        raise ValueError("interval_s and mtbf_s must be positive")
    m = mtbf_s
    wall = m * math.exp(restart_s / m) * math.expm1((interval_s + checkpoint_s) / m)
    return interval_s / wall


def job_mtbf_s(gpus: int, gpu_mtbf_h: float = DEFAULT_GPU_MTBF_H, risk: float = 0.0,
               horizon_s: float = 3600.0) -> float:
    """A job's mean time between failures: ``gpus`` GPUs failing independently at one per
    ``gpu_mtbf_h`` each, or sooner while the predictor's ``risk`` (P(failure within
    ``horizon_s``)) implies a higher hazard ``-ln(1-risk)/horizon``."""
    if gpus <= 0 or gpu_mtbf_h <= 0:
        raise ValueError("gpus and gpu_mtbf_h must be positive")
    base_rate = gpus / (gpu_mtbf_h * 3600.0)
    risk = min(max(risk, 0.0), 0.999999)
    risk_rate = -math.log1p(-risk) / horizon_s if risk > 0 else 0.0
    return 1.0 / max(base_rate, risk_rate)


def advise_interval(
    checkpoint_s: float,
    gpus: int,
    gpu_mtbf_h: float = DEFAULT_GPU_MTBF_H,
    risk: float = 0.0,
    horizon_s: float = 3600.0,
) -> float:
    """Seconds of training between checkpoints for a job of ``gpus`` GPUs: Daly's optimum
    (:func:`daly_interval`) for the job's MTBF (:func:`job_mtbf_s`), so a job at risk
    checkpoints more often."""
    if checkpoint_s <= 0:
        raise ValueError("checkpoint_s and gpus must be positive")
    return daly_interval(checkpoint_s, job_mtbf_s(gpus, gpu_mtbf_h, risk, horizon_s))
