"""Agent -> collector uplink: batches through an on-disk spool, and the command long poll.

An agent :class:`~forewarn.agent.protocols.Component`, enabled when ``collector_url`` is
set:

* ``on_poll`` gathers each cycle's GPU samples, XID events and finding *transitions*
  (new or changed findings, not the unchanged ones every cycle).
* The push thread seals a batch every ``push_interval_s`` (at once when a transition is
  unhealthy or a checkpoint report arrived), adding the ranks' summaries and
  checkpoint reports from its ``feed`` (:class:`~forewarn.agent.protocols.RankFeed`, the
  rank table), and sends it. A batch with a finding transition or a checkpoint report
  is ``urgent``: it overtakes the others on the way (spool replay, the collector's
  writer and policy queues, the bus's urgent lane), in order among themselves.
* **Spool, write-ahead.** Every sealed batch is written to ``spool_dir`` (one file per
  batch named by its ``seq``, fsync'd, renamed into place) *before* it is sent, and
  deleted only when the collector answered ``stored`` or ``duplicate``. So a batch
  survives the collector being down, this process being killed, and the machine
  rebooting; replay is in ``seq`` order (urgent batches jump the queue). The collector
  stores each ``(agent_id, seq)`` once, so a batch sent twice (the answer was lost) is
  stored once. ``agent_id`` and the next ``seq`` live in ``spool_dir/state.json``.
* **Bounded.** Above ``spool_max_bytes`` the oldest batches are dropped and counted
  (``forewarn_uplink_dropped_batches_total``), never one in doubt (sent, no answer or a
  5xx: it may be stored), so a batch counted as dropped is one the collector never got.
* **Refused for good.** A batch the collector answers with a 4xx other than 401 (a token
  can be fixed), 408 or 429 (try later) would never be accepted: it is moved to
  ``spool_dir/rejected/`` with the answer beside it (``<seq>.<u|n>.txt``), logged, counted
  (``forewarn_uplink_rejected_batches_total``) and never sent again; the folder keeps at
  most ``spool_max_bytes``, oldest dropped first. Records the collector left out of a
  stored batch (its ``refused`` list: a bad value, a time outside its window) are logged.
* Every upload carries the agent's clock (header ``Forewarn-Sent-At``): the collector
  reports each agent's clock skew.
* The command thread holds ``GET /api/v1/commands?wait=25`` open; a ``checkpoint``
  command goes to its ``orders`` (:class:`~forewarn.agent.protocols.OrderSink`, the rank
  component's order book: ``order_job(job, step, reason, request_id)``), then is
  acknowledged. Commands are deduplicated by id (the collector
  redelivers what was not acknowledged).

Metrics: ``forewarn_uplink_spool_bytes``, ``forewarn_uplink_spool_batches``,
``forewarn_uplink_dropped_batches_total``, ``forewarn_uplink_rejected_batches_total``,
``forewarn_uplink_push_errors_total``, ``forewarn_uplink_batches_sent_total``,
``forewarn_uplink_last_success_timestamp_seconds``, ``forewarn_uplink_commands_total
{kind,result}``, ``forewarn_uplink_command_poll_errors_total``,
``forewarn_uplink_spool_write_errors_total`` (disk full: records stay in memory, bounded,
and are sealed again later), ``forewarn_uplink_dropped_samples_total``.

Transport (``httpx.BaseTransport``) and clock are injectable for tests.
"""

from __future__ import annotations

import collections
import logging
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from forewarn.agent.commands import carry_out
from forewarn.agent.config import AgentConfig
from forewarn.agent.protocols import AgentHost, ComponentBase, OrderSink, Poll, RankFeed
from forewarn.agent.spool import Spool
from forewarn.config import ConfigError
from forewarn.wire import (
    SENT_AT_HEADER,
    AgentBatch,
    CheckpointReport,
    Command,
    CommandAck,
    Finding,
    GpuSample,
    Health,
    RankSummary,
    WireError,
    XidEvent,
    decode_json,
    encode_json,
)

__all__ = ["Uplink", "check_uplink_config", "read_token"]

