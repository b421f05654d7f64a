"""The collector's start-up and shutdown, in order (the app's lifespan): what starts
first stops last, and nothing staged or queued is lost on a clean stop.

Start: bind the event loop, recover staged telemetry, start the ingest writer, the NATS
consumer (``bus_url``), the policy (``start`` on the policy thread), the leader election,
remote write, then the periodic flush, upkeep and (shared state) the leader's findings feed.
Stop: cancel those tasks, stop the consumer and the writer, the policy (``stop``) and its
thread, flush telemetry one last time (as leader), give up leadership, stop remote write,
close the staging log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING

from starlette.applications import Starlette

from ..decide.seam import DecideContext, StartHook, StopHook
from ..storage.leader import FindingsFeed
from ..storage.staging import StagingLog
from ..storage.upkeep import run_upkeep
from .context import CollectorContext
from .leading import decide_feeds

if TYPE_CHECKING:
    from ..ingest.bus import BusConsumer

__all__ = ["service_lifespan"]

log = logging.getLogger(__name__)


def service_lifespan(ctx: CollectorContext, staging: StagingLog | None
                     ) -> Callable[[Starlette], AbstractAsyncContextManager[None]]:
    """The app's lifespan for the service ``ctx`` (``staging``: closed at the end)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        consumer = await _start(ctx)
        tasks = _background_tasks(ctx)
        try:
            yield
        finally:
            await _stop(ctx, tasks, consumer, staging)

    return lifespan


async def _start(ctx: CollectorContext) -> BusConsumer | None:
    """Everything up to the background tasks; the NATS consumer when there is one."""
    config, telemetry = ctx.config, ctx.telemetry
    ctx.bind_loop(asyncio.get_running_loop())
    await asyncio.to_thread(telemetry.recover)
    ctx.metrics.staged.set(await asyncio.to_thread(telemetry.staged_samples))
    if not ctx.tokens.nodes():
        log.warning("no agent tokens enrolled (%s): every ingest will be refused; "
                    "enrol nodes with `forewarn collector token add NODE`",
                    config.tokens_file)
    ctx.writer.start()
    consumer = None
    if config.bus_url:
        from ..ingest.bus import BusConsumer  # nats-py only where the bus is used

        consumer = BusConsumer(config, ctx.writer, ctx.metrics, ctx.commands,
                               on_ack=ctx.accept_ack, series=ctx.series, clock=ctx.clock,
                               decide=decide_feeds(ctx))
        await consumer.start()
        ctx.bus = consumer
    if isinstance(ctx.policy, StartHook):
        decide_ctx: DecideContext = ctx  # mypy checks that the context fits the seam
        await ctx.run_policy(ctx.policy.start, decide_ctx)
    ctx.leader.start()
    if ctx.series is not None:
        ctx.series.start()
    return consumer


def _background_tasks(ctx: CollectorContext) -> list[asyncio.Task[None]]:
    """The periodic flush, upkeep and, with shared state, the leader's findings feed."""
    tasks = [asyncio.create_task(ctx.periodic_flush()),
             asyncio.create_task(run_upkeep(ctx.config, ctx.store, ctx.telemetry,
                                            ctx.metrics, ctx.clock))]
    if ctx.leader.shared:
        tasks.append(asyncio.create_task(ctx.leader_feed(FindingsFeed(ctx.store))))
    return tasks


async def _stop(ctx: CollectorContext, tasks: list[asyncio.Task[None]],
                consumer: BusConsumer | None, staging: StagingLog | None) -> None:
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if consumer is not None:
        await consumer.stop()
    await asyncio.to_thread(ctx.writer.stop)
    if isinstance(ctx.policy, StopHook):
        with contextlib.suppress(Exception):
            await ctx.run_policy(ctx.policy.stop)
    ctx.stop_policy_thread()
    try:
        if ctx.leader.is_leader:
            await asyncio.to_thread(ctx.telemetry.flush, max_rows=10**9)
    except Exception:
        log.exception("final telemetry flush failed; samples stay staged")
    await asyncio.to_thread(ctx.leader.stop)  # after the flush it did as leader
    if ctx.series is not None:
        await asyncio.to_thread(ctx.series.stop)
    ctx.commands.bind_loop(None)
    if staging is not None:
        staging.close()
    ctx.telemetry.drop_segments()  # the last segment, now closed, if fully flushed
