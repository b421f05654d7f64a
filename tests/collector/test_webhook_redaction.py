"""A webhook URL is a secret (a Slack URL's path is its token; a generic endpoint may carry
one in its query): whatever a delivery's failure, nothing logged quotes it (real HTTP on
loopback, every logger captured at DEBUG)."""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

import pytest

from forewarn.collector.config import CollectorConfig
from forewarn.collector.decide.webhooks import Delivery, WebhookEndpoint, WebhookSender
from forewarn.config import ConfigError
from forewarn.redact import redact_url, scrub

from support.webhooks import Receiver

PATH_TOKEN = "XoxbPathToken0123456789"
QUERY_TOKEN = "QueryToken9876543210"


def secret_url(port: int, extra: str = "") -> str:
    return (f"http://127.0.0.1:{port}/services/T0001/B0002/{PATH_TOKEN}{extra}"
            f"?token={QUERY_TOKEN}")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def deliver(url: str, caplog: pytest.LogCaptureFixture, timeout_s: float = 5.0) -> Delivery:
    """Send one event to ``url`` (two attempts, no backoff); return its last delivery."""
    stored: list[Delivery] = []
    sender = WebhookSender([WebhookEndpoint(url)], max_attempts=2, backoff_s=0.0,
                           timeout_s=timeout_s, on_delivery=stored.append)

    async def run() -> None:
        await sender.start()
        try:
            sender.send({"id": "e1"})
            assert await sender.drain(timeout_s=4 * timeout_s + 10)
        finally:
            await sender.stop()

    caplog.set_level(logging.DEBUG)
    asyncio.run(run())
    assert stored and stored[-1].status == "failed"
    return stored[-1]


def assert_no_secret(caplog: pytest.LogCaptureFixture, last: Delivery) -> None:
    logged = caplog.text + "".join(
        str(r.exc_info[1]) for r in caplog.records if r.exc_info and r.exc_info[1])
    assert caplog.records  # the failure was logged at all (httpx's lines, or ours)
    for secret in (PATH_TOKEN, QUERY_TOKEN):
        assert secret not in logged
        assert secret not in last.detail


def test_a_failing_receivers_url_is_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    receiver = Receiver()
    receiver.statuses = [500, 500]
    try:
        last = deliver(secret_url(int(receiver.server.server_address[1])), caplog)
    finally:
        receiver.close()
    assert last.http_status == 500 and len(receiver.requests) == 2
    assert_no_secret(caplog, last)


def test_a_refused_connections_url_is_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    assert_no_secret(caplog, deliver(secret_url(closed_port()), caplog))


def test_a_timed_out_receivers_url_is_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    receiver = Receiver()
    receiver.hang.set()
    try:
        last = deliver(secret_url(int(receiver.server.server_address[1])), caplog,
                       timeout_s=0.2)
    finally:
        receiver.close()
    assert "Timeout" in last.detail
    assert_no_secret(caplog, last)


def test_a_url_httpx_refuses_is_logged_redacted(caplog: pytest.LogCaptureFixture) -> None:
    # a control character: httpx raises InvalidURL (not an HTTPError), the crash path
    last = deliver(secret_url(closed_port(), extra="\x01"), caplog)
    assert "InvalidURL" in caplog.text
    assert_no_secret(caplog, last)


def test_redacted_forms() -> None:
    url = secret_url(8080)
    assert redact_url(url) == "http://127.0.0.1:8080/…"
    assert redact_url("https://u:pw@hooks.example/") == "https://hooks.example"
    assert redact_url("http://h:notaport/x") == "(unparsable URL)"
    # a message quoting the path or the query alone loses them too
    message = f"bad request <Request('POST', '{url}')> to /services/T0001/B0002/{PATH_TOKEN}"
    assert PATH_TOKEN not in scrub(message, url) and QUERY_TOKEN not in scrub(message, url)


def test_a_mistyped_url_is_refused_without_quoting_its_token(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be http") as caught:
        WebhookEndpoint(f"htps://hooks.slack.com/services/T0001/B0002/{PATH_TOKEN}")
    assert PATH_TOKEN[:6] not in str(caught.value)  # not even the start of it
    with pytest.raises(ConfigError, match="remote_write_url") as refused:
        CollectorConfig(data_dir=tmp_path, tokens_file=tmp_path / "none.toml",
                        remote_write_url=f"htp://vm.example/write?token={QUERY_TOKEN}")
    assert QUERY_TOKEN not in str(refused.value)