log = logging.getLogger(__name__)

MAX_BUFFERED_SAMPLES = 100_000
"""Samples kept in memory while the spool cannot be written (disk full); the oldest
beyond this are dropped and counted (``forewarn_uplink_dropped_samples_total``)."""
MAX_SAMPLES_PER_BATCH = 10_000
"""Seal early past this many samples (the collector's default list limit is 20,000)."""
_RETRY_4XX = frozenset({401, 408, 429})
"""Client errors that may pass later (a fixed token, a less busy collector); every other
4xx means this batch will never be accepted: move it aside rather than block the spool."""


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.spool_bytes = Gauge("forewarn_uplink_spool_bytes",
                                 "Bytes of batches waiting in the spool.", registry=r)
        self.spool_batches = Gauge("forewarn_uplink_spool_batches",
                                   "Batches waiting in the spool.", registry=r)
        self.dropped = Counter("forewarn_uplink_dropped_batches",
                               "Batches dropped because the spool was full (oldest first).",
                               registry=r)
        self.rejected = Counter("forewarn_uplink_rejected_batches",
                                "Batches the collector refused for good (dropped).", registry=r)
        self.errors = Counter("forewarn_uplink_push_errors",
                              "Failed attempts to send a batch.", registry=r)
        self.sent = Counter("forewarn_uplink_batches_sent",
                            "Batches the collector acknowledged.", registry=r)
        self.last_success = Gauge("forewarn_uplink_last_success_timestamp_seconds",
                                  "Unix time of the last batch the collector acknowledged.",
                                  registry=r)
        self.commands = Counter("forewarn_uplink_commands", "Commands from the collector.",
                                ["kind", "result"], registry=r)
        self.spool_errors = Counter("forewarn_uplink_spool_write_errors",
                                    "Batches that could not be written to the spool (kept in"
                                    " memory and retried).", registry=r)
        self.dropped_samples = Counter("forewarn_uplink_dropped_samples",
                                       "Samples dropped from memory while the spool could"
                                       " not be written.", registry=r)
        self.poll_errors = Counter("forewarn_uplink_command_poll_errors",
                                   "Failed command long polls.", registry=r)


def read_token(config: AgentConfig) -> str:
    if config.token:
        return config.token
    if config.token_file is not None:
        try:
            return config.token_file.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"token_file: cannot read {config.token_file}: {exc}") from None
    return ""


