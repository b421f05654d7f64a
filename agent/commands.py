"""What a command from the collector does on this node: a probe answers, a checkpoint
order, a save hold or interval advice goes to the job's local ranks through the order
book (:class:`~forewarn.agent.protocols.OrderSink`). Both transports of the uplink (HTTP,
NATS) use it; deduplication by command id is the uplink's."""

from __future__ import annotations

from collections.abc import Collection

from forewarn.agent.order_ranks import ack_detail
from forewarn.agent.protocols import OrderSink
from forewarn.wire import Command

__all__ = ["carry_out", "hold_detail"]


def carry_out(command: Command, orders: OrderSink | None) -> tuple[bool, str]:
    """Carry out ``command``: ``(ok, detail)`` for its acknowledgement."""
    if command.kind == "probe":
        return True, "alive"
    order, hold, advice = (command.order if command.kind == "checkpoint" else None,
                           command.hold if command.kind == "hold" else None,
                           command.advice if command.kind == "advice" else None)
    if order is None and hold is None and advice is None:
        return False, f"unknown command kind {command.kind!r}"
    if orders is None:
        return False, "no ranks component on this agent"
    if order is not None:
        sent = orders.order_job(order.job, order.step, order.reason, order.request_id)
        if sent is None:
            return True, ack_detail(order.job, None, (), ())
        return True, ack_detail(order.job, sent.step, orders.not_live(sent.request_id),
                                orders.order_waiting(sent.request_id))
    if hold is not None:
        reached = orders.hold_job(hold)
        return True, hold_detail(hold.job, reached, orders.hold_waiting(hold.request_id))
    assert advice is not None
    reached = orders.advise_job(advice)
    return True, f"advice passed to {reached} rank(s) of {advice.job!r}"


def hold_detail(job: str, reached: int, waiting: Collection[int]) -> str:
    """The acknowledgement's detail for a save hold of ``job``: the ranks it reached at
    once of those it is for, and those still ``waiting`` for a retry."""
    out = f"save hold passed to {reached} of {reached + len(waiting)} rank(s) of {job!r}"
    if not waiting:
        return out
    ranks = ", ".join(str(r) for r in sorted(waiting))
    return (f"{out}; rank(s) {ranks} not reached yet: retried on every poll (until they "
            "take it, their process is replaced, or the hold is older than the orders' "
            "time to live)")
