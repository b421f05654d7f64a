"""The leader's feed of every agent batch on the bus, with shared state
(``state = "postgresql"``): the ``decide`` consumers (:mod:`..ingest.bus_decide`, one per
lane) hand every batch on the bus to the policy's ``on_batches`` (the urgent lane's on the
policy thread's urgent lane), and the batches this replica stores
from the bus then skip that hook (:meth:`.context.CollectorContext.on_stored`), so each
reaches it once. Batches that came over HTTP reach it from the replica that stored them
while it leads, as with embedded state. An urgent batch this replica stored is looked up
by the urgent lane as soon as it is committed (``ctx.urgent_stored``). (Findings reach
the leader from the store: :meth:`.context.CollectorContext.leader_feed`.)
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from forewarn.wire import AgentBatch

from ..decide.seam import BatchHook

if TYPE_CHECKING:
    from ..ingest.bus_decide import DecideFeed
    from .context import CollectorContext

__all__ = ["decide_feeds"]


def decide_feeds(ctx: CollectorContext) -> list[DecideFeed]:
    """The leader's feeds of every bus batch (one per lane), when the state is shared and
    the policy hears batches (sets ``ctx.bus_decides``); none otherwise."""
    if not ctx.leader.shared or not isinstance(ctx.policy, BatchHook):
        return []
    from ..ingest.bus_decide import decide_feeds as feeds  # nats-py only with the bus

    async def deliver(batches: list[AgentBatch], urgent: bool) -> None:
        since = time.perf_counter() if urgent else None
        await ctx.run_policy(ctx._policy_batches, batches, False, since, urgent=urgent)

    ctx.bus_decides = True
    made = feeds(ctx.config, ctx.store, ctx.leader, deliver, ctx.metrics.registry,
                 clock=ctx.clock, stages=ctx.metrics.urgent_seconds)
    ctx.urgent_stored = next(f.stored for f in made if f.lane.urgent)
    return made
