"""A replica that starts to lead while its event loop is wedged: handing the webhooks the
last leader queued to the sender is bounded as a whole (one deadline, not one per event),
so the policy thread is not held N times over; what was not handed over stays unended in
the store, counted, and the next attempt sends it (real sender, real loop, real HTTP on
loopback, real SQLite)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from forewarn.collector.decide.actions import ActionPipeline, store_decisions
from forewarn.collector.decide.dispatch import ActionDispatch
from forewarn.collector.decide.orders import OrderBook
from forewarn.collector.decide.policy import Policy, PolicySettings
from forewarn.collector.decide.webhook_history import undelivered
from forewarn.collector.decide.webhooks import WebhookEndpoint
from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.commands import CommandQueue
from forewarn.collector.storage.state import StateStore
from forewarn.wire import SuggestedAction

from support.metrics import value
from support.policy import Clock, fleet, gpu_finding
from support.polling import wait_for
from support.webhooks import Receiver

DEADLINE_S = 1.0
"""The whole resend's bound in this test (the hand-over of one event waited 10 s)."""


@dataclasses.dataclass
class Context:
    """What :class:`ActionDispatch` reads of the service's context: its real parts."""

    store: StateStore
    metrics: CollectorMetrics
    clock: Callable[[], float]
    loop: asyncio.AbstractEventLoop
    outbound: httpx.AsyncClient | None = None


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running on a thread of its own, as the app's."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)
    loop.close()


def queue_webhooks(store: StateStore, clock: Clock) -> list[str]:
    """The ids of the webhooks a last leader queued (and never delivered)."""
    queued: list[dict[str, Any]] = []
    policy = Policy(PolicySettings(), fleet(), clock=clock, record=store_decisions(store))
    orders = OrderBook(CommandQueue(store, CollectorMetrics()), clock=clock)
    ActionPipeline(policy, orders, send_webhook=queued.append, actions=store).handle_findings(
        [gpu_finding(n, check="gpu_lost", action=SuggestedAction.DRAIN)
         for n in ("n0", "n1", "n2")])
    return [e["id"] for e in queued]


def test_a_wedged_loop_holds_the_resend_once_not_once_per_event(
        sqlite_state: StateStore, loop: asyncio.AbstractEventLoop) -> None:
    store, clock = sqlite_state, Clock()
    ids = queue_webhooks(store, clock)
    assert len(ids) >= 3
    clock.t += 30
    receiver, release = Receiver(), threading.Event()
    ctx = Context(store, CollectorMetrics(), clock, loop)
    dispatch = ActionDispatch([WebhookEndpoint(receiver.url)], backoff_s=0.05,
                              resend_within_s=DEADLINE_S)
    policy = Policy(PolicySettings(), fleet(), clock=clock)
    orders = OrderBook(CommandQueue(store, ctx.metrics), clock=clock)
    dispatch.start(ctx, policy, orders)  # type: ignore[arg-type]  # Context: the parts read
    try:
        loop.call_soon_threadsafe(release.wait, 60)  # the loop wedged
        started = time.monotonic()
        assert dispatch.resend_undelivered() == 0
        held = time.monotonic() - started
        # bounded once: under the 10 s one event's hand-over waited before, let alone N
        assert held < DEADLINE_S + 5, f"the policy thread was held {held:.1f} s"
        assert value(ctx.metrics.registry, "forewarn_collector_policy_errors_total") == len(ids)
        release.set()
        # nothing ended: all of them are left for the next attempt, which sends each once
        assert sorted(e["id"] for e, _ in undelivered(store, 0.0)) == sorted(ids)
        assert dispatch.resend_undelivered() == len(ids)
        wait_for(lambda: len(receiver.requests) >= len(ids), what="every webhook sent")
        assert sorted(json.loads(body)["id"] for _, body in receiver.requests) == sorted(ids)
    finally:
        release.set()
        dispatch.stop()
        receiver.close()
