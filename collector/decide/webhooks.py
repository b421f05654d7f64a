"""Outbound webhooks: signed generic JSON and a Slack-compatible form, delivered by a
background worker with retries and exponential backoff.

Signature (generic JSON endpoints with a secret)::

    X-Forewarn-Timestamp: <unix seconds>
    X-Forewarn-Signature: sha256=<hex HMAC-SHA256(secret, "<timestamp>.<raw body>")>

The timestamp is inside the signed text, so it cannot be changed without breaking the
signature. A receiver calls :func:`verify_signature` (or keeps a :class:`WebhookVerifier`,
which also refuses a request it has already seen): requests whose timestamp is more than
``tolerance_s`` (default 300 s) away from the receiver's clock are rejected, so a captured
request cannot be replayed later; within the window, the verifier's memory of signatures
rejects an exact replay (a signature covers the timestamp, so the same event sent again
at another second is not an exact replay: see the idempotency key below).

Idempotency: every decision's event carries ``idempotency_key`` in its body, sent again as
the ``Idempotency-Key`` header (:data:`IDEMPOTENCY_HEADER`). It comes from what the decision
is about (:func:`~.actions.decision_key`: action, target, the finding's content), so the same
finding decided again, by a new leader after a takeover, gives the same key while its
decision ``id`` and ``time`` differ; retries of one delivery carry it too. The body is
signed, so the key a receiver reads from the body of a verified request is authentic
(the header is the same value for receivers that dedupe before parsing).

Bodies: an event is JSON-encoded (every character of a job name or reason survives,
escaped as JSON) and bounded: strings are cut to :data:`MAX_FIELD_CHARS`, lists and
objects to :data:`MAX_ITEMS` (an ellipsis marks each cut), so a body stays under
:data:`MAX_BODY_BYTES`. The Slack form escapes ``&``, ``<`` and ``>`` in every value, as
Slack requires, so a job named ``<!channel>`` is text, not a mention or a link.

Delivery: each event goes to every endpoint, and each endpoint is delivered to on its own:
:class:`WebhookSender` keeps a bounded queue (``queue_size``), a worker and an HTTP client
per endpoint, so a receiver that hangs until ``timeout_s`` delays only its own deliveries,
and when its queue fills only its own are dropped. Connection errors, timeouts, 429 and 5xx
are retried after ``backoff_s * 2**attempt`` (capped) up to ``max_attempts``, each retry
on its own timer; other 4xx fail at once. Each attempt's result is handed to the
``on_delivery`` callback (the store) and counted in
``forewarn_collector_webhook_deliveries_total{status}`` with status ``delivered``,
``retry``, ``failed`` or ``dropped`` (that endpoint's queue full).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import hmac
import logging
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import httpx
import msgspec
from prometheus_client import CollectorRegistry, Counter

from forewarn.errors import InputError
from forewarn.redact import redact_httpx_logs, redact_url, scrub

__all__ = [
    "IDEMPOTENCY_HEADER",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "Delivery",
    "SignatureError",
    "WebhookEndpoint",
    "WebhookSender",
    "WebhookVerifier",
    "bounded",
    "encode_event",
    "sign",
    "signed_headers",
    "slack_payload",
    "verify_signature",
]

log = logging.getLogger(__name__)

TIMESTAMP_HEADER = "X-Forewarn-Timestamp"
SIGNATURE_HEADER = "X-Forewarn-Signature"
IDEMPOTENCY_HEADER = "Idempotency-Key"
"""The event's ``idempotency_key`` (the IETF HTTPAPI draft's header name)."""
DEFAULT_TOLERANCE_S = 300.0
MAX_FIELD_CHARS = 2000
"""Longest string in a webhook body (characters); longer ones end in ``…``."""
MAX_ITEMS = 50
"""Most items of a list or keys of an object in a webhook body."""
MAX_BODY_BYTES = 64 * 1024
"""Largest webhook body: past the bounds above it is sent with strings of 256 characters
and 10 items."""


class SignatureError(InputError, ValueError):
    """A webhook request failed verification; the message says why."""


def sign(secret: bytes, timestamp: int, body: bytes) -> str:
    """``sha256=<hex>`` of HMAC-SHA256 over ``b"<timestamp>." + body``."""
    mac = hmac.new(secret, str(timestamp).encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def signed_headers(secret: bytes, body: bytes, now: float) -> dict[str, str]:
    """The two signature headers for ``body`` sent at ``now``."""
    ts = int(now)
    return {TIMESTAMP_HEADER: str(ts), SIGNATURE_HEADER: sign(secret, ts, body)}


def _header(headers: Mapping[str, str], name: str) -> str:
    for key, value in headers.items():
        if key.lower() == name.lower():
            return value
    raise SignatureError(f"missing header {name}")


def verify_signature(
    secret: bytes,
    body: bytes,
    headers: Mapping[str, str],
    *,
    now: float | None = None,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
) -> int:
    """Check a received webhook; return its timestamp or raise :class:`SignatureError`.

    ``body`` must be the raw bytes as received. Rejects: missing headers, a timestamp that
    is not an integer or is more than ``tolerance_s`` from ``now`` (old requests replayed
    later, or clocks far apart), and a signature that does not match (compared in constant
    time).
    """
    raw_ts = _header(headers, TIMESTAMP_HEADER).strip()
    given = _header(headers, SIGNATURE_HEADER).strip()
    if not raw_ts.isdigit() or len(raw_ts) > 12:
        raise SignatureError(f"bad {TIMESTAMP_HEADER}: {raw_ts[:32]!r}")
    ts = int(raw_ts)
    current = time.time() if now is None else now
    if abs(current - ts) > tolerance_s:
        raise SignatureError(
            f"timestamp {ts} is {current - ts:+.0f} s from now (tolerance {tolerance_s:.0f} s):"
            " stale or replayed request"
        )
    if not given.startswith("sha256="):
        raise SignatureError(f"bad {SIGNATURE_HEADER}: expected sha256=<hex>")
    if not hmac.compare_digest(given.encode(), sign(secret, ts, body).encode()):
        raise SignatureError("signature does not match")
    return ts


class WebhookVerifier:
    """:func:`verify_signature` plus a memory of accepted signatures within the tolerance
    window, so an exact replay inside the window is rejected too."""

    def __init__(
        self,
        secret: bytes,
        *,
        tolerance_s: float = DEFAULT_TOLERANCE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.secret = secret
        self.tolerance_s = tolerance_s
        self._clock = clock
        self._seen: collections.OrderedDict[str, int] = collections.OrderedDict()

    def verify(self, body: bytes, headers: Mapping[str, str]) -> int:
        """Verify one request; raise :class:`SignatureError` if bad or already seen."""
        now = self._clock()
        ts = verify_signature(self.secret, body, headers, now=now, tolerance_s=self.tolerance_s)
        while self._seen and next(iter(self._seen.values())) < now - self.tolerance_s:
            self._seen.popitem(last=False)
        sig = _header(headers, SIGNATURE_HEADER).strip()
        if sig in self._seen:
            raise SignatureError("replayed request: this signature was already accepted")
        self._seen[sig] = ts
        return ts


@dataclasses.dataclass(frozen=True)
class WebhookEndpoint:
    """One receiver: ``format`` is ``json`` (generic, signed when ``secret``) or ``slack``."""

    url: str
    format: str = "json"
    secret: bytes = b""

    def __post_init__(self) -> None:
        if self.format not in ("json", "slack"):
            raise ValueError(f"webhook format must be json or slack, got {self.format!r}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"webhook url must be http(s), got {redact_url(self.url)!r}")


@dataclasses.dataclass(frozen=True)
class Delivery:
    """The result of one delivery attempt (what the store and the API show)."""

    event_id: str
    url: str
    attempt: int
    status: str
    """delivered, retry, failed, dropped."""
    http_status: int | None
    detail: str
    time: float


def bounded(value: Any, chars: int = MAX_FIELD_CHARS, items: int = MAX_ITEMS,
            depth: int = 0) -> Any:
    """``value`` (JSON-like) with strings, lists and objects cut to the bounds."""
    if isinstance(value, str):
        return value if len(value) <= chars else value[:chars - 1] + "…"
    if depth > 8:
        return "…"
    if isinstance(value, Mapping):
        kept = list(value.items())[:items]
        out = {bounded(str(k), 64): bounded(v, chars, items, depth + 1) for k, v in kept}
        if len(value) > items:
            out["…"] = f"{len(value) - items} more"
        return out
    if isinstance(value, list | tuple):
        cut = [bounded(v, chars, items, depth + 1) for v in value[:items]]
        return cut + ([f"… {len(value) - items} more"] if len(value) > items else [])
    return value


def encode_event(event: Mapping[str, Any]) -> bytes:
    """The JSON body of ``event``, at most :data:`MAX_BODY_BYTES`."""
    body = msgspec.json.encode(bounded(event))
    if len(body) > MAX_BODY_BYTES:
        body = msgspec.json.encode(bounded(event, 256, 10))
    return body


def _slack_text(value: Any, limit: int = 500) -> str:
    """``value`` as Slack mrkdwn text: cut, with ``&``, ``<`` and ``>`` escaped."""
    text = str(value)[:limit]
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def slack_payload(event: Mapping[str, Any]) -> dict[str, Any]:
    """Slack incoming-webhook form (``text`` fallback plus ``blocks``) of an event."""
    title = _slack_text(event.get("title") or event.get("type") or "forewarn")
    lines = [f"*{title}*"]
    for key in ("reason", "subject", "job", "node", "action", "outcome"):
        value = event.get(key)
        if value:
            lines.append(f"*{key}*: {_slack_text(value)}")
    text = "\n".join(lines)
    return {
        "text": f"forewarn: {title}",
        "blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": text[:2900]}}],
    }


@dataclasses.dataclass
class _Job:
    event_id: str
    endpoint: WebhookEndpoint
    body: bytes
    key: str = ""
    attempt: int = 0


@dataclasses.dataclass
class _Lane:
    """One endpoint's deliveries: its own bounded queue, worker and HTTP client, so an
    endpoint that hangs delays and drops only its own deliveries."""

    queue: asyncio.Queue[_Job]
    client: httpx.AsyncClient
    worker: asyncio.Task[None] | None = None


class WebhookSender:
    """Background delivery of events to endpoints (see the module docstring).

    ``client`` is the HTTP client every endpoint shares (inject
    ``httpx.AsyncClient(transport=...)`` in tests; its connection pool is then shared too);
    without one, each endpoint gets its own. ``queue_size`` bounds each endpoint's queue.
    ``clock`` stamps signatures. Start with :meth:`start` inside the event loop and stop
    with :meth:`stop`; :meth:`send` never blocks and never raises.
    """

    def __init__(
        self,
        endpoints: list[WebhookEndpoint],
        *,
        client: httpx.AsyncClient | None = None,
        max_attempts: int = 5,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        timeout_s: float = 5.0,
        queue_size: int = 1000,
        on_delivery: Callable[[Delivery], None] | None = None,
        clock: Callable[[], float] = time.time,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.endpoints = endpoints
        self._client = client
        self.max_attempts = max(1, max_attempts)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.timeout_s = timeout_s
        self._queue_size = queue_size
        self._lanes: dict[WebhookEndpoint, _Lane] | None = None
        """Per endpoint, from :meth:`start` to :meth:`stop`."""
        self._on_delivery = on_delivery
        self._clock = clock
        self._tasks: set[asyncio.Task[None]] = set()
        self._pending = 0
        self._under_way: set[tuple[str, WebhookEndpoint]] = set()
        """(event id, endpoint) of the deliveries queued or waiting for a retry."""
        self._idle = asyncio.Event()
        self.deliveries: collections.deque[Delivery] = collections.deque(maxlen=500)
        """The latest delivery attempts, newest last."""
        registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._m = Counter(
            "forewarn_collector_webhook_deliveries",
            "Webhook delivery attempts by status (delivered, retry, failed, dropped).",
            ["status"],
            registry=registry,
        )

    async def start(self) -> None:
        """Start a worker per endpoint on the running loop."""
        if self._lanes is not None:
            return
        self._lanes = {}
        redact_httpx_logs()  # httpx logs each request's full url
        for n, ep in enumerate(dict.fromkeys(self.endpoints)):
            client = (self._client if self._client is not None
                      else httpx.AsyncClient(timeout=self.timeout_s))
            lane = self._lanes[ep] = _Lane(asyncio.Queue(self._queue_size), client)
            # named by position, not url: a url can hold a token (Slack's do)
            lane.worker = asyncio.create_task(self._run(lane), name=f"webhook-sender-{n}")

    async def stop(self) -> None:
        """Stop the workers and pending retries (undelivered events are dropped)."""
        lanes = list((self._lanes or {}).values())
        self._lanes = None
        tasks = [t for t in (*(lane.worker for lane in lanes), *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._under_way.clear()
        self._pending = 0  # dropped: a drain after a restart waits for new events only
        self._idle.set()
        for lane in lanes:
            if lane.client is not self._client:
                await lane.client.aclose()

    def send(self, event: Mapping[str, Any], skip: Collection[str] = ()) -> int:
        """Queue ``event`` for every endpoint but those whose url is in ``skip``; returns
        how many deliveries were queued. A delivery of the same event to the same endpoint
        that is still under way is not queued again (a replica that leads again resends
        what the store says has not ended: :mod:`.webhook_history`). An endpoint whose
        queue is full drops its delivery (status ``dropped``); the others still queue."""
        if self._lanes is None:
            log.warning("webhook sender not started; event %s dropped", event.get("id"))
            return 0
        event_id = str(event.get("id", ""))
        key = str(event.get("idempotency_key", ""))
        generic = encode_event(event)
        slack = msgspec.json.encode(slack_payload(event))
        queued = 0
        for ep, lane in self._lanes.items():
            if ep.url in skip or (event_id and (event_id, ep) in self._under_way):
                continue
            job = _Job(event_id, ep, slack if ep.format == "slack" else generic, key)
            try:
                lane.queue.put_nowait(job)
                self._under_way.add((event_id, ep))
                queued += 1
                self._pending += 1
                self._idle.clear()
            except asyncio.QueueFull:
                self._result(job, "dropped", None, "queue full")
        return queued

    async def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued event reached a final status (delivered, failed);
        returns False on timeout (tests, shutdown)."""
        if self._pending == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def _run(self, lane: _Lane) -> None:
        while True:
            job = await lane.queue.get()
            try:
                await self._attempt(job, lane.client)
            except Exception as exc:  # the worker must survive anything
                log.error("webhook delivery to %s crashed: %s", self._name(job.endpoint),
                          _scrubbed(exc, job.endpoint))
            finally:
                lane.queue.task_done()

    async def _attempt(self, job: _Job, client: httpx.AsyncClient) -> None:
        job.attempt += 1
        headers = {"Content-Type": "application/json", "User-Agent": "forewarn-collector"}
        if job.key:
            headers[IDEMPOTENCY_HEADER] = job.key
        if job.endpoint.format == "json" and job.endpoint.secret:
            headers.update(signed_headers(job.endpoint.secret, job.body, self._clock()))
        status: int | None = None
        try:
            resp = await client.post(
                job.endpoint.url, content=job.body, headers=headers, timeout=self.timeout_s
            )
            status = resp.status_code
            if 200 <= status < 300:
                self._result(job, "delivered", status, "")
                return
            retry = status == 429 or status >= 500
            detail = f"HTTP {status}"
        except httpx.HTTPError as exc:
            retry, detail = True, _scrubbed(exc, job.endpoint)
        except Exception as exc:  # not the network's (a URL httpx refuses): it ends here,
            # stored as failed, or it stays under way and every takeover sends it again
            detail = _scrubbed(exc, job.endpoint)
            log.error("webhook to %s crashed: %s", self._name(job.endpoint), detail)
            retry = False
        if not retry or job.attempt >= self.max_attempts:
            self._result(job, "failed", status, detail)
            return
        self._result(job, "retry", status, detail)
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (job.attempt - 1))
        task = asyncio.create_task(self._later(job, client, delay))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _later(self, job: _Job, client: httpx.AsyncClient, delay: float) -> None:
        await asyncio.sleep(delay)
        try:
            await self._attempt(job, client)
        except Exception as exc:
            log.error("webhook retry to %s crashed: %s", self._name(job.endpoint),
                      _scrubbed(exc, job.endpoint))

    def _name(self, ep: WebhookEndpoint) -> str:
        """How logs name ``ep``: its place in the configured list and its redacted url."""
        place = self.endpoints.index(ep) if ep in self.endpoints else "?"
        return f"#{place} {redact_url(ep.url)}"

    def _result(self, job: _Job, status: str, http_status: int | None, detail: str) -> None:
        d = Delivery(
            event_id=job.event_id, url=job.endpoint.url, attempt=job.attempt, status=status,
            http_status=http_status, detail=detail, time=self._clock(),
        )
        self.deliveries.append(d)
        self._m.labels(status).inc()
        if status in ("delivered", "failed"):
            self._under_way.discard((job.event_id, job.endpoint))
        if status in ("delivered", "failed") and self._pending > 0:
            self._pending -= 1
            if self._pending == 0:
                self._idle.set()
        if self._on_delivery is not None:
            try:
                self._on_delivery(d)
            except Exception:
                log.exception("storing webhook delivery failed")


def _scrubbed(exc: BaseException, ep: WebhookEndpoint) -> str:
    """``exc`` as ``Type: message`` without ``ep``'s url (httpx messages may quote it),
    cut to 500 characters: what is logged and stored, never the raw exception."""
    return scrub(f"{type(exc).__name__}: {exc}", ep.url)[:500]
