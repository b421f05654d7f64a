"""Findings in, actions out: the one policy for findings from agents, from the collector's own
detectors and from alert webhooks.

For each finding that is not healthy:

1. **Severity rules** (:data:`~.severity.SEVERITY_RULES`) say which action kinds the
   finding calls for, from its health and suggested action. Bad numerics (a NaN/Inf
   loss; a grad-norm spike when configured: ``PolicySettings.hold_checks``) call for a
   **hold**: the job's ranks stop saving (no ordered or periodic save of the poisoned
   state) from one step, and mark checkpoints since the onset suspect
   (:class:`~forewarn.wire.SaveHold`).
2. **Incident**: the finding joins its incident (:mod:`.incidents`: correlated findings about
   one GPU, node or job); a healthy finding resolves its tracked finding.
3. **Dedup**: the same check about the same subject within ``dedup_s`` is dropped (counted in
   ``forewarn_collector_policy_findings_total{result="duplicate"}``, not stored), unless it
   escalates (worse health, or materially worse evidence: :mod:`forewarn.escalation`).
4. Per action kind and target (a job for checkpoints, a node for drains, the subject for
   webhooks): **one checkpoint order per job and incident** unless the incident escalates,
   **one save hold per job and incident** (its ranks stopped saving at the first), the
   **cost model** (checkpoints only, :mod:`.costmodel`), the **cooldown** per
   target and kind (an escalation is not held back by it), the **circuit breaker**
   (refuses acting on more than a share of the jobs/fleet within a window, and raises one
   alert per trip), the **rate limit** (a token
   bucket per kind) and finally **shadow mode** (global or per kind: recorded, not done).

Every outcome is a :class:`Decision` carrying its inputs and a reason a person can read;
the caller stores it (``record`` callback) and executes the :class:`PlannedAction`\\ s whose
outcome is ``act``.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter

from forewarn.escalation import escalates
from forewarn.wire import Finding, Health, Subject

from ..jobs.jobview import JobInfo, JobView
from .costmodel import CheckpointCostTracker, decide_checkpoint
from .gates import Gates
from .incidents import IncidentBook, Observation
from .severity import HOLD_CHECKS, ActionKind, Outcome, actions_for

__all__ = ["Decision", "PlannedAction", "Policy", "PolicySettings", "onset_step"]


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """One policy outcome for one action kind and target, with everything it was based on."""

    id: str
    time: float
    action: str
    """An :class:`ActionKind` value."""
    target: str
    """``job:<id>``, ``node:<name>`` or the finding subject's key."""
    outcome: str
    """An :class:`Outcome` value."""
    reason: str
    check: str
    subject: str
    health: str
    source: str = "agent"
    """Where the finding came from: ``agent``, ``collector``, ``alertmanager``, ``grafana``."""
    job: str = ""
    node: str = ""
    inputs: dict[str, Any] = msgspec.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class PlannedAction:
    """An action the policy decided on: carry it out when ``decision.outcome`` is ``act``;
    record it only when ``shadow``."""

    kind: ActionKind
    decision: Decision
    finding: Finding
    job: JobInfo | None = None
    node: str = ""


