"""Bad numerics in one rank: when its training state turned suspect, and from which step its
saves are held.

A NaN/Inf loss makes the state *suspect* from that step on (``onset``): listeners (the
:class:`~forewarn.hook.CheckpointWriter`) mark every checkpoint of that step or later. Saves
are *held* (``held_from``) from the step a :class:`~forewarn.wire.SaveHold` names -- ahead of
the fastest rank, so every rank of the job stops at the same step and none is left alone in
a collective save. A rank alone in its job (world size 1) holds at once, at the NaN's step.

**A hold that arrives late.** The hold's step is chosen as a checkpoint order's S
(:mod:`forewarn.ordering`), so it normally lies ahead of every rank when it lands. A rank
that has already passed that step unheld cannot meet it (it may have saved at steps the
others will refuse): like a missed order, it reports ``missed`` with the last step it
passed unheld under the hold's request id, and holds from the step after (every rank that
took the hold in time holds there too). The issuer -- the agent for a job on its node, else
the collector -- issues the hold again from that same step
(:func:`forewarn.ordering.replacement_hold`), naming the hold it ``replaces``; every rank then
holds from that step instead: the steps the late rank passed unheld are freed for its
peers, and nothing a rank has not reached changes, so a rank decides every later step the
same whether the re-issue has reached it yet or not. A rank that was already holding at
the re-issued step has not missed it; one that passed it unheld too (a second late rank)
reports again (the issuer gives up after a few re-issues, as for orders).

**Several holds.** Several ranks' reports may each cause a hold, and copies are retried, so
holds reach the ranks in different orders, some twice. A rank holds from the earliest step
of the holds it got that no other hold ``replaces``; a copy of a replaced hold arriving after
its re-issue is ignored. Every rank that got the same holds stops at the same step.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from forewarn import wire

__all__ = ["Numerics"]

_log = logging.getLogger("forewarn.hook")


class Numerics:
    """One rank's suspect state and save hold (see the module docstring).

    ``report_missed(step, request_id)`` sends a ``missed`` checkpoint report;
    ``on_error(exc)`` counts and logs a listener's failure.
    """

    def __init__(
        self,
        job: str,
        world_size: int,
        lock: threading.Lock,
        report_missed: Callable[[int, str], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        self.job = job
        self.world_size = world_size
        self.onset: int | None = None
        """First step of the suspect state; None while the state is sound."""
        self.held_from: int | None = None
        """Saves of this step or later are refused; None while not held."""
        self._holds: dict[str, int] = {}  # request id -> step of each hold not replaced
        self._replaced: collections.deque[str] = collections.deque(maxlen=64)
        self._lock = lock
        self._report_missed = report_missed
        self._on_error = on_error
        self._listeners: list[Callable[[int], object]] = []
        self._seen: collections.deque[str] = collections.deque(maxlen=64)

    def nonfinite_loss(self, step: int) -> None:
        """A NaN/Inf loss at ``step``. A rank alone holds its saves at once; ranks of a
        larger job keep saving (marked suspect) until the job-wide hold names the step all
        of them stop at: one rank refusing a collective save would hang the others."""
        self.suspect(step, step if self.world_size == 1 else None)

    def on_hold(self, hold: wire.SaveHold, last_step: int | None) -> None:
        """The job-wide hold (background thread). ``last_step``: this rank's last step."""
        if hold.job != self.job or hold.request_id in self._seen:
            return
        self._seen.append(hold.request_id)
        unheld = last_step  # the last step this rank passed without holding
        if unheld is not None and self.held_from is not None:
            unheld = min(unheld, self.held_from - 1)
        missed = unheld is not None and unheld >= hold.step
        # a late rank holds from the first step it can still meet, as the others do by now
        start = unheld + 1 if missed and unheld is not None else hold.step
        _log.warning("forewarn: saves held from step %d: the training state is suspect since "
                     "step %d (%s)%s", start, hold.onset_step, hold.reason[:200],
                     f"; the hold named step {hold.step}, already passed: reported missed"
                     if missed else "")
        self.suspect(hold.onset_step, start, hold.request_id, replaces=hold.replaces)
        if missed and unheld is not None:
            self._report_missed(unheld, hold.request_id)

    def suspect(self, onset: int, hold_from: int | None, hold_id: str = "",
                replaces: str = "") -> None:
        """The state is suspect since ``onset``; saves held from ``hold_from`` (if any)
        under the hold ``hold_id`` ("" for this rank's own hold).

        Saves are held from the earliest step of the holds not replaced: a hold that
        ``replaces`` another ends it (and a copy of it arriving later), whatever the order
        the holds arrive in, so every rank that got the same holds stops at the same step
        (the collector's rule, :func:`forewarn.collector.jobs.jobmap.numerics_state`)."""
        with self._lock:
            new = self.onset is None or onset < self.onset
            if new:
                self.onset = onset
            if hold_from is not None:
                if replaces:
                    self._replaced.append(replaces)
                    self._holds.pop(replaces, None)
                if hold_id not in self._replaced:
                    self._holds[hold_id] = min(hold_from, self._holds.get(hold_id, hold_from))
                self.held_from = min(self._holds.values(), default=None)
        if not new:
            return
        for fn in list(self._listeners):
            try:
                fn(onset)
            except Exception as exc:  # a listener's failure must not reach the loop
                self._on_error(exc)

    def saves_held(self, step: int) -> bool:
        """Whether saving ``step`` is refused."""
        held = self.held_from
        return held is not None and step >= held

    def release(self) -> None:
        """Saves are no longer held nor marked suspect (checkpoints marked stay marked)."""
        with self._lock:
            self.onset = self.held_from = None
            self._holds.clear()

    def on_suspect(self, fn: Callable[[int], object]) -> None:
        """Call ``fn(onset_step)`` when the state becomes suspect (or its onset moves
        earlier)."""
        self._listeners.append(fn)
