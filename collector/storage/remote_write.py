"""GPU series to a Prometheus remote-write endpoint (VictoriaMetrics, Mimir, Thanos,
Prometheus with ``--web.enable-remote-write-receiver``): the series side of the scale-out
mode. Parquet stays the embedded mode's history and the models' training export.

What is sent: for every GPU sample the collector accepted (once per batch: a duplicate
batch is not staged, so not sent, except that the bus sends a redelivered batch's samples
again, :mod:`..ingest.bus`), the series the agent's exporter exposes for it, with the
same names and labels (``node``, ``gpu``, ``uuid``, ``simulated``; names and scales from
:data:`forewarn.agent.exporter.GPU_GAUGES`, plus ``forewarn_gpu_info`` and
``forewarn_gpu_state``), stamped with the sample's own time, plus ``remote_write_labels``
(e.g. ``cluster``). So the dashboards' queries run unchanged against the store.

Protocol: remote write 1.0 (https://prometheus.io/docs/specs/remote_write_spec/): a
protobuf ``prometheus.WriteRequest`` (encoded here by hand, :func:`encode_write_request`:
four small messages, no generated code), snappy block-compressed, POSTed with
``Content-Encoding: snappy``, ``Content-Type: application/x-protobuf`` and
``X-Prometheus-Remote-Write-Version: 0.1.0``.

Delivery: :meth:`RemoteWriter.offer` queues samples (never blocks ingest); ``shards`` threads
send them, each its own series (a GPU's always go through the same one, in order), in
requests of at most ``batch_samples`` GPU samples, so a slow store has several requests in
flight at once. A 5xx, a 429 or a network error
is retried with exponential backoff (``backoff_s`` doubling up to ``backoff_max_s``), the
request kept; another 4xx drops that request (the spec: never retry those), counted. The
queue holds at most ``queue_samples`` GPU samples; past that new samples are dropped and
counted (``remote_write_dropped_samples_total{reason="queue_full"}``), so an unreachable
store costs bounded memory and never slows ingest. :meth:`RemoteWriter.written` is a future
done once every sample offered so far is in the store (or dropped for good, counted): the
bus acknowledges a batch only then, so a replica killed with samples queued loses none
(JetStream delivers the batch again and the next replica sends its samples again).
At-least-once: a request retried after the store took it, or a batch sent again, writes the
same (series, timestamp, value) again, which the store keeps once (VictoriaMetrics with
``-dedup.minScrapeInterval``; Prometheus-compatible stores drop an equal sample).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import struct
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import httpx

from forewarn.agent.exporter import GPU_GAUGES
from forewarn.config import ConfigError
from forewarn.redact import redact_httpx_logs, redact_url
from forewarn.wire import GpuSample, GpuState

from ..metrics import CollectorMetrics

__all__ = ["RemoteWriter", "encode_write_request", "series_of"]

log = logging.getLogger(__name__)

HEADERS = {"Content-Encoding": "snappy", "Content-Type": "application/x-protobuf",
           "X-Prometheus-Remote-Write-Version": "0.1.0", "User-Agent": "forewarn-collector"}

RECENT_BATCHES = 100_000
"""Batches whose keys :meth:`RemoteWriter.resend` remembers (~10 MB): more than are sent
again while one collector process lives (an agent's retry, a redelivery)."""

Series = tuple[tuple[tuple[str, str], ...], list[tuple[int, float]]]
"""Sorted labels (``__name__`` included) and (timestamp ms, value) samples."""


# -- protobuf, by hand (prompb/types.proto, remote.proto) ---------------------------------

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def encode_write_request(series: Iterable[Series]) -> bytes:
    """``WriteRequest{timeseries=1: TimeSeries{labels=1: Label{name=1, value=2},
    samples=2: Sample{value=1 (double), timestamp=2 (int64 ms)}}}``."""
    out = bytearray()
    for labels, samples in series:
        ts = bytearray()
        for name, value in labels:
            ts += _field(1, _field(1, name.encode()) + _field(2, value.encode()))
        for t_ms, v in samples:
            ts += _field(2, b"\x09" + struct.pack("<d", v) + b"\x10" + _varint(t_ms))
        out += _field(1, bytes(ts))
    return bytes(out)


# -- samples to series ----------------------------------------------------------------

def series_of(samples: Iterable[GpuSample], extra: Mapping[str, str] | None = None
              ) -> list[Series]:
    """The exporter's per-GPU series for ``samples``, grouped by label set, each series'
    samples in time order."""
    grouped: dict[tuple[tuple[str, str], ...], list[tuple[int, float]]] = {}
    extra_items = tuple((extra or {}).items())

    def add(name: str, base: tuple[tuple[str, str], ...], t_ms: int, value: float,
            *more: tuple[str, str]) -> None:
        key = tuple(sorted((("__name__", name), *base, *more)))
        grouped.setdefault(key, []).append((t_ms, value))

    for s in samples:
        base = (("node", s.node), ("gpu", str(s.gpu)), ("uuid", s.uuid),
                ("simulated", "true" if s.simulated else "false"), *extra_items)
        t_ms = round(s.time * 1000)
        add("forewarn_gpu_info", base, t_ms, 1.0, ("name", s.name),
            ("pci_bus_id", s.pci_bus_id), ("source", s.source))
        for state in GpuState:
            add("forewarn_gpu_state", base, t_ms, 1.0 if s.state == state else 0.0,
                ("state", state.value))
        for field, name, _help, scale in GPU_GAUGES:
            value = getattr(s, field)
            if value is not None:
                add(name, base, t_ms, float(value) * scale)
    return [(labels, sorted(points)) for labels, points in grouped.items()]


# -- the sender -----------------------------------------------------------------------

class _Shard:
    """One sender thread's queue. It sends in queue order, one request at a time, so the
    samples it finished are always a prefix of those it was offered."""

    def __init__(self, lock: threading.Lock) -> None:
        self.queue: collections.deque[GpuSample] = collections.deque()
        self.wake = threading.Condition(lock)
        self.offered = 0
        """GPU samples ever queued here: the position of the queue's end."""
        self.finished = 0
        """GPU samples ever taken off this queue and done with (sent, or dropped for good)."""


class RemoteWriter:
    """Queue and send GPU samples to ``url``; see the module docstring. Thread-safe.

    ``shards`` requests may be in flight at once, one per sender thread; each series
    always goes through the same one (a GPU's samples are routed by node and index), so
    its samples reach the store in the order they were offered, as Prometheus' own
    remote write shards them."""

    def __init__(self, url: str, metrics: CollectorMetrics, *,
                 labels: Mapping[str, str] | None = None, queue_samples: int = 200_000,
                 batch_samples: int = 2_000, shards: int = 4, timeout_s: float = 10.0,
                 backoff_s: float = 0.5, backoff_max_s: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        try:
            import cramjam  # noqa: F401  (snappy: checked here, not at the first send)
        except ImportError:
            raise ConfigError("remote_write_url: needs cramjam for snappy: pip install "
                              "'forewarn[scale]'") from None
        self.url = url
        self.metrics = metrics
        self.labels = dict(labels or {})
        self.queue_samples = queue_samples
        self.batch_samples = batch_samples
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        # One pooled client for every shard: httpx.Client is thread-safe.
        self._client = httpx.Client(timeout=timeout_s, transport=transport,
                                    limits=httpx.Limits(max_keepalive_connections=shards))
        self._lock = threading.Lock()
        self._shards = [_Shard(self._lock) for _ in range(shards)]
        self._queued = 0
        self._stopping = False
        self._stopped = threading.Event()
        """Set by :meth:`stop`: it wakes a sender waiting out a retry's backoff."""
        self._waiters: collections.deque[tuple[list[int], concurrent.futures.Future[None]]] = \
            collections.deque()
        """:meth:`written` futures with each shard's position they wait for, oldest first
        (so each one's positions are at least its predecessor's)."""
        self._recent: collections.OrderedDict[tuple[str, int], None] = \
            collections.OrderedDict()
        """``(agent_id, seq)`` of the last :data:`RECENT_BATCHES` batches whose samples
        this process queued (:meth:`resend` need not queue them again)."""
        self.last_error = ""
        """Why the last request failed ("" after a success), for /readyz."""
        self._threads = [threading.Thread(target=self._run, args=(shard,), daemon=True,
                                          name=f"forewarn-remote-write-{i}")
                         for i, shard in enumerate(self._shards)]

    def start(self) -> None:
        redact_httpx_logs()  # httpx logs each request's full url, which may hold a token
        for thread in self._threads:
            thread.start()

    @property
    def queued(self) -> int:
        """GPU samples waiting to be sent."""
        return self._queued

    def offer(self, samples: Sequence[GpuSample]) -> None:
        """Queue ``samples``; what does not fit in the queue is dropped and counted."""
        with self._lock:
            room = max(0, self.queue_samples - self._queued)
            woken = set()
            for sample in samples[:room]:
                shard = self._shards[hash((sample.node, sample.gpu)) % len(self._shards)]
                shard.queue.append(sample)
                shard.offered += 1
                woken.add(id(shard))
            self._queued += min(room, len(samples))
            if len(samples) > room:
                self.metrics.remote_write_dropped.labels("queue_full").inc(len(samples) - room)
            for shard in self._shards:
                if id(shard) in woken:
                    shard.wake.notify()
            queued = self._queued
        self.metrics.remote_write_queued.set(queued)

    def written(self) -> concurrent.futures.Future[None]:
        """A future done once every sample offered so far is in the store or dropped for
        good (refused by it, or past the queue: counted), whichever requests carried them;
        it fails when the writer stops first (those samples were not sent)."""
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            if self._stopping:
                future.set_exception(RuntimeError("remote write stopped"))
            elif all(s.finished >= s.offered for s in self._shards):
                future.set_result(None)
            else:
                self._waiters.append(([s.offered for s in self._shards], future))
        return future

    def on_staged(self, staged: list[tuple[int, str, int, list[GpuSample]]]) -> None:
        """The ingest writer's hook: the samples of newly stored batches."""
        for _id, agent_id, seq, samples in staged:
            self._remember(agent_id, seq)
            self.offer(samples)

    def resend(self, agent_id: str, seq: int, samples: Sequence[GpuSample]) -> None:
        """A batch the state store already had (a duplicate) came again: queue its samples
        again (counted, ``remote_write_resent_samples_total``) unless this process queued
        them itself. The process that stored it may have died with them queued; the store
        keeps an equal sample once."""
        if self._remember(agent_id, seq):
            return
        self.offer(samples)
        self.metrics.remote_write_resent.inc(len(samples))

    def _remember(self, agent_id: str, seq: int) -> bool:
        """Note the batch as queued here; whether it was already."""
        key = (agent_id, seq)
        with self._lock:
            if key in self._recent:
                return True
            self._recent[key] = None
            if len(self._recent) > RECENT_BATCHES:
                self._recent.popitem(last=False)
            return False

    def stop(self, timeout_s: float = 10.0) -> None:
        """Send what is queued for up to ``timeout_s``, then end: what was not written is
        dropped and counted, and no :meth:`written` future waiting for it succeeds (its
        batches stay unacknowledged, so the bus delivers them again and agents resend).

        In order: the senders drain (a shard whose request fails while stopping sends
        nothing after it, so a later success cannot acknowledge it); the waiters still
        waiting fail; only then is the client closed. A request still in flight to a
        hung store ends on its own (its read times out on the closed client); its
        sender thread then ends without raising."""
        with self._lock:
            self._stopping = True
            for shard in self._shards:
                shard.wake.notify()
        self._stopped.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            if thread.ident is not None:  # started
                thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            left = self._queued
            for shard in self._shards:
                shard.queue.clear()
            self._queued = 0
            waiters, self._waiters = self._waiters, collections.deque()
        for _positions, future in waiters:
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled
                future.set_exception(RuntimeError("remote write stopped before these were"
                                                  " sent"))
        if left:
            self.metrics.remote_write_dropped.labels("shutdown").inc(left)
        self._client.close()

    def _take(self, shard: _Shard) -> list[GpuSample]:
        with self._lock:
            while not shard.queue and not self._stopping:
                shard.wake.wait()
            n = min(self.batch_samples, len(shard.queue))
            self._queued -= n
            return [shard.queue.popleft() for _ in range(n)]

    def _run(self, shard: _Shard) -> None:
        while True:
            batch = self._take(shard)
            if not batch:
                return  # stopping and drained
            self.metrics.remote_write_queued.set(self._queued)
            body = _compress(encode_write_request(series_of(batch, self.labels)))
            if not self._send(body, len(batch)):
                # Stopping, and this request was not written: send nothing after it.
                # ``finished`` must stay a prefix of what was offered, or a later success
                # would acknowledge these samples (:meth:`written`).
                self._drop_rest(shard)
                return
            self._done(shard, len(batch))

    def _drop_rest(self, shard: _Shard) -> None:
        """The writer stops and ``shard`` sends no more: its queue is dropped, counted."""
        with self._lock:
            left = len(shard.queue)
            shard.queue.clear()
            self._queued -= left
        if left:
            self.metrics.remote_write_dropped.labels("shutdown").inc(left)

    def _done(self, shard: _Shard, samples: int) -> None:
        """``samples`` more of ``shard`` are done with: wake the :meth:`written` futures
        whose samples are all done now."""
        ready = []
        with self._lock:
            shard.finished += samples
            while self._waiters and all(
                    s.finished >= want for s, want in zip(self._shards, self._waiters[0][0],
                                                          strict=True)):
                ready.append(self._waiters.popleft()[1])
        for future in ready:
            # A waiter may have cancelled it; the sender thread must go on.
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_result(None)

    def _send(self, body: bytes, samples: int) -> bool:
        """POST until it is taken or refused for good (True), or the writer stops
        (False: the samples were not sent)."""
        delay = self.backoff_s
        while True:
            started = time.perf_counter()
            try:
                r = self._client.post(self.url, content=body, headers=HEADERS)
                status: int | str = r.status_code
            except httpx.HTTPError as exc:
                status, r = type(exc).__name__, None
            except RuntimeError as exc:  # the client was closed by stop(): not sent
                if not self._stopping:
                    raise
                status, r = f"{type(exc).__name__}: {exc}", None
            self.metrics.remote_write_seconds.observe(time.perf_counter() - started)
            if isinstance(status, int) and 200 <= status < 300:
                self.metrics.remote_write_samples.inc(samples)
                self.last_error = ""
                return True
            detail = f"{status}: {r.text[:200]}" if r is not None else str(status)
            self.last_error = detail
            if isinstance(status, int) and 400 <= status < 500 and status != 429:
                self.metrics.remote_write_dropped.labels("refused").inc(samples)
                log.error("remote write %s refused %d samples for good (%s)",
                          redact_url(self.url), samples, detail)
                return True
            self.metrics.remote_write_retries.inc()
            if not self._stopping:
                log.warning("remote write %s failed (%s); retried in %.1f s",
                            redact_url(self.url), detail, delay)
                # Not time.sleep: stop() must wake the wait, or it would return (and close
                # the client) while this thread still sleeps.
                self._stopped.wait(delay)
            if self._stopping:
                self.metrics.remote_write_dropped.labels("shutdown").inc(samples)
                return False
            delay = min(delay * 2, self.backoff_max_s)


def _compress(data: bytes) -> bytes:
    import cramjam

    return bytes(cramjam.snappy.compress_raw(data))


def status(writer: RemoteWriter | None) -> dict[str, Any]:
    """For /readyz: the queue and the last error (always ready: samples wait or are
    dropped, counted; ingest never stops for the series store)."""
    if writer is None:
        return {"ready": True, "detail": "not configured"}
    return {"ready": True, "url": writer.url, "queued_samples": writer.queued,
            "detail": writer.last_error or "last request ok"}
