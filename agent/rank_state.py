"""One training rank as the agent knows it: :class:`RankState` (mutable, only the rank
table touches it, under its lock) and :class:`RankView` (its immutable copy, for checks,
orders and metrics); with the helpers every rank check uses (:func:`quantile`,
:func:`by_job`, :func:`rank_finding`).

How a step record, a beat and a checkpoint report change a rank: :meth:`RankState.apply_step`
(step times, NaN/Inf, grad-norm spikes against the rolling median),
:meth:`RankState.apply_beat` (phase, preemption notice, beat interval and delivery time)
and :meth:`RankState.apply_report`. Which records are believed at all is the table's
business (:mod:`forewarn.agent.ranks`).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

from forewarn.wire import (
    Beat,
    CheckpointReport,
    Evidence,
    Finding,
    Health,
    StepRecord,
    Subject,
    SuggestedAction,
)

__all__ = ["RankState", "RankView", "by_job", "quantile", "rank_finding"]


def quantile(values: Iterable[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank, 0..1) of ``values``; ``None`` when empty."""
    return _nearest_rank(sorted(values), q)


def _nearest_rank(data: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of ``data``, already sorted; ``None`` when empty."""
    if not data:
        return None
    return data[min(len(data) - 1, max(0, math.ceil(q * len(data)) - 1))]


@dataclasses.dataclass
class RankState:
    """Mutable state of one rank; only :class:`RankTable` touches it (under its lock)."""

    job: str
    rank: int
    local_rank: int
    world_size: int
    host: str
    pid: int
    """The pid the rank reports (its own namespace)."""
    os_pid: int
    """The kernel-verified pid in the agent's namespace: the one that may be signalled."""
    uid: int
    start_time: int | None
    first_seen: float
    last_msg: float
    history: int = 256
    last_step: int | None = None
    last_step_wall: float | None = None
    """``time`` of the last step record (the rank's clock)."""
    last_progress: float | None = None
    """When ``last_step`` last changed: the record's own time if it arrived promptly (the
    rank runs on this host's clock), else the arrival time. The hang timer starts here."""
    step_seconds: collections.deque[float] = dataclasses.field(default_factory=collections.deque)
    compute_seconds: collections.deque[float] = dataclasses.field(
        default_factory=collections.deque
    )
    loss: float | None = None
    grad_norm: float | None = None
    grad_norms: collections.deque[float] = dataclasses.field(default_factory=collections.deque)
    grad_norms_sorted: list[float] = dataclasses.field(default_factory=list)
    """The same window kept sorted (bisect), so the median costs no sort per step."""
    last_beat: float | None = None
    beat_interval_s: float | None = None
    beat_latency: collections.deque[float] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=8))
    """Seconds from the hook making each recent beat to its arrival here (same host clock):
    the measured one-way delivery of a datagram between the rank and the agent."""
    reply_to: str = ""
    hook_dropped: int = 0
    nonfinite_loss_step: int | None = None
    """First step of the current run of NaN/Inf losses (None once finite again)."""
    nonfinite_grad_step: int | None = None
    nonfinite_grad_streak: int = 0
    spike_step: int | None = None
    spike_value: float | None = None
    spike_median: float | None = None
    checkpointing: str | None = None
    checkpoint_started: float | None = None
    last_checkpoint_step: int | None = None
    last_checkpoint_time: float | None = None
    checkpoint_seconds: float | None = None
    checkpoint_bytes: int | None = None
    phase: str = ""
    phase_started: float | None = None
    phase_longest: dict[str, float] = dataclasses.field(default_factory=dict)
    preempted: bool = False
    finished: bool = False
    restarts: int = 0
    steps_total: int = 0
    beats_total: int = 0
    step_seconds_sum: float = 0.0
    step_seconds_count: int = 0

    def _push(self, dq: collections.deque[float], value: float) -> None:
        dq.append(value)
        while len(dq) > self.history:
            dq.popleft()

    def apply_step(self, rec: StepRecord, now: float, spike_factor: float) -> None:
        self.last_msg = now
        self.steps_total += 1
        prev_step, prev_wall = self.last_step, self.last_step_wall
        seconds = rec.step_seconds
        if (seconds is None and prev_step is not None and prev_wall is not None
                and rec.step > prev_step):
            seconds = max(0.0, (rec.time - prev_wall) / (rec.step - prev_step))
        if seconds is not None:
            self._push(self.step_seconds, seconds)
            self.step_seconds_sum += seconds
            self.step_seconds_count += 1
        compute = rec.extras.get("compute_seconds")
        if compute is not None and math.isfinite(compute) and compute >= 0:
            self._push(self.compute_seconds, compute)
        if prev_step is None or rec.step != prev_step:
            # progress dates from the step itself (same host clock), not from its arrival
            # (the hook batches reports for up to 10 ms): the hang timer starts on time
            self.last_progress = rec.time if 0.0 <= now - rec.time < 5.0 else now
        self.last_step, self.last_step_wall = rec.step, rec.time
        if rec.loss is not None:
            self.loss = rec.loss
            if math.isfinite(rec.loss):
                self.nonfinite_loss_step = None
            elif self.nonfinite_loss_step is None:
                self.nonfinite_loss_step = rec.step
        if rec.grad_norm is not None:
            g = rec.grad_norm
            self.grad_norm = g
            if not math.isfinite(g):
                self.nonfinite_grad_streak += 1
                if self.nonfinite_grad_step is None:
                    self.nonfinite_grad_step = rec.step
                return
            self.nonfinite_grad_step, self.nonfinite_grad_streak = None, 0
            median = self.grad_median() if len(self.grad_norms) >= 8 else None
            if median is not None and median > 0 and g > spike_factor * median:
                self.spike_step, self.spike_value, self.spike_median = rec.step, g, median
                # a spike is not added to the baseline: it would drag the median up
                return
            self.grad_norms.append(g)
            bisect.insort(self.grad_norms_sorted, g)
            while len(self.grad_norms) > self.history:
                old = self.grad_norms.popleft()
                del self.grad_norms_sorted[bisect.bisect_left(self.grad_norms_sorted, old)]

    def grad_median(self) -> float | None:
        """Median (nearest rank, as :func:`quantile`) of the grad-norm window."""
        return _nearest_rank(self.grad_norms_sorted, 0.5)

    def apply_beat(self, beat: Beat, now: float, min_interval: float,
                   reply_ok: Callable[[str], bool]) -> bool:
        """Apply a beat; True when it is this process's first preemption notice."""
        self.last_msg = now
        noticed = beat.preempted and not self.preempted
        self.preempted = self.preempted or beat.preempted
        self.finished = beat.finished
        self.phase, self.phase_started = beat.phase, beat.phase_started
        self.phase_longest = dict(beat.phase_longest)
        self.beats_total += 1
        if self.last_beat is not None:
            gap = max(min_interval, now - self.last_beat)
            # EWMA of beat gaps: follows the hook's real interval, ignores one late beat.
            # A gap under half the interval is an early beat (a phase began, a preemption
            # notice), not the interval: counting it would shrink the gone timeout.
            if self.beat_interval_s is None:
                self.beat_interval_s = gap
            elif gap >= 0.5 * self.beat_interval_s:
                self.beat_interval_s = 0.8 * self.beat_interval_s + 0.2 * gap
        self.last_beat = now
        if 0.0 <= now - beat.time < 1.0:  # a late or skewed one says nothing of the socket
            self.beat_latency.append(now - beat.time)
        if beat.reply_to and beat.reply_to != self.reply_to and reply_ok(beat.reply_to):
            self.reply_to = beat.reply_to
        self.hook_dropped = beat.dropped
        last = beat.last_step
        if last is not None and (self.last_step is None or last > self.last_step):
            # the beat thread saw a step whose record was lost: that is progress too
            self.last_step, self.last_progress = last, now
        return noticed

    def apply_report(self, rep: CheckpointReport, now: float) -> None:
        self.last_msg = now
        if rep.phase == "started":
            self.checkpointing, self.checkpoint_started = rep.request_id or "local", now
            return
        self.checkpointing = None
        if rep.phase == "done":
            self.last_checkpoint_step, self.last_checkpoint_time = rep.step, rep.time
            self.checkpoint_seconds, self.checkpoint_bytes = rep.seconds, rep.bytes
            self.last_progress = now  # the save itself was the stall

    def view(self) -> RankView:
        return RankView(
            job=self.job, rank=self.rank, local_rank=self.local_rank,
            world_size=self.world_size, host=self.host, pid=self.pid, os_pid=self.os_pid,
            uid=self.uid, start_time=self.start_time, first_seen=self.first_seen,
            last_msg=self.last_msg, last_step=self.last_step, last_step_wall=self.last_step_wall,
            last_progress=self.last_progress, step_seconds=tuple(self.step_seconds),
            compute_seconds=tuple(self.compute_seconds), loss=self.loss,
            grad_norm=self.grad_norm, grad_norm_median=self.grad_median(),
            grad_norm_samples=len(self.grad_norms), last_beat=self.last_beat,
            beat_interval_s=self.beat_interval_s,
            delivery_s=max(self.beat_latency, default=None), reply_to=self.reply_to,
            hook_dropped=self.hook_dropped, nonfinite_loss_step=self.nonfinite_loss_step,
            nonfinite_grad_step=self.nonfinite_grad_step,
            nonfinite_grad_streak=self.nonfinite_grad_streak, spike_step=self.spike_step,
            spike_value=self.spike_value, spike_median=self.spike_median,
            checkpointing=self.checkpointing, checkpoint_started=self.checkpoint_started,
            last_checkpoint_step=self.last_checkpoint_step,
            last_checkpoint_time=self.last_checkpoint_time,
            checkpoint_seconds=self.checkpoint_seconds, checkpoint_bytes=self.checkpoint_bytes,
            phase=self.phase, phase_started=self.phase_started,
            phase_longest=tuple(sorted(self.phase_longest.items())),
            preempted=self.preempted, finished=self.finished, restarts=self.restarts,
            steps_total=self.steps_total, beats_total=self.beats_total,
            step_seconds_sum=self.step_seconds_sum, step_seconds_count=self.step_seconds_count,
        )


