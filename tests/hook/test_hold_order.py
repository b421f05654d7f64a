"""Every rank of a job ends holding its saves from the same step, whatever order the job's
holds reach it in: copies are retried and arrive out of order or twice, and several
ranks' NaN reports each cause a hold. A hold re-issued with ``replaces`` ends the hold it
names; the step a rank holds from is the earliest of the holds not replaced (the
collector's rule: ``numerics_state`` in collector/jobs/jobmap.py)."""

from __future__ import annotations

import itertools
import threading
import time

from forewarn import wire
from forewarn.hook._numerics import Numerics


def _hold(request_id: str, step: int, replaces: str = "") -> wire.SaveHold:
    return wire.SaveHold(request_id=request_id, job="j", onset_step=5, step=step,
                         reason="nan_loss on rank 1", issued=time.time(), replaces=replaces)


def _held_from(holds: list[wire.SaveHold]) -> int | None:
    missed: list[tuple[int, str]] = []
    n = Numerics("j", 4, threading.Lock(), lambda s, r: missed.append((s, r)), print)
    for h in holds:
        n.on_hold(h, last_step=6)  # every hold lies ahead of this rank: none is missed
    assert not missed
    return n.held_from


def test_ranks_hold_from_the_same_step_whatever_order_the_holds_arrive_in() -> None:
    """``a`` (step 10) re-issued as ``a-r1`` (15), itself re-issued as ``a-r2`` (18), and a
    second hold ``b`` (20) of the same incident, one sent twice: every order ends at 18."""
    a, a1, a2, b = _hold("a", 10), _hold("a-r1", 15, "a"), _hold("a-r2", 18, "a-r1"), \
        _hold("b", 20)
    ends = {order: _held_from(list(order))
            for order in itertools.permutations([a, a1, a2, b, a1])}
    assert set(ends.values()) == {18}, {
        tuple(h.request_id for h in order): end for order, end in ends.items() if end != 18}


def test_a_hold_not_replaced_still_brings_the_step_nearer() -> None:
    """A re-issue ends only the hold it names: a hold of an earlier step still stands."""
    early, a, a1 = _hold("early", 12), _hold("a", 10), _hold("a-r1", 15, "a")
    for order in itertools.permutations([early, a, a1]):
        assert _held_from(list(order)) == 12
