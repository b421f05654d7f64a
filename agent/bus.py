"""The agent's uplink over NATS JetStream (``uplink = "nats"``): same spool, other wire.

:class:`NatsUplink` is :class:`~forewarn.agent.uplink.Uplink` with the transport swapped;
sealing, the write-ahead spool, its bound, replay order and metrics are the same (see
that module). What changes:

* **Sending.** Each spooled batch (the same msgpack bytes as over HTTP) is published to
  ``forewarn.batch.<node>``, an urgent one (a finding or a checkpoint report in it) to
  ``forewarn.urgent.<node>`` (the urgent lane, :mod:`forewarn.bus`), with header
  ``Nats-Msg-Id: <agent_id>:<seq>``, and the agent waits for JetStream's publish
  acknowledgement (the batch is in the stream, replicated as the stream says) before
  deleting it from the spool. No ack (NATS down, a timeout)
  leaves it in the spool; it is sent again in order, and JetStream's duplicate window
  plus the collector's ``(agent_id, seq)`` key store it once. The client buffers nothing
  while disconnected (``pending_size=0``): the spool is the buffer. A batch larger than
  the server's ``max_payload`` is moved to ``rejected/`` like a batch the collector
  refuses for good; batches are sealed at :data:`NATS_MAX_SAMPLES` samples so that a
  normal one fits the 1 MiB default.
* **Validation is the collector's.** It checks each batch as the HTTP route does; a
  refused batch is counted and logged there (the agent is not told: it already has the
  publish ack).
* **Commands.** The agent pulls ``forewarn.cmd.<node>`` through its durable consumer
  (:func:`forewarn.bus.command_consumer`), carries each command out once (by id, as over
  HTTP), publishes its :class:`~forewarn.wire.CommandAck` to ``forewarn.ack.<node>``,
  and only then acknowledges the message: a command whose answer was not published is
  delivered again (``ack_wait``) and answered again without being applied twice.
* **Identity.** User :func:`forewarn.bus.node_token` of the node, password
  :func:`forewarn.bus.nats_password` of its token; replies on its own inbox prefix. The
  nats-server permissions (``forewarn collector nats-auth``) let it publish nothing else.

nats-py is asyncio: one event loop runs in the thread ``forewarn-uplink-nats``; the push
thread hands it each publish and waits for the result.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import ssl
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig
from prometheus_client import CollectorRegistry

from forewarn import bus
from forewarn.agent.config import AgentConfig
from forewarn.agent.protocols import AgentHost, OrderSink, RankFeed
from forewarn.agent.uplink import Uplink, check_uplink_config
from forewarn.config import ConfigError
from forewarn.wire import Command, CommandAck, WireError, decode_json, encode_json

__all__ = ["NATS_MAX_SAMPLES", "NatsUplink", "build_nats"]

log = logging.getLogger(__name__)

T = TypeVar("T")

NATS_MAX_SAMPLES = 400
"""Seal a batch past this many samples: a full GPU sample is ~1.6 KB of msgpack, and
nats-server's default ``max_payload`` is 1 MiB."""
COMMAND_ACK_WAIT_S = 10.0
"""A command delivered but not acknowledged is delivered again after this long."""


class _Unanswered(Exception):
    """A publish went out but no acknowledgement came back (a timeout, a connection lost
    meanwhile): the server may have stored it."""


