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
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from .actions import ActionLog, ActionPipeline
from .drain import DrainRunner
from .orders import OrderBook
from .policy import Policy
from .webhook_history import ResendDeadline, resend_undelivered
from .webhooks import Delivery, WebhookEndpoint, WebhookSender

if TYPE_CHECKING:
    from .seam import DecideContext

__all__ = ["RESEND_WITHIN_S", "ActionDispatch", "store_delivery"]

log = logging.getLogger(__name__)

RESEND_WITHIN_S: Final = 10.0
"""How long, in all, a replica that starts to lead waits for its event loop to take the
webhooks the last leader left unended: the policy thread decides nothing meanwhile, so a
wedged loop costs this once, not once per event; what it did not take is left unended."""


class ActionDispatch:
    """Webhooks to ``endpoints`` (``max_attempts`` tries, ``backoff_s`` apart) and drains
    through ``drain`` (none: drains are recorded as skipped); the resend at a takeover is
    given ``resend_within_s`` in all (:data:`RESEND_WITHIN_S`)."""

    def __init__(self, endpoints: Sequence[WebhookEndpoint] = (), *, max_attempts: int = 5,
                 backoff_s: float = 1.0, drain: DrainRunner | None = None,
                 resend_within_s: float = RESEND_WITHIN_S) -> None:
        self.endpoints = list(endpoints)
        self.resend_within_s = resend_within_s
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
        queued and whose delivery has not ended go out again (:mod:`.webhook_history`),
        handed to the event loop within ``resend_within_s`` in all; returns how many
        deliveries were queued."""
        ctx, sender = self._ctx, self.sender
        if ctx is None or sender is None or ctx.loop is None:
            return 0
        loop, within = ctx.loop, self.resend_within_s
        deadline = time.monotonic() + within

        def send(event: dict[str, Any], ended: frozenset[str]) -> int:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ResendDeadline(f"the event loop took none within {within:g} s")
            handed = _on_loop(loop, sender.send, event, ended)
            try:
                return handed.result(left)
            except TimeoutError:
                handed.cancel()  # never run once the loop wakes: the next leader resends it
                raise ResendDeadline(f"the event loop took it not within {within:g} s"
                                     ) from None

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


def _on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., int], *args: Any
             ) -> concurrent.futures.Future[int]:
    """``fn(*args)`` called on ``loop``, unless the returned future was cancelled before
    the loop came to it (a task from ``run_coroutine_threadsafe`` still takes its first
    step after such a cancel: a resend given up on was queued anyway)."""
    done: concurrent.futures.Future[int] = concurrent.futures.Future()

    def call() -> None:
        if not done.set_running_or_notify_cancel():
            return
        try:
            done.set_result(fn(*args))
        except Exception as exc:
            done.set_exception(exc)

    loop.call_soon_threadsafe(call)
    return done


def _threadsafe(send: Callable[[dict[str, Any]], object], loop: asyncio.AbstractEventLoop
                ) -> Callable[[dict[str, Any]], None]:
    """``send`` called on ``loop`` from any thread (the policy thread)."""

    def call(event: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(send, event)

    return call
