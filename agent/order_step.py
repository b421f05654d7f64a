"""How an order's step S is chosen: :func:`choose_step` (the agent's own orders) and
:func:`preempt_step` (a preemption order, placed closer). The rule and its reasons are in
:mod:`forewarn.agent.orders` ("Choosing the step") and :mod:`forewarn.ordering`."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable

from forewarn.agent.rank_state import RankView, quantile
from forewarn.ordering import RankProgress, estimated_step, order_step

__all__ = ["choose_step", "preempt_step"]


def _paced_estimate(views: list[RankView], q: float, at: float) -> tuple[float | None, int | None]:
    """The job's ``q`` quantile step time on this node, and the furthest step a rank has
    probably reported by ``at`` when every rank goes at that pace."""
    pace = quantile([s for v in views for s in v.step_seconds], q)
    return pace, estimated_step(
        (RankProgress(v.last_step, v.last_progress, pace) for v in views), at)


def choose_step(
    views: Iterable[RankView],
    now: float,
    *,
    delivery_latency_s: float = 0.05,
    safety_s: float = 0.25,
    margin_scale: float = 1.0,
    fallback_steps: int = 10,
    floor: int | None = None,
) -> int:
    """The step S every rank of a job should save at: :func:`forewarn.ordering.order_step`
    with the job's median step time on this node as every rank's pace (S > ``floor``)."""
    p50, estimated = _paced_estimate(list(views), 0.5, now)
    step, _ = order_step(estimated, p50, lead_s=margin_scale * (delivery_latency_s + safety_s),
                         unknown_margin=math.ceil(margin_scale * fallback_steps), floor=floor)
    return step


def preempt_step(
    views: Iterable[RankView],
    now: float,
    *,
    reissues: int = 0,
    fallback_delivery_s: float = 0.05,
    fallback_steps: int = 10,
    floor: int | None = None,
) -> int:
    """The step S of a local preemption order: the first step no rank can have reported
    when the order lands, by :func:`forewarn.ordering.order_step` with no extra lead.

    The order goes over this node's datagram socket, and the ranks' step records carry
    the time of each step on this host's clock, so the agent knows each rank's phase
    within its current step. It estimates where the fastest rank is when the order
    arrives (``now + delivery``), advancing each rank at the job's fast pace (the 10th
    percentile of its recent step times, so a rank running faster than its median is
    still behind the estimate), and orders the step after that. ``delivery`` is the
    slowest recent beat from a rank to here (measured) plus the interpreter's switch
    interval (the hook's thread may wait that long for the GIL before it compares its
    step with S); ``fallback_delivery_s`` before any beat was measured. Each reissue
    after a ``missed`` report doubles the margin in steps (1, 2, 4, ...) past the
    estimate or ``floor`` (the step the rank reported with its ``missed``)."""
    views = list(views)
    measured = [v.delivery_s for v in views if v.delivery_s is not None]
    delivery = (max(measured) if measured else fallback_delivery_s) + sys.getswitchinterval()
    pace, estimated = _paced_estimate(views, 0.1, now + delivery)
    step, _ = order_step(estimated, pace, lead_s=0.0, min_margin=2**reissues,
                         unknown_margin=fallback_steps * 2**reissues, floor=floor)
    return step
