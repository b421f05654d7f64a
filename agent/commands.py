"""What a command from the collector does on this node: a probe answers, a checkpoint
order, a save hold or interval advice goes to the job's local ranks through the order
book (:class:`~forewarn.agent.protocols.OrderSink`). Both transports of the uplink (HTTP,
NATS) use it; deduplication by command id is the uplink's."""

from __future__ import annotations

from forewarn.agent.order_ranks import ack_detail
from forewarn.agent.protocols import OrderSink
from forewarn.wire import Command

__all__ = ["carry_out"]


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
        return True, ack_detail(order.job, None if sent is None else sent.step,
                                () if sent is None else orders.not_live(sent.request_id))
    if hold is not None:
        reached = orders.hold_job(hold)
        return True, f"save hold passed to {reached} rank(s) of {hold.job!r}"
    assert advice is not None
    reached = orders.advise_job(advice)
    return True, f"advice passed to {reached} rank(s) of {advice.job!r}"
