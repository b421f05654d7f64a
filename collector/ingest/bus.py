"""Collector replicas on the NATS JetStream bus (``bus_url``): batches in, commands out.

Names and subjects are :mod:`forewarn.bus`'s. At start, :class:`BusConsumer` creates or
verifies the two streams (batches: limits by ``bus_stream_max_age_s`` and
``bus_stream_max_bytes``; commands: a work queue kept ``command_ttl_s``) and the
collectors' durable pull consumers, then runs its tasks on the app's event loop:

* **Batches.** Every replica pulls from the ONE durable consumer
  :data:`~forewarn.bus.BATCH_CONSUMER`, so each batch goes to one replica; the urgent
  lane likewise from :data:`~forewarn.bus.URGENT_CONSUMER`, in a task of its own (its
  batches also go first in the writer's queue). A batch goes through the HTTP route's
  path (:func:`~.batch.accept_batch`'s two halves: the same checks, record refusals and
  counts, the same writer and group commit) with the node named by its subject, which
  nats-server's permissions bind to that node's user. The message is acknowledged only
  after the batch is durable (or found a duplicate: the store keys
  batches by ``(agent_id, seq)``, so a batch redelivered after a replica died between
  its commit and its ack is stored once) and, with ``remote_write_url``, after its GPU
  samples are in the series store (:meth:`RemoteWriter.written`; meanwhile the message's
  ack timer is reset, ``in_progress``, every quarter ``bus_ack_wait_s``, so a slow store does
  not make it come back while the replica lives). A duplicate's samples are sent again:
  the replica that stored the batch may have died before sending them, and the store keeps
  an equal sample once. A batch refused whole is counted
  (``forewarn_collector_ingest_rejected_total{reason}``), logged and terminated (never
  redelivered); a store failure (503) is negatively acknowledged and comes back after
  a second. A replica that dies holding batches loses nothing: JetStream redelivers
  them to another after ``bus_ack_wait_s``.
* **Commands.** When a command is queued (:attr:`CommandQueue.on_enqueue`) and every
  ``command_redeliver_s`` for commands still due, commands of nodes on the bus are
  taken from the queue (marked delivered) and published together to
  ``forewarn.cmd.<node>`` with ``Nats-Msg-Id`` = the command id, so a republish is
  dropped by JetStream. A node is on
  the bus when its batches reached this replica over NATS or, in the shared state, its
  last batch came over NATS (whichever replica stored it): so a command whose publish
  was in doubt when its replica died is published again by the next. Nodes whose
  batches come over HTTP keep getting theirs over the HTTP long poll.
* **The leader's batches.** With :class:`~.bus_decide.DecideFeed`\\ s (shared state, one
  per lane), the leader also pulls every batch through a second consumer per lane for
  its decisions (see there).
* **Answers.** Agents' :class:`~forewarn.wire.CommandAck`\\ s are pulled from
  :data:`~forewarn.bus.ACK_CONSUMER` and recorded like the HTTP acknowledgement route
  does (``on_ack``); an answer naming another node than its subject is dropped and
  counted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import ssl
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from forewarn import bus
from forewarn.errors import UnavailableError
from forewarn.wire import AgentBatch, Command, CommandAck, WireError, decode_json, encode_json

from ..config import CollectorConfig, bus_password
from ..metrics import CollectorMetrics
from ..storage.commands import CommandQueue
from ..storage.remote_write import RemoteWriter
from .batch import IngestResult, IngestWriter, submit_checked
from .bus_decide import DecideFeed
from .validate import CheckedBatch, IngestError, TimeWindow, check_batch, count_rejection

__all__ = ["BusConsumer", "BusError"]

log = logging.getLogger(__name__)

DUPLICATE_WINDOW_S = 600.0
"""JetStream drops a message whose ``Nats-Msg-Id`` it saw within this long."""


STARTUP_WAIT_S = 60.0
"""How long start-up waits for JetStream to answer (a cluster electing its leader)."""


class BusError(UnavailableError, RuntimeError):
    """The bus could not be set up (streams, consumers); the message names what."""


def stream_configs(config: CollectorConfig) -> list[StreamConfig]:
    """The two streams the collectors own, from ``config``."""
    batches = StreamConfig(
        name=bus.BATCH_STREAM, subjects=[f"{bus.BATCH_PREFIX}.*", f"{bus.URGENT_PREFIX}.*"],
        retention=RetentionPolicy.LIMITS, discard=DiscardPolicy.OLD,
        max_age=config.bus_stream_max_age_s, max_bytes=config.bus_stream_max_bytes,
        storage=StorageType.FILE, num_replicas=config.bus_stream_replicas,
        duplicate_window=min(DUPLICATE_WINDOW_S, config.bus_stream_max_age_s))
    commands = StreamConfig(
        name=bus.COMMAND_STREAM, subjects=[f"{bus.COMMAND_PREFIX}.*", f"{bus.ACK_PREFIX}.*"],
        retention=RetentionPolicy.WORK_QUEUE, discard=DiscardPolicy.OLD,
        max_age=config.command_ttl_s, storage=StorageType.FILE,
        num_replicas=config.bus_stream_replicas,
        duplicate_window=min(DUPLICATE_WINDOW_S, config.command_ttl_s))
    return [batches, commands]


class BusConsumer:
    """One collector replica's side of the bus (see the module docstring)."""

    def __init__(
        self,
        config: CollectorConfig,
        writer: IngestWriter,
        metrics: CollectorMetrics,
        commands: CommandQueue,
        *,
        on_ack: Callable[[CommandAck, str], str],
        series: RemoteWriter | None = None,
        clock: Callable[[], float] = time.time,
        startup_wait_s: float = STARTUP_WAIT_S,
        decide: Sequence[DecideFeed] = (),
    ) -> None:
        self.config = config
        self.writer = writer
        self.metrics = metrics
        self.commands = commands
        self.on_ack = on_ack
        self.series = series
        self.clock = clock
        self.startup_wait_s = startup_wait_s
        self.decide = decide
        self.nodes: set[str] = set()
        """Nodes whose batches came over the bus (their commands go over it too)."""
        self.error = ""
        """Why the last bus operation failed ("" after one worked), for logs and tests."""
        self._nc: NatsClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._holding: set[asyncio.Task[None]] = set()
        """Acknowledgements waiting for the series store (:meth:`_ack_when_written`)."""
        self._wanted: set[str] = set()
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- life cycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, create or verify streams and consumers, start the tasks. Raises
        :class:`BusError` when a stream exists with settings that cannot be changed."""
        self._loop = asyncio.get_running_loop()
        tls = None
        if self.config.bus_ca_file is not None:
            tls = ssl.create_default_context(cafile=str(self.config.bus_ca_file))
        wait = self.startup_wait_s
        deadline = time.monotonic() + wait
        try:
            # Without a bound, the client retries a server that is not there for ever
            # (max_reconnect_attempts=-1) and the collector would never start serving.
            self._nc = await asyncio.wait_for(nats.connect(
                servers=bus.servers(self.config.bus_url), user=bus.COLLECTOR_USER,
                password=bus_password(self.config) or None, tls=tls,
                name="forewarn-collector", max_reconnect_attempts=-1, reconnect_time_wait=1,
                connect_timeout=min(5.0, wait), error_cb=self._log_error), wait)
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            raise BusError(f"bus_url {self.config.bus_url}: no NATS server answered within"
                           f" {wait:g} s ({self.error or exc!r})") from None
        js = self._nc.jetstream(timeout=10.0)
        for stream in stream_configs(self.config):
            while True:
                try:
                    await _ensure_stream(js, stream)
                    break
                except (nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError,
                        nats.errors.NoRespondersError) as exc:
                    # A cluster still electing its JetStream leader answers 503 or not
                    # at all for a few seconds.
                    if time.monotonic() > deadline:
                        raise BusError(f"stream {stream.name}: JetStream not available"
                                       f" after {wait:g} s: {exc!r}") from None
                    await asyncio.sleep(0.5)
        batches = await self._pull(js, f"{bus.BATCH_PREFIX}.*", bus.BATCH_CONSUMER,
                                   bus.BATCH_STREAM)
        urgent = await self._pull(js, f"{bus.URGENT_PREFIX}.*", bus.URGENT_CONSUMER,
                                  bus.BATCH_STREAM)
        acks = await self._pull(js, f"{bus.ACK_PREFIX}.*", bus.ACK_CONSUMER,
                                bus.COMMAND_STREAM)
        self.commands.on_enqueue = self._command_queued
        self._tasks = [
            asyncio.create_task(self._loop_forever(self._take_batches, batches),
                                name="bus-batches"),
            # The urgent lane has a pull of its own always waiting: its batches are taken
            # as they arrive, however long the telemetry backlog is.
            asyncio.create_task(self._loop_forever(self._take_batches, urgent),
                                name="bus-urgent"),
            asyncio.create_task(self._loop_forever(self._take_acks, acks), name="bus-acks"),
            asyncio.create_task(self._publish_commands(js), name="bus-commands"),
        ]
        self._tasks.extend(
            asyncio.create_task(self._loop_forever(feed.step, js), name=f"bus-{feed.lane.name}")
            for feed in self.decide)

    async def stop(self) -> None:
        """Stop the tasks (batches taken and not yet stored are redelivered), disconnect."""
        self.commands.on_enqueue = None
        if self._holding:  # a last chance to acknowledge what the store took
            await asyncio.wait(self._holding, timeout=self.config.bus_ack_wait_s)
        for task in self._holding:
            task.cancel()
        for task in self._tasks:
            await _cancel(task)
        self._tasks, self._holding = [], set()
        if self._nc is not None and not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await self._nc.close()
        self._nc = None

    def readiness(self) -> dict[str, Any]:
        """The ``bus`` part of ``/readyz``: connected to a NATS server, last step ok."""
        nc = self._nc
        connected = nc is not None and nc.is_connected
        where = self.config.bus_url
        if not connected:
            return {"ready": False, "nodes": len(self.nodes),
                    "detail": f"{where}: not connected ({self.error or 'reconnecting'})"}
        out = {"ready": not self.error, "nodes": len(self.nodes),
               "detail": f"{where}: {self.error}" if self.error
                         else f"{where}: connected, {len(self.nodes)} node(s) on the bus"}
        if self.decide:
            out["decide"] = {feed.lane.name: feed.status() for feed in self.decide}
        return out

    async def _pull(self, js: JetStreamContext, subject: str, durable: str, stream: str
                    ) -> JetStreamContext.PullSubscription:
        config = ConsumerConfig(
            durable_name=durable, ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.config.bus_ack_wait_s, max_deliver=-1, filter_subject=subject,
            max_ack_pending=max(1000, 8 * self.config.bus_fetch_max),
            num_replicas=self.config.bus_stream_replicas)
        try:
            await js.add_consumer(stream, config=config)
        except nats.js.errors.BadRequestError as exc:
            raise BusError(f"stream {stream}: consumer {durable}: {exc.description}; delete"
                           " it (nats consumer rm) to let the collector create it") from None
        return await js.pull_subscribe_bind(durable=durable, stream=stream)

    async def _loop_forever(self, step: Callable[[Any], Coroutine[Any, Any, None]],
                            sub: Any) -> None:
        """Run ``step(sub)`` until cancelled; NATS trouble is logged, counted, retried."""
        backoff = 0.1
        while True:
            try:
                await step(sub)
                backoff = 0.1
                self.error = ""
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("bus: %s", self.error)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, 5.0)

    async def _log_error(self, exc: Exception) -> None:
        self.error = f"{type(exc).__name__}: {exc}"
        log.warning("bus: NATS: %s", self.error)

    # -- batches ----------------------------------------------------------------------

    async def _take_batches(self, sub: JetStreamContext.PullSubscription) -> None:
        try:
            msgs = await sub.fetch(self.config.bus_fetch_max, timeout=1.0)
        except TimeoutError:  # nats.errors.TimeoutError, or the builtin one under load
            return
        await self.ingest(msgs)

    async def ingest(self, msgs: list[Msg]) -> None:
        """Store a fetched group of batches (one group commit), then acknowledge each
        (with a series store: once their samples are in it, :meth:`_ack_when_written`).
        Checked one at a time, each a turn on the event loop; queued to the writer together."""
        c = self.config
        window = TimeWindow(self.clock(), c.ingest_max_age_s, c.ingest_max_future_s)
        checked: list[tuple[Msg, str, CheckedBatch]] = []
        for msg in msgs:
            # A turn for the other tasks (the urgent lane's) between batches: decoding a
            # whole fetched group at once kept an urgent batch waiting behind it.
            await asyncio.sleep(0)
            try:
                node = self._node(msg)
                if len(msg.data) > c.max_body_bytes:
                    raise IngestError(413, "too_large", f"batch of {len(msg.data)} bytes"
                                      f" exceeds the limit of {c.max_body_bytes} bytes")
                checked.append((msg, node, check_batch(msg.data, node=node, window=window,
                                                       max_items=c.max_batch_items)))
            except IngestError as exc:
                await self._not_stored(msg, exc)
        # Queued together, so that the writer commits them as one group (queued one by one
        # between the turns above, each could become a group commit, an fsync, of its own).
        queued: list[tuple[Msg, AgentBatch, asyncio.Future[IngestResult]]] = []
        for msg, node, ok in checked:
            try:
                stored = submit_checked(self.writer, self.metrics, ok, address=bus.BUS_ADDRESS)
            except IngestError as exc:  # the writer is stopping
                await self._not_stored(msg, exc)
                continue
            self.nodes.add(node)
            queued.append((msg, ok.batch, asyncio.wrap_future(stored)))
        results = await asyncio.gather(*(f for _m, _s, f in queued), return_exceptions=True)
        held = []
        for (msg, batch, _f), result in zip(queued, results, strict=True):
            if isinstance(result, BaseException):
                await self._not_stored(msg, result)
            elif self.series is None:
                await msg.ack()
            else:
                if result is IngestResult.DUPLICATE and batch.samples:
                    # maybe never sent: the replica that stored it died
                    self.series.resend(batch.agent_id, batch.seq, batch.samples)
                held.append(msg)
        if held and self.series is not None:
            task = asyncio.create_task(self._ack_when_written(held, self.series.written()))
            self._holding.add(task)
            task.add_done_callback(self._holding.discard)

    async def _ack_when_written(self, msgs: list[Msg],
                                written: concurrent.futures.Future[None]) -> None:
        """Acknowledge ``msgs`` once their samples are in the series store, keeping them
        ours meanwhile; a writer stopped first: negatively acknowledge, they come back."""
        done = asyncio.wrap_future(written)
        try:
            while True:
                try:
                    # A quarter: the message waited for its commit already.
                    await asyncio.wait_for(asyncio.shield(done),
                                           self.config.bus_ack_wait_s / 4)
                    break
                except TimeoutError:
                    for msg in msgs:
                        await msg.in_progress()
                except RuntimeError as exc:  # the remote writer stopped
                    log.warning("bus: %d batch(es) not acknowledged: %s", len(msgs), exc)
                    for msg in msgs:
                        await msg.nak(delay=1.0)
                    return
            for msg in msgs:
                await msg.ack()
        except nats.errors.Error as exc:  # not acknowledged: they come back, sent again
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("bus: acknowledging %d batch(es) failed: %s", len(msgs), self.error)

    async def _not_stored(self, msg: Msg, exc: BaseException) -> None:
        """A batch refused for good (a 4xx) is terminated; any other failure (the store,
        a writer shutting down: 503) is negatively acknowledged and comes back."""
        if isinstance(exc, IngestError) and exc.status < 500:
            await self._refuse(msg, exc)
            return
        log.warning("bus: batch on %s not stored (%s); it comes back", msg.subject, exc)
        await msg.nak(delay=1.0)

    def _node(self, msg: Msg) -> str:
        try:
            return bus.node_of(msg.subject.rpartition(".")[2])
        except ValueError as exc:
            raise IngestError(400, "subject", f"subject {msg.subject!r}: {exc}") from None

    async def _refuse(self, msg: Msg, exc: IngestError) -> None:
        """A batch that will never be stored: count, log, and never deliver it again."""
        count_rejection(self.metrics, exc)
        log.warning("bus: batch on %s refused (%d %s): %s", msg.subject, exc.status,
                    exc.reason, exc)
        await msg.term()

    # -- commands and their answers ---------------------------------------------------

    def _command_queued(self, node: str) -> None:
        """CommandQueue.on_enqueue (any thread): wake the publisher for ``node``."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # loop shutting down
            loop.call_soon_threadsafe(self._want, node)

    def _want(self, node: str) -> None:
        self._wanted.add(node)
        self._wake.set()

    async def _publish_commands(self, js: JetStreamContext) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.commands.redeliver_s)
            self._wake.clear()
            wanted, self._wanted = self._wanted, set()
            try:
                due = set(await asyncio.to_thread(self.commands.due_nodes))
                await self._learn_bus_nodes((wanted | due) - self.nodes)
                # All nodes' commands in one transaction (a decision's, for every node of
                # its job), then published.
                taken = await asyncio.to_thread(self.commands.take_many,
                                                (wanted | due) & self.nodes)
                # The nodes together (a decision's 8 nodes took 8 round trips), each node's
                # commands in their order (an agent applies them as they come).
                results = await asyncio.gather(*(
                    _publish_in_order(js, node, commands)
                    for node, commands in sorted(taken.items())), return_exceptions=True)
                failed = [r for r in results if isinstance(r, BaseException)]
                if failed:
                    raise failed[0]
                self.error = ""
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("bus: publishing commands failed: %s", self.error)

    async def _learn_bus_nodes(self, nodes: set[str]) -> None:
        """Which of ``nodes`` send their batches over the bus, from the shared state (the
        address of each node's last batch), not only from what reached this process: a
        command another replica queued, or marked delivered and died before its publish
        was answered, is published by this one when it falls due again."""
        if not nodes:
            return
        marks = ", ".join("?" * len(nodes))
        rows = await asyncio.to_thread(
            self.commands.store.query,
            f"SELECT node FROM nodes WHERE address = ? AND node IN ({marks})",
            [bus.BUS_ADDRESS, *sorted(nodes)])
        self.nodes.update(str(r["node"]) for r in rows)

    async def _take_acks(self, sub: JetStreamContext.PullSubscription) -> None:
        try:
            msgs = await sub.fetch(64, timeout=1.0)
        except TimeoutError:  # nats.errors.TimeoutError, or the builtin one under load
            return
        for msg in msgs:
            try:
                node = bus.node_of(msg.subject.rpartition(".")[2])
                ack = decode_json(msg.data, CommandAck)
                if ack.node != node:
                    raise WireError(f"$.node: {ack.node!r} answered on node {node!r}'s"
                                    " subject")
            except (ValueError, WireError) as exc:
                self.metrics.rejected.labels("command_ack").inc()
                log.warning("bus: command answer on %s dropped: %s", msg.subject, exc)
                await msg.term()
                continue
            state = await asyncio.to_thread(self.on_ack, ack, node)
            if state == "unknown":
                log.warning("bus: node %s answered unknown command %r", node, ack.id)
            await msg.ack()


