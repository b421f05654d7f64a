"""The one rule for the checkpoint step S that every rank of a job saves at.

Agent (a job on its own node) and collector (a job across nodes) both call it; neither adds
a collective or a device sync to the training step. The contract:

    estimated = max over ranks (last_step + floor((now - t_last_step) / p50_rank))
    margin    = ceil(lead_s / p50) + 1            clamped to [min_margin, max_margin]
              = unknown_margin + 1                 when no step time is known
    S         = max(estimated, floor) + margin

``t_last_step`` is when the rank's last step was seen and ``p50_rank`` the pace used to
advance it (its own median step time, or the job's); a rank that reported no step counts
for nothing; a report from the future (clock skew) advances nothing. ``lead_s`` is the time
the order needs to reach every rank (delivery latency + safety). ``floor`` is a step S must
exceed, e.g. the step a rank reported when it missed the previous order.

A caller that knows when each rank reported its last step on its own clock (the agent,
for ranks on its node) may instead estimate at the moment the order lands and pass no
lead: ``order_step(estimated_step(ranks, now + lead_s), pace, lead_s=0)`` is the first step
no rank can have reported by then, up to one step sooner than the margin form, which
does not know where in its current step each rank is (the agent's preemption orders).

Properties (tests/test_ordering.py checks them with hypothesis): S is greater than every
rank's estimated step and than ``floor``; S never decreases when ``lead_s`` or time grows;
with a known pace, S - estimated is at least the number of steps the fastest rank makes
in ``lead_s``.

A save hold (:class:`~forewarn.wire.SaveHold`) is placed by the same rule, never before
its onset. A rank that had passed its step unheld reports ``missed`` with the last step it
passed unheld (m); the side that issued the hold (agent or collector, :class:`IssuedHolds`)
then sends :func:`replacement_hold`, ``replaces`` naming the missed hold. A ``missed``
report counts only from a rank of the hold's own job.

**The replacement does not follow the rule**: it holds from m + 1. The late rank saved what
it liked up to m and holds from m + 1 on, while the ranks that took the hold in time hold
from its step; the replacement frees the steps the late rank has already passed unheld (its
peers may still join a save it made there) and no step beyond. A replacement placed ahead
of the ranks, as an order's S is, would free steps no rank has reached yet, and a rank would
then refuse or make a save there depending on whether the replacement had reached it: the
ranks split on a collective save (issue 15).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Generic, TypeVar

import msgspec

from forewarn.wire import CheckpointReport, SaveHold

__all__ = ["IssuedHolds", "RankProgress", "estimated_step", "order_step", "replacement_hold"]

Context = TypeVar("Context")


@dataclasses.dataclass(frozen=True)
class RankProgress:
    """What the rule needs of one rank."""

    last_step: int | None
    last_step_time: float | None
    """When that step was seen (seconds, the caller's clock)."""
    step_s: float | None
    """The pace to advance it by (seconds per step), None when unknown."""


def estimated_step(ranks: Iterable[RankProgress], now: float) -> int | None:
    """The furthest step any rank has probably reached by ``now`` (None: no rank reported)."""
    best: int | None = None
    for r in ranks:
        if r.last_step is None:
            continue
        step = r.last_step
        if r.last_step_time is not None and r.step_s and r.step_s > 0 and now > r.last_step_time:
            step += math.floor((now - r.last_step_time) / r.step_s)
        best = step if best is None else max(best, step)
    return best


def order_step(
    estimated: int | None,
    p50_s: float | None,
    *,
    lead_s: float,
    unknown_margin: int = 10,
    floor: int | None = None,
    min_margin: int = 1,
    max_margin: int | None = None,
) -> tuple[int, int]:
    """``(S, margin)`` by the rule in the module doc."""
    known = p50_s is not None and p50_s > 0
    margin = math.ceil(lead_s / p50_s) + 1 if known and p50_s else unknown_margin + 1
    margin = max(min_margin, margin)
    if max_margin is not None:
        margin = min(max_margin, margin)
    return max(estimated or 0, floor or 0) + margin, margin


def replacement_hold(hold: SaveHold, missed_step: int, request_id: str, now: float
                     ) -> SaveHold:
    """The hold that replaces ``hold`` after a rank reported it ``missed`` at
    ``missed_step``: held from the step after (see the module doc), never before the
    onset."""
    return msgspec.structs.replace(hold, request_id=request_id,
                                   step=max(missed_step + 1, hold.onset_step), issued=now,
                                   replaces=hold.request_id)


class IssuedHolds(Generic[Context]):
    """The save holds one side issued (the newest ``keep``), each with its re-issues so
    far and what it was issued for (``Context``)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._holds: dict[str, tuple[SaveHold, int, Context]] = {}

    def add(self, hold: SaveHold, reissues: int, context: Context) -> None:
        """Remember ``hold`` (the oldest beyond ``keep`` is forgotten)."""
        self._holds[hold.request_id] = (hold, reissues, context)
        while len(self._holds) > self.keep:
            self._holds.pop(next(iter(self._holds)))

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._holds

    def missed(self, report: CheckpointReport) -> tuple[SaveHold, int, Context] | None:
        """The hold a rank of its own job reports ``missed``, with its re-issues and
        context, forgotten here (its replacement takes its place); None for any other
        report."""
        known = self._holds.get(report.request_id)
        if known is None or report.phase != "missed" or report.job != known[0].job:
            return None
        return self._holds.pop(report.request_id)
