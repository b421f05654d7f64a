"""The collector's ASGI app (Starlette), built by :func:`create_app`.

Routes
------
``POST /api/v1/ingest``
    Body: msgpack :class:`~forewarn.wire.AgentBatch`, ``Content-Type: application/msgpack``,
    ``Authorization: Bearer <the node's token>``, optionally ``Forewarn-Sent-At: <the
    agent's Unix time>`` (the agent's clock skew, a metric per node). Answers ``200
    {"result": "stored" | "duplicate", "seq": n}`` only once the batch is durable, with
    ``"refused": [{"field", "reason", "error"}]`` listing records left out (bad values,
    times outside the window; the rest is stored); 401 bad token, 403 another node's
    batch or agent id, 400 bad batch, 413 too large, 415 wrong content type, 422 a batch
    the store cannot hold (quarantined): ``{"error": msg}`` naming the problem, nothing
    stored.
``GET /api/v1/commands?node=N&wait=25``
    Long poll (agent token of node N): JSON list of :class:`~forewarn.wire.Command`.
``POST /api/v1/commands/{id}/ack``
    JSON (or msgpack) :class:`~forewarn.wire.CommandAck` from the agent.
``GET /api/v1/...``: ``nodes``, ``gpus``, ``jobs``, ``job?name=J``, ``jobs/{job}``,
    ``findings``, ``incidents``, ``xids``, ``actions``, ``decisions``, ``checkpoints``,
    ``commands/log``.
    Read API (JSON; ``api_token`` when configured). ``GET /openapi.json``, ``/metrics``,
    ``/healthz`` (liveness). These live in :mod:`forewarn.collector.http.api`.
``GET /readyz``
    Readiness, JSON per component (storage writable, ingest writer alive, last telemetry
    flush ok); 503 when not ready: :mod:`forewarn.collector.http.readiness`.

The seam for the policy and actions (``policy=``)
-------------------------------------------------
``create_app(config, store, outbound=None, *, policy=None, ...)`` takes any object with

``on_findings(findings, store, now) -> Sequence[NodeCommand] | None``
    (``findings: Sequence[Finding]``, ``store: StateStore``, ``now: float`` Unix time.)
    Called with every newly stored finding (from agents' batches, urgent ones first, and
    from :meth:`CollectorContext.submit_findings`). Returned
    :class:`~forewarn.collector.storage.commands.NodeCommand`\\ s are queued for their agents; the
    policy may also queue itself through ``ctx.commands`` (a ``CommandSink``:
    ``order_checkpoint(nodes, order)``).

and optionally any of these (each its own small Protocol in
:mod:`forewarn.collector.decide.seam`, ``StartHook``, ``StopHook``, ``BatchHook``,
``AckHook``, ``ApiHook``: a policy implements the ones it needs, and :func:`create_app`
calls what it implements):

``start(ctx: DecideContext) -> None`` / ``stop() -> None``
    At app start-up / shutdown. ``ctx`` holds ``config``, ``store``, ``commands``,
    ``jobs`` (a :class:`~forewarn.collector.jobs.jobmap.StoreJobView`, the ``JobView`` protocol),
    ``metrics`` (``metrics.registry`` for the policy's own metrics), ``outbound`` (the
    injected ``httpx.AsyncClient`` or ``None``), ``clock`` and ``loop``.
``on_batches(batches: Sequence[AgentBatch], now: float) -> None``
    Every newly stored batch (rank summaries, checkpoint reports for the order book).
``on_ack(ack: CommandAck, node: str) -> None``
    Every acknowledgement an agent sends.
``api() -> PolicyApi``
    What the policy answers over HTTP (alert webhooks, operator actions, risk, goodput):
    plain callables for which the HTTP layer builds the routes
    (:mod:`forewarn.collector.http.policy_routes`); nothing in the decide layer imports
    this one.

All hook calls run one at a time on a single dedicated thread ("forewarn-policy"), in the
order events arrived, so a policy need not be thread-safe and never blocks ingest (bulk
work queued with ``ctx.submit_bulk(fn, *args)`` runs only while no other hook call
waits: :mod:`forewarn.collector.decide.policy_thread`); a hook
that raises is logged and counted (``forewarn_collector_policy_errors_total``), never
fatal. Handlers of the policy's API run their calls with ``await ctx.run_policy(fn,
*args)``; other collector code passes findings through ``await
ctx.submit_findings(findings, origin=...)`` (stores them, then runs the hook on the same
thread).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from forewarn.wire import (
    MAX_UNIX_TIME,
    SENT_AT_HEADER,
    AgentBatch,
    CommandAck,
    Finding,
    WireError,
    decode,
    decode_json,
)

from ..config import CollectorConfig
from ..decide.policy_thread import PolicyThread
from ..decide.seam import (
    AckHook,
    ApiHook,
    BatchHook,
    DecideContext,
    FindingsPolicy,
    StartHook,
    StopHook,
)
from ..ingest.batch import (
    IngestError,
    IngestWriter,
    TimeWindow,
    accept_batch,
    store_findings,
)
from ..jobs.jobmap import StoreJobView
from ..metrics import CollectorMetrics
from ..storage.commands import CommandQueue, NodeCommand
from ..storage.datadir import check_data_dir
from ..storage.leader import (
    LOCAL_ORIGINS,
    AdvisoryLockLeader,
    FindingsFeed,
    Leadership,
    SoleLeader,
)
from ..storage.remote_write import RemoteWriter
from ..storage.staging import StagingLog
from ..storage.state import StateStore
from ..storage.telemetry import TelemetryWriter
from ..storage.upkeep import run_upkeep
from . import statuspage
from .api import (
    agent_node,
    ctx_of,
    error_response,
    float_param,
    handled,
    json_response,
    read_limited,
    read_routes,
)
from .auth import TokenRegistry
from .policy_routes import policy_routes
from .readiness import readyz

if TYPE_CHECKING:
    import httpx

    from ..ingest.bus import BusConsumer

__all__ = ["CollectorContext", "create_app"]

log = logging.getLogger(__name__)

T = TypeVar("T")

POLICY_BACKLOG_MAX = 20_000
"""Batches waiting for the policy thread beyond which sample-only batches skip it."""

MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")


@dataclasses.dataclass
class CollectorContext:
    """Everything a route or the policy needs; ``request.app.state.ctx``."""

    config: CollectorConfig
    store: StateStore
    metrics: CollectorMetrics
    commands: CommandQueue
    jobs: StoreJobView
    telemetry: TelemetryWriter
    writer: IngestWriter
    tokens: TokenRegistry
    outbound: httpx.AsyncClient | None
    policy: FindingsPolicy | None
    clock: Callable[[], float]
    loop: asyncio.AbstractEventLoop | None = None
    series: RemoteWriter | None = None
    """Remote write of the GPU series, when ``remote_write_url`` is set."""
    leader: Leadership = dataclasses.field(default_factory=SoleLeader)
    """Whether this replica decides (always, with embedded state; see
    :mod:`~forewarn.collector.storage.leader`)."""
    bus: BusConsumer | None = None
    """The NATS bus side of this replica (``bus_url`` set), once started."""
    _policy_pool: PolicyThread = dataclasses.field(default_factory=PolicyThread)
    _flush_wanted: asyncio.Event | None = None
    flush_error: str = ""
    """Why the last telemetry flush failed ("" when it worked), for /readyz."""
    flush_time: float = 0.0
    """When the last telemetry flush ended (Unix time; 0 before the first)."""
    _staged: int = 0
    _policy_backlog: int = 0
    _backlog_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    async def run_policy(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the policy thread (serialised with every hook call)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._policy_pool, fn, *args)

    def submit_bulk(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args)`` on the policy thread's bulk lane: it runs only while no
        decision work (agent batches, acks, timers) waits (alert storms)."""
        return self._policy_pool.submit_bulk(fn, *args)

    async def submit_findings(self, findings: Sequence[Finding], *, origin: str = "collector",
                              node: str = "") -> None:
        """Store findings produced inside the collector (detectors, alert webhooks) and
        pass them to the policy."""
        if not findings:
            return
        now = self.clock()

        def write() -> None:
            with self.store.write() as conn:
                store_findings(conn, findings, node=node, origin=origin, received=now)

        await asyncio.to_thread(write)
        for f in findings:
            self.metrics.findings.labels(f.health.value, origin.split(":")[0]).inc()
        local = self.leader.shared and origin in LOCAL_ORIGINS
        await self.run_policy(self._decide if local else self._policy_findings, list(findings))

    def accept_ack(self, ack: CommandAck, node: str) -> str:
        """Record ``node``'s answer to a command (HTTP or the bus) and tell the policy;
        returns :meth:`CommandQueue.ack`'s ``acked``, ``already`` or ``unknown``."""
        state = self.commands.ack(ack, node)
        if state != "unknown" and self.policy is not None:
            self._policy_pool.submit(self._policy_ack, ack, node)
        return state

    # -- runs on the policy thread ----------------------------------------------------

    def _policy_findings(self, findings: list[Finding]) -> None:
        if self.leader.shared:
            return  # with shared state the leader reads every finding from the feed
        self._decide(findings)

    def _decide(self, findings: list[Finding]) -> None:
        """Run findings through the policy and queue the commands it returns."""
        if self.policy is None or not findings or not self.leader.is_leader:
            return
        try:
            out = self.policy.on_findings(findings, self.store, self.clock())
        except Exception:
            self.metrics.policy_errors.inc()
            log.exception("policy.on_findings failed on %d findings", len(findings))
            return
        for item in out or ():
            if isinstance(item, NodeCommand):
                self.commands.enqueue(item.node, item.command)

    def _policy_batches(self, batches: list[AgentBatch]) -> None:
        with self._backlog_lock:
            self._policy_backlog -= len(batches)
            self.metrics.policy_backlog.set(self._policy_backlog)
        policy = self.policy
        if isinstance(policy, BatchHook) and self.leader.is_leader:
            try:
                policy.on_batches(batches, self.clock())
            except Exception:
                self.metrics.policy_errors.inc()
                log.exception("policy.on_batches failed")
        self._policy_findings([f for b in batches for f in b.findings])

    def _policy_ack(self, ack: CommandAck, node: str) -> None:
        policy = self.policy
        if isinstance(policy, AckHook) and self.leader.is_leader:
            try:
                policy.on_ack(ack, node)
            except Exception:
                self.metrics.policy_errors.inc()
                log.exception("policy.on_ack failed")

    def _on_stored(self, batches: list[AgentBatch]) -> None:
        """Writer thread: hand stored batches to the policy thread; maybe wake the flush."""
        if self.policy is not None:
            if self._policy_backlog > POLICY_BACKLOG_MAX:
                # The policy thread is behind: keep what it must see (findings, ranks,
                # checkpoint reports), skip batches that carry only samples (counted).
                kept = [b for b in batches if b.findings or b.ranks or b.checkpoints or b.xids]
                self.metrics.policy_skipped.inc(len(batches) - len(kept))
                batches_for_policy = kept
            else:
                batches_for_policy = batches
            if batches_for_policy:
                with self._backlog_lock:
                    self._policy_backlog += len(batches_for_policy)
                self._policy_pool.submit(self._policy_batches, batches_for_policy)
        loop, event = self.loop, self._flush_wanted
        if loop is not None and event is not None and not loop.is_closed():
            self._staged += sum(len(b.samples) for b in batches)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._maybe_flush)

    def _maybe_flush(self) -> None:
        if self._flush_wanted is not None and self._staged >= self.config.flush_samples:
            self._flush_wanted.set()


