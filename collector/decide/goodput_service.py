"""Goodput accounting inside the collector: :class:`~..jobs.goodput.GoodputTracker` fed from the
stored batches and findings, exported as metrics and ``GET /api/v1/goodput``.

What the batches carry is not one record per step but, per rank and batch, a
:class:`~forewarn.wire.RankSummary`: the rank's latest step and its time, its median step
time and its process id. :class:`GoodputService` turns those into the tracker's calls:

* a rank's step moving forward past the job's furthest step is progress: the steps in
  between count with the rank's median step time (capped by the wall time between the
  two observations); a rank lagging behind the job's furthest step says nothing new;
* a rank's step going back, or its process id changing, is a restart: the job resumed
  from the checkpoint the rank reports (``last_checkpoint_step``, else the job's last
  complete checkpoint seen in the reports). The first rank of a job to show a restart
  counts it; the job's other ranks showing the same restart do not count it again;
* ``done`` checkpoint reports add the slowest rank's seconds per order to the checkpoint
  overhead (median step times do not include the save, so useful time is left alone);
* findings that mean the job stopped -- ``rank_hang`` / ``rank_gone`` about one of its
  ranks, ``gpu_lost`` or a fatal ``xid`` (unhealthy) on one of its GPUs -- mark when the
  failure was noticed: detection delay runs from the job's last progress to then, restart
  downtime from then to the first progress after the restart.

Metrics (rendered from the last :meth:`GoodputService.refresh`, every predictor interval):
``forewarn_job_goodput_ratio{training_job}``,
``forewarn_job_lost_seconds_total{training_job,cause}`` (cause
``checkpoint``, ``rework``, ``detection``, ``restart``) and
``forewarn_job_checkpoint_interval_advice_seconds{training_job}``: Daly's interval
(:func:`~..jobs.goodput.advise_interval`) from the job's measured checkpoint cost (the cost
model's tracker, else what the ranks report, else ``checkpoint_default_s``), its GPU count
from the job map, the fleet's per-GPU failure rate (prior updated with the failures the
predictor saw) and the job's current risk (the failure probability P of its highest-scoring
GPU), which can only shorten the interval. A P the predictor does not know (no predictor, a
model without a calibration, none of the job's GPUs scored) is ``risk: null`` in
``GET /api/v1/goodput``, never 0: the interval then comes from the fleet's failure rate
alone, and ``risk_source`` (and the reason the hooks are sent) says P is unknown and why.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from forewarn.wire import AgentBatch, Command, Finding, Health, IntervalAdvice, RankSummary

from ..jobs.goodput import (
    DEFAULT_GPU_MTBF_H,
    DEFAULT_RESTART_S,
    GoodputTracker,
    advise_interval,
    expected_goodput,
    job_mtbf_s,
)
from ..storage.commands import NodeCommand
from .orders import OrderSettings, choose_step

if TYPE_CHECKING:
    from ..jobs.jobview import JobInfo, JobView
    from .costmodel import CheckpointCostTracker

__all__ = ["FAILURE_CHECKS", "AdviceSender", "GoodputService", "JobAdvice"]

FAILURE_CHECKS = frozenset({"rank_hang", "rank_gone", "gpu_lost", "xid"})
"""Unhealthy findings of these checks mean the job on the subject stopped: a hung or dead
rank (the agent's rank checks), a GPU off the bus (NVML_ERROR_GPU_IS_LOST, XID 79), or an
XID the agent rates unhealthy, i.e. the fatal classes of NVIDIA's catalog (docs/reference.md)."""

CAUSES = ("checkpoint", "rework", "detection", "restart")

FORGET_S = 7 * 86400.0
"""Jobs with no report for this long are dropped from the accounting."""


@dataclasses.dataclass(frozen=True)
class JobAdvice:
    """Checkpoint interval advice for one job, with its inputs."""

    interval_s: float
    checkpoint_s: float
    checkpoint_source: str
    gpus: int
    risk: float | None
    """P(the job's highest-scoring GPU fails within ``horizon_s``); None: unknown."""
    risk_gpu: str
    risk_source: str
    """``predictor``, or ``unknown: <why>`` (the interval then weighs the fleet's failure
    rate alone)."""
    gpu_mtbf_h: float
    horizon_s: float
    restart_s: float
    """R: the job's measured mean restart time (detection to progress), else the default."""
    restart_source: str
    expected_goodput: float
    """Share of wall time left for progress at this interval (Daly's model with C, R, M)."""


@dataclasses.dataclass(frozen=True)
class _RankSeen:
    pid: int
    step: int
    time: float


@dataclasses.dataclass(frozen=True)
class _JobRow:
    job: str
    ratio: float
    lost: dict[str, float]
    advice: JobAdvice | None


JobRisk = Callable[["JobInfo"], tuple[float | None, str]]
"""A job's P (None: unknown) and its GPU (``node/gpu``; "": none scored):
:meth:`.risk.RiskScores.job_risk`."""

def _job_risk(info: JobInfo, risk: JobRisk | None) -> tuple[float | None, str, str]:
    """P of ``info``'s highest-scoring GPU, that GPU, and where P came from (or why it
    is unknown)."""
    if risk is None:
        return None, "", "unknown: no failure predictor"
    p, where = risk(info)
    if p is not None:
        return p, where, "predictor"
    why = "the model has no calibration" if where else "none of the job's GPUs was scored"
    return None, where, f"unknown: {why}"


def _ended(r: RankSummary, created: float) -> float:
    """When a finished rank ended: its last beat (the hook's ``finished`` beat), else its
    last step, else when the batch saying so was created."""
    return max((t for t in (r.last_beat, r.last_step_time) if t is not None), default=created)


class GoodputService:
    """See the module docstring. Call from the policy thread; the metrics collector reads
    the snapshot :meth:`refresh` leaves."""

    def __init__(self, *, checkpoint_default_s: float = 60.0,
                 gpu_mtbf_h: float = DEFAULT_GPU_MTBF_H) -> None:
        self.tracker = GoodputTracker()
        self.checkpoint_default_s = checkpoint_default_s
        self.gpu_mtbf_h = gpu_mtbf_h
        self._ranks: dict[tuple[str, int], _RankSeen] = {}
        self._resumed: dict[str, float] = {}
        """Per job: when progress resumed after the last restart counted."""
        self._checkpoint_step: dict[str, int] = {}
        self._rows: tuple[_JobRow, ...] = ()
        self._advice: dict[str, JobAdvice] = {}

    # -- feeding (policy thread) -------------------------------------------------------

    def on_batches(self, batches: Sequence[AgentBatch]) -> None:
        """Rank summaries and checkpoint reports of newly stored batches."""
        for b in batches:
            for c in b.checkpoints:
                if c.phase == "done":
                    if c.seconds is not None and math.isfinite(c.seconds):
                        self.tracker.observe_checkpoint(c.job, c.request_id, c.seconds,
                                                        c.time, in_step_time=False)
                    self._checkpoint_step[c.job] = max(self._checkpoint_step.get(c.job, -1),
                                                       c.step)
            for r in b.ranks:
                self._rank(r, b.created)

    def _rank(self, r: RankSummary, created: float) -> None:
        key = (r.job, r.rank)
        prev = self._ranks.get(key)
        if r.last_step is None or r.last_step_time is None:
            self.tracker.touch(r.job, _ended(r, created) if r.finished else created)
            return
        step, at = r.last_step, r.last_step_time
        self._ranks[key] = _RankSeen(r.pid, step, at)
        restarted = prev is not None and (r.pid != prev.pid or step < prev.step)
        if restarted and prev is not None and self._resumed.get(r.job, -math.inf) >= prev.time:
            restarted = False  # the job's restart was already counted from another rank
        g = self.tracker.jobs.get(r.job)
        if restarted:
            ckpt = r.last_checkpoint_step
            if ckpt is None or ckpt > step:
                ckpt = self._checkpoint_step.get(r.job)
            self.tracker.observe_step(r.job, step, at, r.step_seconds_p50, restarted=True,
                                      resumed_from=ckpt if ckpt is not None and ckpt < step
                                      else None)
            job = self.tracker.jobs[r.job]
            self._resumed[r.job] = job.last_progress
        elif g is None or step > g.last_step:
            self.tracker.observe_step(r.job, step, at, r.step_seconds_p50)
        # A rank that ended cleanly stops its job's wall clock at its end, not at each
        # later report the agent still sends about it (goodput frozen at the end).
        self.tracker.touch(r.job, _ended(r, created) if r.finished else max(created, at))

    def on_findings(self, findings: Sequence[Finding], jobs: JobView) -> None:
        """Findings that mean a job stopped mark when its failure was noticed."""
        for f in findings:
            if f.health != Health.UNHEALTHY or f.check not in FAILURE_CHECKS:
                continue
            s = f.subject
            if s.kind in ("rank", "job"):
                names = [s.job] if s.job else []
            elif s.node:
                names = jobs.jobs_on(s.node, s.gpu if s.kind == "gpu" else None)
            else:
                names = []
            for name in names:
                if name in self.tracker.jobs:
                    self.tracker.observe_failure(name, noticed=f.time)

    # -- snapshot ----------------------------------------------------------------------

    def refresh(
        self,
        now: float,
        jobs: JobView,
        cost: CheckpointCostTracker | None = None,
        risk: JobRisk | None = None,
        gpu_mtbf_h: float | None = None,
        horizon_s: float = 3600.0,
    ) -> None:
        """Recompute interval advice and the metrics snapshot."""
        mtbf = gpu_mtbf_h if gpu_mtbf_h is not None else self.gpu_mtbf_h
        rows = []
        advice: dict[str, JobAdvice] = {}
        for name, g in list(self.tracker.jobs.items()):
            if now - g.last_seen > FORGET_S:
                self._forget(name)
                continue
            info = jobs.job(name)
            a = None
            if info is not None:
                a = self._advise(info, cost, risk, mtbf, horizon_s)
                advice[name] = a
            rows.append(_JobRow(name, g.goodput, g.lost(), a))
        self._advice = advice
        self._rows = tuple(rows)

    @property
    def advice(self) -> dict[str, JobAdvice]:
        """The latest interval advice per job."""
        return dict(self._advice)

    def _advise(self, info: JobInfo, cost: CheckpointCostTracker | None,
                risk: JobRisk | None, mtbf: float,
                horizon_s: float) -> JobAdvice:
        measured = cost.seconds(info.job) if cost is not None else None
        if measured is not None and measured > 0:
            ckpt, source = measured, f"measured({cost.samples(info.job) if cost else 0})"
        elif info.checkpoint_seconds is not None and info.checkpoint_seconds > 0:
            ckpt, source = info.checkpoint_seconds, "ranks"
        else:
            ckpt, source = self.checkpoint_default_s, "default"
        p, where, risk_source = _job_risk(info, risk)
        gpus = info.gpu_count
        g = self.tracker.jobs.get(info.job)
        if g is not None and g.restarts > 0 and g.restart_s > 0:
            restart, restart_source = g.restart_s / g.restarts, f"measured({g.restarts})"
        else:
            restart, restart_source = DEFAULT_RESTART_S, "default"
        # an unknown P adds no hazard to the fleet rate's; risk_source says so
        hazard_p = p if p is not None else 0.0
        interval = advise_interval(ckpt, gpus, gpu_mtbf_h=mtbf, risk=hazard_p,
                                   horizon_s=horizon_s)
        return JobAdvice(
            interval_s=interval, checkpoint_s=ckpt, checkpoint_source=source, gpus=gpus,
            risk=p, risk_gpu=where, risk_source=risk_source, gpu_mtbf_h=mtbf,
            horizon_s=horizon_s, restart_s=restart, restart_source=restart_source,
            expected_goodput=expected_goodput(interval, ckpt, restart,
                                              job_mtbf_s(gpus, mtbf, hazard_p, horizon_s)))

    def _forget(self, job: str) -> None:
        self.tracker.jobs.pop(job, None)
        self._resumed.pop(job, None)
        self._checkpoint_step.pop(job, None)
        for key in [k for k in self._ranks if k[0] == job]:
            del self._ranks[key]

    def report(self) -> list[dict[str, Any]]:
        """Per job: goodput ratio, lost time by cause, restarts, advice (JSON-ready)."""
        out = []
        for name, g in sorted(self.tracker.jobs.items()):
            a = self._advice.get(name)
            out.append({
                "job": name, "ratio": round(g.goodput, 6), "wall_s": round(g.wall_s, 3),
                "useful_s": round(g.useful_s, 3),
                "lost_s": {k: round(v, 3) for k, v in g.lost().items()},
                "unaccounted_s": round(g.unaccounted_s, 3), "restarts": g.restarts,
                "high_water_step": g.high_water_step, "last_step": g.last_step,
                "failure_pending": g.failure_noticed is not None,
                "advice": dataclasses.asdict(a) if a is not None else None,
            })
        return out

    # -- API and metrics ---------------------------------------------------------------

    def report_for(self, job: str | None) -> list[dict[str, Any]]:
        """:meth:`report`, of one job only unless ``job`` is ``None``."""
        return [row for row in self.report() if job is None or row["job"] == job]

    def register(self, registry: CollectorRegistry) -> None:
        """Add the goodput metrics to ``registry``."""
        registry.register(_GoodputMetrics(self))


class _GoodputMetrics:
    def __init__(self, svc: GoodputService) -> None:
        self.svc = svc

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        rows = self.svc._rows
        ratio = GaugeMetricFamily("forewarn_job_goodput_ratio",
                                  "Share of the job's wall time spent on new progress.",
                                  labels=["training_job"])
        lost = CounterMetricFamily("forewarn_job_lost_seconds",
                                   "Job wall time lost, by cause (checkpoint overhead, work "
                                   "redone, detection delay, restart downtime).",
                                   labels=["training_job", "cause"])
        advice = GaugeMetricFamily("forewarn_job_checkpoint_interval_advice_seconds",
                                   "Checkpoint interval advised for the job (Daly's optimum), "
                                   "adjusted by risk.",
                                   labels=["training_job"])
        for row in rows:
            ratio.add_metric([row.job], row.ratio)
            for cause in CAUSES:
                lost.add_metric([row.job, cause], row.lost[cause])
            if row.advice is not None:
                advice.add_metric([row.job], row.advice.interval_s)
        yield ratio
        yield lost
        yield advice


ADVICE_MIN_GAP_S = 300.0
"""Advice for a job is sent to its agents at most this often ..."""
ADVICE_CHANGE = 0.2
"""... and only when the advised step count moved by more than this share."""


class AdviceSender:
    """Turns a job's interval advice into :class:`~forewarn.wire.IntervalAdvice` commands
    for every node of the job, so hooks with ``follow_advice`` save at the advised steps.

    The interval becomes a step count from the job's median step time, and ``from_step`` is
    chosen as a checkpoint order's step is (ahead of the fastest rank), so every rank counts
    the same steps."""

    def __init__(self, settings: OrderSettings) -> None:
        self.settings = settings
        self._sent: dict[str, tuple[int, float]] = {}  # job -> (every_steps, when)

    def due(self, advice: Mapping[str, JobAdvice], jobs: JobView, now: float
            ) -> list[NodeCommand]:
        """The commands of the advice due now: new, or changed enough and not sent for
        :data:`ADVICE_MIN_GAP_S`. Nothing counts as sent until :meth:`sent` says so (a
        refused write queues nothing: the advice stays due)."""
        out: list[NodeCommand] = []
        for name, a in advice.items():
            info = jobs.job(name)
            if info is None or not info.step_seconds_p50 or not info.nodes:
                continue
            every = max(1, round(a.interval_s / info.step_seconds_p50))
            last = self._sent.get(name)
            if last is not None and (now - last[1] < ADVICE_MIN_GAP_S
                                     or abs(every - last[0]) <= ADVICE_CHANGE * last[0]):
                continue
            start, _ = choose_step(info, now, self.settings)
            msg = IntervalAdvice(
                job=name, every_steps=every, from_step=start, interval_s=a.interval_s,
                reason=(f"Daly: checkpoint {a.checkpoint_s:.1f} s ({a.checkpoint_source}), "
                        f"{a.gpus} GPUs, per-GPU MTBF {a.gpu_mtbf_h:.0f} h, {_risk_text(a)}, "
                        f"expected goodput {a.expected_goodput:.1%}"),
                issued=now)
            rid = f"adv-{uuid.uuid4().hex[:12]}"
            for node in info.nodes:
                out.append(NodeCommand(node=node, command=Command(
                    id=f"{rid}@{node}", kind="advice", advice=msg, issued=now)))
        return out

    def sent(self, queued: Sequence[NodeCommand]) -> None:
        """The advice of ``queued`` (commands of :meth:`due`) was queued: held back from
        now on."""
        for item in queued:
            msg = item.command.advice
            if msg is not None:
                self._sent[msg.job] = (msg.every_steps, msg.issued)


def _risk_text(a: JobAdvice) -> str:
    """The advice's risk as its reason says it: ``risk 0.42``, or ``P unknown: <why>``."""
    if a.risk is not None:
        return f"risk {a.risk:.2f}"
    return f"P {a.risk_source} (fleet failure rate alone)"