async def _publish_in_order(js: JetStreamContext, node: str, commands: list[Command]) -> None:
    """``node``'s commands one after the other, each once JetStream acknowledged the one
    before. A failed publish leaves its command (and the node's next ones)
    delivered-but-unacknowledged: the queue makes them due again after
    ``command_redeliver_s``."""
    for command in commands:
        await js.publish(bus.subject(bus.COMMAND_PREFIX, node), encode_json(command),
                         headers={"Nats-Msg-Id": command.id})


async def _cancel(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait for its end, cancelling again while it runs: Python 3.11's
    ``asyncio.wait_for`` (nats-py's fetch waits with it) drops a cancel that meets a result
    (timers that fire together after the loop was busy), and the pull loop goes on."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.5)
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


async def _ensure_stream(js: JetStreamContext, stream: StreamConfig) -> None:
    """Create ``stream``, or bring an existing one to these settings."""
    try:
        await js.add_stream(stream)
        return
    except nats.js.errors.BadRequestError:
        pass  # it exists with other settings (limits changed in the config): update
    try:
        await js.update_stream(stream)
    except nats.js.errors.ServiceUnavailableError:
        raise
    except nats.js.errors.APIError as exc:
        raise BusError(f"stream {stream.name}: exists with settings that cannot be changed"
                       f" to these ({exc.description}); see docs/scale.md") from None
