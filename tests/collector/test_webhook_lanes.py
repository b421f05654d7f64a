"""Each webhook endpoint is delivered to on its own (real HTTP on loopback): a receiver
that hangs past the sender's timeout neither delays nor drops another endpoint's
deliveries."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator

import pytest

from forewarn.collector.decide.webhooks import Delivery, WebhookEndpoint, WebhookSender

from support.webhooks import Receiver

TIMEOUT_S = 10.0
"""The sender's timeout: loopback deliveries take milliseconds, so a healthy endpoint
served only after a hang timed out cannot pass for one served beside it."""


@pytest.fixture
def receivers() -> Iterator[tuple[Receiver, Receiver]]:
    hanging, answering = Receiver(), Receiver()
    hanging.hang.set()
    yield hanging, answering
    hanging.close()
    answering.close()


async def until(cond: Callable[[], bool], timeout: float = 2 * TIMEOUT_S) -> None:
    """Let the loop run until ``cond()`` holds (or ``timeout`` s passed: the caller
    asserts)."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def ended(stored: list[Delivery], url: str, status: str) -> list[str]:
    return [d.event_id for d in stored if d.url == url and d.status == status]


def test_a_hanging_endpoint_does_not_delay_the_others(
        receivers: tuple[Receiver, Receiver]) -> None:
    hanging, answering = receivers
    stored: list[Delivery] = []
    sender = WebhookSender([WebhookEndpoint(hanging.url), WebhookEndpoint(answering.url)],
                           timeout_s=TIMEOUT_S, max_attempts=1, on_delivery=stored.append)
    events = [f"e{i}" for i in range(5)]

    async def run() -> None:
        await sender.start()
        try:
            for event_id in events:
                sender.send({"id": event_id})
            # until every event reached the healthy endpoint, or the first hang ended
            await until(lambda: len(ended(stored, answering.url, "delivered")) == len(events)
                        or any(d.url == hanging.url for d in stored))
            assert ended(stored, answering.url, "delivered") == events
            assert not [d for d in stored if d.url == hanging.url], "the hang ended first"
            assert len(hanging.requests) == 1  # its first delivery is still hanging
        finally:
            await sender.stop()

    asyncio.run(run())
    assert [json.loads(body)["id"] for _, body in answering.requests] == events


def test_a_full_queue_drops_only_its_own_endpoints_deliveries(
        receivers: tuple[Receiver, Receiver]) -> None:
    hanging, answering = receivers
    stored: list[Delivery] = []
    sender = WebhookSender([WebhookEndpoint(hanging.url), WebhookEndpoint(answering.url)],
                           timeout_s=TIMEOUT_S, max_attempts=1, queue_size=2,
                           on_delivery=stored.append)
    events = [f"e{i}" for i in range(6)]

    def delivered(n: int) -> Callable[[], bool]:
        """Whether ``n`` events reached the healthy endpoint (or a hang ended)."""
        return lambda: (len(ended(stored, answering.url, "delivered")) >= n
                        or any(d.status == "failed" for d in stored))

    async def run() -> None:
        await sender.start()
        try:
            for n, event_id in enumerate(events, 1):
                assert sender.send({"id": event_id}) in (1, 2)
                await until(delivered(n))
                assert len(ended(stored, answering.url, "delivered")) == n, stored
        finally:
            await sender.stop()

    asyncio.run(run())
    # the hanging endpoint: one delivery in flight, two queued behind it, the rest dropped
    assert ended(stored, hanging.url, "dropped") == events[3:]
    assert ended(stored, answering.url, "dropped") == []
    assert ended(stored, answering.url, "delivered") == events


def test_a_sender_stopped_and_started_again_drains_what_it_queued_since(
        receivers: tuple[Receiver, Receiver]) -> None:
    """Stopped with a delivery hanging (dropped, as documented), then started again: a
    drain waits for what was queued after the restart only."""
    hanging, answering = receivers
    sender = WebhookSender([WebhookEndpoint(hanging.url)], timeout_s=TIMEOUT_S,
                           max_attempts=1)

    async def run() -> bool:
        await sender.start()
        assert sender.send({"id": "before"}) == 1
        await until(lambda: len(hanging.requests) == 1)
        await sender.stop()
        sender.endpoints = [WebhookEndpoint(answering.url)]
        await sender.start()
        try:
            assert sender.send({"id": "after"}) == 1
            return await sender.drain(TIMEOUT_S / 2)
        finally:
            await sender.stop()

    assert asyncio.run(run()), "the drain waited for the delivery the stop dropped"
    assert [json.loads(body)["id"] for _, body in answering.requests] == ["after"]