class NatsUplink(Uplink):
    """The uplink over NATS JetStream (see the module docstring)."""

    max_samples_per_batch = NATS_MAX_SAMPLES

    def __init__(
        self,
        config: AgentConfig,
        *,
        clock: Callable[[], float] = time.time,
        registry: CollectorRegistry | None = None,
        on_command: Callable[[Command], tuple[bool, str]] | None = None,
        feed: RankFeed | None = None,
        orders: OrderSink | None = None,
        retry_s: float = 1.0,
        publish_timeout_s: float = 5.0,
        fetch_wait_s: float = 5.0,
    ) -> None:
        super().__init__(config, clock=clock, registry=registry, on_command=on_command,
                         feed=feed, orders=orders, retry_s=retry_s)
        self.publish_timeout_s = publish_timeout_s
        self.fetch_wait_s = fetch_wait_s
        self._servers = bus.servers(config.nats_url)
        self._tls: ssl.SSLContext | None = None
        if config.nats_ca_file is not None:
            self._tls = ssl.create_default_context(cafile=str(config.nats_ca_file))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._nc: NatsClient | None = None

    # -- the event loop thread --------------------------------------------------------

    def start(self, agent: AgentHost | None = None) -> None:
        """Start the NATS event loop, then the push and command threads."""
        if self._loop is None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            self._loop_thread = threading.Thread(target=loop.run_forever,
                                                 name="forewarn-uplink-nats", daemon=True)
            self._loop_thread.start()
        super().start(agent)

    def stop(self) -> None:
        """Seal and send what is left (the base class), then close NATS and the loop."""
        super().stop()
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(Exception):
            self._run(self._shutdown(), 5.0)
        loop.call_soon_threadsafe(loop.stop)
        if self._loop_thread is not None:
            self._loop_thread.join(5.0)
        loop.close()
        self._loop = None

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the NATS loop and wait for it (from another thread)."""
        assert self._loop is not None, "start() first"
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no answer from NATS within {timeout:g} s") from None

    async def _connect(self) -> JetStreamContext:
        """This node's JetStream context, connecting first when needed."""
        nc = self._nc
        if nc is None or nc.is_closed:
            nc = await nats.connect(
                servers=self._servers, user=bus.node_token(self.node),
                password=bus.nats_password(self.token), inbox_prefix=bus.inbox_prefix(self.node),
                tls=self._tls, name=f"forewarn-agent {self.node}", connect_timeout=2,
                reconnect_time_wait=1, max_reconnect_attempts=-1, pending_size=0,
                error_cb=_log_error, allow_reconnect=True)
            self._nc = nc
        return nc.jetstream(timeout=self.publish_timeout_s)

    async def _shutdown(self) -> None:
        """Close the connection and end every task left on the loop (the client's)."""
        nc, self._nc = self._nc, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                await nc.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- sending (push thread) --------------------------------------------------------

    def _target(self) -> str:
        return self.config.nats_url

    def _open(self) -> None:
        return None

    def _close(self, conn: Any) -> None:
        return None

    def _send(self, conn: Any, seq: int, body: bytes) -> tuple[str, str]:
        msg_id = f"{self.spool.agent_id}:{seq}"
        try:
            lane = bus.URGENT_PREFIX if self.spool.urgent(seq) else bus.BATCH_PREFIX
            self._run(self._publish(bus.subject(lane, self.node), body, msg_id),
                      self.publish_timeout_s + 5.0)
        except nats.errors.MaxPayloadError:
            return "rejected", (f"batch of {len(body)} bytes is larger than the NATS server's"
                                " max_payload (raise it in the nats-server config)")
        except _Unanswered as exc:  # the stream may hold it: the spool's bound keeps it
            return "in_doubt", f"NATS: {exc}"
        except Exception as exc:  # no connection: the batch stays in the spool
            return "retry", f"NATS: {type(exc).__name__}: {exc}"
        return "stored", ""

    async def _publish(self, subject: str, body: bytes, msg_id: str) -> None:
        js = await self._connect()
        try:
            await js.publish(subject, body, headers={"Nats-Msg-Id": msg_id})
        except nats.errors.MaxPayloadError:
            raise  # refused by the client before anything was sent
        except Exception as exc:
            raise _Unanswered(f"{type(exc).__name__}: {exc}") from exc

    # -- commands (command thread) ----------------------------------------------------

    def _command_loop(self) -> None:
        if self._loop is None:
            return
        future = asyncio.run_coroutine_threadsafe(self._commands(), self._loop)
        self._stop.wait()
        future.cancel()

    async def _commands(self) -> None:
        backoff = self.retry_s
        sub: JetStreamContext.PullSubscription | None = None
        while not self._stop.is_set():
            try:
                if sub is not None:  # the last pull failed: drop its inbox subscription
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
                    sub = None
                js = await self._connect()
                sub = await js.pull_subscribe(
                    bus.subject(bus.COMMAND_PREFIX, self.node),
                    durable=bus.command_consumer(self.node), stream=bus.COMMAND_STREAM,
                    config=ConsumerConfig(ack_wait=COMMAND_ACK_WAIT_S))
                backoff = self.retry_s
                while not self._stop.is_set():
                    try:
                        msgs = await sub.fetch(16, timeout=self.fetch_wait_s)
                    except TimeoutError:
                        # No command within the wait: nats.errors.TimeoutError, or asyncio's
                        # own when the server's "request timeout" lands at the deadline.
                        continue
                    for msg in msgs:
                        await self._answer(js, msg)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self.metrics is not None:
                    self.metrics.poll_errors.inc()
                log.warning("uplink: NATS command pull failed: %s: %s", type(exc).__name__, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)

    async def _answer(self, js: JetStreamContext, msg: Msg) -> None:
        """Carry out one command, publish its answer, then acknowledge the message."""
        try:
            command = decode_json(msg.data, Command)
        except WireError as exc:
            log.error("uplink: undecodable command on %s dropped: %s", msg.subject, exc)
            if self.metrics is not None:
                self.metrics.commands.labels("invalid", "failed").inc()
            await msg.term()  # it will never decode: do not have it delivered again
            return
        try:
            ok, detail = await asyncio.to_thread(self.handle, command)
        except Exception as exc:  # a failing order must not end the command loop
            log.exception("uplink: command %s failed", command.id)
            ok, detail = False, f"agent error: {exc}"
        answer = CommandAck(id=command.id, node=self.node, ok=ok, detail=detail[:4000],
                            time=self.clock())
        await js.publish(bus.subject(bus.ACK_PREFIX, self.node), encode_json(answer),
                         headers={"Nats-Msg-Id": f"ack:{command.id}"})
        await msg.ack()


async def _log_error(exc: Exception) -> None:
    log.warning("uplink: NATS: %s: %s", type(exc).__name__, exc)


def build_nats(config: AgentConfig, *, feed: RankFeed | None = None,
               orders: OrderSink | None = None) -> NatsUplink:
    """The NATS uplink for ``forewarn agent`` (``uplink = "nats"``), fed ``feed`` and
    ``orders`` (the rank component's table and order book)."""
    try:
        bus.check_url("nats_url", config.nats_url)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    check_uplink_config(config)
    if config.nats_ca_file is not None and not config.nats_ca_file.is_file():
        raise ConfigError(f"nats_ca_file: no such file {config.nats_ca_file}")
    return NatsUplink(config, feed=feed, orders=orders)