@dataclasses.dataclass(frozen=True)
class RankView:
    """An immutable copy of one rank's state, for checks, orders and metrics."""

    job: str
    rank: int
    local_rank: int
    world_size: int
    host: str
    pid: int
    os_pid: int
    uid: int
    start_time: int | None
    first_seen: float
    last_msg: float
    last_step: int | None
    last_step_wall: float | None
    last_progress: float | None
    step_seconds: tuple[float, ...]
    compute_seconds: tuple[float, ...]
    loss: float | None
    grad_norm: float | None
    grad_norm_median: float | None
    grad_norm_samples: int
    last_beat: float | None
    beat_interval_s: float | None
    delivery_s: float | None
    """The slowest of the rank's recent beats from the hook to here (None: none measured)."""
    reply_to: str
    hook_dropped: int
    nonfinite_loss_step: int | None
    nonfinite_grad_step: int | None
    nonfinite_grad_streak: int
    spike_step: int | None
    spike_value: float | None
    spike_median: float | None
    checkpointing: str | None
    checkpoint_started: float | None
    last_checkpoint_step: int | None
    last_checkpoint_time: float | None
    checkpoint_seconds: float | None
    checkpoint_bytes: int | None
    phase: str
    phase_started: float | None
    phase_longest: tuple[tuple[str, float], ...]
    preempted: bool
    finished: bool
    restarts: int
    steps_total: int
    beats_total: int
    step_seconds_sum: float
    step_seconds_count: int

    @property
    def key(self) -> tuple[str, int]:
        return (self.job, self.rank)

    def step_p50(self) -> float | None:
        return quantile(self.step_seconds, 0.5)

    def step_p99(self) -> float | None:
        return quantile(self.step_seconds, 0.99)


def rank_finding(
    check: str,
    view: RankView,
    node: str,
    now: float,
    health: Health,
    reason: str,
    action: SuggestedAction = SuggestedAction.NONE,
    evidence: Mapping[str, float | int | str | bool | None] | None = None,
) -> Finding:
    """A finding about one rank of a job on this node (``gpu`` = its local rank's GPU)."""
    ev: Evidence = {"step": view.last_step, "pid": view.os_pid, "local_rank": view.local_rank}
    ev.update(evidence or {})
    return Finding(
        check=check,
        health=health,
        subject=Subject(kind="rank", node=node, gpu=view.local_rank, job=view.job,
                        rank=view.rank),
        reason=reason[:4000],
        action=action,
        evidence=ev,
        time=now,
    )


def by_job(views: Iterable[RankView]) -> dict[str, list[RankView]]:
    """Group rank views by job (ranks in order)."""
    out: dict[str, list[RankView]] = {}
    for v in views:
        out.setdefault(v.job, []).append(v)
    return out