# -- agent endpoints -------------------------------------------------------------------


@handled
async def ingest(request: Request) -> Response:
    ctx = ctx_of(request)
    node = agent_node(ctx, request)
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in MSGPACK_TYPES:
        raise IngestError(415, "content_type",
                          f"Content-Type must be application/msgpack, got {ctype or 'none'!r}")
    body = await read_limited(request, ctx.config.max_body_bytes)
    received = ctx.clock()
    sent = request.headers.get(SENT_AT_HEADER)
    if sent is not None:
        ctx.metrics.clock_skew.labels(node).set(_sent_at(sent) - received)
    window = TimeWindow(received, ctx.config.ingest_max_age_s, ctx.config.ingest_max_future_s)
    address = request.client.host if request.client else ""
    checked, stored = accept_batch(ctx.writer, ctx.metrics, body, node=node, window=window,
                                   max_items=ctx.config.max_batch_items, address=address)
    batch = checked.batch
    result = await asyncio.wrap_future(stored)
    answer: dict[str, Any] = {"result": result.value, "seq": batch.seq}
    if checked.refused:
        answer["refused"] = [r.as_json() for r in checked.refused]
    return json_response(answer)


def _sent_at(value: str) -> float:
    """The agent's clock when it sent the request (header :data:`SENT_AT_HEADER`)."""
    try:
        sent = float(value)
    except ValueError:
        sent = math.nan
    if not 0 < sent < MAX_UNIX_TIME:
        raise IngestError(400, "decode", f"{SENT_AT_HEADER}: expected Unix seconds, got "
                                         f"{value[:40]!r}")
    return sent


