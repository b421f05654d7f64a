"""The preemption notice's decisions: one rank's way from a notice to its save and exit.

:class:`~forewarn.hook.monitor.Monitor` (whose module docstring tells the whole story)
keeps the checkpoint orders; this module keeps what a notice sets in motion:

* a notice is a preemption signal or the notice file appearing; it moves the rank from
  *none* to *pending* and asks the background thread for an early beat (the agent orders
  the whole job as soon as it hears);
* a repeated notice within ``grace_s`` of the first is absorbed (Slurm's SIGTERM,
  SIGCONT, SIGTERM); one after the grace, or one the Monitor cannot act on (closed, or a
  loop that never calls ``should_checkpoint``), ends the process *as before*;
* a pending rank saves alone unless the job agrees on a step (agree mode, or the agent's
  order, awaited ``order_wait_s`` while an agent is connected), and ends *as before* if no
  save started within the grace; alone, at the step the noticed ranks agree on in the
  process group's store (:mod:`._preempt_step`), its next one with no process group;
* after the save (*saving*) the process ends *after the save*.

The two ways out of the process, and the handlers themselves, are :mod:`._preempt`'s.

The whole story, as a user of :class:`~forewarn.hook.Monitor` sees it:

A preemption notice is one of ``preempt_signals`` (SIGTERM by default;
SIGUSR1 for Slurm's ``--signal=USR1@N`` warning; handlers in the main thread only,
``handle_sigterm=False`` opts out) or the appearance of ``preempt_notice_file`` (a cloud
maintenance notice written by the user's watcher; checked once per beat on the background
thread, nothing on the step path). Every rank of the job then saves ONE step and exits:

* with an agent: the rank's next beat (sent at once) says ``preempted``; the agent orders
  the whole job to save at the first step its fastest rank cannot have reached when the
  order lands, usually the next step (reason ``preempted``). Every rank that gets that
  order saves at its step and exits, signalled or not, so ranks signalled a step apart, or
  only some ranks, save the same step. A rank whose agent does not answer within
  ``preempt_order_wait_s`` saves alone (at the step below);
* with ``agree_every=k`` (the collective fallback for jobs run without an agent): the
  ranks' ``all_reduce(MAX)`` every k steps carries the notice, and every rank saves the
  agreed step and exits;
* with neither: every signalled rank saves at the same step, the next step of the first
  rank to act on its notice (agreed in the process group's store: a rank signalled just
  after its ``should_checkpoint`` and its peer signalled just before must not save a step
  apart), or at its own next step without a process group.

A repeated notice within ``preempt_grace_s`` of the first does not abort the save (Slurm
22.05 preemption sends SIGTERM, SIGCONT, SIGTERM within a few ms, and torchrun forwarding
plus a direct signal doubles it too). After the save (``Monitor.checkpoint_done`` or
``Monitor.checkpoint_failed``) the process exits with ``preempt_exit_code`` (default 128 +
the signal number, what a shell and torchrun report for a signalled worker), or calls the
user's own handler if one was installed before the Monitor. A loop that never calls
``should_checkpoint``, a save that has not started within ``preempt_grace_s``, or a
notice after the grace, get the previous behaviour at once (the previous handler, or
death by the signal).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from types import FrameType
from typing import Final

from ._preempt import SignalExit

__all__ = ["NONE", "PENDING", "SAVING", "PreemptState"]

_log = logging.getLogger("forewarn.hook")

NONE: Final = 0
PENDING: Final = 1
"""A notice came; the rank has not started its preemption save."""
SAVING: Final = 2
"""The preemption save is under way: the process exits after it."""


class PreemptState:
    """The stage of one rank's preemption and the notice that started it.

    ``can_save()`` is False when nothing here can save (the Monitor is closed, or its loop
    never called ``should_checkpoint``). ``on_notice()`` runs on the first notice, maybe
    inside a signal handler: it must only set flags and write to a pipe.
    """

    def __init__(
        self,
        exits: SignalExit,
        *,
        notice_file: str | None,
        grace_s: float,
        order_wait_s: float,
        monotonic: Callable[[], float],
        can_save: Callable[[], bool],
        on_notice: Callable[[], None],
    ) -> None:
        self.exits = exits
        self.notice_file = notice_file
        self.grace_s = grace_s
        self.order_wait_s = order_wait_s
        self._mono = monotonic
        self._can_save = can_save
        self._on_notice = on_notice
        self.stage = NONE
        self.signum: int | None = None
        """The notice's signal (None for the notice file or a job-wide order)."""
        self.since = 0.0
        """Monotonic time of the first notice."""
        self.order_due = False
        """The agent's job-wide preemption order arrived (the rank waits for its step)."""
        self.noticed = False
        """This process got a notice (sticky: what its beats say)."""
        self.absorbed = 0
        """Repeated notices within the grace that did not abort the save."""
        self.save_at: int | None = None
        """The step this rank's own save is made at, once decided (:mod:`._preempt_step`)."""

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        """A preemption signal. Runs between two bytecodes of the training thread: it only
        sets flags and writes one byte to a pipe (no lock the interrupted code may hold)."""
        if not self._can_save():
            self.exit_as_before(signum, frame)  # nothing here can save: as without us
            return
        if self.stage != NONE:
            if self._mono() - self.since <= self.grace_s:
                self.absorbed += 1  # Slurm's SIGTERM, SIGCONT, SIGTERM: save on
                return
            self.exit_as_before(signum, frame)
            return
        self.notice(signum)

    def poll_notice_file(self) -> None:
        """A notice when the notice file has appeared (the background thread, per beat)."""
        path = self.notice_file
        if (path is not None and self.stage == NONE and self._can_save()
                and os.path.exists(path)):
            _log.warning("forewarn: preemption notice file %s appeared", path)
            self.notice(None)

    def notice(self, signum: int | None) -> None:
        """A preemption notice (signal, or the notice file when ``signum`` is None)."""
        self.signum = signum
        self.since = self._mono()
        self.noticed = True
        self.save_at = None
        self.stage = PENDING
        self._on_notice()

    def save_alone(self, agreeing: bool, connected: bool) -> bool:
        """A pending rank saves at once, on its own, unless the job agrees on a step:
        through the collective (``agreeing``) or the agent's order (awaited for
        ``order_wait_s`` while ``connected`` to an agent, then for good once it came)."""
        if agreeing or self.order_due:
            return False
        return not connected or self._mono() - self.since >= self.order_wait_s

    def grace_over(self) -> bool:
        """Pending, and no save started within the grace after the notice."""
        return self.stage == PENDING and self._mono() - self.since > self.grace_s

    def exit_as_before(self, signum: int | None, frame: FrameType | None = None) -> None:
        """End the process as it would have ended without the Monitor (see :mod:`._preempt`)."""
        self.stage = NONE
        self.exits.as_before(signum, frame)

    def exit_if_saving(self) -> None:
        """After a save (done or failed): a preemption save ends the process."""
        if self.stage == SAVING:
            self.stage = NONE
            self.exits.after_save(self.signum)