@dataclasses.dataclass(frozen=True)
class PolicySettings:
    """Thresholds of the policy; the collector config maps onto these (``policy_*`` keys)."""

    shadow: bool = False
    """Global shadow mode: record every decision, do nothing."""
    shadow_actions: frozenset[str] = frozenset({"drain"})
    """Action kinds in shadow mode (drain is off until an operator turns it on)."""
    dedup_s: float = 300.0
    cooldown_s: Mapping[str, float] = dataclasses.field(
        default_factory=lambda: {"checkpoint": 600.0, "webhook": 300.0, "drain": 3600.0}
    )
    rate_per_minute: Mapping[str, float] = dataclasses.field(
        default_factory=lambda: {"checkpoint": 30.0, "webhook": 60.0, "drain": 2.0}
    )
    burst: Mapping[str, float] = dataclasses.field(
        default_factory=lambda: {"checkpoint": 10.0, "webhook": 20.0, "drain": 2.0}
    )
    breaker_share: Mapping[str, float] = dataclasses.field(
        default_factory=lambda: {"checkpoint": 0.5, "drain": 0.1}
    )
    """Largest share of the jobs (checkpoint) or nodes (drain) acted on within the window."""
    breaker_window_s: float = 600.0
    breaker_min: int = 1
    """The breaker always allows at least this many targets per window (small fleets)."""
    probability: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """P(failure) per check name, overriding the cost model's tables."""
    hold_checks: frozenset[str] = HOLD_CHECKS
    """Checks whose unhealthy findings hold the job's saves (:data:`HOLD_CHECKS`)."""

    def is_shadow(self, kind: ActionKind) -> bool:
        """Whether ``kind`` is recorded only."""
        return self.shadow or kind.value in self.shadow_actions


_INCIDENT_KINDS = frozenset({ActionKind.CHECKPOINT, ActionKind.HOLD})
"""Actions that count once per job and incident: their decisions keep the finding."""


def _new_id() -> str:
    return uuid.uuid4().hex[:16]


