"""The leader's feed of every agent batch on the bus, with shared state
(``state = "postgresql"``): the ``decide`` consumer (:mod:`..ingest.bus_decide`) hands
every batch on the bus to the policy's ``on_batches``, and the batches this replica stores
from the bus then skip that hook (:meth:`.context.CollectorContext.on_stored`), so each
reaches it once. Batches that came over HTTP reach it from the replica that stored them
while it leads, as with embedded state. (Findings reach the leader from the store:
:meth:`.context.CollectorContext.leader_feed`.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from forewarn.wire import AgentBatch

from ..decide.seam import BatchHook

if TYPE_CHECKING:
    from ..ingest.bus_decide import DecideFeed
    from .context import CollectorContext

__all__ = ["decide_feed"]


def decide_feed(ctx: CollectorContext) -> DecideFeed | None:
    """The leader's feed of every bus batch, when the state is shared and the policy
    hears batches (sets ``ctx.bus_decides``); ``None`` otherwise."""
    if not ctx.leader.shared or not isinstance(ctx.policy, BatchHook):
        return None
    from ..ingest.bus_decide import DecideFeed  # nats-py only where the bus is used

    async def deliver(batches: list[AgentBatch]) -> None:
        await ctx.run_policy(ctx._policy_batches, batches, False)

    ctx.bus_decides = True
    return DecideFeed(ctx.config, ctx.store, ctx.leader, deliver, ctx.metrics.registry,
                      clock=ctx.clock)
