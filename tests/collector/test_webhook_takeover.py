"""A webhook the old leader queued but had not delivered when it died goes out from the
next leader (issue 16): once, with the old leader's idempotency key, freshly signed; one
whose delivery ended is not sent again. On SQLite and PostgreSQL (the same code)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from forewarn.collector.decide.actions import ActionPipeline, store_decisions
from forewarn.collector.decide.dispatch import store_delivery
from forewarn.collector.decide.orders import OrderBook
from forewarn.collector.decide.policy import Policy, PolicySettings
from forewarn.collector.decide.webhook_history import resend_undelivered, undelivered
from forewarn.collector.decide.webhooks import (
    IDEMPOTENCY_HEADER,
    WebhookEndpoint,
    WebhookSender,
    WebhookVerifier,
)
from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.commands import CommandQueue
from forewarn.collector.storage.state import StateStore
from forewarn.wire import Finding, Health, Subject, SuggestedAction

from support.collector import ranks_on, start_service, stop_service
from support.handover import gpu_lost
from support.policy import Clock, fleet, gpu_finding
from support.polling import wait_for
from support.webhooks import Receiver

SECRET = b"webhook-secret-for-tests"


async def take_over(store: StateStore, clock: Clock, receiver: Receiver) -> int:
    """A new leader's webhook sender, started as it starts to lead: resends what the store
    says is undelivered, waits until each delivery ended; how many it queued."""
    sender = WebhookSender([WebhookEndpoint(receiver.url, "json", SECRET)],
                           on_delivery=store_delivery(store), backoff_s=0.05)
    await sender.start()
    try:
        queued = resend_undelivered(store, clock.t, sender.send)
        assert await sender.drain(20.0)
        return queued
    finally:
        await sender.stop()


def test_the_next_leader_sends_a_webhook_the_old_leader_queued_once_with_its_key(
        backend_state: StateStore) -> None:
    store, clock = backend_state, Clock()
    queued: list[dict[str, Any]] = []  # leader A's sender: its receiver was down, A died
    policy = Policy(PolicySettings(), fleet(), clock=clock, record=store_decisions(store))
    orders = OrderBook(CommandQueue(store, CollectorMetrics()), clock=clock)
    ActionPipeline(policy, orders, send_webhook=queued.append, actions=store).handle_findings(
        [gpu_finding("n0", check="gpu_lost", action=SuggestedAction.DRAIN)])
    [event] = queued
    clock.t += 30
    receiver = Receiver()
    receiver.statuses = [503]  # B's first try fails too: B retries within its limits
    try:
        assert asyncio.run(take_over(store, clock, receiver)) == 1  # leader B
        clock.t += 30
        assert asyncio.run(take_over(store, clock, receiver)) == 0  # C: it ended
    finally:
        receiver.close()
    assert len(receiver.requests) == 2  # the 503, then the delivery
    headers, body = receiver.requests[-1]
    WebhookVerifier(SECRET).verify(body, headers)  # signed afresh by B
    assert {k.lower(): v for k, v in headers.items()}[IDEMPOTENCY_HEADER.lower()] == \
        event["idempotency_key"]
    assert json.loads(body)["id"] == event["id"]


def key_of(request: tuple[dict[str, str], bytes]) -> str:
    return {k.lower(): v for k, v in request[0].items()}[IDEMPOTENCY_HEADER.lower()]


@pytest.mark.usefixtures("state_backend")
def test_a_collector_started_again_sends_the_webhook_it_had_not_delivered(
        tmp_path: Path) -> None:
    receiver = Receiver()
    receiver.statuses = [503]  # down: the retry is 60 s away when the collector stops
    keys = {"webhook_urls": (receiver.url,), "webhook_secret": SECRET.decode(),
            "webhook_backoff_s": 60.0}
    svc = start_service(tmp_path, **keys)
    try:
        now = time.time()
        svc.push("node1", ranks=ranks_on("node1", 0, now))
        svc.push("node1", findings=[gpu_lost("node1")])
        wait_for(lambda: receiver.requests, 30, "the first try")
    finally:
        stop_service(svc)
    seq = svc.seq
    svc = start_service(tmp_path, **keys)
    svc.seq = seq
    try:
        # any finding makes it lead (its memory taken over first)
        svc.push("node2", findings=[Finding(
            check="xid", health=Health.HEALTHY, subject=Subject(kind="gpu", node="node2"),
            time=time.time(), reason="ok", action=SuggestedAction.NONE)])
        wait_for(lambda: svc.store.scalar("SELECT count(*) FROM actions WHERE"
                                          " kind = 'webhook_delivery'") == 1, 30,
                 "the webhook resent and delivered")
        assert len(receiver.requests) == 2 and key_of(receiver.requests[0]) == \
            key_of(receiver.requests[1])
        WebhookVerifier(SECRET).verify(receiver.requests[1][1], receiver.requests[1][0])
    finally:
        stop_service(svc)
        receiver.close()


def test_each_undelivered_webhook_is_resent_on_its_own(
        sqlite_state: StateStore, caplog: pytest.LogCaptureFixture) -> None:
    """The webhooks the old leader queued, two endpoints: one hangs past the sender's
    timeout, one answers; the hand-over of the first event to the sender times out (as
    the policy thread's wait on the event loop does). The hang is each of its deliveries'
    failure, the timeout is that event's own (logged naming it, counted): every other
    event still reaches both endpoints."""
    store, clock = sqlite_state, Clock()
    queued: list[dict[str, Any]] = []
    policy = Policy(PolicySettings(), fleet(), clock=clock, record=store_decisions(store))
    orders = OrderBook(CommandQueue(store, CollectorMetrics()), clock=clock)
    ActionPipeline(policy, orders, send_webhook=queued.append, actions=store).handle_findings(
        [gpu_finding(n, check="gpu_lost", action=SuggestedAction.DRAIN) for n in ("n0", "n1")])
    assert len(queued) >= 2
    clock.t += 30
    hanging, answering = Receiver(), Receiver()
    hanging.hang.set()

    async def next_leader() -> int:
        sender = WebhookSender([WebhookEndpoint(hanging.url, "json", SECRET),
                                WebhookEndpoint(answering.url, "json", SECRET)],
                               on_delivery=store_delivery(store), timeout_s=0.3,
                               max_attempts=1)
        await sender.start()
        try:
            def send(event: dict[str, Any], ended: frozenset[str]) -> int:
                if event["id"] == first:
                    raise TimeoutError("the event loop did not take the event in time")
                return sender.send(event, ended)

            queued = resend_undelivered(store, clock.t, send, lambda: skipped.append(1))
            assert await sender.drain(20.0)
            return queued
        finally:
            await sender.stop()

    first, skipped = queued[0]["id"], list[int]()
    try:
        with caplog.at_level(logging.WARNING):
            assert asyncio.run(next_leader()) == 2 * (len(queued) - 1)
    finally:
        hanging.close()
        answering.close()
    assert sorted(json.loads(body)["id"] for _, body in answering.requests) == sorted(
        e["id"] for e in queued[1:])
    ended = store.query("SELECT status, detail FROM actions WHERE kind = 'webhook_delivery'")
    outcome = {(json.loads(r["detail"])["url"], r["status"]) for r in ended}
    assert outcome == {(hanging.url, "failed"), (answering.url, "delivered")}
    assert len(ended) == 2 * (len(queued) - 1)
    assert skipped == [1] and first in caplog.text


def test_a_webhook_queued_before_events_were_stored_is_no_policy_error(
        sqlite_state: StateStore, caplog: pytest.LogCaptureFixture) -> None:
    """After an upgrade the window holds webhooks an older collector queued without their
    event: they cannot be sent again, which is said once, and nothing is wrong with the
    policy; a stored event that is no event still is a bad row."""
    store, skipped = sqlite_state, list[int]()
    for n in range(3):  # as the collector before the resend stored them
        store.record_action(time=1000.0 + n, kind="webhook", status="queued",
                            detail={"decision": f"old{n}"})
    store.record_action(time=1010.0, kind="webhook", status="queued",
                        detail={"decision": "bad", "event": "not an event"})
    with caplog.at_level(logging.WARNING):
        assert undelivered(store, 900.0, lambda: skipped.append(1)) == []
    assert skipped == [1]  # the bad row only
    older = [r for r in caplog.records if "stored no event" in r.getMessage()]
    assert len(older) == 1 and "3 webhook" in older[0].getMessage(), caplog.text
