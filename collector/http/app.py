"""The collector's ASGI app (Starlette), built by :func:`create_app`.

Routes
------
``POST /api/v1/ingest``
    Body: msgpack :class:`~forewarn.wire.AgentBatch`, ``Content-Type: application/msgpack``,
    ``Authorization: Bearer <the node's token>``, optionally ``Forewarn-Sent-At: <the
    agent's Unix time>`` (the agent's clock skew, a metric per node). Answers ``200
    {"result": "stored" | "duplicate", "seq": n}`` only once the batch is durable (with
    ``remote_write_url``: and its GPU samples are in the series store, else 503 after
    5 s, the batch stored but answered to be sent again), with
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
    Called with every newly stored finding of the agents' batches, urgent ones first
    (with shared state: on the leader, the findings any replica stored, from
    :meth:`~.context.CollectorContext.leader_feed`). Returned
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
    Every newly stored batch (rank summaries, checkpoint reports for the order book); with
    shared state, on the leader only, and for the bus's batches from its ``decide``
    consumer, whichever replica stored them (:mod:`.leading`).
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
*args)``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from starlette.applications import Starlette
from starlette.routing import BaseRoute, Route

from ..config import CollectorConfig
from ..decide.seam import ApiHook, FindingsPolicy
from ..ingest.batch import IngestWriter
from ..jobs.jobmap import StoreJobView
from ..metrics import CollectorMetrics
from ..storage.commands import CommandQueue
from ..storage.datadir import check_data_dir, telemetry_replica
from ..storage.leader import AdvisoryLockLeader
from ..storage.remote_write import RemoteWriter
from ..storage.staging import StagingLog
from ..storage.state import StateStore
from ..storage.telemetry import TelemetryWriter
from . import statuspage
from .agent_routes import agent_routes
from .api import read_routes
from .auth import TokenRegistry
from .context import CollectorContext
from .lifespan import service_lifespan
from .policy_routes import policy_routes
from .readiness import readyz

if TYPE_CHECKING:
    import httpx

__all__ = ["create_app"]

log = logging.getLogger(__name__)

T = TypeVar("T")


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
    check_data_dir(store, config.telemetry_dir)
    # The staging log is a local file: with shared PostgreSQL state, batch bodies stay in
    # their staged_samples rows so that any replica can flush any of them.
    staging = StagingLog(config.data_dir / "staging") if config.state == "sqlite" else None
    ctx = _context(config, store, outbound, policy, tokens, metrics, clock, staging)
    _elect(ctx)
    _wire_writer(ctx)
    app = Starlette(routes=_routes(policy, extra_routes),
                    lifespan=service_lifespan(ctx, staging))
    app.state.ctx = ctx
    return app


def _context(config: CollectorConfig, store: StateStore, outbound: httpx.AsyncClient | None,
             policy: FindingsPolicy | None, tokens: TokenRegistry, metrics: CollectorMetrics,
             clock: Callable[[], float], staging: StagingLog | None) -> CollectorContext:
    """The service's parts: command queues, telemetry, the ingest writer, the job view."""
    commands = CommandQueue(store, metrics, redeliver_s=config.command_redeliver_s,
                            ttl_s=config.command_ttl_s, clock=clock)
    telemetry = TelemetryWriter(store, config.telemetry_dir, metrics,
                                retention_days=config.retention_days, clock=clock,
                                staging=staging, replica=telemetry_replica(config))
    writer = IngestWriter(store, metrics, group_max=config.group_commit_max, clock=clock,
                          staging=staging, quarantine_dir=config.quarantine_dir)
    return CollectorContext(
        config=config, store=store, metrics=metrics, commands=commands,
        jobs=StoreJobView(store), telemetry=telemetry, writer=writer, tokens=tokens,
        outbound=outbound, policy=policy, clock=clock,
    )


def _elect(ctx: CollectorContext) -> None:
    """With shared PostgreSQL state replicas elect a leader; embedded state always leads."""
    if ctx.config.state == "postgresql":
        ctx.store.fence.on_refused = ctx.metrics.fenced_writes.inc
        ctx.leader = AdvisoryLockLeader(ctx.config.postgres_dsn, fence=ctx.store.fence,
                                        on_change=functools.partial(_leader_changed,
                                                                    ctx.metrics))
    else:
        ctx.metrics.leader.set(1)


def _wire_writer(ctx: CollectorContext) -> None:
    """Stored batches to the policy thread; staged samples to telemetry (and to remote
    write, when ``remote_write_url`` is set)."""
    config = ctx.config
    ctx.writer.on_stored = ctx.on_stored
    ctx.writer.on_staged = ctx.telemetry.remember
    if config.remote_write_url:
        ctx.series = RemoteWriter(config.remote_write_url, ctx.metrics,
                                  labels=config.remote_write_labels,
                                  queue_samples=config.remote_write_queue_samples,
                                  shards=config.remote_write_shards)
        ctx.writer.on_staged = _both(ctx.telemetry.remember, ctx.series.on_staged)


def _routes(policy: FindingsPolicy | None, extra_routes: Sequence[BaseRoute]
            ) -> list[BaseRoute]:
    """The agents' endpoints, the read API, readiness, the status page, the caller's
    extra routes and the policy's API."""
    routes: list[BaseRoute] = [
        *agent_routes(),
        *read_routes(),
        Route("/readyz", readyz, methods=["GET"]),
        *statuspage.routes(),
        *extra_routes,
    ]
    if isinstance(policy, ApiHook):
        routes.extend(policy_routes(policy.api()))
    return routes


def _both(first: Callable[[T], None], second: Callable[[T], None]) -> Callable[[T], None]:
    def call(arg: T) -> None:
        first(arg)
        second(arg)

    return call


def _leader_changed(metrics: CollectorMetrics, leader: bool) -> None:
    metrics.leader.set(1 if leader else 0)
    metrics.leader_changes.inc()