class Uplink(ComponentBase):
    """The agent's collector uplink component (see the module docstring)."""

    name = "uplink"
    max_samples_per_batch = MAX_SAMPLES_PER_BATCH
    """Seal early past this many samples (a transport with smaller messages lowers it)."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.time,
        registry: CollectorRegistry | None = None,
        on_command: Callable[[Command], tuple[bool, str]] | None = None,
        feed: RankFeed | None = None,
        orders: OrderSink | None = None,
        poll_wait_s: float = 25.0,
        retry_s: float = 1.0,
    ) -> None:
        self.config = config
        self.node = config.node
        self.clock = clock
        self.transport = transport
        self.token = read_token(config)
        self.spool = Spool(config.spool_dir, config.spool_max_bytes)
        self.poll_wait_s = poll_wait_s
        self.retry_s = retry_s
        self.on_command = on_command
        self.feed = feed
        self.orders = orders
        self._registry = registry
        self.metrics: _Metrics | None = None
        self._lock = threading.Lock()
        self._samples: list[GpuSample] = []
        self._xids: list[XidEvent] = []
        self._findings: list[Finding] = []
        self._unsent_reports: list[CheckpointReport] = []
        self._urgent = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._seen_commands: collections.OrderedDict[str, tuple[bool, str]] = (
            collections.OrderedDict())
        self._dropped_seen = 0
        self._last_error = ""
        """Why the last send failed ("" after a success), for /readyz."""
        self._depth = (len(self.spool), self.spool.bytes)

    # -- component interface --------------------------------------------------------

    def start(self, agent: AgentHost | None = None) -> None:
        """Register metrics (in the agent's registry, unless one was given), start the push
        and poll threads. Without an agent (tests, tools) a registry of its own."""
        if self.metrics is None:  # a restarted uplink keeps its metrics
            registry = self._registry
            if registry is None:
                registry = agent.registry if agent is not None else CollectorRegistry()
            self.metrics = _Metrics(registry)
        self._stop.clear()
        self._update_gauges()
        for target, name in ((self._push_loop, "forewarn-uplink-push"),
                             (self._command_loop, "forewarn-uplink-commands")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def on_poll(self, poll: Poll) -> None:
        """Take this cycle's samples, XIDs and finding transitions (poll thread; no I/O)."""
        findings = [t.finding for t in poll.transitions]
        self.add(samples=poll.samples, xids=poll.xids, findings=findings)

    def stop(self) -> None:
        """Seal what is buffered (to the spool), try one last send, end the threads."""
        self._stop.set()
        self._wake.set()
        for i, t in enumerate(self._threads):
            # The push thread seals and sends what is left; a long poll in flight ends
            # with its own timeout (the thread is a daemon).
            t.join(30.0 if i == 0 else 1.0)
        self._threads.clear()

    # -- feeding ----------------------------------------------------------------------

    def add(self, *, samples: Any = (), xids: Any = (), findings: Any = (),
            urgent: bool = False) -> None:
        """Buffer records for the next batch; unhealthy findings make it urgent."""
        with self._lock:
            self._samples.extend(samples)
            self._xids.extend(xids)
            self._findings.extend(findings)
            if urgent or any(f.health == Health.UNHEALTHY for f in findings):
                self._urgent = True
            big = len(self._samples) >= self.max_samples_per_batch
        if self._urgent or big:
            self._wake.set()

    def _ranks_data(self) -> tuple[list[RankSummary], list[CheckpointReport]]:
        if self.feed is None:
            return [], []
        try:
            return (list(self.feed.summaries(self.node, self.clock())),
                    list(self.feed.drain_reports()))
        except Exception:
            log.exception("uplink: reading rank summaries failed")
            return [], []

    def seal(self, *, force: bool = False) -> AgentBatch | None:
        """Move buffered records into one spooled batch (None when there is nothing and
        not ``force``)."""
        ranks, reports = self._ranks_data()
        with self._lock:
            reports = self._unsent_reports + reports
            self._unsent_reports = []
            samples = self._samples[:self.max_samples_per_batch]
            del self._samples[:self.max_samples_per_batch]
            xids, self._xids = self._xids, []
            findings, self._findings = self._findings, []
            # Every finding transition rides urgent, not only the unhealthy ones that
            # seal at once: urgent batches overtake the others (spool replay, the
            # collector's queues, the bus's urgent lane), and a GPU's transitions must
            # reach the policy in order (unhealthy, healthy, unhealthy ends firing).
            urgent = self._urgent or bool(reports) or bool(findings)
            self._urgent = False
        if not (force or samples or xids or findings or ranks or reports):
            return None
        now = self.clock()
        try:
            batch = self.spool.append(lambda agent_id, seq: AgentBatch(
                node=self.node, agent_id=agent_id, seq=seq, created=now, urgent=urgent,
                samples=samples, xids=xids, findings=findings, ranks=ranks,
                checkpoints=reports))
        except OSError:
            # Disk full or unwritable: keep the records (bounded) for the next seal.
            with self._lock:
                self._samples[:0] = samples
                self._xids[:0] = xids
                self._findings[:0] = findings
                self._unsent_reports[:0] = reports
                self._urgent = self._urgent or urgent
                excess = len(self._samples) - MAX_BUFFERED_SAMPLES
                if excess > 0:
                    del self._samples[:excess]
            if excess > 0 and self.metrics is not None:
                self.metrics.dropped_samples.inc(excess)
            if self.metrics is not None:
                self.metrics.spool_errors.inc()
            raise
        self._update_gauges()
        return batch

    # -- sending ----------------------------------------------------------------------

    def _client(self, timeout: httpx.Timeout) -> httpx.Client:
        headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
        verify: ssl.SSLContext | bool = True
        if self.config.collector_ca_file is not None:
            verify = ssl.create_default_context(cafile=str(self.config.collector_ca_file))
        return httpx.Client(base_url=self.config.collector_url.rstrip("/"), headers=headers,
                            timeout=timeout, transport=self.transport, verify=verify)

    def flush(self, conn: Any) -> bool:
        """Send every spooled batch over ``conn`` (what :meth:`_open` gave); True when
        the spool is empty afterwards."""
        for seq, path in self.spool.pending():
            try:
                body = path.read_bytes()
            except OSError:
                self.spool.remove(seq)
                continue
            outcome, detail = self._send(conn, seq, body)
            assert self.metrics is not None
            if outcome == "stored":
                self._last_error = ""
                self.spool.remove(seq)
                self.metrics.sent.inc()
                self.metrics.last_success.set(self.clock())
            elif outcome == "rejected":
                where = self.spool.reject(seq, detail)
                log.error("uplink: batch %d refused for good (%s); moved to %s, it will not"
                          " be sent again", seq, detail[:300], where)
                self.metrics.rejected.inc()
            else:
                if outcome == "in_doubt":
                    self.spool.in_doubt(seq)
                self._count_error(detail)
                return False
            self._update_gauges()
        self._update_gauges()
        return True

    # -- the transport: HTTP here, NATS in forewarn.agent.bus --------------------------

    def _open(self) -> Any:
        """The connection the push thread sends over (closed by :meth:`_close`)."""
        return self._client(httpx.Timeout(10.0, connect=5.0))

    def _close(self, conn: Any) -> None:
        conn.close()

    def _send(self, conn: Any, seq: int, body: bytes) -> tuple[str, str]:
        """Send one spooled batch: ``("stored" | "rejected" | "retry" | "in_doubt", why)``.
        Stored includes a duplicate; rejected means it would never be accepted; in doubt:
        send it again, but it may be stored (no answer, or a server error)."""
        try:
            r = conn.post("/api/v1/ingest", content=body, headers={
                "content-type": "application/msgpack", SENT_AT_HEADER: f"{self.clock():.3f}"})
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            return "retry", f"collector unreachable: {exc!r}"  # nothing was sent
        except httpx.HTTPError as exc:
            return "in_doubt", f"collector unreachable: {exc!r}"
        if r.status_code == 200:
            _log_refused(seq, r)
            return "stored", ""
        if 400 <= r.status_code < 500 and r.status_code not in _RETRY_4XX:
            return "rejected", f"collector answered {r.status_code}: {r.text[:2000]}"
        again = "in_doubt" if r.status_code >= 500 else "retry"  # a 503 may follow storing
        return again, f"collector answered {r.status_code}: {r.text[:300]}"

    def _target(self) -> str:
        """Where batches go, for /readyz."""
        return self.config.collector_url

    def readiness(self) -> dict[str, Any]:
        """Ready unless the last attempt to send failed; with the spool depth."""
        batches, size = self._depth
        error = self._last_error
        return {"ready": not error, "spool_batches": batches, "spool_bytes": size,
                "detail": error or f"{self._target()}: ok, {batches} batch(es) "
                                   "waiting"}

    def _count_error(self, message: str) -> None:
        self._last_error = message
        if self.metrics is not None:
            self.metrics.errors.inc()
        log.warning("uplink: %s; batches stay in the spool", message)

    def _update_gauges(self) -> None:
        self._depth = (len(self.spool), self.spool.bytes)
        m = self.metrics
        if m is None:
            return
        m.spool_bytes.set(self.spool.bytes)
        m.spool_batches.set(len(self.spool))
        new = self.spool.dropped - self._dropped_seen
        if new > 0:
            m.dropped.inc(new)
            self._dropped_seen = self.spool.dropped

    def _push_loop(self) -> None:
        client = self._open()
        backoff = self.retry_s
        next_seal = time.monotonic() + self.config.push_interval_s
        try:
            while True:
                stopping = self._stop.is_set()
                timeout = max(0.0, next_seal - time.monotonic())
                if len(self.spool) and backoff > 0 and not stopping:
                    timeout = min(timeout, backoff)
                if not stopping:
                    self._wake.wait(timeout)
                self._wake.clear()
                stopping = self._stop.is_set()
                if stopping or self._urgent or time.monotonic() >= next_seal or \
                        len(self._samples) >= self.max_samples_per_batch:
                    try:
                        self.seal(force=time.monotonic() >= next_seal)
                    except OSError as exc:
                        log.error("uplink: cannot write the spool: %s", exc)
                    if time.monotonic() >= next_seal:
                        next_seal = time.monotonic() + self.config.push_interval_s
                if len(self.spool):
                    if self.flush(client):
                        backoff = self.retry_s
                    else:
                        backoff = min(backoff * 2, max(self.retry_s,
                                                       self.config.push_interval_s))
                if stopping:
                    return
        finally:
            self._close(client)

    # -- commands ---------------------------------------------------------------------

    def handle(self, command: Command) -> tuple[bool, str]:
        """Carry out ``command`` once (a redelivered id gets the first answer again)."""
        done = self._seen_commands.get(command.id)
        if done is not None:
            return done
        if self.on_command is not None:
            result = self.on_command(command)
        else:
            result = carry_out(command, self.orders)
        self._seen_commands[command.id] = result
        while len(self._seen_commands) > 1000:
            self._seen_commands.popitem(last=False)
        if self.metrics is not None:
            self.metrics.commands.labels(command.kind, "ok" if result[0] else "failed").inc()
        return result

    def poll_commands(self, client: httpx.Client) -> int:
        """One long poll; handles and acknowledges what arrives. Returns commands seen."""
        r = client.get("/api/v1/commands", params={"node": self.node,
                                                   "wait": self.poll_wait_s})
        if r.status_code != 200:
            raise httpx.HTTPStatusError(f"collector answered {r.status_code}: {r.text[:300]}",
                                        request=r.request, response=r)
        try:
            commands = decode_json(r.content, list[Command])
        except WireError as exc:
            raise httpx.DecodingError(str(exc)) from None
        for cmd in commands:
            try:
                ok, detail = self.handle(cmd)
            except Exception as exc:  # a failing order must not end the poll loop
                log.exception("uplink: command %s failed", cmd.id)
                ok, detail = False, f"agent error: {exc}"
            ack = CommandAck(id=cmd.id, node=self.node, ok=ok, detail=detail[:4000],
                             time=self.clock())
            client.post(f"/api/v1/commands/{cmd.id}/ack", content=encode_json(ack),
                        headers={"content-type": "application/json"})
        return len(commands)

    def _command_loop(self) -> None:
        client = self._client(httpx.Timeout(10.0, connect=5.0, read=self.poll_wait_s + 15.0))
        backoff = self.retry_s
        try:
            while not self._stop.is_set():
                try:
                    self.poll_commands(client)
                    backoff = self.retry_s
                except httpx.HTTPError as exc:
                    if self.metrics is not None:
                        self.metrics.poll_errors.inc()
                    log.warning("uplink: command poll failed: %s", exc)
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, 30.0)
        finally:
            client.close()


def _log_refused(seq: int, r: httpx.Response) -> None:
    """Log the records the collector left out of stored batch ``seq`` (if any)."""
    try:
        refused = r.json().get("refused") or []
    except (ValueError, AttributeError):
        return
    if refused and isinstance(refused, list):
        log.warning("uplink: collector left %d record(s) out of batch %d: %s", len(refused),
                    seq, "; ".join(str(x.get("error", x)) if isinstance(x, dict) else str(x)
                                   for x in refused[:5]))


def check_uplink_config(config: AgentConfig) -> None:
    """What every transport needs: a bounded spool and this node's token."""
    if config.spool_max_bytes < 4096:
        raise ConfigError(f"spool_max_bytes: must be at least 4096, got "
                          f"{config.spool_max_bytes}")
    if not config.token and config.token_file is None:
        raise ConfigError("token: the collector needs this node's token (token or token_file;"
                          " enrol with `forewarn collector token add NODE`)")
