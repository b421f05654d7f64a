"""The table of training ranks built from the hooks' datagrams, and who is believed.

One rank's state and its view are in :mod:`forewarn.agent.rank_state`; sender
credentials and the ``/proc`` view in :mod:`forewarn.agent.procview`.

The ingest thread (:mod:`forewarn.agent.ingest`) writes a :class:`RankTable`; the poll
loop's checks, the order protocol and the metrics collector read it. Every public method
takes the table's lock, and readers get immutable :class:`RankView` copies, so a check
never sees a half-applied record.

Admission rules (:meth:`RankTable.admit`) decide which datagrams are believed. A record is
dropped, and counted under its reason, when:

* ``forged``: the kernel-verified sender pid (``SCM_CREDENTIALS``) differs from the pid
  the record claims, and the sender lives in *our* pid namespace (a rank in a container
  sees another pid for itself; its host pid from the credentials is used then);
* ``absurd``: ``rank >= world_size``, a record time more than ``max_clock_skew_s`` away
  from the agent's clock, a step time over a day, or a step jump larger than
  ``max_step_jump`` for the same process;
* ``slot_taken``: another live process already owns this ``(job, rank)``;
* ``wrong_job``: a process that owns one ``(job, rank)`` claims another;
* ``world_size_mismatch``: the job's live ranks report another world size;
* ``unknown_rank``: a checkpoint report for a rank this agent never admitted, or from a
  process that does not own it;
* ``table_full``: more than ``max_ranks`` ranks (bounds memory against a flood).

A beat's ``reply_to`` (where orders go) is taken only when it is an absolute path to a
socket owned by the sender's kernel-verified uid.

A new pid for a ``(job, rank)`` whose owner is dead (or silent past the gone timeout) is a
restart: the slot's history is reset and ``restarts`` counts it. A rank admitted with a
world size other than the one its job's (no longer live) ranks had is a new rendezvous
round (torchrun elastic shrink or grow), and so is a new process of a job none of whose
other ranks here is live (a restart round, which may give this node other ranks): the
job's old ranks are dropped at once, so a departed rank is not reported gone; ``rounds``
counts these.

Beats carry the rank's phase (``eval``, ``data``, ...: see :mod:`.checks.rank_hang`), a
preemption notice (the ``on_preempt`` listeners order the job's save) and a clean end
(``finished``: the rank is then neither alive nor gone, and its slot is free).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import stat
import threading
from collections.abc import Callable

from forewarn.agent.procview import Credentials, ProcView
from forewarn.agent.rank_state import RankState, RankView, quantile
from forewarn.wire import (
    Beat,
    CheckpointReport,
    RankSummary,
    StepRecord,
)

__all__ = ["RankLimits", "RankTable"]

HookRecord = StepRecord | Beat | CheckpointReport

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RankLimits:
    """Thresholds of the rank table and the rank checks (defaults cited where derived)."""

    hang_floor_s: float = 2.0
    """No rank is called hung sooner than this (AgentConfig.hang_floor_s)."""
    hang_factor: float = 3.0
    """Hung after ``hang_factor`` × the job's p99 step time without progress."""
    startup_timeout_s: float = 600.0
    """Before a rank has ``min_steps`` step times: PyTorch's NCCL default timeout (10 min)."""
    min_steps: int = 3
    checkpoint_timeout_s: float = 600.0
    """A rank that reported checkpoint ``started`` is not hung while saving, up to this."""
    beat_misses: float = 3.0
    """Gone after this many beat intervals without a beat."""
    default_beat_interval_s: float = 1.0
    min_beat_interval_s: float = 0.05
    gone_floor_s: float = 1.5
    """Never gone sooner than this, however fast the beats came."""
    max_step_jump: int = 10_000_000
    max_clock_skew_s: float = 3600.0
    max_step_seconds: float = 86_400.0
    max_ranks: int = 4096
    history: int = 256
    """Step times and grad norms kept per rank (rolling windows)."""
    evict_after_s: float = 600.0
    """A rank silent this long is forgotten."""


StepListener = Callable[[RankView, StepRecord], None]
PreemptListener = Callable[[RankView], object]
ReportListener = Callable[[RankView | None, CheckpointReport], None]


