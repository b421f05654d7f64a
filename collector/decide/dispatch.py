"""The actuators of the collector's policy: the webhook sender and the drain runner, wired
into an :class:`~.actions.ActionPipeline` when the service starts.

Threads: the webhook sender runs on the app's event loop (events are handed over with
``call_soon_threadsafe``); drains run on their own one-thread pool, so a slow drain
command never holds up a checkpoint order; final webhook deliveries are stored in the
``actions`` table off the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .actions import ActionLog, ActionPipeline
from .drain import DrainRunner
from .orders import OrderBook
from .policy import Policy
from .webhook_history import resend_undelivered
from .webhooks import Delivery, WebhookEndpoint, WebhookSender

if TYPE_CHECKING:
    from .seam import DecideContext

__all__ = ["ActionDispatch", "store_delivery"]

log = logging.getLogger(__name__)


class ActionDispatch:
    """Webhooks to ``endpoints`` (``max_attempts`` tries, ``backoff_s`` apart) and drains
    through ``drain`` (none: drains are recorded as skipped)."""

    def __init__(self, endpoints: Sequence[WebhookEndpoint] = (), *, max_attempts: int = 5,
                 backoff_s: float = 1.0, drain: DrainRunner | None = None) -> None:
        self.endpoints = list(endpoints)
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.drain = drain
        self.sender: WebhookSender | None = None
        self._ctx: DecideContext | None = None
        self._drain_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="drain")

    def start(self, ctx: DecideContext, policy: Policy, orders: OrderBook) -> ActionPipeline:
        """Start the webhook sender on the app's loop; the pipeline that carries out
        ``policy``'s decisions with ``orders`` and these actuators."""
        self._ctx = ctx
        registry = ctx.metrics.registry
        send = None
        if self.endpoints and ctx.loop is not None:
            self.sender = WebhookSender(
                self.endpoints, client=ctx.outbound, max_attempts=self.max_attempts,
                backoff_s=self.backoff_s, on_delivery=self._delivered,
                clock=ctx.clock, registry=registry,
            )
            asyncio.run_coroutine_threadsafe(self.sender.start(), ctx.loop).result(10)
            send = _threadsafe(self.sender.send, ctx.loop)
        if self.drain is not None:
            self.drain.register(registry)
        return ActionPipeline(policy, orders, send_webhook=send, drain=self.drain,
                              drain_pool=self._drain_pool, actions=ctx.store)

    def stop(self) -> None:
        """Stop the webhook worker and wait for a running drain."""
        ctx = self._ctx
        if self.sender is not None and ctx is not None and ctx.loop is not None:
            try:
                asyncio.run_coroutine_threadsafe(self.sender.stop(), ctx.loop).result(10)
            except Exception:
                log.exception("stopping the webhook sender failed")
        self._drain_pool.shutdown(wait=True)

    def resend_undelivered(self) -> int:
        """Policy thread, as this replica starts to lead: the webhooks the last leader
        queued and whose delivery has not ended go out again (:mod:`.webhook_history`);
        returns how many deliveries were queued."""
        ctx, sender = self._ctx, self.sender
        if ctx is None or sender is None or ctx.loop is None:
            return 0
        loop = ctx.loop

        def send(event: dict[str, Any], ended: frozenset[str]) -> int:
            return asyncio.run_coroutine_threadsafe(_call(sender.send, event, ended),
                                                    loop).result(10)

        try:
            return resend_undelivered(ctx.store, ctx.clock(), send,
                                      ctx.metrics.policy_errors.inc)
        except Exception:
            ctx.metrics.policy_errors.inc()
            log.exception("resending the webhooks the last leader queued failed")
            return 0

    def _delivered(self, d: Delivery) -> None:
        """Runs on the loop: store final delivery results off the loop."""
        ctx = self._ctx
        if ctx is None:
            return
        record = store_delivery(ctx.store)
        try:
            asyncio.get_running_loop().run_in_executor(None, record, d)
        except RuntimeError:
            record(d)


def store_delivery(store: ActionLog) -> Callable[[Delivery], None]:
    """An ``on_delivery`` callback storing each delivery that ended (delivered, failed,
    dropped) as a ``webhook_delivery`` action; a retry is not stored."""

    def record(d: Delivery) -> None:
        if d.status == "retry":
            return
        store.record_action(
            time=d.time, kind="webhook_delivery", subject=d.url, status=d.status,
            detail={"event": d.event_id, "url": d.url, "attempt": d.attempt,
                    "http_status": d.http_status, "detail": d.detail})

    return record


async def _call(fn: Callable[..., int], *args: Any) -> int:
    return fn(*args)


def _threadsafe(send: Callable[[dict[str, Any]], object], loop: asyncio.AbstractEventLoop
                ) -> Callable[[dict[str, Any]], None]:
    """``send`` called on ``loop`` from any thread (the policy thread)."""

    def call(event: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(send, event)

    return call
