"""Outbound webhooks over real HTTP on loopback: signatures, replay rejection, Slack form,
retries with backoff and delivery status."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator, Mapping

import pytest
from prometheus_client import CollectorRegistry

from forewarn.collector.decide.webhooks import (
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    Delivery,
    SignatureError,
    WebhookEndpoint,
    WebhookSender,
    WebhookVerifier,
    sign,
    signed_headers,
    verify_signature,
)

from support.webhooks import Receiver

SECRET = b"s3cret-for-tests"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def test_sign_and_verify_roundtrip() -> None:
    body = b'{"a":1}'
    headers = signed_headers(SECRET, body, 1_000_000.0)
    assert headers[SIGNATURE_HEADER] == sign(SECRET, 1_000_000, body)
    assert headers[SIGNATURE_HEADER].startswith("sha256=")
    assert verify_signature(SECRET, body, headers, now=1_000_010.0) == 1_000_000
    lower = {k.lower(): v for k, v in headers.items()}  # header names are case-insensitive
    assert verify_signature(SECRET, body, lower, now=1_000_010.0) == 1_000_000


@pytest.mark.parametrize("mutate, message", [
    (lambda h, b: (h, b + b" "), "does not match"),
    (lambda h, b: ({**h, TIMESTAMP_HEADER: str(int(h[TIMESTAMP_HEADER]) + 1)}, b),
     "does not match"),
    (lambda h, b: ({TIMESTAMP_HEADER: h[TIMESTAMP_HEADER]}, b), "missing header"),
    (lambda h, b: ({**h, TIMESTAMP_HEADER: "-5"}, b), "bad X-Forewarn-Timestamp"),
    (lambda h, b: ({**h, SIGNATURE_HEADER: "md5=00"}, b), "expected sha256"),
])
def test_verify_rejects_tampering(mutate, message) -> None:  # type: ignore[no-untyped-def]
    body = b'{"a":1}'
    headers, body2 = mutate(signed_headers(SECRET, body, 1_000_000.0), body)
    with pytest.raises(SignatureError, match=message):
        verify_signature(SECRET, body2, headers, now=1_000_000.0)
    with pytest.raises(SignatureError):
        verify_signature(b"other", body, signed_headers(SECRET, body, 1e6), now=1e6)


def test_replayed_request_rejected() -> None:
    now = [1_000_000.0]
    verifier = WebhookVerifier(SECRET, tolerance_s=300, clock=lambda: now[0])
    body = b'{"id":"x"}'
    headers = signed_headers(SECRET, body, now[0])
    assert verifier.verify(body, headers) == 1_000_000
    # the same request again, inside the window: refused by the verifier's memory
    now[0] += 5
    with pytest.raises(SignatureError, match="replayed"):
        verifier.verify(body, headers)
    # the same request much later: refused by the timestamp window
    now[0] += 3600
    with pytest.raises(SignatureError, match="stale or replayed"):
        verifier.verify(body, headers)
    with pytest.raises(SignatureError, match="stale or replayed"):
        verify_signature(SECRET, body, headers, now=now[0])
    # a fresh signature of the same body is fine
    assert verifier.verify(body, signed_headers(SECRET, body, now[0]))


def test_endpoint_validation() -> None:
    with pytest.raises(ValueError, match="format"):
        WebhookEndpoint("http://x", format="xml")
    with pytest.raises(ValueError, match="http"):
        WebhookEndpoint("file:///etc/passwd")


async def _deliver(sender: WebhookSender, event: Mapping[str, object]) -> None:
    await sender.start()
    try:
        sender.send(event)
        assert await sender.drain(20.0)
    finally:
        await sender.stop()


def test_signed_json_and_slack_delivered(receiver: Receiver) -> None:
    registry = CollectorRegistry()
    stored: list[Delivery] = []
    sender = WebhookSender(
        [WebhookEndpoint(receiver.url, "json", SECRET), WebhookEndpoint(receiver.url, "slack")],
        on_delivery=stored.append, registry=registry,
    )
    event = {"id": "d1", "title": "unhealthy: xid on gpu:n2/1", "reason": "XID 79",
             "job": "j1", "action": "checkpoint", "outcome": "act"}
    asyncio.run(_deliver(sender, event))
    assert len(receiver.requests) == 2
    by_kind = {("blocks" in json.loads(b)): (h, b) for h, b in receiver.requests}
    headers, body = by_kind[False]
    verifier = WebhookVerifier(SECRET)
    verifier.verify(body, headers)  # the receiver's check passes on what actually arrived
    assert json.loads(body)["id"] == "d1"
    slack_headers, slack_body = by_kind[True]
    slack = json.loads(slack_body)
    assert slack["text"].startswith("forewarn:") and slack["blocks"][0]["type"] == "section"
    assert "XID 79" in slack["blocks"][0]["text"]["text"]
    assert SIGNATURE_HEADER not in slack_headers
    assert [d.status for d in stored] == ["delivered", "delivered"]
    assert registry.get_sample_value("forewarn_collector_webhook_deliveries_total",
                                     {"status": "delivered"}) == 2.0


def test_retries_with_backoff_then_delivers(receiver: Receiver) -> None:
    receiver.statuses = [503, 429]
    registry = CollectorRegistry()
    sender = WebhookSender([WebhookEndpoint(receiver.url, "json", SECRET)], backoff_s=0.05,
                           registry=registry)
    asyncio.run(_deliver(sender, {"id": "d2"}))
    assert [(d.status, d.http_status, d.attempt) for d in sender.deliveries] == [
        ("retry", 503, 1), ("retry", 429, 2), ("delivered", 200, 3)]
    # backoff doubles: the third attempt comes at least 0.05 + 0.1 s after the first
    assert sender.deliveries[2].time - sender.deliveries[0].time >= 0.14
    # every attempt carried a valid, fresh signature
    for headers, body in receiver.requests:
        verify_signature(SECRET, body, headers)
    assert registry.get_sample_value("forewarn_collector_webhook_deliveries_total",
                                     {"status": "retry"}) == 2.0


def test_client_error_fails_without_retry(receiver: Receiver) -> None:
    receiver.statuses = [400]
    sender = WebhookSender([WebhookEndpoint(receiver.url)], backoff_s=0.01)
    asyncio.run(_deliver(sender, {"id": "d3"}))
    assert [(d.status, d.http_status) for d in sender.deliveries] == [("failed", 400)]


def test_unreachable_gives_up_after_max_attempts() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sender = WebhookSender([WebhookEndpoint(f"http://127.0.0.1:{port}/")], max_attempts=3,
                           backoff_s=0.01)
    asyncio.run(_deliver(sender, {"id": "d4"}))
    assert [d.status for d in sender.deliveries] == ["retry", "retry", "failed"]
    assert "ConnectError" in sender.deliveries[-1].detail


def test_a_delivery_that_crashes_ends_failed() -> None:
    """An error that is not HTTP's (httpx refuses the URL) ends the delivery as failed,
    stored like any other ending: left under way, it had no stored ending, so every
    takeover sent it again (webhook_history resends deliveries that have not ended)."""
    sender = WebhookSender([WebhookEndpoint("http://[::1/")], backoff_s=0.01)
    asyncio.run(_deliver(sender, {"id": "d5"}))
    assert [d.status for d in sender.deliveries] == ["failed"]
    assert "InvalidURL" in sender.deliveries[-1].detail


def test_full_queue_drops_and_counts() -> None:
    registry = CollectorRegistry()
    sender = WebhookSender([WebhookEndpoint("http://127.0.0.1:9/")], queue_size=1,
                           registry=registry)

    async def run() -> None:
        await sender.start()
        try:
            sender.send({"id": "a"})
            sender.send({"id": "b"})  # the worker has not run yet: the queue is full
        finally:
            await sender.stop()

    asyncio.run(run())
    assert registry.get_sample_value("forewarn_collector_webhook_deliveries_total",
                                     {"status": "dropped"}) == 1.0