class RankTable:
    """All ranks this agent hears from, keyed by ``(job, rank)``; thread-safe.

    ``proc`` is the ``/proc`` seam; ``spike_factor`` is the grad-norm spike threshold
    (shared with :mod:`forewarn.agent.checks.grad_spike`, which reads the marks it sets).
    """

    def __init__(
        self,
        limits: RankLimits | None = None,
        *,
        proc: ProcView | None = None,
        spike_factor: float = 10.0,
    ) -> None:
        self.limits = limits or RankLimits()
        self.proc = proc or ProcView()
        self.spike_factor = spike_factor
        self._lock = threading.Lock()
        self._ranks: dict[tuple[str, int], RankState] = {}
        self._by_pid: dict[int, tuple[str, int]] = {}
        self._step_listeners: list[StepListener] = []
        self._report_listeners: list[ReportListener] = []
        self._preempt_listeners: list[PreemptListener] = []
        self.rounds: collections.Counter[str] = collections.Counter()
        """Job -> new rendezvous rounds seen that dropped old ranks (module docstring)."""
        self._reports: collections.deque[CheckpointReport] = collections.deque(maxlen=10_000)
        self._findings: dict[tuple[str, int, str], tuple[int, int | None, float]] = {}

    # -- listeners (called on the ingest thread, outside the lock) ------------------------
    def on_step(self, fn: StepListener) -> None:
        """Call ``fn(view, record)`` for admitted step records that mark an event: a
        rank's first step, the first step of a non-finite loss or grad norm, a grad-norm
        spike (the fast detectors). Other steps skip the copy a view costs."""
        self._step_listeners.append(fn)

    def on_report(self, fn: ReportListener) -> None:
        """Call ``fn(view, report)`` for every admitted checkpoint report (orders)."""
        self._report_listeners.append(fn)

    def on_preempt(self, fn: PreemptListener) -> None:
        """Call ``fn(view)`` when a rank process first says it got a preemption notice."""
        self._preempt_listeners.append(fn)

    # -- admission ---------------------------------------------------------------------------
    def gone_after(self, beat_interval_s: float | None) -> float:
        """Seconds without a beat after which a rank counts as gone."""
        lim = self.limits
        interval = beat_interval_s or lim.default_beat_interval_s
        return max(lim.gone_floor_s, lim.beat_misses * max(interval, lim.min_beat_interval_s))

    def admit(self, msg: HookRecord, cred: Credentials, now: float) -> str | None:
        """Apply ``msg`` if believable; return the drop reason otherwise (see module doc).

        The rules run in a fixed order, each a method below: the record alone
        (:meth:`_implausible`), its sender (:meth:`_sender_pid`), then, under the lock, the
        table (:meth:`_conflict_locked`), the slot (:meth:`_seat_locked`) and the update
        (:meth:`_apply_locked`); listeners run last, outside the lock."""
        if abs(msg.time - now) > self.limits.max_clock_skew_s:
            return "absurd"
        if isinstance(msg, CheckpointReport):
            return self._admit_report(msg, cred, now)
        if self._implausible(msg):
            return "absurd"
        os_pid = self._sender_pid(msg, cred)
        if os_pid is None:
            return "forged"
        key = (msg.job, msg.rank)
        with self._lock:
            reason = self._conflict_locked(msg, key, os_pid, now)
            if reason is not None:
                return reason
            st = self._ranks.get(key)
            if st is None or st.os_pid != os_pid:
                st = self._seat_locked(msg, key, os_pid, cred.uid, now)
                if st is None:
                    return "table_full"
            view = self._apply_locked(st, msg, cred.uid, now)
        if view is not None:
            self._notify(view, msg)
        return None

    def _implausible(self, msg: StepRecord | Beat) -> bool:
        """The record contradicts itself: a rank outside its world, a step over a day."""
        if msg.rank >= msg.world_size:
            return True
        return isinstance(msg, StepRecord) and (
            msg.step_seconds is not None and msg.step_seconds > self.limits.max_step_seconds
        )

    def _sender_pid(self, msg: StepRecord | Beat, cred: Credentials) -> int | None:
        """The sender's pid in our namespace, or None when the claimed pid is forged."""
        if cred.pid == msg.pid:
            return msg.pid
        if self.proc.same_pid_namespace(cred.pid):
            return None
        return cred.pid  # a containerised rank: its own pid differs from ours

    def _conflict_locked(self, msg: StepRecord | Beat, key: tuple[str, int], os_pid: int,
                         now: float) -> str | None:
        """The drop reason when the record clashes with what the table holds, else None."""
        if self._owns_another_slot(key, os_pid, now):
            return "wrong_job"
        st = self._ranks.get(key)
        if st is not None and st.os_pid != os_pid and self.alive(st, now):
            return "slot_taken"
        if self._world_size_disagrees(msg, os_pid, now):
            return "world_size_mismatch"
        if st is not None and st.os_pid == os_pid and self._step_jumps(st, msg):
            return "absurd"
        return None

    def _owns_another_slot(self, key: tuple[str, int], os_pid: int, now: float) -> bool:
        """The process is the live owner of another ``(job, rank)``."""
        other = self._by_pid.get(os_pid)
        if other is None or other == key:
            return False
        owner = self._ranks.get(other)
        return owner is not None and owner.os_pid == os_pid and self.alive(owner, now)

    def _world_size_disagrees(self, msg: StepRecord | Beat, os_pid: int, now: float) -> bool:
        """Another live process of the job reports another world size."""
        return any(
            peer.job == msg.job
            and peer.world_size != msg.world_size
            and peer.os_pid != os_pid
            and self.alive(peer, now)
            for peer in self._ranks.values()
        )

    def _step_jumps(self, st: RankState, msg: StepRecord | Beat) -> bool:
        """A step record further from the process's last step than ``max_step_jump``."""
        return (
            isinstance(msg, StepRecord)
            and st.last_step is not None
            and msg.step - st.last_step > self.limits.max_step_jump
        )

    def _seat_locked(self, msg: StepRecord | Beat, key: tuple[str, int], os_pid: int,
                     uid: int, now: float) -> RankState | None:
        """A new process takes slot ``key`` (first seen, or a restart); None when the table
        is full even after evicting silent ranks."""
        st = self._ranks.get(key)
        other = self._by_pid.get(os_pid)
        if st is None and len(self._ranks) >= self.limits.max_ranks:
            self._evict_locked(now)
            if len(self._ranks) >= self.limits.max_ranks:
                return None
        restarts = 0 if st is None else st.restarts + 1
        if st is not None:
            self._by_pid.pop(st.os_pid, None)
        if other is not None and other != key:
            self._ranks.pop(other, None)  # its owner is dead: admission checked
        self._new_round_locked(key, msg.world_size, now)
        st = RankState(
            job=msg.job, rank=msg.rank, local_rank=msg.local_rank,
            world_size=msg.world_size, host=msg.host, pid=msg.pid, os_pid=os_pid,
            uid=uid, start_time=self.proc.start_time(os_pid), first_seen=now,
            last_msg=now, history=self.limits.history, restarts=restarts,
        )
        self._ranks[key] = st
        self._by_pid[os_pid] = key
        return st

    def _apply_locked(self, st: RankState, msg: StepRecord | Beat, uid: int,
                      now: float) -> RankView | None:
        """Apply the record; a view when listeners must hear of it (see :meth:`on_step`,
        :meth:`on_preempt`), else None (a view is a copy: most steps skip it)."""
        st.local_rank, st.world_size, st.host = msg.local_rank, msg.world_size, msg.host
        if isinstance(msg, StepRecord):
            st.apply_step(msg, now, self.spike_factor)
            marks = (st.nonfinite_loss_step, st.nonfinite_grad_step, st.spike_step)
            if self._step_listeners and (st.steps_total == 1 or msg.step in marks):
                return st.view()
            return None
        noticed = st.apply_beat(msg, now, self.limits.min_beat_interval_s,
                                lambda path: self._reply_ok(path, uid))
        return st.view() if noticed else None

    def _notify(self, view: RankView, msg: StepRecord | Beat) -> None:
        """Run the step or preemption listeners (outside the lock)."""
        if isinstance(msg, StepRecord):
            for fn in self._step_listeners:
                fn(view, msg)
        else:
            for hear in self._preempt_listeners:
                hear(view)

    def _new_round_locked(self, key: tuple[str, int], world_size: int, now: float) -> None:
        """A new process joins the job as rank ``key``: a new rendezvous round when it
        reports another world size than the job's ranks had (none of them live: admission
        checked), or when none of the job's other ranks here is live (torchrun stops every
        local worker before the next round, which may give this node other ranks). The old
        ranks departed with the old round; keeping them would report them gone for
        ``evict_after_s``, or "gone while peers run: will hang" beside the new ranks."""
        job = key[0]
        others = [k for k in self._ranks if k[0] == job and k != key]
        if any(self.alive(self._ranks[k], now) for k in others):
            old = [k for k in others if self._ranks[k].world_size != world_size]
        else:
            old = others
        if key in self._ranks and self._ranks[key].world_size != world_size:
            old.append(key)
        if not old:
            return
        for k in old:
            st = self._ranks.pop(k)
            self._by_pid.pop(st.os_pid, None)
            self._forget_findings_locked(k)
        self.rounds[job] += 1
        log.info("job %s: new rendezvous round with world size %d; dropped %d rank(s) of the "
                 "previous round", job, world_size, len(old))

    @staticmethod
    def _reply_ok(path: str, uid: int) -> bool:
        """Orders go only to a socket owned by the rank's own user (kernel-verified uid),
        so a rank cannot point the agent at another process's socket (journald,
        NOTIFY_SOCKET, another user's rank)."""
        if not path.startswith("/"):
            log.warning("ignoring reply_to %r: not an absolute socket path", path[:100])
            return False
        try:
            st = os.lstat(path)
        except OSError as exc:
            log.warning("ignoring reply_to %s: %s", path, exc.strerror)
            return False
        if not stat.S_ISSOCK(st.st_mode) or (st.st_uid != uid and uid != 0):
            log.warning("ignoring reply_to %s: not a socket owned by uid %d", path, uid)
            return False
        return True

    def _admit_report(self, rep: CheckpointReport, cred: Credentials, now: float) -> str | None:
        with self._lock:
            st = self._ranks.get((rep.job, rep.rank))
            if st is None or st.os_pid != cred.pid:
                return "unknown_rank"
            st.apply_report(rep, now)
            self._reports.append(rep)
            view = st.view()
        for fn in self._report_listeners:
            fn(view, rep)
        return None

    # -- readers -----------------------------------------------------------------------------
    def views(self) -> list[RankView]:
        """Copies of every rank, sorted by job then rank."""
        with self._lock:
            return sorted((s.view() for s in self._ranks.values()), key=lambda v: v.key)

    def get(self, job: str, rank: int) -> RankView | None:
        with self._lock:
            st = self._ranks.get((job, rank))
            return None if st is None else st.view()

    def job_views(self, job: str) -> list[RankView]:
        return [v for v in self.views() if v.job == job]

    def jobs(self) -> list[str]:
        with self._lock:
            return sorted({k[0] for k in self._ranks})

    def __len__(self) -> int:
        with self._lock:
            return len(self._ranks)

    def alive(self, rank: RankState | RankView, now: float) -> bool:
        """True when the rank spoke within the gone timeout and its process still exists
        (a rank that finished cleanly is not alive, and not gone either). The one rule:
        the checks read it from views, and admission from the table's own state (a slot
        whose owner is not alive is free for a restart)."""
        if rank.finished or now - rank.last_msg > self.gone_after(rank.beat_interval_s):
            return False
        return self.proc.alive(rank.os_pid, rank.start_time)

    # -- findings marks for metrics (step at which a check last fired) -----------------------
    def note_finding(self, job: str, rank: int, check: str, step: int | None, now: float) -> bool:
        """Record that ``check`` fired for a rank at ``step``; False if already noted."""
        key = (job, rank, check)
        with self._lock:
            prev = self._findings.get(key)
            if prev is not None and prev[1] == step:
                return False
            count = 1 if prev is None else prev[0] + 1
            self._findings[key] = (count, step, now)
            return True

    def finding_marks(self) -> dict[tuple[str, int, str], tuple[int, int | None, float]]:
        """``(job, rank, check) -> (times fired, last step, last time)``."""
        with self._lock:
            return dict(self._findings)

    # -- upward ------------------------------------------------------------------------------
    def drain_reports(self) -> list[CheckpointReport]:
        """Checkpoint reports received since the last call (for the collector uplink)."""
        with self._lock:
            out = list(self._reports)
            self._reports.clear()
            return out

    def summaries(self, node: str, now: float, gpu_of: Callable[[int], int | None] | None = None
                  ) -> list[RankSummary]:
        """One :class:`RankSummary` per rank (``gpu_of`` maps local rank to GPU index)."""
        out = []
        for v in self.views():
            out.append(
                RankSummary(
                    job=v.job, rank=v.rank, local_rank=v.local_rank, world_size=v.world_size,
                    node=node, gpu=(gpu_of or (lambda lr: lr))(v.local_rank), pid=v.pid,
                    last_step=v.last_step, last_step_time=v.last_step_wall,
                    last_beat=v.last_beat,
                    step_seconds_p50=v.step_p50(), step_seconds_p99=v.step_p99(),
                    loss=v.loss, grad_norm=v.grad_norm, alive=self.alive(v, now),
                    last_checkpoint_step=v.last_checkpoint_step,
                    last_checkpoint_time=v.last_checkpoint_time,
                    checkpoint_seconds=v.checkpoint_seconds, finished=v.finished,
                    phase=v.phase, compute_seconds_p50=quantile(v.compute_seconds[-8:], 0.5),
                )
            )
        return out

    def evict(self, now: float) -> list[RankView]:
        """Forget ranks silent for ``evict_after_s``; returns what was forgotten."""
        with self._lock:
            return self._evict_locked(now)

    def _evict_locked(self, now: float) -> list[RankView]:
        gone = [k for k, s in self._ranks.items() if now - s.last_msg > self.limits.evict_after_s]
        out = []
        for k in gone:
            st = self._ranks.pop(k)
            self._by_pid.pop(st.os_pid, None)
            out.append(st.view())
            self._forget_findings_locked(k)
        return out

    def _forget_findings_locked(self, key: tuple[str, int]) -> None:
        for fk in [f for f in self._findings if f[:2] == key]:
            del self._findings[fk]