@handled
async def poll_commands(request: Request) -> Response:
    ctx = ctx_of(request)
    node = agent_node(ctx, request)
    wanted = request.query_params.get("node", node)
    if wanted != node:
        raise IngestError(403, "node_mismatch",
                          f"node: token is for node {node!r}, asked for {wanted!r}")
    wait = float_param(request, "wait") or 0.0
    wait = min(max(0.0, wait), ctx.config.long_poll_max_s)
    commands = await ctx.commands.poll(node, wait)
    return json_response(commands)


@handled
async def ack_command(request: Request) -> Response:
    ctx = ctx_of(request)
    node = agent_node(ctx, request)
    body = await read_limited(request, 64 * 1024)
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    try:
        ack = decode(body, CommandAck) if ctype in MSGPACK_TYPES else decode_json(body,
                                                                                  CommandAck)
    except WireError as exc:
        raise IngestError(400, "decode", str(exc)) from None
    if ack.id != request.path_params["id"]:
        raise IngestError(400, "decode", f"$.id: {ack.id!r} does not match the URL")
    if ack.node != node:
        raise IngestError(403, "node_mismatch",
                          f"$.node: token is for node {node!r}, ack says {ack.node!r}")
    state = await asyncio.to_thread(ctx.accept_ack, ack, node)
    if state == "unknown":
        return error_response(404, f"no command {ack.id!r} for node {node!r}")
    return json_response({"result": state})


