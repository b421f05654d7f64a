"""The training-side client: step reports, liveness beats, checkpoint orders, preemption.

A guest in someone else's training loop: standard library only at import time (torch is
imported lazily, and only when a tensor is passed or agreement mode runs), ``step()``
never blocks and never raises, and with no agent running the training runs unchanged
while :attr:`Monitor.dropped` counts the reports nobody received.

Call order in a loop::

    with Monitor(job="llm-7b") as mon:
        for step in range(start, steps):
            loss = train_step()
            mon.step(step, loss=loss, grad_norm=gn)
            if mon.should_checkpoint(step):
                res = writer.save(step, state)
                mon.checkpoint_done(step, res.seconds, res.bytes, res.path)

**Transport.** ``step()`` appends the step's values to a deque; the rank's background
thread encodes them (hand-rolled msgpack, :mod:`._pack`) and sends queued records to the
agent's Unix datagram socket every ``flush_interval_s`` (10 ms; at once for NaN/Inf values
and checkpoint reports), sends a :class:`~forewarn.wire.Beat` every ``beat_interval_s``
(the first at construction) and receives orders (:mod:`._reporter`, :mod:`._sender`,
:mod:`._channel`). The training thread makes no syscall per step.

**Loss and grad norm as tensors.** Python floats and CPU tensors are read at once. A CUDA
tensor is never read with ``.item()`` (that would sync the device every step): it is
copied ``non_blocking`` into a pinned host buffer behind a CUDA event, and the step's
record is sent by a later ``step()`` once the event has completed (see
:mod:`forewarn.hook._tensors`). Passing floats that you already have is cheapest.

**Checkpoint orders** ("every rank of job J saves at step S") arrive from the agent on the
rank's own socket. If this rank has not reported step S yet, :meth:`should_checkpoint`
returns True at step S. If S has already passed, the rank reports ``missed`` with its
current step and the agent issues a new S. Orders never replace each other: with several
pending (the agent's fast path and the collector can both order a job for one finding),
the rank saves at each order's step, and one save serves every order for the same step.
So every rank that received the same orders before their steps saves at the same steps.
With ``agree_every=k`` the ranks instead ``all_reduce(MAX)`` the pending order step every
k steps over the default process group so that all of them agree; this adds one tiny
collective (and, on NCCL, one device sync) every k steps and is off by default.

**Preemption** (the decisions in :mod:`._preempt_state`, the signals and exits in
:mod:`._preempt`). A preemption notice is one of ``preempt_signals`` (SIGTERM by default;
SIGUSR1 for Slurm's ``--signal=USR1@N`` warning; handlers in the main thread only,
``handle_sigterm=False`` opts out) or the appearance of ``preempt_notice_file`` (a cloud
maintenance notice written by the user's watcher; checked once per beat on the background
thread, nothing on the step path). Every rank of the job then saves ONE step and exits:

* with an agent: the rank's next beat (sent at once) says ``preempted``; the agent orders
  the whole job to save at the first step its fastest rank cannot have reached when the
  order lands, usually the next step (reason ``preempted``). Every rank that gets that
  order saves at its step and exits, signalled or not, so ranks signalled a step apart, or
  only some ranks, save the same step. A rank whose agent does not answer within
  ``preempt_order_wait_s`` saves alone at its next step;
* with ``agree_every=k`` (the collective fallback for jobs run without an agent): the
  ranks' ``all_reduce(MAX)`` every k steps carries the notice, and every rank saves the
  agreed step and exits;
* with neither: each rank saves at its own next step.

A repeated notice within ``preempt_grace_s`` of the first does not abort the save (Slurm
22.05 preemption sends SIGTERM, SIGCONT, SIGTERM within a few ms, and torchrun forwarding
plus a direct signal doubles it too). After the save (:meth:`checkpoint_done` or
:meth:`checkpoint_failed`) the process exits with ``preempt_exit_code`` (default 128 +
the signal number, what a shell and torchrun report for a signalled worker), or calls the
user's own handler if one was installed before the Monitor. A loop that never calls
``should_checkpoint``, a save that has not started within ``preempt_grace_s``, or a
notice after the grace, get the previous behaviour at once (the previous handler, or
death by the signal).

**Phases and a clean end.** ``with mon.phase("eval"):`` (or ``data``, ``compile``,
``checkpoint``) tells the agent that a long pause in steps is expected: its hang bound
for a rank in a phase is learned from the longest earlier stay in that phase (the first
one gets the startup timeout), and the phase's time is left out of the next step time.
``close()``, leaving the ``with`` block without an exception, and a normal interpreter
exit (atexit) mark the rank *finished* at the agent: never hung or gone.

**Bad numerics.** A NaN/Inf loss makes the training state *suspect* from that step on
(:attr:`Monitor.suspect_since`): a :class:`~forewarn.hook.CheckpointWriter` given this
monitor marks every checkpoint of that step or later suspect, and ``load_latest`` skips
those unless told (``allow_suspect=True``). Saves are *held* (:meth:`Monitor.saves_held`:
``should_checkpoint`` refuses ordered and advised saves, reporting them failed, and the
writer refuses to save) from the step the collector's :class:`~forewarn.wire.SaveHold`
names -- ahead of the fastest rank, so every rank of the job stops at the same step and
none is left alone in a collective save. A rank alone in its job (world size 1) holds its
saves at once, at the NaN's own step. The hold also comes for a grad-norm spike when the
collector's policy is so configured. :meth:`Monitor.release_hold` lifts it (the user
judged the state sound); ``writer.save(..., allow_suspect=True)`` saves once anyway,
marked suspect.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, Final

from forewarn import wire

from ._channel import AgentChannel, resolve_socket_path
from ._identity import RankIdentity, identity_from_env
from ._pack import build_step_packer
from ._preempt import PREEMPT_REQUEST, SignalExit, is_preemption, parse_signals
from ._preempt_state import NONE, PENDING, SAVING, PreemptState
from ._reporter import Reporter, checked_step
from ._sender import Sender

__all__ = ["Monitor", "MonitorStats"]

_log = logging.getLogger("forewarn.hook")

_MAX_PHASES: Final = 16
"""Phases whose longest stay a beat carries (the wire's limit)."""


@dataclasses.dataclass(frozen=True)
class MonitorStats:
    """Counters of one :class:`Monitor` (a snapshot)."""

    steps: int
    """``step()`` calls."""
    dropped: int
    """Reports (steps, beats, checkpoint reports) that did not reach an agent."""
    failures: int
    """``step()`` calls that failed inside the hook (bad arguments, bugs): counted, logged."""
    beats: int
    orders: int
    """Orders for this job that were accepted."""
    orders_ignored: int
    """Orders for another job, duplicates, or ones that came too late (see ``missed``)."""
    orders_invalid: int
    """Datagrams on the order socket that did not decode as a CheckpointOrder."""
    missed: int
    checkpoints: int
    values_skipped: int
    """Tensor values left out rather than waiting for the device."""
    connected: bool
    notices_absorbed: int = 0
    """Repeated preemption notices within the grace that did not abort the save."""


def _finite(x: Any) -> bool:
    """False only for a non-finite Python float."""
    return not (type(x) is float and x - x != 0.0)


class _RateLimitedLog:
    """At most one log line per key per ``interval_s``, with the count of suppressed ones."""

    def __init__(self, interval_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: collections.Counter[str] = collections.Counter()

    def warning(self, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._suppressed[key] += 1
            return
        self._last[key] = now
        n = self._suppressed.pop(key, 0)
        suffix = f" ({n} similar suppressed)" if n else ""
        _log.warning("forewarn: " + msg + suffix, *args)


class Monitor:
    """Report training steps to the node's forewarn agent and obey its checkpoint orders.

    Args:
        job, rank, world_size, local_rank: identity; default from torchrun
            (``TORCHELASTIC_RUN_ID``, ``RANK``, ...) or Slurm (``SLURM_JOB_ID``, ...).
        socket_path: the agent's socket; default ``$FOREWARN_SOCKET`` or
            ``/run/forewarn/agent.sock``.
        beat_interval_s: liveness beat period of the background thread.
        agree_every: opt-in agreement mode (see module docstring); 0 = off.
        follow_advice: also save at the periodic interval the collector advises (Young's
            interval from the job's measured checkpoint cost, the fleet's failure rate and
            current risk; :class:`forewarn.wire.IntervalAdvice`). Every rank of the job then
            saves at the same advised steps. Off by default: the job keeps its own schedule.
        handle_sigterm: install the preemption signal handlers (main thread only).
        preempt_signals: signals that are a preemption notice (names like ``"TERM"``,
            ``"SIGUSR1"`` or numbers; a comma-separated string too); default
            ``$FOREWARN_PREEMPT_SIGNALS`` or SIGTERM.
        preempt_notice_file: a path whose appearance is a preemption notice (checked once
            per beat); default ``$FOREWARN_PREEMPT_NOTICE_FILE`` or none.
        preempt_grace_s: after the first notice, repeated notices within this time do not
            abort the save, and the save must start within it.
        preempt_order_wait_s: how long a noticed rank waits for the agent's job-wide order
            before it saves alone (only while an agent is connected).
        preempt_exit_code: exit code after the preemption save; default 128 + signal
            number (128 + SIGTERM for the notice file or a job-wide order).
        cuda_depth: pinned slots for in-flight CUDA values.
        flush_interval_s: how often the background thread sends queued reports
            (non-finite values and checkpoint reports are sent at once).
        queue_limit: most reports held for the background thread; more are dropped.
        send_timeout_s: how long the background thread waits on a full agent queue.
        clock, monotonic: injectable clocks (wall time for records, monotonic for step time).
    """

    def __init__(
        self,
        job: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        local_rank: int | None = None,
        socket_path: str | os.PathLike[str] | None = None,
        beat_interval_s: float = 1.0,
        *,
        agree_every: int = 0,
        follow_advice: bool = False,
        handle_sigterm: bool = True,
        preempt_signals: Sequence[int | str] | str | None = None,
        preempt_notice_file: str | os.PathLike[str] | None = None,
        preempt_grace_s: float = 20.0,
        preempt_order_wait_s: float = 2.0,
        preempt_exit_code: int | None = None,
        cuda_depth: int = 8,
        flush_interval_s: float = 0.01,
        queue_limit: int = 4096,
        send_timeout_s: float = 0.05,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if beat_interval_s <= 0:
            raise ValueError(f"beat_interval_s must be > 0, got {beat_interval_s}")
        if agree_every < 0:
            raise ValueError(f"agree_every must be >= 0, got {agree_every}")
        self.identity: RankIdentity = identity_from_env(job, rank, world_size, local_rank)
        self.job = self.identity.job
        self.rank = self.identity.rank
        self.beat_interval_s = beat_interval_s
        self.agree_every = agree_every
        self._signals = SignalExit(
            parse_signals(preempt_signals if preempt_signals is not None
                          else os.environ.get("FOREWARN_PREEMPT_SIGNALS", "TERM")),
            preempt_exit_code, lambda finished: self._close(finished))
        self.preempt_signals = self._signals.signals
        notice = preempt_notice_file or os.environ.get("FOREWARN_PREEMPT_NOTICE_FILE")
        self._time = clock
        self._mono = monotonic
        self._log = _RateLimitedLog()
        self._lock = threading.Lock()
        # hot-path state
        self._prev_mono: float | None = None
        self._last_step: int | None = None
        self._steps = 0
        self._failures = 0
        self._special = agree_every > 0  # step() runs _special_step when True
        # orders and checkpoints
        self._due: dict[int, list[tuple[str, str]]] = {}  # step -> [(request_id, reason)]
        self._next_due: int | None = None  # min(self._due): the hot path reads only this
        self.follow_advice = follow_advice
        self._advice: wire.IntervalAdvice | None = None
        self._agree_pending: tuple[int, str, str] | None = None
        self._active: tuple[tuple[str, ...], str] | None = None  # (request_ids, reason)
        self._seen_requests: collections.deque[str] = collections.deque(maxlen=64)
        self._checks_seen = False
        self._orders = self._orders_ignored = self._orders_invalid = 0
        self._missed = self._checkpoints = 0
        self._pre = PreemptState(
            self._signals, notice_file=os.fspath(notice) if notice else None,
            grace_s=preempt_grace_s, order_wait_s=preempt_order_wait_s, monotonic=monotonic,
            can_save=lambda: self._checks_seen and not self._closed,
            on_notice=self._on_notice,
        )
        # phases (see phase())
        self._phase = ""
        self._phase_started: float | None = None
        self._phase_longest: dict[str, float] = {}
        self._finished = False
        self._closed = False
        # bad numerics (see suspect_since, saves_held)
        self._onset: int | None = None
        self._held_from: int | None = None
        self._suspect_listeners: list[Callable[[int], object]] = []
        self._ch = AgentChannel(resolve_socket_path(socket_path), send_timeout_s)
        if handle_sigterm:
            self._signals.install(self._pre.on_signal)
        self._sender = Sender(
            self._ch, self._make_beat, self._on_datagram, self._on_thread_error,
            build_step_packer(self.identity), beat_interval_s=beat_interval_s,
            flush_interval_s=flush_interval_s, queue_limit=queue_limit,
            name=f"forewarn-hook-r{self.rank}",
        )
        self._out = Reporter(self.identity, self._ch, self._sender, clock=clock,
                             queue_limit=queue_limit, cuda_depth=cuda_depth,
                             on_nonfinite_loss=self._nonfinite_loss)
        # the fast path's state on the Monitor itself: one object to touch per step
        self._queue = self._sender.queue
        self._queue_limit = queue_limit
        self._tensors = False  # CUDA values are in flight: step() takes the general path
        self._sender.start()  # the first beat goes out at construction
        atexit.register(self._at_exit)

    # ------------------------------------------------------------------ hot path

    def step(self, step: int, loss: Any = None, grad_norm: Any = None, **extras: Any) -> None:
        """Report that ``step`` finished. Never blocks, never raises; microseconds.

        ``loss`` and ``grad_norm``: float, int, 0-d tensor or None. ``extras``: more
        named scalars (``tokens=...``), sent as floats.
        """
        try:
            mono = self._mono()
            now = self._time()
            prev = self._prev_mono
            self._prev_mono = mono
            self._last_step = step
            self._steps += 1
            if self._special:
                self._special_step(step)
            if (
                type(loss) is float
                and type(grad_norm) is float
                and prev is not None
                and not extras
                and not self._tensors
            ):
                if loss - loss != 0.0:  # NaN/Inf: suspect now, with or without an agent
                    self._nonfinite_loss(step)
                    self._out.send(self._out.pack(step, now, mono - prev, loss, grad_norm),
                                   urgent=True)  # the agent's NaN detector wants it now
                    return
                # Reporter.send, inlined and packed later by the background thread: the
                # hot path spares a call and the encoding
                if not self._ch.up:
                    self._out.dropped += 1  # no agent: the background thread reconnects
                    return
                q = self._queue
                if len(q) >= self._queue_limit:
                    self._out.dropped += 1
                    return
                q.append((step, now, mono - prev, loss, grad_norm))
                return
            data = self._record(step, now, None if prev is None else mono - prev, loss,
                                grad_norm, extras)
            bad = not _finite(loss)
            if bad:  # at once, even when a CUDA grad norm defers the record
                self._nonfinite_loss(checked_step(step))
            if data is not None:  # else sent by a later step() once the CUDA copy landed
                self._out.send(data, urgent=bad)
        except Exception as exc:
            self._failures += 1
            self._log.warning("step", "step() failed and was skipped: %r", exc)

    def report_values(self, step: int, loss: Any = None, grad_norm: Any = None,
                      **extras: Any) -> None:
        """Send values of an already reported ``step`` that were known only later (e.g. a
        trainer's logging hook). The record has no ``step_seconds``, so the agent's
        step-time statistics are not touched. Never raises."""
        try:
            if not self._ch.up:
                self._out.dropped += 1
                return
            data = self._record(step, self._time(), None, loss, grad_norm, extras)
            if data is not None:
                self._out.send(data, urgent=not _finite(loss) or not _finite(grad_norm))
        except Exception as exc:
            self._failures += 1
            self._log.warning("step", "report_values() failed and was skipped: %r", exc)

    def _record(
        self, step: Any, now: float, ss: float | None, loss: Any, grad_norm: Any,
        extras: dict[str, Any],
    ) -> bytes | None:
        """The slow path's record (see :meth:`._reporter.Reporter.record`)."""
        step = checked_step(step)
        self._last_step = step
        try:
            return self._out.record(step, now, ss, loss, grad_norm, extras)
        finally:
            self._tensors = self._out.deferred is not None

    # ------------------------------------------------------------------ checkpoints

    def should_checkpoint(self, step: int) -> bool:
        """True when this rank must save now, at ``step`` (call after :meth:`step`)."""
        try:
            self._checks_seen = True
            pre = self._pre
            if pre.stage == PENDING and pre.save_alone(self._agreeing(), self._ch.up):
                with self._lock:
                    self._due.clear()  # the preemption save comes first, then the exit
                    self._next_due = None
                    pre.stage = SAVING
                self._start(step, (PREEMPT_REQUEST,), "preempted")
                return True
            next_due = self._next_due
            held = self._held_from
            if held is not None and step >= held:
                if next_due is not None and step >= next_due:
                    self._refuse_due(step)
                return False
            advice = self._advice
            if (self.follow_advice and advice is not None and step >= advice.from_step
                    and (step - advice.from_step) % advice.every_steps == 0
                    and next_due != step):
                self._start(step, ("advised",), "advised interval")
                return True
            if next_due is None or step < next_due:
                return False
            with self._lock:
                passed = sorted(s for s in self._due if s < step)
                missed = [rid for s in passed for rid, _ in self._due.pop(s)]
                now = self._due.pop(step, [])
                self._next_due = min(self._due, default=None)
            for rid in missed:
                self._report_missed(step, rid)
            if not now:
                return False
            rids = tuple(rid for rid, _ in now)
            reason = now[0][1]
            if any(is_preemption(r) for _, r in now):
                # the job-wide preemption save (this rank may not have been signalled
                # itself): checkpoint_done() then exits the process
                if pre.stage == NONE:
                    # the order is this rank's notice: its own signal, arriving during
                    # the save, is a repeat within the grace, not a reason to die mid-save
                    pre.since = self._mono()
                pre.stage = SAVING
                reason = PREEMPT_REQUEST
            self._start(step, rids, reason)
            return True
        except Exception as exc:
            self._failures += 1
            self._log.warning("should_checkpoint", "should_checkpoint() failed: %r", exc)
            return False

    def _refuse_due(self, step: int) -> None:
        """Saves are held: the orders due by ``step`` are reported failed, not saved."""
        with self._lock:
            due = [rid for s in sorted(s for s in self._due if s <= step)
                   for rid, _ in self._due.pop(s)]
            self._next_due = min(self._due, default=None)
        why = f"held: the training state is suspect since step {self._onset}"
        for rid in due:
            self._out.checkpoint(step, "failed", rid, path=why)

    def _start(self, step: int, request_ids: tuple[str, ...], reason: str) -> None:
        self._active = (request_ids, reason)
        for rid in request_ids:
            self._out.checkpoint(step, "started", rid)

    def checkpoint_done(self, step: int, seconds: float, bytes: int, path: str = "") -> None:
        """Report a finished checkpoint (ordered or not): the policy learns its cost.

        After a preemption checkpoint this exits the process (see the module docstring).
        """
        try:
            rids = self._active[0] if self._active is not None else ("",)
            self._active = None
            self._checkpoints += 1
            for rid in rids:
                self._out.checkpoint(step, "done", rid, seconds=max(0.0, float(seconds)),
                                     nbytes=max(0, int(bytes)), path=str(path)[:4096])
        except Exception as exc:
            self._failures += 1
            self._log.warning("checkpoint", "checkpoint_done() failed: %r", exc)
        self._pre.exit_if_saving()

    def checkpoint_failed(self, step: int, reason: str = "") -> None:
        """Report a checkpoint that could not be written (a preempted process still exits)."""
        try:
            rids = self._active[0] if self._active is not None else ("",)
            self._active = None
            for rid in rids:
                self._out.checkpoint(step, "failed", rid, path=str(reason)[:4096])
        except Exception as exc:
            self._failures += 1
            self._log.warning("checkpoint", "checkpoint_failed() failed: %r", exc)
        self._pre.exit_if_saving()

    def _report_missed(self, step: int, request_id: str) -> None:
        self._missed += 1
        self._out.checkpoint(step, "missed", request_id)

    # ------------------------------------------------------------------ orders

    def _on_order(self, order: wire.CheckpointOrder) -> None:
        if order.job != self.job or order.request_id in self._seen_requests:
            self._orders_ignored += 1
            return
        self._seen_requests.append(order.request_id)
        entry = (order.step, order.request_id, order.reason)
        with self._lock:
            if self.agree_every > 0:
                pend = self._agree_pending
                if pend is None or order.step >= pend[0]:
                    self._agree_pending = entry
                self._orders += 1
                return
            last = self._last_step
            if last is None or last < order.step:
                self._add_due(order.step, order.request_id, order.reason)
                self._orders += 1
                if is_preemption(order.reason):
                    self._pre.order_due = True
                return
        self._report_missed(last if last is not None else 0, order.request_id)

    def _agreeing(self) -> bool:
        if self.agree_every <= 0 or "torch" not in sys.modules:
            return False
        import torch.distributed as dist

        return bool(dist.is_available() and dist.is_initialized())

    def _special_step(self, step: int) -> None:
        if self.agree_every > 0 and step % self.agree_every == 0 and self._agreeing():
            self._agree(step)
        pre = self._pre
        # a rank leaving alone would hang its peers' collective: not while agreeing
        if pre.grace_over() and not self._agreeing():
            self._log.warning("preempt", "no checkpoint started %.0f s after the preemption "
                              "notice", pre.grace_s)
            pre.exit_as_before(pre.signum)

    def _agree(self, step: int) -> None:
        """All ranks: ``all_reduce(MAX)`` of the pending order step (or -1)."""
        import torch
        import torch.distributed as dist

        with self._lock:
            pend, self._agree_pending = self._agree_pending, None
        value = pend[0] if pend is not None else -1
        noticed = self._pre.stage == PENDING or (
            pend is not None and is_preemption(pend[2]))
        if noticed:
            value = max(value, step + 1)
        device = "cpu"
        if dist.get_backend() == "nccl":
            device = f"cuda:{torch.cuda.current_device()}"
        # [order step, preemption notice]: a notice on any rank preempts every rank
        t = torch.tensor([value, int(noticed)], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        agreed, preempted = (int(x) for x in t.tolist())
        if agreed < 0:
            return
        target = max(agreed, step + 1)  # every rank computes the same target
        rid, reason = (pend[1], pend[2]) if pend is not None else ("", "agreed")
        if preempted:
            rid, reason = rid or PREEMPT_REQUEST, PREEMPT_REQUEST
        with self._lock:
            self._add_due(target, rid, reason)

    def _add_due(self, step: int, request_id: str, reason: str) -> None:
        """Hold an order until its step (caller holds the lock)."""
        self._due.setdefault(step, []).append((request_id, reason))
        self._next_due = step if self._next_due is None else min(self._next_due, step)

    # ------------------------------------------------------------------ beats

    def _make_beat(self, sender_dropped: int) -> bytes:
        """The beat (background thread; also where the notice file is looked for)."""
        self._pre.poll_notice_file()
        i = self.identity
        return wire.encode(
            wire.Beat(
                job=i.job, rank=i.rank, local_rank=i.local_rank, world_size=i.world_size,
                pid=i.pid, host=i.host, time=self._time(), last_step=self._last_step,
                dropped=self._out.dropped + sender_dropped, reply_to=self._ch.reply_path,
                phase=self._phase, phase_started=self._phase_started,
                phase_longest=dict(self._phase_longest),
                preempted=self._pre.noticed, finished=self._finished,
            )
        )

    def _on_datagram(self, data: bytes) -> None:
        try:
            message = wire.decode_agent_message(data)
        except wire.WireError as exc:
            self._orders_invalid += 1
            self._log.warning("order", "ignored an undecodable order: %s", exc)
            return
        if isinstance(message, wire.IntervalAdvice):
            if message.job == self.job:
                self._advice = message
            return
        if isinstance(message, wire.SaveHold):
            if message.job == self.job:
                _log.warning("forewarn: saves held from step %d: the training state is suspect "
                             "since step %d (%s)", message.step, message.onset_step,
                             message.reason[:200])
                self._suspect(message.onset_step, message.step)
            return
        self._on_order(message)

    @property
    def advice(self) -> wire.IntervalAdvice | None:
        """The collector's latest interval advice for this job (None until one arrives)."""
        return self._advice

    def _on_thread_error(self, exc: BaseException) -> None:
        self._log.warning("thread", "background thread error: %r", exc)

    # ------------------------------------------------------------------ preemption

    def _on_notice(self) -> None:
        """The first preemption notice (maybe in a signal handler: flags and a pipe write)."""
        self._special = True  # step() now looks at the grace
        self._sender.beat_soon()  # the agent orders the job as soon as it hears

    @property
    def preempted(self) -> bool:
        """True once a preemption notice (or the job's preemption order) arrived."""
        return self._pre.stage != NONE

    @property
    def preempt_notice_file(self) -> str | None:
        """The path whose appearance is a preemption notice (None: not watched)."""
        return self._pre.notice_file

    @property
    def preempt_grace_s(self) -> float:
        """Repeated notices within this time of the first do not abort the save."""
        return self._pre.grace_s

    @property
    def preempt_order_wait_s(self) -> float:
        """How long a noticed rank waits for the agent's job-wide order."""
        return self._pre.order_wait_s

    # ------------------------------------------------------------------ bad numerics

    def _nonfinite_loss(self, step: int) -> None:
        """A NaN/Inf loss at ``step``. A rank alone holds its saves at once; ranks of a
        larger job keep saving (marked suspect) until the job-wide hold names the step all
        of them stop at: one rank refusing a collective save would hang the others."""
        self._suspect(step, step if self.identity.world_size == 1 else None)

    def _suspect(self, onset: int, hold_from: int | None) -> None:
        """The state is suspect since ``onset``; saves held from ``hold_from`` (if any)."""
        with self._lock:
            new = self._onset is None or onset < self._onset
            if new:
                self._onset = onset
            if hold_from is not None and (self._held_from is None or hold_from < self._held_from):
                self._held_from = hold_from
        if not new:
            return
        for fn in list(self._suspect_listeners):
            try:
                fn(onset)
            except Exception as exc:  # a listener's failure must not reach the loop
                self._failures += 1
                self._log.warning("suspect", "marking checkpoints suspect failed: %r", exc)

    @property
    def suspect_since(self) -> int | None:
        """First step of the suspect training state (a NaN/Inf loss here, or the onset
        the collector's save hold names); None while the state is sound."""
        return self._onset

    def saves_held(self, step: int) -> bool:
        """Whether saving ``step`` is refused (see the module docstring)."""
        held = self._held_from
        return held is not None and step >= held

    def release_hold(self) -> None:
        """The user judged the state sound (e.g. after a benign grad-norm spike): saves are
        no longer held nor marked suspect. Checkpoints already marked stay marked."""
        with self._lock:
            self._onset = self._held_from = None

    def on_suspect(self, fn: Callable[[int], object]) -> None:
        """Call ``fn(onset_step)`` when the state becomes suspect (or its onset moves
        earlier): the checkpoint writer marks committed checkpoints from there on."""
        self._suspect_listeners.append(fn)

    # ------------------------------------------------------------------ phases

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark a phase in which a long pause between steps is expected (``eval``,
        ``data``, ``compile``, ``checkpoint``): the agent's hang bound for it is learned
        from its longest earlier stay, and its time is left out of the next step time.

        Costs one pipe write on entry (the agent hears of the phase at once)."""
        name = str(name)[:32]
        outer = self._phase
        self._phase, self._phase_started = name, self._time()
        began = self._mono()
        self._sender.beat_soon()
        try:
            yield
        finally:
            took = self._mono() - began
            longest = self._phase_longest
            if took > longest.get(name, -1.0) and (name in longest
                                                   or len(longest) < _MAX_PHASES):
                longest[name] = took
            if self._prev_mono is not None:
                self._prev_mono += took  # the next step time is the step's own
            self._phase, self._phase_started = outer, self._time()

    # ------------------------------------------------------------------ lifecycle

    @property
    def dropped(self) -> int:
        """Reports that did not reach an agent (no agent, agent queue full, ...)."""
        return self._out.dropped + self._sender.dropped

    @property
    def connected(self) -> bool:
        """Whether the last send found an agent."""
        return self._ch.up

    @property
    def reply_path(self) -> str:
        """This rank's order socket (what beats carry as ``reply_to``)."""
        return self._ch.reply_path

    @property
    def stats(self) -> MonitorStats:
        """A snapshot of the counters."""
        return MonitorStats(
            steps=self._steps, dropped=self.dropped,
            failures=self._failures + self._sender.bad_records,
            beats=self._sender.beats, orders=self._orders, orders_ignored=self._orders_ignored,
            orders_invalid=self._orders_invalid, missed=self._missed,
            checkpoints=self._checkpoints, values_skipped=self._out.values_skipped,
            connected=self._ch.up,            notices_absorbed=self._pre.absorbed,
        )

    def close(self) -> None:
        """Send pending values, tell the agent this rank finished cleanly, stop the beat
        thread, remove the order socket. Idempotent."""
        self._close(finished=True)

    def _at_exit(self) -> None:
        # an uncaught exception sets sys.last_value before atexit handlers run: a crash
        # is not a clean end
        self._close(finished=getattr(sys, "last_value", None) is None)

    def _close(self, finished: bool) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        if os.getpid() != self.identity.pid:
            return  # a forked child (e.g. a DataLoader worker): the parent owns all of it
        try:
            self._out.flush_deferred(wait=True)
        except Exception as exc:
            self._log.warning("close", "could not flush pending tensor values: %r", exc)
        self._sender.stop()
        if finished:
            self._finished = True
            self._sender.beat()  # the thread is stopped: the last beat goes from here
        self._signals.restore()
        self._ch.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close(finished=exc_type is None)
