"""Save holds on this node: the job's training state is suspect, its ranks stop saving.

A hold (:class:`forewarn.wire.SaveHold`) goes to every local rank of its job whose process
runs, live or marked gone (as an order: :mod:`forewarn.agent.order_ranks`): the
collector's as it comes, the agent's own (a NaN/Inf loss of a job whose every rank runs on
this node, :class:`forewarn.agent.orders.CheckpointOrders`'s fast path) with its step
chosen as an order's S. A rank that had already passed that step reports ``missed`` with
the last step it passed unheld; the agent then sends its own hold again for the step after
it (:func:`forewarn.ordering.replacement_hold`), ``replaces`` naming the missed one. A
collector's hold is the collector's to re-issue (the report goes up).

A hold's copy that cannot reach a rank (its socket not there for a moment, its queue full)
is retried on every poll as an order's is, with the same ending rules
(:mod:`forewarn.agent.delivery`): it ends when a rank it is for is replaced by a new process
(the job restarted, from a checkpoint taken before the onset) or after the orders' time to
live; a hold re-issued with ``replaces`` ends the undelivered copies of the one it replaces
(a late copy of the old hold would move that rank's stop back to a step its peers save).
A rank that never got the hold would go on saving the poisoned state and marking it good.
Each hold given up is counted by why (:data:`GIVEN_UP`; exported as
``forewarn_save_holds_given_up_total``).
"""

from __future__ import annotations

import collections
import logging
import uuid
from collections.abc import Callable, Sequence

from forewarn.agent.delivery import Delivery
from forewarn.agent.order_ranks import job_ranks
from forewarn.agent.rank_state import RankView
from forewarn.agent.ranks import RankTable
from forewarn.ordering import IssuedHolds, replacement_hold
from forewarn.wire import CheckpointReport, Finding, SaveHold, encode

__all__ = ["LocalHolds"]

log = logging.getLogger("forewarn.agent.orders")

StepFor = Callable[[Sequence[RankView], float], int]
"""``(views, now) -> S`` (the agent's ordering rule)."""

KEEP_UNDELIVERED = 64
"""Holds with copies still to deliver, the newest kept (bounds memory; each also ends with
its time to live)."""

GIVEN_UP = ("expired", "restarted", "crowded", "reissues")
"""Why a hold is given up: a rank it is for not reached within the time to live, a rank's
process replaced (the job restarted), more than :data:`KEEP_UNDELIVERED` holds waiting
(the oldest), the agent's own hold missed after its last reissue."""


class LocalHolds:
    """Sends holds to local ranks and re-issues the agent's own when one is missed.
    Not locked: :class:`~forewarn.agent.orders.CheckpointOrders` calls it under its lock."""

    def __init__(self, table: RankTable, send: Callable[[str, bytes], bool],
                 clock: Callable[[], float], step_for: StepFor, max_reissues: int, *,
                 monotonic: Callable[[], float], ttl_s: float) -> None:
        self.table = table
        self.send = send
        self.clock = clock
        self.step_for = step_for
        self.max_reissues = max_reissues
        self.monotonic = monotonic
        self.ttl_s = ttl_s
        self._own: IssuedHolds[None] = IssuedHolds(keep=64)
        """The agent's own holds."""
        self._undelivered: dict[str, tuple[SaveHold, Delivery]] = {}
        """Request id -> a hold with copies that have not reached their rank yet."""
        self.given_up_total: collections.Counter[str] = collections.Counter()
        """Why (:data:`GIVEN_UP`) -> holds given up."""

    def _views(self, job: str) -> list[RankView]:
        """The ranks a hold goes to: as an order's (a rank marked gone may only be unheard,
        :mod:`forewarn.agent.order_ranks`); a datagram to a stopped process waits for it."""
        return job_ranks(self.table, job, self.clock())[0]

    def send_hold(self, hold: SaveHold) -> int:
        """Send ``hold`` to every running local rank of its job; how many it reached at
        once (the others get it on a later poll: :meth:`tick`)."""
        self._undelivered.pop(hold.replaces, None)  # a late old copy would undo the move
        delivery = Delivery.send(self.send, self._views(hold.job), encode(hold),
                                 self.monotonic())
        if delivery.unsent:
            self._undelivered[hold.request_id] = (hold, delivery)
            while len(self._undelivered) > KEEP_UNDELIVERED:
                old = next(iter(self._undelivered))
                log.warning("save hold %s: more than %d holds wait for a rank: its "
                            "undelivered copies are given up", old, KEEP_UNDELIVERED)
                del self._undelivered[old]
                self.given_up_total["crowded"] += 1
        return delivery.reached

    def waiting(self, request_id: str) -> frozenset[int]:
        """Ranks a hold has not reached yet (retried on every poll; none once delivered or
        given up)."""
        pending = self._undelivered.get(request_id)
        return frozenset(pending[1].unsent) if pending is not None else frozenset()

    def tick(self) -> None:
        """Retry the copies of holds that have not reached their rank (every poll); end
        those of a restarted job or past the time to live."""
        mono = self.monotonic()
        for rid, (hold, delivery) in list(self._undelivered.items()):
            views = self.table.job_views(hold.job)
            why = ("restarted" if delivery.replaced(views) else
                   "expired" if delivery.expired(mono, self.ttl_s) else "")
            if why:
                self.given_up_total[why] += 1
                log.warning("save hold %s: never reached rank(s) %s of job %s (a rank "
                            "restarted, or it is older than %.0f s): given up", rid,
                            sorted(delivery.unsent), hold.job, self.ttl_s)
            else:
                delivery.retry(self.send, views)
                if delivery.unsent:
                    continue
            del self._undelivered[rid]

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
            self.given_up_total["reissues"] += 1
            log.error("save hold %s: rank %d missed it; gave up after %d reissues",
                      hold.request_id, rep.rank, reissues)
            return True
        new = replacement_hold(hold, rep.step,
                               f"{hold.request_id.split('-r')[0]}-r{reissues + 1}", self.clock())
        log.warning("save hold %s missed by rank %d at step %d: saves stop at step %d instead",
                    hold.request_id, rep.rank, rep.step, new.step)
        self._send_own(new, reissues + 1)
        return True