class Policy:
    """Turns findings into decisions and planned actions (see the module docstring).

    ``jobs`` is the job map, ``tracker`` the measured checkpoint costs, ``record`` receives
    every decision (the store), ``clock`` returns Unix time. Not thread-safe: call it from
    one task (the collector's event loop).
    """

    def __init__(
        self,
        settings: PolicySettings,
        jobs: JobView,
        tracker: CheckpointCostTracker | None = None,
        *,
        record: Callable[[Decision], None] | None = None,
        clock: Callable[[], float] = time.time,
        registry: CollectorRegistry | None = None,
        new_id: Callable[[], str] = _new_id,
        incidents: IncidentBook | None = None,
    ) -> None:
        self.settings = settings
        self.jobs = jobs
        self.tracker = tracker or CheckpointCostTracker()
        self._record = record
        self._clock = clock
        self._new_id = new_id
        self._seen: dict[str, tuple[float, Finding]] = {}
        self.gates = Gates(settings, clock())
        """Cooldowns, rate limits and circuit breakers (:mod:`.gates`)."""
        self._pending_alerts: list[PlannedAction] = []
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=1000)
        """The latest decisions, newest last (the store keeps them all)."""
        registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.incidents = incidents if incidents is not None else IncidentBook(
            clock=clock, registry=registry)
        """Tracked findings and incidents; every finding evaluated goes through it."""
        self._m_decisions = Counter(
            "forewarn_collector_decisions",
            "Policy decisions by action kind and outcome.",
            ["action", "outcome"],
            registry=registry,
        )
        self._m_findings = Counter(
            "forewarn_collector_policy_findings",
            "Findings seen by the policy, by result (evaluated, duplicate, healthy).",
            ["result"],
            registry=registry,
        )

    # -- entry point ------------------------------------------------------------------

    def evaluate(
        self, finding: Finding, *, source: str = "agent", force_checkpoint: bool = False
    ) -> list[PlannedAction]:
        """Decide what to do about ``finding``; return the planned actions: those with
        outcome ``act`` are to be carried out, those with ``shadow`` only recorded.

        ``force_checkpoint`` skips the cost model (alert webhooks: an operator's rule asked
        for a checkpoint); every other gate still applies.
        """
        now = self._clock()
        key = f"{finding.check}|{finding.subject.key()}"
        obs = self.incidents.observe(finding, source, now)
        if obs is None:  # healthy (resolves its tracked finding) or unknown
            if finding.health == Health.HEALTHY:
                self._seen.pop(key, None)
            self._m_findings.labels("healthy").inc()
            return []
        seen = self._seen.get(key)
        if (
            seen is not None
            and now - seen[0] < self.settings.dedup_s
            and not escalates(seen[1], finding)
        ):
            self._m_findings.labels("duplicate").inc()
            return []
        self._seen[key] = (now, finding)
        if len(self._seen) > 100_000:
            self._prune_seen(now)
        self._m_findings.labels("evaluated").inc()
        planned: list[PlannedAction] = []
        for kind in actions_for(finding, self.settings.hold_checks):
            if kind == ActionKind.CHECKPOINT:
                planned += self._checkpoint(finding, source, now, force_checkpoint, obs)
            elif kind == ActionKind.HOLD:
                planned += self._hold(finding, source, now, obs)
            elif kind == ActionKind.DRAIN:
                planned += self._drain(finding, source, now)
            else:
                planned += self._webhook(finding, source, now)
        planned += self._pending_alerts
        self._pending_alerts = []
        return planned

    # -- per action kind ----------------------------------------------------------------

    def _checkpoint(
        self, finding: Finding, source: str, now: float, force: bool, obs: Observation
    ) -> list[PlannedAction]:
        out: list[PlannedAction] = []
        job_ids = self._jobs_of(finding.subject)
        if not job_ids:
            self._decide(
                ActionKind.CHECKPOINT, finding, source, now, target=finding.subject.key(),
                outcome=Outcome.SUPPRESSED, reason="no job runs on the subject",
                inputs={"jobs": []},
            )
            return out
        for job_id in job_ids:
            job = self.jobs.job(job_id)
            target = f"job:{job_id}"
            if job is None:
                self._decide(
                    ActionKind.CHECKPOINT, finding, source, now, target=target,
                    outcome=Outcome.SUPPRESSED, reason="job left the job map", job=job_id,
                )
                continue
            cost = decide_checkpoint(finding, job, now, self.tracker, self.settings.probability)
            inputs: dict[str, Any] = {**cost.inputs(), "nodes": list(job.nodes),
                                      "incident": obs.incident.id, "escalation": obs.escalated}
            earlier = obs.incident.ordered.get(job_id)
            if earlier is not None and not obs.escalated:
                self._decide(
                    ActionKind.CHECKPOINT, finding, source, now, target=target,
                    outcome=Outcome.SUPPRESSED, job=job_id, inputs=inputs,
                    reason=f"incident {obs.incident.id} already ordered this job "
                    f"({earlier.check}: {earlier.health.value}); it has not escalated",
                )
                continue
            if force:
                inputs["cost_model"] = "bypassed: the alert rule asked for a checkpoint"
            elif not cost.act:
                self._decide(
                    ActionKind.CHECKPOINT, finding, source, now, target=target,
                    outcome=Outcome.SUPPRESSED, job=job_id, inputs=inputs,
                    reason=(
                        f"expected loss {cost.expected_loss_gpu_s:.0f} GPU-s "
                        f"<= checkpoint cost {cost.cost_gpu_s:.0f} GPU-s"
                    ),
                )
                continue
            why = (
                "alert asked for a checkpoint"
                if force
                else f"expected loss {cost.expected_loss_gpu_s:.0f} GPU-s "
                f"> checkpoint cost {cost.cost_gpu_s:.0f} GPU-s"
            )
            if earlier is not None:
                why = f"incident escalated: {why}"
            decision = self._gate(
                ActionKind.CHECKPOINT, finding, source, now, target, why, inputs,
                population=self.jobs.job_count(), job=job_id, escalation=earlier is not None,
            )
            if decision is not None:
                self.incidents.ordered(obs, job_id)
                out.append(PlannedAction(ActionKind.CHECKPOINT, decision, finding, job=job))
        return out

    def _hold(self, finding: Finding, source: str, now: float, obs: Observation
              ) -> list[PlannedAction]:
        out: list[PlannedAction] = []
        for job_id in self._jobs_of(finding.subject):
            job = self.jobs.job(job_id)
            if job is None:
                self._decide(
                    ActionKind.HOLD, finding, source, now, target=f"job:{job_id}",
                    outcome=Outcome.SUPPRESSED, reason="job left the job map", job=job_id,
                )
                continue
            onset = onset_step(finding, job, now)
            inputs = {"onset_step": onset, "incident": obs.incident.id}
            if obs.incident.held.get(job_id, onset + 1) <= onset:
                # its ranks stopped saving at the first hold: a repeat (a later report of
                # the same NaN, after a takeover too) would only move the stop later; a
                # report of an earlier onset (the ranks' reports come in any order) holds
                self._decide(
                    ActionKind.HOLD, finding, source, now, target=f"job:{job_id}",
                    outcome=Outcome.SUPPRESSED, job=job_id, inputs=inputs,
                    reason=f"incident {obs.incident.id} already held this job's saves",
                )
                continue
            decision = self._gate(
                ActionKind.HOLD, finding, source, now, f"job:{job_id}",
                f"{finding.check}: the training state is suspect since step {onset}: "
                "stop saving it", inputs, population=0, job=job_id,
            )
            if decision is not None:
                self.incidents.held(obs, job_id, onset)
                out.append(PlannedAction(ActionKind.HOLD, decision, finding, job=job))
        return out

    def _drain(self, finding: Finding, source: str, now: float) -> list[PlannedAction]:
        node = finding.subject.node
        if not node:
            self._decide(
                ActionKind.DRAIN, finding, source, now, target=finding.subject.key(),
                outcome=Outcome.SUPPRESSED, reason="the subject names no node",
            )
            return []
        decision = self._gate(
            ActionKind.DRAIN, finding, source, now, f"node:{node}",
            f"{finding.health.value} finding suggests {finding.action.value}", {},
            population=self.jobs.node_count(), node=node,
        )
        if decision is None:
            return []
        return [PlannedAction(ActionKind.DRAIN, decision, finding, node=node)]

    def _webhook(self, finding: Finding, source: str, now: float) -> list[PlannedAction]:
        jobs = self._jobs_of(finding.subject)
        decision = self._gate(
            ActionKind.WEBHOOK, finding, source, now, finding.subject.key(),
            f"{finding.health.value} finding: notify", {"jobs": jobs},
            population=0, node=finding.subject.node,
        )
        if decision is None:
            return []
        return [PlannedAction(ActionKind.WEBHOOK, decision, finding, node=finding.subject.node)]

    # -- gates ----------------------------------------------------------------------------

    def _gate(
        self,
        kind: ActionKind,
        finding: Finding,
        source: str,
        now: float,
        target: str,
        why: str,
        inputs: dict[str, Any],
        *,
        population: int,
        job: str = "",
        node: str = "",
        escalation: bool = False,
    ) -> Decision | None:
        """Cooldown (not for an ``escalation``: the same incident got worse), breaker, rate
        limit, shadow: the decision when the action is to be done (``act``) or recorded as
        shadow (``shadow``), else ``None``."""
        s = self.settings
        common = {"target": target, "job": job, "node": node}
        gates = self.gates
        cooldown = gates.cooldown_s(kind)
        last = gates.cooldowns.get((kind, target))
        inputs = {**inputs, "cooldown_s": cooldown}
        if last is not None and now - last < cooldown and not escalation:
            self._decide(
                kind, finding, source, now, outcome=Outcome.SUPPRESSED, inputs=inputs,
                reason=f"cooldown: acted on {target} {now - last:.0f} s ago (< {cooldown:.0f} s)",
                **common,
            )
            return None
        breaker = gates.breakers.get(kind)
        if breaker is not None:
            allowed, first, b_inputs = breaker.check(target, population, now)
            inputs.update(b_inputs)
            if not allowed:
                self._decide(
                    kind, finding, source, now, outcome=Outcome.REFUSED, inputs=inputs,
                    reason=(
                        f"circuit breaker: {b_inputs['breaker_targets_in_window']} of "
                        f"{population} already acted on within {s.breaker_window_s:.0f} s "
                        f"(limit {b_inputs['breaker_limit']})"
                    ),
                    **common,
                )
                if first:
                    self._breaker_alert(kind, finding, source, now, inputs)
                return None
        if not gates.buckets[kind].take(now):
            self._decide(
                kind, finding, source, now, outcome=Outcome.SUPPRESSED, inputs=inputs,
                reason=f"rate limit: more than {s.rate_per_minute.get(kind.value, 60.0):g} "
                f"{kind.value} actions per minute",
                **common,
            )
            return None
        gates.acted(kind, target, now)
        if kind in _INCIDENT_KINDS:  # a next leader rebuilds from it an incident the store
            inputs["finding"] = msgspec.to_builtins(finding)  # never had (gate_history)
        if s.is_shadow(kind):
            return self._decide(
                kind, finding, source, now, outcome=Outcome.SHADOW, inputs=inputs,
                reason=f"shadow mode: would {kind.value}: {why}", **common,
            )
        return self._decide(
            kind, finding, source, now, outcome=Outcome.ACT, inputs=inputs, reason=why, **common
        )

    def _breaker_alert(
        self, kind: ActionKind, finding: Finding, source: str, now: float, inputs: dict[str, Any]
    ) -> None:
        """The one alert per breaker trip: a webhook decision that bypasses the gates."""
        decision = self._decide(
            ActionKind.WEBHOOK, finding, source, now, target=f"breaker:{kind.value}",
            outcome=Outcome.SHADOW if self.settings.is_shadow(ActionKind.WEBHOOK) else Outcome.ACT,
            inputs=inputs,
            reason=f"circuit breaker open for {kind.value}: refusing mass action",
        )
        self._pending_alerts.append(PlannedAction(ActionKind.WEBHOOK, decision, finding))

    # -- helpers ----------------------------------------------------------------------------

    def _jobs_of(self, subject: Subject) -> list[str]:
        if subject.kind in ("rank", "job"):
            return [subject.job] if subject.job else []
        if not subject.node:
            return []
        return self.jobs.jobs_on(subject.node, subject.gpu if subject.kind == "gpu" else None)

    def _decide(
        self,
        kind: ActionKind,
        finding: Finding,
        source: str,
        now: float,
        *,
        target: str,
        outcome: Outcome,
        reason: str,
        inputs: Mapping[str, Any] | None = None,
        job: str = "",
        node: str = "",
    ) -> Decision:
        all_inputs = {
            "finding_reason": finding.reason,
            "finding_time": finding.time,
            "suggested_action": finding.action.value,
            "probability": finding.probability,
            "evidence": dict(finding.evidence),
            **(inputs or {}),
        }
        decision = Decision(
            id=self._new_id(), time=now, action=kind.value, target=target,
            outcome=outcome.value, reason=reason, check=finding.check,
            subject=finding.subject.key(), health=finding.health.value, source=source,
            job=job, node=node or finding.subject.node, inputs=all_inputs,
        )
        self.decisions.append(decision)
        self._m_decisions.labels(kind.value, outcome.value).inc()
        if self._record is not None:
            self._record(decision)
        return decision

    def _prune_seen(self, now: float) -> None:
        horizon = now - self.settings.dedup_s
        self._seen = {k: v for k, v in self._seen.items() if v[0] >= horizon}
        self.gates.prune(now)


def onset_step(finding: Finding, job: JobInfo, now: float) -> int:
    """First step of the suspect state: the finding's ``bad_step`` (the step the rank
    reported the NaN or the spike at), else the job's furthest step by now."""
    bad = finding.evidence.get("bad_step")
    if isinstance(bad, int) and not isinstance(bad, bool) and bad >= 0:
        return bad
    return job.estimated_step(now) or 0
