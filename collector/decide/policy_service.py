"""The policy plugged into the collector service (the ``policy=`` seam of
:func:`forewarn.collector.http.app.create_app`).

:class:`PolicyService` builds the :class:`~.policy.Policy`, :class:`~.orders.OrderBook`,
:class:`~.webhooks.WebhookSender` and :class:`~.drain.DrainRunner` from
:class:`~forewarn.collector.config.CollectorConfig` and wires them to the service: the job
map (``ctx.jobs``), the command queues (``ctx.commands``), the store (decisions and
actions tables) and the metrics registry. It also mounts the Alertmanager and Grafana
webhook routes (:mod:`..ingest.alerts`). With them run the live failure predictor
(:mod:`.predict`: its findings go through the same policy, so the cost-aware checkpoint
decision uses the predicted probability) and goodput accounting (:mod:`.goodput_service`),
both fed from the stored batches; every ``predict_interval_s`` a timer scores the fleet and
refreshes goodput advice on the policy thread. Peer comparison of the ranks of every job
across its nodes (:mod:`.stragglers`) runs on the same batches; its straggler findings go
through the policy too.

Alert webhooks go through an :class:`~..ingest.alert_book.AlertBook` (deduplicated, stored in
batches every half second); only alerts that start firing or resolve reach the policy,
coalesced by check and subject and handed over in small chunks on the policy thread's bulk
lane, so a storm never delays a decision about an agent's finding (:mod:`.policy_thread`).

Every finding the policy sees is tracked in its incident (:mod:`.incidents`): resolved by
its source (the agent's healthy finding, a resolved alert), expired when its source is
silent for ``finding_ttl_s`` (checked every :data:`EXPIRE_EVERY_S`; a closing ``unknown``
finding is stored so the GPU's colour clears); the incidents that changed are written to
the ``incidents`` table after each turn of the policy thread.

Threads: the hooks run on the service's single policy thread; the webhook sender runs on
the event loop (events are handed over with ``call_soon_threadsafe``); drains run on their
own one-thread pool.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client import Counter, Gauge

from forewarn.config import ConfigError
from forewarn.wire import AgentBatch, CommandAck, Finding, Health, SuggestedAction

from ..ingest.alert_book import AlertBook
from ..ingest.batch import store_findings
from .actions import ActionPipeline, store_decisions
from .costmodel import CheckpointCostTracker
from .drain import DrainError, DrainRunner, DrainTemplate
from .goodput_service import AdviceSender, GoodputService
from .incidents import IncidentBook, TrackedFinding, save_incidents
from .orders import OrderBook, OrderSettings
from .policy import Decision, Policy, PolicySettings
from .predict import PredictorService
from .seam import DecideContext, PolicyApi
from .stragglers import StragglerService
from .webhooks import Delivery, WebhookEndpoint, WebhookSender

if TYPE_CHECKING:
    from ..config import CollectorConfig
    from ..ingest.alerts import AlertPayload

__all__ = ["PolicyService", "settings_from_config"]

log = logging.getLogger(__name__)

ALERT_CHUNK = 4
"""Alert findings the policy takes per turn on the bulk lane (bounds how long a decision
about an agent's finding can wait behind alerts)."""
ALERT_QUEUE_MAX = 10_000
"""Alert findings (distinct check and subject) waiting for the policy; more are dropped
and counted: their rows and findings are stored all the same."""
ALERT_FLUSH_S = 0.5
EXPIRE_EVERY_S = 5.0
"""How often silent sources' findings are checked for expiry."""
BULK_SAVE_S = 1.0
"""How often the bulk lane writes the incidents that changed while alerts keep coming."""


def settings_from_config(config: CollectorConfig) -> PolicySettings:
    """The policy thresholds from the collector config's ``policy_*`` keys."""
    shadow_actions = set(config.policy_shadow_actions)
    if not config.drain_enabled:
        shadow_actions.add("drain")
    return PolicySettings(
        shadow=config.policy_shadow,
        shadow_actions=frozenset(shadow_actions),
        dedup_s=config.policy_dedup_s,
        cooldown_s={
            "checkpoint": config.policy_cooldown_checkpoint_s,
            "webhook": config.policy_cooldown_webhook_s,
            "drain": config.policy_cooldown_drain_s,
        },
        rate_per_minute={
            "checkpoint": config.policy_rate_checkpoint_per_min,
            "webhook": config.policy_rate_webhook_per_min,
            "drain": config.policy_rate_drain_per_min,
        },
        breaker_share={
            "checkpoint": config.policy_breaker_checkpoint_share,
            "drain": config.policy_breaker_drain_share,
        },
        breaker_window_s=config.policy_breaker_window_s,
        probability=dict(config.policy_probability),
        hold_checks=frozenset(config.policy_hold_checks),
    )


def _secret(value: str, path: Any, key: str) -> str:
    """``value``, else the contents of the file ``path`` (config key ``key``); a file that
    cannot be read is a :class:`ConfigError` naming the key (the CLI exits 2 with it)."""
    if value or path is None:
        return value
    try:
        return str(path.read_text()).strip()
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path}: {exc.strerror or exc}") from None