# -- the factory -----------------------------------------------------------------------


FEED_INTERVAL_S = 0.2
"""How often the leader reads new findings from shared state (adds at most this to the
latency of a decision in the scale-out mode)."""


async def _leader_feed(ctx: CollectorContext, feed: FindingsFeed) -> None:
    """Shared state: while this replica leads, every finding any replica stored goes
    through the policy (once; the cursor is saved after each group)."""
    leading = False
    while True:
        await asyncio.sleep(FEED_INTERVAL_S)
        try:
            if not ctx.leader.is_leader:
                leading = False
                continue
            if not leading:
                await asyncio.to_thread(feed.resume)
                leading = True
            findings = await asyncio.to_thread(feed.take)
            if findings:
                await ctx.run_policy(ctx._decide, findings)
            await asyncio.to_thread(feed.save)
        except Exception:
            leading = False  # resume from the saved cursor once the store answers
            log.exception("leader feed failed; retried in %.1f s", FEED_INTERVAL_S)


async def _periodic_flush(ctx: CollectorContext) -> None:
    assert ctx._flush_wanted is not None
    event = ctx._flush_wanted
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), ctx.config.flush_interval_s)
        event.clear()
        if not ctx.leader.is_leader:
            continue  # shared state: the leader alone writes the Parquet export
        try:
            ctx._staged = 0
            try:
                await asyncio.to_thread(ctx.telemetry.flush, max_rows=10**9)
            except Exception as exc:
                ctx.flush_error = f"{type(exc).__name__}: {exc}"[:1000]
                raise
            finally:
                ctx.flush_time = ctx.clock()
            ctx.flush_error = ""
        except Exception:
            log.exception("telemetry flush failed; staged samples are kept and retried")


def _both(first: Callable[[T], None], second: Callable[[T], None]) -> Callable[[T], None]:
    def call(arg: T) -> None:
        first(arg)
        second(arg)

    return call


def _leader_changed(metrics: CollectorMetrics, leader: bool) -> None:
    metrics.leader.set(1 if leader else 0)
    metrics.leader_changes.inc()


