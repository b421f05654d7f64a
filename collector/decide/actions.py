"""Carries out what the policy decided: checkpoint orders, webhooks, drains.

:class:`ActionPipeline` is the seam the collector service calls:

* :meth:`ActionPipeline.handle_findings` with new findings (from agents' batches, the
  collector's detectors, alert webhooks) -> policy decisions -> actions (checkpoint
  orders, save holds, webhooks, drains);
* :meth:`ActionPipeline.on_report` with every :class:`CheckpointReport` (measured checkpoint
  cost, order progress, reissue on a miss);
* :meth:`ActionPipeline.on_ack` with every :class:`CommandAck`.

Every action, done or shadowed, is recorded through ``record_action`` (the store's
``actions`` table); every decision through the policy's ``record`` callback.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import msgspec

from forewarn.wire import CheckpointReport, CommandAck, Finding

from ..storage.fence import NotLeaderError
from .drain import DrainError, DrainRunner
from .orders import JobOrder, OrderBook, order_key
from .policy import Decision, PlannedAction, Policy
from .severity import ActionKind, Outcome

__all__ = ["ActionLog", "ActionPipeline", "decision_key", "event_for", "store_decisions"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class ActionLog(Protocol):
    """Where actions are recorded (the service's :class:`~..storage.state.StateStore`)."""

    def record_action(
        self,
        *,
        time: float,
        kind: str,
        subject: str = "",
        job: str = "",
        node: str = "",
        status: str,
        shadow: bool = False,
        detail: dict[str, Any] | None = None,
        lead: bool = False,
    ) -> int: ...

    def write(self, *, lead: bool = False) -> contextlib.AbstractContextManager[Any]:
        """A write transaction; ``lead``: refused once this replica lost the lead."""
        ...


def decision_key(decision: Decision, finding: Finding) -> str:
    """What ``decision`` is about, whoever decides it: its action and target and the
    finding's whole content, hashed. Two leaders that decide the same finding (the next
    one cannot know how far the old one got) give the same key; a webhook carries it as
    its idempotency key, so its receiver can tell the second from a new event."""
    key = f"{decision.action}|{decision.target}|{msgspec.json.encode(finding).decode()}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def event_for(decision: Decision, finding: Finding, orders: Sequence[JobOrder]) -> dict[str, Any]:
    """The generic webhook event for a decision (its Slack form is derived from it)."""
    return {
        "type": "forewarn.decision",
        "id": decision.id,
        "idempotency_key": decision_key(decision, finding),
        "time": decision.time,
        "title": f"{finding.health.value}: {finding.check} on {finding.subject.key()}",
        "reason": finding.reason,
        "subject": finding.subject.key(),
        "node": finding.subject.node,
        "job": decision.job or ", ".join(sorted({o.job for o in orders})),
        "action": decision.action,
        "outcome": decision.outcome,
        "decision_reason": decision.reason,
        "check": finding.check,
        "health": finding.health.value,
        "probability": finding.probability,
        "source": decision.source,
        "orders": [
            {"job": o.job, "request_id": o.request_id, "step": o.step, "nodes": list(o.nodes)}
            for o in orders
        ],
    }


class ActionPipeline:
    """Policy plus actuators (see the module docstring).

    Synchronous: the service calls it from its single policy thread. ``send_webhook``
    hands an event to the webhook sender (thread-safe: the service wraps
    ``loop.call_soon_threadsafe``); drains run on ``drain_pool`` so a slow drain command
    never holds up checkpoint orders (``None``: run inline).
    """

    def __init__(
        self,
        policy: Policy,
        orders: OrderBook,
        *,
        send_webhook: Callable[[dict[str, Any]], None] | None = None,
        drain: DrainRunner | None = None,
        drain_pool: concurrent.futures.Executor | None = None,
        actions: ActionLog | None = None,
    ) -> None:
        self.policy = policy
        self.orders = orders
        self.send_webhook = send_webhook
        self.drain = drain
        self.drain_pool = drain_pool
        self.actions = actions

    def handle_findings(
        self, findings: Sequence[Finding], source: str = "agent", *, force_checkpoint: bool = False
    ) -> list[Decision]:
        """Run each finding through the policy and carry out its actions; returns the
        decisions that led to an action or a shadow record."""
        out: list[Decision] = []
        for finding in findings:
            planned = self.policy.evaluate(
                finding, source=source, force_checkpoint=force_checkpoint
            )
            # checkpoint orders first, so the webhook can name them
            planned.sort(key=lambda p: (p.kind != ActionKind.CHECKPOINT, p.kind.value))
            issued: list[JobOrder] = []
            for action in planned:
                out.append(action.decision)
                try:
                    order = self._carry_out(action, issued)
                except NotLeaderError:  # another replica leads: it decides (logged once)
                    self._not_carried_out(action)
                    return out
                except Exception as exc:  # one failed action must not stop the others
                    log.exception("action %s failed", action.kind)
                    self._record(action, "error", {"error": f"{type(exc).__name__}: {exc}"})
                    self._not_carried_out(action)
                    continue
                if order is not None:
                    issued.append(order)
        return out

    def _not_carried_out(self, action: PlannedAction) -> None:
        """An order or a hold the store did not take is not the incident's: its next
        finding may order or hold the job."""
        if action.job is None:
            return
        incident = str(action.decision.inputs.get("incident", ""))
        if action.kind == ActionKind.HOLD:
            self.policy.incidents.hold_failed(incident, action.job.job)
        elif action.kind == ActionKind.CHECKPOINT:
            self.policy.incidents.order_failed(incident, action.job.job)

    def _carry_out(self, action: PlannedAction, issued: list[JobOrder]) -> JobOrder | None:
        d = action.decision
        shadow = d.outcome == Outcome.SHADOW
        if action.kind == ActionKind.CHECKPOINT:
            if shadow or action.job is None:
                self._record(action, "shadow", {"inputs": d.inputs})
                return None
            # its actions row goes with its commands, in one transaction
            return self.orders.issue(
                action.job, action.finding.reason, decision_id=d.id,
                key=order_key(action.finding, action.job.job),
                note=self._note(lambda o: self._row(action, "ordered", {
                    "request_id": o.request_id, "step": o.step, "nodes": list(o.nodes),
                    "choose_step": o.inputs})))
        if action.kind == ActionKind.HOLD:
            onset = d.inputs.get("onset_step", 0)
            if shadow or action.job is None:
                self._record(action, "shadow", {"onset_step": onset})
                return None
            nodes = list(action.job.nodes)
            self.orders.hold(action.job, int(onset), action.finding.reason,
                             key="hold|" + order_key(action.finding, action.job.job),
                             note=self._note(lambda h: self._row(action, "ordered", {
                                 "request_id": h.request_id, "onset_step": h.onset_step,
                                 "step": h.step, "nodes": nodes})))
            return None
        if action.kind == ActionKind.WEBHOOK:
            if shadow or self.send_webhook is None:
                self._record(action, "shadow" if shadow else "skipped",
                             {"why": "shadow" if shadow else "no webhook configured"})
                return None
            event = event_for(d, action.finding, issued)
            # the event itself: the next leader sends it again if its delivery has not
            # ended (:mod:`.webhook_history`). Stored first, fenced: a replica that lost
            # the lead sends nothing (NotLeaderError).
            self._record(action, "queued", {"event": event}, lead=True)
            self.send_webhook(event)
            return None
        self._drain(action, shadow)
        return None

    def _drain(self, action: PlannedAction, shadow: bool) -> None:
        if self.drain is None:
            self._record(action, "skipped", {"why": "no drain command configured"})
            return
        drain = self.drain
        try:
            argv = drain.render(action.node, action.finding.reason)
        except DrainError as exc:
            self._record(action, "rejected", {"error": str(exc)})
            return
        if shadow or not drain.enabled:
            self._record(action, "shadow", {"argv": argv})
            return

        def run() -> None:
            if not self._still_leads(action):
                return
            try:
                result = drain.run(action.node, action.finding.reason)
            except DrainError as exc:
                self._record(action, "rejected", {"error": str(exc)})
                return
            self._record(
                action, "done" if result.returncode == 0 else "failed",
                {"argv": list(result.argv), "returncode": result.returncode,
                 "output": result.output, "error": result.error, "seconds": result.seconds},
            )

        if self.drain_pool is None:
            run()
        else:
            self.drain_pool.submit(run)

    def _still_leads(self, action: PlannedAction) -> bool:
        """Whether this replica may run ``action``'s drain now: a fenced empty write (its
        decision is stored already, so a next leader counts it and drains the node no
        second time). False, and nothing run, once another replica leads (the fence
        logs that) or when the lead cannot be checked (logged here)."""
        if self.actions is None:
            return True
        try:
            with self.actions.write(lead=True):
                pass
        except NotLeaderError:
            return False
        except Exception:
            log.exception("drain of %s not run: the lead could not be checked", action.node)
            return False
        return True

    def _record(self, action: PlannedAction, status: str, detail: dict[str, Any],
                lead: bool = False) -> None:
        """Store the action's row; ``lead``: fenced, :class:`NotLeaderError` raised."""
        if self.actions is None:
            return
        try:
            self.actions.record_action(**self._row(action, status, detail), lead=lead)
        except NotLeaderError:
            raise
        except Exception:
            log.exception("recording action %s failed", action.decision.id)

    @staticmethod
    def _row(action: PlannedAction, status: str, detail: dict[str, Any]) -> dict[str, Any]:
        """The ``actions`` row of ``action`` (``record_action``'s keywords)."""
        d = action.decision
        return {"time": d.time, "kind": d.action, "subject": d.subject, "job": d.job,
                "node": d.node, "status": status, "shadow": d.outcome == Outcome.SHADOW,
                "detail": {"decision": d.id, "target": d.target, **detail}}

    def _note(self, row: Callable[[T], dict[str, Any]]) -> Callable[[T], dict[str, Any]] | None:
        """``row`` as the note an order or a hold is queued with (its actions row, in the
        same transaction as its commands); none without an action log."""
        return None if self.actions is None else row

    def on_report(self, report: CheckpointReport) -> JobOrder | None:
        """A rank's checkpoint report: cost measurement, order progress, reissue on miss.
        A reissue refused by the fence is none (another replica leads: it answers the
        stored miss, :meth:`reissue_missed`; the fence logged it)."""
        self.policy.tracker.observe(report)
        try:
            return self._answer(report)
        except NotLeaderError:
            return None

    def reissue_missed(self) -> int:
        """Once the order book is rebuilt as this replica starts to lead: answer each miss
        the last leader had not (of an order still ``issued``, of a hold not replaced) as
        :meth:`on_report` would have, with a reissue. Returns how many were answered."""
        answered = 0
        for report in self.orders.take_unanswered():
            try:
                self._answer(report)
            except NotLeaderError:  # another replica leads already: it answers them
                break
            except Exception:  # the store failed: the rank's next miss asks again
                log.exception("answering a miss of %s at takeover failed", report.request_id)
                continue
            answered += 1
        return answered

    def _answer(self, report: CheckpointReport) -> JobOrder | None:
        """Order progress from a rank's report; a miss answered with a reissue."""
        job = self.policy.jobs.job(report.job)
        missed = {"missed_by_rank": report.rank, "rank_step": report.step}
        hold = self.orders.on_hold_report(report, job, self._note(lambda h: {
            "time": h.issued, "kind": "hold", "subject": f"job:{h.job}", "job": h.job,
            "status": "reissued",
            "detail": {"request_id": h.request_id, "replaces": h.replaces,
                       "onset_step": h.onset_step, "step": h.step, **missed}}))
        if hold is not None:
            return None
        return self.orders.on_report(report, job, self._note(lambda o: {
            "time": o.issued, "kind": "checkpoint", "subject": f"job:{o.job}", "job": o.job,
            "status": "reissued",
            "detail": {"request_id": o.request_id, "step": o.step,
                       "replaces": report.request_id, "attempt": o.attempt, **missed}}))

    def on_ack(self, ack: CommandAck) -> None:
        """An agent acknowledged a command."""
        self.orders.on_ack(ack)


def store_decisions(store: Any) -> Callable[[Decision], None]:
    """A ``record`` callback for :class:`Policy` writing to the service store's
    ``decisions`` table (``decision`` = ``<action>:<outcome>``; inputs keep the whole
    decision)."""

    def record(d: Decision) -> None:
        store.record_decision(
            time=d.time, job=d.job, subject=d.subject, decision=f"{d.action}:{d.outcome}",
            reason=d.reason,
            inputs={"id": d.id, "target": d.target, "check": d.check, "health": d.health,
                    "source": d.source, "node": d.node, **d.inputs},
        )

    return record
