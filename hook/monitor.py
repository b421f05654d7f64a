r"""The training-side client: step reports, liveness beats, checkpoint orders, preemption.

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

**Loss and grad norm as tensors** (:mod:`._tensors`): a CUDA tensor is never read with
``.item()``; its value is sent by a later ``step()`` once a non-blocking copy landed.
Passing floats that you already have is cheapest.

**Checkpoint orders** ("every rank of job J saves at step S", :mod:`._orders`) arrive from
the agent on the rank's own socket: :meth:`should_checkpoint` returns True at step S; an S
that has already passed is reported ``missed`` and the agent issues a new S. Orders never
replace each other; ``agree_every=k`` (off by default) ``all_reduce``\ s the pending order
step every k steps instead.

**Preemption** (:mod:`._preempt_state` tells the whole story). A notice (``preempt_signals``,
SIGTERM by default, or ``preempt_notice_file`` appearing) makes every rank of the job save
ONE step and exit with ``preempt_exit_code`` (default 128 + the signal number); a repeated
notice within ``preempt_grace_s`` does not abort the save.

**Phases and a clean end.** ``with mon.phase("eval"):`` marks a phase in which a long
pause in steps is expected (:mod:`._phases`). ``close()``, leaving the ``with`` block
without an exception, and a normal exit (atexit) mark the rank *finished*: never hung.

**Bad numerics** (:mod:`._numerics`). A NaN/Inf loss makes the training state *suspect*
(:attr:`Monitor.suspect_since`): a :class:`~forewarn.hook.CheckpointWriter` given this
monitor marks checkpoints since the onset, ``load_latest`` skips them, and saves are
*held* (:meth:`Monitor.saves_held`) from the step the job-wide
:class:`~forewarn.wire.SaveHold` names (a hold already passed is reported ``missed`` and
issued again) until :meth:`Monitor.release_hold`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from forewarn import wire

from ._channel import AgentChannel, resolve_socket_path
from ._identity import RankIdentity, identity_from_env
from ._numerics import Numerics
from ._orders import DueOrders, Saves, agree, agreeing
from ._pack import build_step_packer
from ._phases import Phases
from ._preempt import SignalExit, parse_signals
from ._preempt_state import NONE, PENDING, PreemptState
from ._reporter import Reporter, checked_step, passed_step
from ._sender import Sender
from ._stats import MonitorStats, RateLimitedLog

__all__ = ["Monitor", "MonitorStats"]

_log = logging.getLogger("forewarn.hook")



def _finite(x: Any) -> bool:
    """False only for a non-finite Python float."""
    return not (type(x) is float and x - x != 0.0)


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
        # hot-path state first (step() reads nothing else of the Monitor)
        self._time = clock
        self._mono = monotonic
        self._prev_mono: float | None = None
        self._last_step: int | None = None
        self._steps = 0
        self._plain = False  # step() may take the fast path (see _replan)
        self._special = agree_every > 0  # step() runs _special_step when True
        self._failures = 0
        self._log = RateLimitedLog()
        self._lock = threading.Lock()
        self._orders = DueOrders(self.job, self._lock, agree_every)
        self._checks_seen = False
        self._pre = PreemptState(
            self._signals, notice_file=os.fspath(notice) if notice else None,
            grace_s=preempt_grace_s, order_wait_s=preempt_order_wait_s, monotonic=monotonic,
            can_save=lambda: self._checks_seen and not self._closed,
            on_notice=self._on_notice,
        )
        self._finished = False
        self._closed = False
        self._numerics = Numerics(self.job, self.identity.world_size, self._lock,
                                  lambda s, rid: self._saves.report_missed(s, rid),
                                  self._on_listener_error)
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
                             cuda_depth=cuda_depth,
                             on_nonfinite_loss=self._numerics.nonfinite_loss)
        self._saves = Saves(self._orders, self._out, self._pre, self._numerics, monotonic,
                            follow_advice)
        self._phases = Phases(clock, monotonic, self._sender.beat_soon)
        # the fast path's state on the Monitor itself: one object to touch per step
        self._queue = self._sender.queue
        self._queue_limit = self._sender.queue_limit
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
            if (self._plain and type(loss) is float and type(grad_norm) is float
                    and not extras and loss - loss == 0.0):
                # Reporter.send, inlined, the record packed later by the background thread:
                # the hot path spares a call and the encoding
                if self._ch.up:
                    q = self._queue
                    if len(q) < self._queue_limit:
                        q.append((step, now, mono - prev, loss, grad_norm))  # type: ignore[operator]
                        return
                self._out.dropped += 1  # no agent (the background thread reconnects), or full
                return
            self._general_step(step, now, mono, prev, loss, grad_norm, extras)
        except Exception as exc:
            self._failures += 1
            self._log.warning("step", "step() failed and was skipped: %r", exc)

    def _general_step(self, step: int, now: float, mono: float, prev: float | None,
                      loss: Any, grad_norm: Any, extras: dict[str, Any]) -> None:
        """Everything but the fast path: the first step, agreement and preemption checks,
        NaN/Inf, tensors and extras (the general record)."""
        if self._special:
            self._special_step(step)
        data = self._record(step, now, None if prev is None else mono - prev, loss, grad_norm,
                            extras)
        # (a NaN/Inf loss made the state suspect as the Reporter read it: Reporter.record)
        if data is not None:  # else sent by a later step() once the CUDA copy landed
            # NaN/Inf: the agent's detector wants it now
            self._out.send(data, urgent=not _finite(loss))

    def _replan(self) -> None:
        """Whether the next step() may take the fast path: not once a CUDA value was passed
        (the Reporter keeps its deferred values from then on)."""
        self._plain = not (self._special or self._out.deferred is not None
                           or self._prev_mono is None)

    def report_values(self, step: int, loss: Any = None, grad_norm: Any = None,
                      **extras: Any) -> None:
        """Send values of an already reported ``step`` that were known only later (e.g. a
        trainer's logging hook). The record has no ``step_seconds``, so the agent's
        step-time statistics are not touched, and the rank's last step stays where
        :meth:`step` left it (an order or hold is judged against it). Never raises."""
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
        try:
            return self._out.record(step, now, ss, loss, grad_norm, extras)
        finally:
            self._replan()

    # ------------------------------------------------------------------ checkpoints

    def should_checkpoint(self, step: int) -> bool:
        """True when this rank must save now, at ``step`` (call after :meth:`step`)."""
        try:
            self._checks_seen = True
            return self._saves.should(step, self._ch.up)
        except Exception as exc:
            self._failures += 1
            self._log.warning("should_checkpoint", "should_checkpoint() failed: %r", exc)
            return False

    def checkpoint_done(self, step: int, seconds: float, bytes: int, path: str = "") -> None:
        """Report a finished checkpoint (ordered or not): the policy learns its cost.
        After a preemption checkpoint this exits the process (see the module docstring)."""
        self._finish(step, "done", path, seconds, bytes)

    def checkpoint_failed(self, step: int, reason: str = "") -> None:
        """Report a checkpoint that could not be written (a preempted process still exits)."""
        self._finish(step, "failed", reason)

    def _finish(self, step: int, phase: str, path: str, seconds: float | None = None,
                nbytes: int | None = None) -> None:
        try:
            self._saves.finish(step, phase, path, seconds, nbytes)
        except Exception as exc:
            self._failures += 1
            self._log.warning("checkpoint", f"checkpoint_{phase}() failed: %r", exc)
        self._pre.exit_if_saving()

    def _special_step(self, step: int) -> None:
        pre = self._pre
        every = self.agree_every
        # agreeing() asks torch.distributed (µs): only on an agreement step or after the grace
        if every and step % every == 0 and agreeing(every):
            agree(self._orders, step, pre.stage == PENDING)
        # a rank leaving alone would hang its peers' collective: not while agreeing
        if pre.grace_over() and not agreeing(every):
            self._log.warning("preempt", "no checkpoint started %.0f s after the preemption "
                              "notice", pre.grace_s)
            pre.exit_as_before(pre.signum)

    def _make_beat(self, sender_dropped: int) -> bytes:
        """The beat (background thread; also where the notice file is looked for)."""
        self._pre.poll_notice_file()
        i = self.identity
        return wire.encode(
            wire.Beat(
                job=i.job, rank=i.rank, local_rank=i.local_rank, world_size=i.world_size,
                pid=i.pid, host=i.host, time=self._time(), last_step=passed_step(self._last_step),
                dropped=self._out.dropped + sender_dropped, reply_to=self._ch.reply_path,
                phase=self._phases.name, phase_started=self._phases.started,
                phase_longest=dict(self._phases.longest),
                preempted=self._pre.noticed, finished=self._finished,
            )
        )

    def _on_datagram(self, data: bytes) -> None:
        try:
            message = wire.decode_agent_message(data)
        except wire.WireError as exc:
            self._orders.invalid += 1
            self._log.warning("order", "ignored an undecodable order: %s", exc)
            return
        if isinstance(message, wire.IntervalAdvice):
            if message.job == self.job:
                self._saves.advice = message
            return
        if isinstance(message, wire.SaveHold):
            self._numerics.on_hold(message, passed_step(self._last_step))
            return
        self._saves.on_order(message, passed_step(self._last_step))

    @property
    def follow_advice(self) -> bool:
        """Whether this rank saves at the collector's advised interval too."""
        return self._saves.follow_advice

    @property
    def advice(self) -> wire.IntervalAdvice | None:
        """The collector's latest interval advice for this job (None until one arrives)."""
        return self._saves.advice

    def _on_thread_error(self, exc: BaseException) -> None:
        self._log.warning("thread", "background thread error: %r", exc)

    def _on_notice(self) -> None:
        """The first preemption notice (maybe in a signal handler: flags and a pipe write)."""
        self._special = True  # step() now looks at the grace
        self._plain = False
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

    def _on_listener_error(self, exc: BaseException) -> None:
        self._failures += 1
        self._log.warning("suspect", "marking checkpoints suspect failed: %r", exc)

    @property
    def suspect_since(self) -> int | None:
        """First step of the suspect training state (a NaN/Inf loss here, or the onset
        the collector's save hold names); None while the state is sound."""
        return self._numerics.onset

    def saves_held(self, step: int) -> bool:
        """Whether saving ``step`` is refused (see the module docstring)."""
        return self._numerics.saves_held(step)

    def release_hold(self) -> None:
        """The user judged the state sound (e.g. after a benign grad-norm spike): saves are
        no longer held nor marked suspect. Checkpoints already marked stay marked."""
        self._numerics.release()

    def on_suspect(self, fn: Callable[[int], object]) -> None:
        """Call ``fn(onset_step)`` when the state becomes suspect (or its onset moves
        earlier): the checkpoint writer marks committed checkpoints from there on."""
        self._numerics.on_suspect(fn)

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Mark a phase in which a long pause between steps is expected (``eval``,
        ``data``, ``compile``, ``checkpoint``; :mod:`._phases`). Costs one pipe write on
        entry (the agent hears of the phase at once)."""
        return self._phases.enter(name, self._left_phase)

    def _left_phase(self, took: float) -> None:
        if self._prev_mono is not None:
            self._prev_mono += took  # the next step time is the step's own

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
            beats=self._sender.beats, orders=self._orders.accepted,
            orders_ignored=self._orders.ignored, orders_invalid=self._orders.invalid,
            missed=self._orders.missed,
            checkpoints=self._saves.checkpoints, values_skipped=self._out.values_skipped,
            connected=self._ch.up, notices_absorbed=self._pre.absorbed,
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
