"""The policy plugged into the collector service (the ``policy=`` seam of
:func:`forewarn.collector.http.app.create_app`, typed in :mod:`.seam`).

:class:`PolicyService` is the composition root of the decide layer: it wires, explicitly,
parts that each do one thing:

* :class:`~.policy.Policy` (findings -> decisions) and :class:`~.orders.OrderBook`
  (checkpoint orders and save holds), carried out by an :class:`~.actions.ActionPipeline`
  whose actuators (webhooks, drains) :class:`~.dispatch.ActionDispatch` starts and stops;
* :class:`~.ledger.FindingLedger`: every finding's incident, findings made in the collector
  stored, silent sources' findings expired (every :data:`~.ledger.EXPIRE_EVERY_S`);
* :class:`~.alert_intake.AlertIntake`: Alertmanager and Grafana webhooks, handed to the
  policy in small chunks on the policy thread's bulk lane;
* :class:`~.advisors.Advisors`: the failure predictor, peer comparison and goodput advice,
  fed from the stored batches; every ``predict_interval_s`` a timer (or a batch that finds
  a scoring due) scores the fleet and refreshes goodput advice on the policy thread, in
  parts each its own item (:mod:`.scoring_pass`): urgent work runs between them, and none
  runs inside a batch's item.

Every finding goes through the one policy: agents' findings on the decision lane, the
collector's own detectors' findings stored first, alerts' and operators' findings with the
cost model bypassed. :meth:`PolicyService.api` tells the HTTP layer what to mount.

Only the leader decides (shared state, several replicas: :mod:`..storage.leader`): the
timers, alert turns and operators' orders act only while this replica leads. A follower
stores the alerts and operators' orders it receives (an order under the origin
``operator`` + :data:`RELAYED`); the leader's feed hands them back with their origins
(:meth:`PolicyService.on_feed`) and decides each once, as if it had come in there. A
replica that starts to lead takes the open incidents over from the store first, and rebuilds
the policy's gates (cooldowns, rate limits, circuit breakers) from the stored decisions
(:mod:`.gate_history`) and the order book from the stored commands (:mod:`.order_history`;
a miss the last leader had not answered is answered then), and sends again the webhooks
queued and not delivered (:mod:`.webhook_history`), and puts the failure predictor's learned
state into its scorer (:mod:`.scorer_state`); so does a collector started again on its
state.

Threads: the hooks run on the service's single policy thread; the webhook sender runs on
the event loop; drains run on their own one-thread pool (:mod:`.dispatch`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from forewarn.wire import AgentBatch, CommandAck, Finding

from ..config import secret
from ..storage.leader import leads_in
from . import service_config
from .actions import ActionPipeline, store_decisions
from .advisors import Advisors
from .alert_intake import ALERT_SOURCES, AlertIntake, AlertLimits
from .costmodel import CheckpointCostTracker
from .dispatch import ActionDispatch
from .gate_history import restore_gates
from .ledger import EXPIRE_EVERY_S, FindingLedger
from .order_history import restore_orders
from .orders import OrderBook, OrderSettings
from .policy import Decision, Policy, PolicySettings
from .scoring_pass import PartRunner, Parts
from .seam import DecideContext, PolicyApi

if TYPE_CHECKING:
    from ..config import CollectorConfig
    from ..storage.state import StateStore

__all__ = ["RELAYED", "PolicyService"]

log = logging.getLogger(__name__)

RELAYED = ":relayed"
"""Suffix of the origin under which a follower stores an operator's findings for the
leader (``operator:relayed``)."""


class PolicyService:
    """See the module docstring. Build with :meth:`from_config`."""

    def __init__(self, settings: PolicySettings, orders: OrderSettings, *,
                 tracker: CheckpointCostTracker, dispatch: ActionDispatch,
                 ledger: FindingLedger, advisors: Advisors,
                 alert_limits: AlertLimits | None = None, alert_token: str = "",
                 operator_token: str = "") -> None:
        self.settings = settings
        self.order_settings = orders
        self.tracker = tracker
        self.dispatch = dispatch
        self.ledger = ledger
        self.advisors = advisors
        self.alerts = AlertIntake(alert_limits or AlertLimits(), decide=self._alert_finding,
                                  refresh=ledger.refresh, save=ledger.save)
        self.alert_token = alert_token
        self.operator_token = operator_token
        self.policy: Policy | None = None
        self.pipeline: ActionPipeline | None = None
        self._ctx: DecideContext | None = None
        self._timers: list[concurrent.futures.Future[None]] = []
        self._scoring: PartRunner | None = None
        self._led_term: int | None = None
        """The leader's term (:attr:`~..storage.leader.Leadership.term`) the memory was
        taken over in; None while this replica does not lead."""

    @classmethod
    def from_config(cls, config: CollectorConfig) -> PolicyService:
        """Everything from the collector config (secrets from their files when given);
        see :mod:`.service_config` for what is refused as a ``ConfigError``."""
        tracker = CheckpointCostTracker(config.checkpoint_default_s)
        return cls(
            service_config.settings_from_config(config), service_config.order_settings(config),
            tracker=tracker, dispatch=service_config.action_dispatch(config),
            ledger=service_config.ledger(config),
            advisors=service_config.advisors(config, tracker),
            alert_limits=service_config.alert_limits(config),
            alert_token=secret(config.alert_token, config.alert_token_file,
                                              "alert_token_file"),
            operator_token=secret(config.operator_token,
                                                 config.operator_token_file,
                                                 "operator_token_file"),
        )

    def readiness(self) -> dict[str, dict[str, Any]]:
        """``/readyz`` components of the policy's own: the failure predictor's model."""
        predictor = self.advisors.predictor
        return {} if predictor is None else {"predictor": predictor.readiness()}

    # -- the app's hooks (policy thread) ------------------------------------------------

    def start(self, ctx: DecideContext) -> None:
        """Build the pieces against the running service."""
        self._ctx = ctx
        registry = ctx.metrics.registry
        incidents = self.ledger.start(ctx)
        self.policy = Policy(self.settings, ctx.jobs, self.tracker,
                             record=store_decisions(ctx.store), clock=ctx.clock,
                             registry=registry, incidents=incidents)
        orders = OrderBook(ctx.commands, self.order_settings, clock=ctx.clock, registry=registry)
        self.pipeline = self.dispatch.start(ctx, self.policy, orders)
        self.alerts.start(ctx)
        self.advisors.start(ctx)
        self._scoring = PartRunner(ctx.submit_next, ctx.metrics.policy_errors.inc)
        if ctx.leader.is_leader:  # the incidents were just loaded; the gates and orders
            self._led_term = ctx.leader.term  # too: a restart keeps them
            self._take_over_memory(ctx)
        if ctx.loop is not None:
            self._timers.append(_every(EXPIRE_EVERY_S, ctx, self._when_leading(
                self.ledger.expire), "expiry"))
            tick_s = self.advisors.tick_s
            if tick_s is not None:
                self._timers.append(_every(tick_s, ctx, self._when_leading(self.tick), "tick"))

    def stop(self) -> None:
        """Stop the timers and a scoring under way, store the last alerts, stop the
        actuators, write the failure predictor's learned state a last time (leader)."""
        for timer in self._timers:
            timer.cancel()
        if self._scoring is not None:
            self._scoring.cancel()
        self.alerts.stop()
        self.dispatch.stop()
        # the lock as it stands (a replica that lost it may not have noticed yet): a
        # follower's last state must not replace the new leader's
        self.advisors.stop(self._ctx is not None and self._ctx.leader.is_leader)

    def on_findings(self, findings: Sequence[Finding], store: StateStore, now: float) -> None:
        """New findings: through the policy, actions carried out; orders go straight to
        the command queues, so nothing is returned."""
        if not self._leads():
            return
        self._decide(findings, "agent")
        self.ledger.save()

    def on_feed(self, found: Sequence[tuple[str, Finding]], now: float) -> None:
        """The leader's feed (shared state): alerts to the alert queue, operators' orders
        a follower relayed through the policy as :meth:`api`'s ``operator`` runs them,
        the rest (agents' findings) as :meth:`on_findings`."""
        ctx = self._ctx
        if ctx is None or not self._leads():
            return
        plain: list[Finding] = []
        by_origin: dict[str, list[Finding]] = {}
        for origin, finding in found:
            if origin in ALERT_SOURCES or origin.endswith(RELAYED):
                by_origin.setdefault(origin, []).append(finding)
            else:
                plain.append(finding)
        for origin, findings in by_origin.items():
            if origin in ALERT_SOURCES:
                self.alerts.queue(findings, origin)
            else:
                self._forced_findings(findings, origin.removesuffix(RELAYED))
        if plain:
            self.on_findings(plain, ctx.store, now)

    def settled(self) -> bool:
        """Whether the alerts :meth:`on_feed` queued have all been through the policy."""
        return self.alerts.idle()

    def on_batches(self, batches: Sequence[AgentBatch], now: float) -> None:
        """Checkpoint reports: measured cost, order progress, reissue on a miss; the
        batches to the advisors; a scoring when due."""
        if self.pipeline is None or not self._leads():
            return
        for batch in batches:
            self.ledger.heard(f"agent:{batch.node}", now)  # the agent is alive: its findings too
            for report in batch.checkpoints:
                self.pipeline.on_report(report)
        self._detected(self.advisors.observe(batches, now), now, "peers")
        if self.advisors.scoring_due(now):
            self.tick(now)

    def on_ack(self, ack: CommandAck, node: str) -> None:
        """An agent acknowledged a command."""
        if self.pipeline is not None:
            self.pipeline.on_ack(ack)

    def api(self) -> PolicyApi:
        """The alert webhooks and the operator's orders and drains; with the predictor
        ``GET /api/v1/risk``, with goodput ``GET /api/v1/goodput``."""
        predictor = self.advisors.predictor
        return PolicyApi(
            alert_token=self.alert_token, alerts=self.alerts.handle,
            operator_token=self.operator_token, operator=self._submit_forced,
            risk=predictor.risk if predictor is not None else None,
            goodput=self.advisors.goodput_report if self.advisors.goodput is not None
            else None,
        )

    def tick(self, now: float) -> None:
        """Queue a pass (unless one is under way): score the fleet when due, predictions
        through the policy, goodput advice; in parts, each its own policy-thread item."""
        if self._scoring is not None:
            self._scoring.run(self._tick_parts(now))

    def _tick_parts(self, now: float) -> Parts:
        findings = yield from self.advisors.score_parts(now)
        yield  # the decisions in a part of their own
        if self._leads():  # only then do the findings count as passed on (a step-down
            # meanwhile drops them: the next leader, or this one again, passes them on)
            self._detected(self.advisors.to_submit(findings, now), now, "predictor")
            self.advisors.refresh_goodput(now)
            yield  # the scorer's state copied when a save is due, a part of its own
            if self._leads():
                self.advisors.save_state(now)

    # -- leadership (policy thread) -------------------------------------------------------

    def _leads(self) -> bool:
        """Whether this replica decides now; when it starts to, the open incidents, the
        gates' memory and the orders in flight are taken over from the store first (with
        shared state another replica decided). Each term of its lead starts so, also one
        this thread never saw begin after the last (it lost the lock and took it again
        while busy: another replica may have decided meanwhile)."""
        ctx = self._ctx
        if ctx is None:
            return False
        leads = ctx.leader.is_leader
        term = ctx.leader.term  # read after: a leader's term is set before it leads
        if leads and self._led_term != term:
            self.ledger.take_over()
            self._take_over_memory(ctx)
        self._led_term = term if leads else None
        return leads

    def _take_over_memory(self, ctx: DecideContext) -> None:
        """The policy's gates and the order book as the store has them (another replica,
        or this collector before it started, decided until now)."""
        self.advisors.take_over()
        if self.policy is not None:
            restore_gates(self.policy, ctx)
        if self.pipeline is not None:
            restore_orders(self.pipeline.orders, ctx)
            self.pipeline.reissue_missed()
        self.dispatch.resend_undelivered()

    def _when_leading(self, fn: Callable[[float], object]) -> Callable[[float], None]:
        """A timer's ``fn``, run only while this replica leads."""

        def run(now: float) -> None:
            if self._leads():
                fn(now)

        return run

    # -- findings into the policy (policy thread) ---------------------------------------

    def _detected(self, findings: list[Finding], now: float, origin: str) -> None:
        """Store the findings of the collector's own detectors (``origin``: predictor,
        peers) and run them through the policy."""
        if self.pipeline is None or not findings:
            return
        self.ledger.record(findings, origin, now)
        self.pipeline.handle_findings(findings, origin)
        self.ledger.save()

    def _alert_finding(self, finding: Finding, source: str) -> None:
        """Bulk lane: one alert finding, the cost model bypassed (an alert rule asked)."""
        if self._leads():
            self._decide([finding], source, force=True)

    async def _submit_forced(
        self, ctx: DecideContext, findings: list[Finding], source: str
    ) -> dict[str, Any]:
        """Store ``findings`` and run them through the policy with the cost model bypassed
        (an operator asked), on the decision lane; the decisions taken. (Alerts take the
        alert book and the bulk lane instead: :mod:`.alert_intake`.) A follower stores
        them for the leader (see the module docstring) and answers ``relayed``; so does a
        replica that lost the lead before or while it decided them (the fence refused
        what it queued, and the findings it stored under ``source`` are no feed's): the
        leader decides them again, to the same order ids."""
        if ctx.leader.shared and not ctx.leader.is_leader:
            return await self._relay(ctx, findings, source)
        await asyncio.to_thread(self.ledger.record, findings, source, ctx.clock())
        term = ctx.leader.term
        taken = await ctx.run_policy(self._forced_findings, findings, source)
        if ctx.leader.shared and not leads_in(ctx.leader, term):
            return await self._relay(ctx, findings, source)
        decisions = [{"id": d.id, "action": d.action, "target": d.target,
                      "outcome": d.outcome, "reason": d.reason} for d in taken]
        return {"findings": len(findings), "decisions": decisions}

    async def _relay(self, ctx: DecideContext, findings: list[Finding], source: str
                     ) -> dict[str, Any]:
        """Store an operator's ``findings`` for the leader's feed (origin ``source`` +
        :data:`RELAYED`); the answer says so."""
        await asyncio.to_thread(self.ledger.record, findings, source + RELAYED, ctx.clock())
        return {"findings": len(findings), "decisions": [], "relayed": "leader"}

    def _forced_findings(self, findings: list[Finding], source: str) -> list[Decision]:
        """Policy thread: an operator's findings, the cost model bypassed; none decided
        unless this replica leads. The memory is taken over first (:meth:`_leads`) when
        this is a new leader's first decision: an order decided before it would enter an
        order book the takeover then replaces from the store."""
        if not self._leads():
            return []
        decisions = self._decide(findings, source, force=True)
        self.ledger.save()
        return decisions

    def _decide(self, findings: Sequence[Finding], source: str, *, force: bool = False
                ) -> list[Decision]:
        """Policy thread: findings from outside (agents, alerts, operators) to the
        advisors (goodput notes a job that stopped), then through the policy (``force``:
        the cost model bypassed); the decisions taken."""
        if self.pipeline is None or self._ctx is None:
            return []
        self.advisors.on_findings(findings, self._ctx.jobs)
        return self.pipeline.handle_findings(findings, source, force_checkpoint=force)


def _every(interval_s: float, ctx: DecideContext, fn: Callable[[float], object], name: str
           ) -> concurrent.futures.Future[None]:
    """Run ``fn(now)`` on the policy thread every ``interval_s`` until cancelled."""
    assert ctx.loop is not None
    return asyncio.run_coroutine_threadsafe(_repeat(interval_s, ctx, fn, name), ctx.loop)


async def _repeat(interval_s: float, ctx: DecideContext, fn: Callable[[float], object],
                  name: str) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await ctx.run_policy(fn, ctx.clock())
        except RuntimeError:  # the policy thread is gone: the app is stopping
            return
        except Exception:
            ctx.metrics.policy_errors.inc()
            log.exception("periodic task %s failed", name)
