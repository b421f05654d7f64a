"""Save holds on this node: the job's training state is suspect, its ranks stop saving.

A hold (:class:`forewarn.wire.SaveHold`) goes to every live local rank of its job: the
collector's as it comes, the agent's own (a NaN/Inf loss of a job whose every rank runs on
this node, :class:`forewarn.agent.orders.CheckpointOrders`'s fast path) with its step
chosen as an order's S. A rank that had already passed that step reports ``missed`` with
the last step it passed unheld; the agent then sends its own hold again for the step after
it (:func:`forewarn.ordering.replacement_hold`), ``replaces`` naming the missed one. A
collector's hold is the collector's to re-issue (the report goes up).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence

from forewarn.agent.rank_state import RankView
from forewarn.agent.ranks import RankTable
from forewarn.ordering import IssuedHolds, replacement_hold
from forewarn.wire import CheckpointReport, Finding, SaveHold, encode

__all__ = ["LocalHolds"]

log = logging.getLogger("forewarn.agent.orders")

StepFor = Callable[[Sequence[RankView], float], int]
"""``(views, now) -> S`` (the agent's ordering rule)."""


class LocalHolds:
    """Sends holds to local ranks and re-issues the agent's own when one is missed.
    Not locked: :class:`~forewarn.agent.orders.CheckpointOrders` calls it under its lock."""

    def __init__(self, table: RankTable, send: Callable[[str, bytes], bool],
                 clock: Callable[[], float], step_for: StepFor, max_reissues: int) -> None:
        self.table = table
        self.send = send
        self.clock = clock
        self.step_for = step_for
        self.max_reissues = max_reissues
        self._own: IssuedHolds[None] = IssuedHolds(keep=64)
        """The agent's own holds."""

    def _views(self, job: str) -> list[RankView]:
        now = self.clock()
        return [v for v in self.table.job_views(job) if self.table.alive(v, now)]

    def send_hold(self, hold: SaveHold) -> int:
        """Send ``hold`` to every live local rank of its job; how many it reached."""
        data = encode(hold)
        return sum(1 for v in self._views(hold.job) if self.send(v.reply_to, data))

    def hold(self, job: str, f: Finding) -> SaveHold | None:
        """Hold the local job's saves for the poisoned state ``f`` found."""
        views = self._views(job)
        if not views:
            return None
        bad = f.evidence.get("bad_step")
        onset = bad if isinstance(bad, int) and not isinstance(bad, bool) and bad >= 0 else \
            max((v.last_step or 0 for v in views), default=0)
        now = self.clock()
        hold = SaveHold(request_id=f"fw-{uuid.uuid4().hex[:16]}", job=job, onset_step=onset,
                        step=max(self.step_for(views, now), onset),
                        reason=f"{f.check}: {f.reason}"[:4000], issued=now)
        reached = self._send_own(hold, 0)
        log.warning("save hold %s: job %s is suspect since step %d, saves stop at step %d "
                    "(%d local rank(s))", hold.request_id, job, onset, hold.step, reached)
        return hold

    def _send_own(self, hold: SaveHold, reissues: int) -> int:
        self._own.add(hold, reissues, None)
        return self.send_hold(hold)

    def on_report(self, rep: CheckpointReport) -> bool:
        """A rank's report; True when it was about one of the agent's own holds."""
        if rep.request_id not in self._own:
            return False
        missed = self._own.missed(rep)
        if missed is None:
            return True
        hold, reissues, _ = missed
        if reissues >= self.max_reissues:
            log.error("save hold %s: rank %d missed it; gave up after %d reissues",
                      hold.request_id, rep.rank, reissues)
            return True
        new = replacement_hold(hold, rep.step,
                               f"{hold.request_id.split('-r')[0]}-r{reissues + 1}", self.clock())
        log.warning("save hold %s missed by rank %d at step %d: saves stop at step %d instead",
                    hold.request_id, rep.rank, rep.step, new.step)
        self._send_own(new, reissues + 1)
        return True