def _endpoints(key: str, urls: Sequence[str], fmt: str,
               secret: bytes = b"") -> list[WebhookEndpoint]:
    try:
        return [WebhookEndpoint(u, fmt, secret) for u in urls]
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}") from None


class PolicyService:
    """See the module docstring. Build with :meth:`from_config`."""

    def __init__(
        self,
        settings: PolicySettings,
        orders: OrderSettings,
        *,
        endpoints: Sequence[WebhookEndpoint] = (),
        webhook_max_attempts: int = 5,
        webhook_backoff_s: float = 1.0,
        drain: DrainRunner | None = None,
        alert_token: str = "",
        operator_token: str = "",
        checkpoint_default_s: float = 60.0,
        predictor: PredictorService | None = None,
        goodput: GoodputService | None = None,
        stragglers: StragglerService | None = None,
        advise_hooks: bool = True,
        alert_ttl_s: float = 7200.0,
        alert_max_rows: int = 10_000,
        retention_days: int = 30,
        finding_ttl_s: float = 7200.0,
        incident_window_s: float = 300.0,
    ) -> None:
        self.settings = settings
        self.order_settings = orders
        self.advice_sender = AdviceSender(orders) if advise_hooks else None
        self.endpoints = list(endpoints)
        self.webhook_max_attempts = webhook_max_attempts
        self.webhook_backoff_s = webhook_backoff_s
        self.drain = drain
        self.alert_token = alert_token
        self.operator_token = operator_token
        self.checkpoint_default_s = checkpoint_default_s
        self.pipeline: ActionPipeline | None = None
        self.sender: WebhookSender | None = None
        self._ctx: DecideContext | None = None
        self._drain_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="drain")
        self._incident_settings = (finding_ttl_s, incident_window_s)
        self.incidents: IncidentBook | None = None
        self._bulk_saved = 0.0
        self._expirer: concurrent.futures.Future[None] | None = None
        self._alert_settings = (alert_ttl_s, alert_max_rows, retention_days * 86400.0)
        self.alert_book: AlertBook | None = None
        self._alert_queue: collections.OrderedDict[str, tuple[Finding, str]] = (
            collections.OrderedDict())
        self._alert_lock = threading.Lock()
        self._alert_turn_queued = False
        self._alert_flusher: concurrent.futures.Future[None] | None = None
        self.predictor = predictor
        self.goodput = goodput
        self.stragglers = stragglers
        self.policy: Policy | None = None
        self._ticker: concurrent.futures.Future[None] | None = None

    @classmethod
    def from_config(cls, config: CollectorConfig) -> PolicyService:
        """Everything from the collector config (secrets from their files when given). A
        webhook URL or drain template this module refuses is a :class:`ConfigError`
        naming the key (checked here, where they are parsed, not in the config module)."""
        secret = _secret(config.webhook_secret, config.webhook_secret_file,
                         "webhook_secret_file").encode()
        endpoints = (_endpoints("webhook_urls", config.webhook_urls, "json", secret)
                     + _endpoints("webhook_slack_urls", config.webhook_slack_urls, "slack"))
        drain = None
        if config.drain_command:
            try:
                template = DrainTemplate(config.drain_command)
            except DrainError as exc:
                raise ConfigError(f"drain_command: {exc}") from None
            drain = DrainRunner(template, enabled=config.drain_enabled,
                                timeout_s=config.drain_timeout_s)
        return cls(
            settings_from_config(config),
            OrderSettings(delivery_latency_s=config.order_delivery_latency_s,
                          safety_s=config.order_safety_s,
                          max_reissues=config.order_max_reissues),
            endpoints=endpoints,
            webhook_max_attempts=config.webhook_max_attempts,
            webhook_backoff_s=config.webhook_backoff_s,
            drain=drain,
            alert_token=_secret(config.alert_token, config.alert_token_file, "alert_token_file"),
            operator_token=_secret(config.operator_token, config.operator_token_file,
                                   "operator_token_file"),
            checkpoint_default_s=config.checkpoint_default_s,
            predictor=PredictorService.from_config(config),
            goodput=GoodputService(checkpoint_default_s=config.checkpoint_default_s,
                                   gpu_mtbf_h=config.goodput_gpu_mtbf_h),
            stragglers=StragglerService.from_config(config),
            # shadow mode acts on nothing: no advice reaches the ranks either
            advise_hooks=config.advise_hooks and not config.policy_shadow,
            alert_ttl_s=config.alert_ttl_s,
            alert_max_rows=config.alert_max_rows,
            retention_days=config.retention_days,
            finding_ttl_s=config.finding_ttl_s,
            incident_window_s=config.incident_window_s,
        )

    # -- the app's hooks (policy thread) ------------------------------------------------

    def start(self, ctx: DecideContext) -> None:
        """Build the pieces against the running service."""
        self._ctx = ctx
        registry = ctx.metrics.registry
        ttl_s, window_s = self._incident_settings
        self.incidents = IncidentBook(ttl_s=ttl_s, window_s=window_s, clock=ctx.clock,
                                      registry=registry)
        reopened = self.incidents.load(
            ctx.store.query("SELECT * FROM incidents WHERE state = 'open'"), ctx.clock())
        if reopened:
            log.info("%d open incident(s) taken back from the store", reopened)
        policy = Policy(
            self.settings, ctx.jobs, CheckpointCostTracker(self.checkpoint_default_s),
            record=store_decisions(ctx.store), clock=ctx.clock, registry=registry,
            incidents=self.incidents,
        )
        orders = OrderBook(ctx.commands, self.order_settings, clock=ctx.clock, registry=registry)
        send = None
        if self.endpoints and ctx.loop is not None:
            self.sender = WebhookSender(
                self.endpoints, client=ctx.outbound, max_attempts=self.webhook_max_attempts,
                backoff_s=self.webhook_backoff_s, on_delivery=self._delivered,
                clock=ctx.clock, registry=registry,
            )
            asyncio.run_coroutine_threadsafe(self.sender.start(), ctx.loop).result(10)
            sender, loop = self.sender, ctx.loop

            def send(event: dict[str, Any]) -> None:
                loop.call_soon_threadsafe(sender.send, event)

        self.pipeline = ActionPipeline(
            policy, orders, send_webhook=send, drain=self.drain, drain_pool=self._drain_pool,
            actions=ctx.store,
        )
        self.policy = policy
        if self.drain is not None:
            self.drain.register(registry)
        ttl_s, max_rows, retention_s = self._alert_settings
        self.alert_book = AlertBook(ttl_s=ttl_s, max_rows=max_rows, retention_s=retention_s,
                                    clock=ctx.clock)
        self._m_alerts = Counter("forewarn_collector_alerts",
                                 "Inbound alerts by result: new (a finding for the policy), "
                                 "duplicate (already firing), resolved, skipped, dropped "
                                 "(policy queue full).", ["source", "result"], registry=registry)
        self._m_alert_queue = Gauge("forewarn_collector_alert_findings_queued",
                                    "Alert findings waiting for the policy.", registry=registry)
        if ctx.loop is not None:
            self._alert_flusher = asyncio.run_coroutine_threadsafe(
                _flush_alerts(self.alert_book, ctx), ctx.loop)
        if ctx.loop is not None:
            self._expirer = asyncio.run_coroutine_threadsafe(
                _every(EXPIRE_EVERY_S, ctx, self.expire_findings), ctx.loop)
        for part in (self.predictor, self.goodput):
            if part is not None:
                part.register(registry)
        if (self.predictor is not None or self.goodput is not None) and ctx.loop is not None:
            interval = self.predictor.interval_s if self.predictor is not None else 10.0
            self._ticker = asyncio.run_coroutine_threadsafe(
                _every(interval, ctx, self.tick), ctx.loop)

    def stop(self) -> None:
        """Stop the webhook worker and wait for a running drain."""
        ctx = self._ctx
        for timer in (self._ticker, self._expirer):
            if timer is not None:
                timer.cancel()
        if self._alert_flusher is not None:
            self._alert_flusher.cancel()
        if self.alert_book is not None and ctx is not None:
            try:
                self.alert_book.flush(ctx.store)
            except Exception:
                log.exception("storing the last alerts failed")
        if self.sender is not None and ctx is not None and ctx.loop is not None:
            try:
                asyncio.run_coroutine_threadsafe(self.sender.stop(), ctx.loop).result(10)
            except Exception:
                log.exception("stopping the webhook sender failed")
        self._drain_pool.shutdown(wait=True)

    def on_findings(self, findings: Sequence[Finding], store: Any, now: float) -> None:
        """New findings: through the policy, actions carried out; orders go straight to
        the command queues, so nothing is returned."""
        if self.pipeline is None:
            return
        if self.goodput is not None and self._ctx is not None:
            self.goodput.on_findings(findings, self._ctx.jobs)
        self.pipeline.handle_findings(findings)
        self._save_incidents()

    def on_batches(self, batches: Sequence[AgentBatch], now: float) -> None:
        """Checkpoint reports: measured cost, order progress, reissue on a miss; samples
        and XIDs to the predictor, rank summaries to goodput; a scoring when due."""
        if self.pipeline is None:
            return
        for batch in batches:
            if self.incidents is not None:  # the node's agent is alive: its findings too
                self.incidents.heard(f"agent:{batch.node}", now)
            for report in batch.checkpoints:
                self.pipeline.on_report(report)
        if self.predictor is not None:
            self.predictor.observe(batches)
        if self.goodput is not None:
            self.goodput.on_batches(batches)
        if self.stragglers is not None:
            self.stragglers.observe(batches)
            if self.stragglers.due(now):
                self._detected(self.stragglers.findings(now), now, "peers")
        if self.predictor is not None and self.predictor.due(now):
            self.tick(now)

    def on_ack(self, ack: CommandAck, node: str) -> None:
        """An agent acknowledged a command."""
        if self.pipeline is not None:
            self.pipeline.on_ack(ack)

    def api(self) -> PolicyApi:
        """The alert webhooks and the operator's orders and drains; with the predictor
        ``GET /api/v1/risk``, with goodput ``GET /api/v1/goodput``."""
        return PolicyApi(
            alert_token=self.alert_token, alerts=self._handle_alert,
            operator_token=self.operator_token, operator=self._submit_forced,
            risk=self.predictor.risk if self.predictor is not None else None,
            goodput=self._goodput_report if self.goodput is not None else None,
        )

    def _goodput_report(self, job: str | None, now: float) -> list[dict[str, Any]]:
        """Policy thread: goodput refreshed now, of ``job`` or of every job."""
        self.refresh_goodput(now)
        return self.goodput.report_for(job) if self.goodput is not None else []

    def tick(self, now: float) -> None:
        """Score the fleet when due; predictions through the policy; goodput advice."""
        if self.predictor is not None and self.predictor.due(now):
            self._detected(self.predictor.score(now), now, "predictor")
        self.refresh_goodput(now)

    def refresh_goodput(self, now: float) -> None:
        """Recompute goodput advice with the job's cost, risk and the fleet failure rate."""
        ctx, goodput, predictor = self._ctx, self.goodput, self.predictor
        if ctx is None or goodput is None:
            return
        goodput.refresh(
            now, ctx.jobs, self.policy.tracker if self.policy is not None else None,
            risk=predictor.scores.job_risk if predictor is not None else None,
            gpu_mtbf_h=predictor.fleet_gpu_mtbf_h() if predictor is not None else None,
            horizon_s=predictor.horizon_s if predictor is not None else 3600.0,
        )
        if self.advice_sender is not None:
            # Hooks that follow the advice save at the advised steps: tell the job's agents.
            ctx.commands.enqueue_many(self.advice_sender.due(goodput.advice, ctx.jobs, now))

    def _detected(self, findings: list[Finding], now: float, origin: str) -> None:
        """Store the findings of the collector's own detectors (``origin``: predictor,
        peers) and run them through the policy (this thread)."""
        ctx = self._ctx
        if ctx is None or self.pipeline is None or not findings:
            return
        _record_findings(ctx, findings, origin, now)
        self.pipeline.handle_findings(findings, origin)
        self._save_incidents()

    def expire_findings(self, now: float) -> list[TrackedFinding]:
        """Policy thread: end the findings whose source went silent for ``finding_ttl_s``;
        a closing ``unknown`` finding is stored for each, so its GPU's colour clears."""
        ctx, book = self._ctx, self.incidents
        if ctx is None or book is None:
            return []
        expired = book.expire(now)
        if expired:
            log.warning("%d finding(s) expired: their source was silent for %.0f s: %s",
                        len(expired), book.ttl_s, ", ".join(t.key for t in expired[:5]))
            closing = [msgspec.structs.replace(
                t.finding, health=Health.UNKNOWN, action=SuggestedAction.NONE, time=now,
                reason=f"expired: {t.source} silent for {book.ttl_s:.0f} s "
                f"(was: {t.finding.reason})"[:4096]) for t in expired]
            _record_findings(ctx, closing, "expiry", now)
        self._save_incidents()
        return expired

    def _save_incidents(self) -> None:
        """Write the incidents that changed (policy thread)."""
        ctx, book = self._ctx, self.incidents
        if ctx is None or book is None:
            return
        changed = book.take_changed()
        try:
            save_incidents(ctx.store, changed)
        except Exception:
            ctx.metrics.policy_errors.inc()
            log.exception("storing %d incident(s) failed", len(changed))

    # -- helpers ------------------------------------------------------------------------

    async def _handle_alert(
        self, ctx: DecideContext, payload: AlertPayload, source: str
    ) -> dict[str, Any]:
        """Sort the alerts (off the loop), queue the new ones for the policy, answer at
        once: the policy's decisions are in ``GET /api/v1/decisions``."""
        book = self.alert_book
        if book is None:
            raise RuntimeError("alert webhook before the policy service started")
        intake = await asyncio.to_thread(book.accept, payload, source, ctx.jobs, ctx.clock())
        for f in intake.findings + intake.cleared:
            ctx.metrics.findings.labels(f.health.value, source).inc()
        dropped = self._queue_alerts(intake.findings + intake.cleared, source, ctx)
        if intake.refreshed:
            ctx.submit_bulk(self._refresh_alerts, intake.refreshed, source, ctx.clock())
        for result, n in (("new", len(intake.findings)), ("duplicate", intake.duplicates),
                          ("resolved", intake.resolved), ("skipped", len(intake.skipped)),
                          ("dropped", dropped)):
            if n:
                self._m_alerts.labels(source, result).inc(n)
        return {"findings": len(intake.findings), "duplicates": intake.duplicates,
                "resolved": intake.resolved, "skipped": intake.skipped}

    def _queue_alerts(self, findings: list[Finding], source: str, ctx: DecideContext
                      ) -> int:
        """Coalesce new alert findings (and the healthy ones of resolved alerts) by check,
        subject and health for the bulk lane; returns how many were dropped because the
        queue is full."""
        dropped = 0
        with self._alert_lock:
            for f in findings:
                key = f"{f.check}|{f.subject.key()}|{f.health.value}"
                if key not in self._alert_queue and len(self._alert_queue) >= ALERT_QUEUE_MAX:
                    dropped += 1
                    continue
                self._alert_queue[key] = (f, source)
            self._m_alert_queue.set(len(self._alert_queue))
            start = bool(self._alert_queue) and not self._alert_turn_queued
            self._alert_turn_queued = self._alert_turn_queued or start
        if dropped:
            log.warning("alert findings dropped: %d (the policy is %d behind)", dropped,
                        ALERT_QUEUE_MAX)
        if start:
            ctx.submit_bulk(self._alert_turn, ctx)
        return dropped

    def _alert_turn(self, ctx: DecideContext) -> None:
        """Bulk lane: run up to :data:`ALERT_CHUNK` alert findings through the policy,
        then queue the next turn behind any decision work that arrived meanwhile."""
        with self._alert_lock:
            chunk = [self._alert_queue.popitem(last=False)[1]
                     for _ in range(min(ALERT_CHUNK, len(self._alert_queue)))]
            self._m_alert_queue.set(len(self._alert_queue))
            more = bool(self._alert_queue)
            self._alert_turn_queued = more
        if more:
            ctx.submit_bulk(self._alert_turn, ctx)
        if self.pipeline is None:
            return
        for finding, source in chunk:
            try:
                if self.goodput is not None:
                    self.goodput.on_findings([finding], ctx.jobs)
                self.pipeline.handle_findings([finding], source, force_checkpoint=True)
            except Exception:
                ctx.metrics.policy_errors.inc()
                log.exception("policy failed on alert finding %s", finding.check)
        # During a storm the incidents are written once a second and when the queue runs
        # dry, not after every chunk: a write per turn would hold up the decision lane.
        mono = time.monotonic()
        if not more or mono - self._bulk_saved >= BULK_SAVE_S:
            self._bulk_saved = mono
            self._save_incidents()

    def _refresh_alerts(self, findings: list[Finding], source: str, now: float) -> None:
        """Bulk lane: alerts re-sent while firing keep their findings from expiring."""
        if self.incidents is not None:
            for f in findings:
                self.incidents.refresh(f, source, now)

    async def _submit_forced(
        self, ctx: DecideContext, findings: list[Finding], source: str
    ) -> dict[str, Any]:
        """Store ``findings`` and run them through the policy with the cost model bypassed
        (an operator asked), on the decision lane; the decisions taken. (Alerts take the
        alert book and the bulk lane instead: :meth:`_handle_alert`.)"""
        await asyncio.to_thread(_record_findings, ctx, findings, source, ctx.clock())
        taken = await ctx.run_policy(self._forced_findings, findings, source)
        decisions = [{"id": d.id, "action": d.action, "target": d.target,
                      "outcome": d.outcome, "reason": d.reason} for d in taken]
        return {"findings": len(findings), "decisions": decisions}

    def _forced_findings(self, findings: list[Finding], source: str) -> list[Decision]:
        """Policy thread: an operator's findings, the cost model bypassed."""
        if self.pipeline is None:
            return []
        if self.goodput is not None and self._ctx is not None:
            self.goodput.on_findings(findings, self._ctx.jobs)
        decisions = self.pipeline.handle_findings(findings, source, force_checkpoint=True)
        self._save_incidents()
        return decisions

    def _delivered(self, d: Delivery) -> None:
        """Runs on the loop: store final delivery results off the loop."""
        ctx = self._ctx
        if ctx is None or d.status == "retry":
            return
        record = functools.partial(
            ctx.store.record_action, time=d.time, kind="webhook_delivery", subject=d.url,
            status=d.status, detail={"event": d.event_id, "url": d.url, "attempt": d.attempt,
                                     "http_status": d.http_status, "detail": d.detail},
        )
        try:
            asyncio.get_running_loop().run_in_executor(None, record)
        except RuntimeError:
            record()


def _record_findings(ctx: DecideContext, findings: Sequence[Finding], origin: str,
                     now: float) -> None:
    """Store findings made in the collector and count them (``origin`` labels both)."""
    with ctx.store.write() as conn:
        store_findings(conn, findings, node="", origin=origin, received=now)
    for f in findings:
        ctx.metrics.findings.labels(f.health.value, origin).inc()


async def _flush_alerts(book: AlertBook, ctx: DecideContext) -> None:
    """Store the alert book's rows and new findings every :data:`ALERT_FLUSH_S`."""
    while True:
        await asyncio.sleep(ALERT_FLUSH_S)
        try:
            await asyncio.to_thread(book.flush, ctx.store)
        except Exception:
            log.exception("storing alerts failed; they are kept for the next try")


async def _every(interval_s: float, ctx: DecideContext, fn: Callable[[float], object]
                 ) -> None:
    """Run ``fn(now)`` on the policy thread every ``interval_s`` until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await ctx.run_policy(fn, ctx.clock())
        except RuntimeError:  # the policy thread is gone: the app is stopping
            return
        except Exception:
            ctx.metrics.policy_errors.inc()
            log.exception("periodic task %s failed", getattr(fn, "__name__", fn))