def create_app(
    config: CollectorConfig,
    store: StateStore,
    outbound: httpx.AsyncClient | None = None,
    *,
    policy: FindingsPolicy | None = None,
    tokens: TokenRegistry | None = None,
    metrics: CollectorMetrics | None = None,
    clock: Callable[[], float] = time.time,
    extra_routes: Sequence[BaseRoute] = (),
) -> Starlette:
    """Build the collector app. ``store`` is the caller's to close after the app stops;
    ``tokens`` defaults to ``config.tokens_file``; ``policy``: see the module docstring.

    Raises :class:`~forewarn.collector.storage.datadir.DataDirError` when ``store`` is not the
    database of ``config.data_dir``'s files (nothing is moved or deleted then)."""
    metrics = metrics or CollectorMetrics()
    tokens = tokens or TokenRegistry(config.tokens_file, on_error=metrics.tokens_errors.inc)
    commands = CommandQueue(store, metrics, redeliver_s=config.command_redeliver_s,
                            ttl_s=config.command_ttl_s, clock=clock)
    check_data_dir(store, config.telemetry_dir)
    # The staging log is a local file: with shared PostgreSQL state, batch bodies stay in
    # their staged_samples rows so that any replica can flush any of them.
    staging = StagingLog(config.data_dir / "staging") if config.state == "sqlite" else None
    telemetry = TelemetryWriter(store, config.telemetry_dir, metrics,
                                retention_days=config.retention_days, clock=clock,
                                staging=staging)
    ctx = CollectorContext(
        config=config, store=store, metrics=metrics, commands=commands,
        jobs=StoreJobView(store), telemetry=telemetry,
        writer=IngestWriter(store, metrics, group_max=config.group_commit_max, clock=clock,
                            staging=staging, quarantine_dir=config.quarantine_dir),
        tokens=tokens, outbound=outbound, policy=policy, clock=clock,
    )
    ctx.writer.on_stored = ctx._on_stored
    if config.state == "postgresql":
        ctx.leader = AdvisoryLockLeader(config.postgres_dsn,
                                        on_change=functools.partial(_leader_changed, metrics))
    else:
        metrics.leader.set(1)
    ctx.writer.on_staged = telemetry.remember
    if config.remote_write_url:
        ctx.series = RemoteWriter(config.remote_write_url, metrics,
                                  labels=config.remote_write_labels,
                                  queue_samples=config.remote_write_queue_samples)
        ctx.writer.on_staged = _both(telemetry.remember, ctx.series.on_staged)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        ctx.loop = asyncio.get_running_loop()
        ctx._flush_wanted = asyncio.Event()
        commands.bind_loop(ctx.loop)
        await asyncio.to_thread(telemetry.recover)
        metrics.staged.set(await asyncio.to_thread(telemetry.staged_samples))
        if not tokens.nodes():
            log.warning("no agent tokens enrolled (%s): every ingest will be refused; "
                        "enrol nodes with `forewarn collector token add NODE`",
                        config.tokens_file)
        ctx.writer.start()
        consumer = None
        if config.bus_url:
            from ..ingest.bus import BusConsumer  # nats-py only where the bus is used

            consumer = BusConsumer(config, ctx.writer, metrics, commands,
                                   on_ack=ctx.accept_ack, clock=clock)
            await consumer.start()
            ctx.bus = consumer
        if isinstance(policy, StartHook):
            decide_ctx: DecideContext = ctx  # mypy checks that the context fits the seam
            await ctx.run_policy(policy.start, decide_ctx)
        ctx.leader.start()
        if ctx.series is not None:
            ctx.series.start()
        flusher = asyncio.create_task(_periodic_flush(ctx))
        tasks = [flusher, asyncio.create_task(run_upkeep(config, store, telemetry, metrics,
                                                         clock))]
        if ctx.leader.shared:
            tasks.append(asyncio.create_task(_leader_feed(ctx, FindingsFeed(store))))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if consumer is not None:
                await consumer.stop()
            await asyncio.to_thread(ctx.writer.stop)
            if isinstance(policy, StopHook):
                with contextlib.suppress(Exception):
                    await ctx.run_policy(policy.stop)
            ctx._policy_pool.shutdown(wait=True)
            try:
                if ctx.leader.is_leader:
                    await asyncio.to_thread(telemetry.flush, max_rows=10**9)
            except Exception:
                log.exception("final telemetry flush failed; samples stay staged")
            await asyncio.to_thread(ctx.leader.stop)  # after the flush it did as leader
            if ctx.series is not None:
                await asyncio.to_thread(ctx.series.stop)
            commands.bind_loop(None)
            if staging is not None:
                staging.close()
            telemetry.drop_segments()  # the last segment, now closed, if fully flushed

    routes: list[BaseRoute] = [
        Route("/api/v1/ingest", ingest, methods=["POST"]),
        Route("/api/v1/commands", poll_commands, methods=["GET"]),
        Route("/api/v1/commands/{id}/ack", ack_command, methods=["POST"]),
        *read_routes(),
        Route("/readyz", readyz, methods=["GET"]),
        *statuspage.routes(),
        *extra_routes,
    ]
    if isinstance(policy, ApiHook):
        routes.extend(policy_routes(policy.api()))
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.ctx = ctx
    return app

