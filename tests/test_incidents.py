"""Findings with an identity and a lifecycle, incidents, and the policy's one order per job
and incident (issue 13 points 4 and 5, issue 14's row_remap_failure)."""

from __future__ import annotations

import msgspec
from prometheus_client import CollectorRegistry
from test_policy import T0, Clock, fleet, gpu_finding

from forewarn.collector.decide.incidents import FindingState, IncidentBook
from forewarn.collector.decide.policy import ActionKind, Policy, PolicySettings
from forewarn.escalation import escalates
from forewarn.wire import Finding, Health, Subject, SuggestedAction


def make(**settings: object) -> tuple[Policy, Clock, CollectorRegistry]:
    clock = Clock()
    registry = CollectorRegistry()
    policy = Policy(PolicySettings(**settings), fleet(), clock=clock,  # type: ignore[arg-type]
                    registry=registry)
    return policy, clock, registry


def checkpoints(planned: list[object]) -> int:
    return sum(1 for p in planned if getattr(p, "kind", None) == ActionKind.CHECKPOINT
               and p.decision.outcome == "act")  # type: ignore[attr-defined]


def remap(rows: int, health: Health = Health.DEGRADED) -> Finding:
    return Finding(check="remap", health=health, subject=Subject(kind="gpu", node="n0", gpu=1),
                   reason=f"{rows} rows remapped, remap pending", action=SuggestedAction.RESET_GPU,
                   evidence={"extent": rows}, time=T0)


def test_one_double_bit_error_is_one_incident_and_one_order() -> None:
    """XID 48 and the uncorrectable-ECC counter of one DBE on one GPU: one order for the job
    even with no cooldown between orders (the chaos lab's collector runs with 3 s)."""
    policy, clock, registry = make(cooldown_s={"checkpoint": 0.0})
    first = policy.evaluate(gpu_finding(check="xid"))
    clock.t += 1
    second = policy.evaluate(gpu_finding(check="ecc"))
    assert (checkpoints(first), checkpoints(second)) == (1, 0)
    (incident,) = policy.incidents.incidents()
    assert incident.scope == "gpu:n0/1" and incident.orders == 1
    assert sorted(t.finding.check for t in incident.findings.values()) == ["ecc", "xid"]
    assert registry.get_sample_value("forewarn_collector_incidents_total", {"kind": "gpu"}) == 1
    # another GPU of the same node is another incident
    clock.t += 1
    policy.evaluate(gpu_finding(gpu=2, check="xid"))
    assert registry.get_sample_value("forewarn_collector_incidents_total", {"kind": "gpu"}) == 2


def test_an_escalating_incident_orders_again_through_the_cooldown() -> None:
    """Remapped rows growing under one "remap pending": each material growth is an
    escalation of the same incident and may order again; an unchanged re-send may not."""
    policy, clock, _ = make(cooldown_s={"checkpoint": 600.0}, dedup_s=0.0)
    assert checkpoints(policy.evaluate(remap(1))) == 1
    clock.t += 30
    assert checkpoints(policy.evaluate(remap(1))) == 0
    clock.t += 30
    planned = policy.evaluate(remap(3))
    assert checkpoints(planned) == 1
    d = next(p.decision for p in planned if p.kind == ActionKind.CHECKPOINT)
    assert d.inputs["escalation"] is True and d.reason.startswith("incident escalated")
    clock.t += 30
    assert checkpoints(policy.evaluate(remap(3, Health.UNHEALTHY))) == 1  # worse health
    (incident,) = policy.incidents.incidents()
    assert incident.orders == 3


def test_escalation_rule() -> None:
    assert escalates(remap(1), remap(2)) and escalates(remap(4), remap(5))
    assert not escalates(remap(8), remap(9))  # < 25 % more
    assert escalates(remap(8), remap(10))
    assert escalates(remap(3), remap(1, Health.UNHEALTHY))
    assert not escalates(remap(3, Health.UNHEALTHY), remap(9))
    assert not escalates(gpu_finding(check="xid"), gpu_finding(check="ecc"))


def test_a_healthy_finding_resolves_and_a_silent_source_expires() -> None:
    clock = Clock()
    registry = CollectorRegistry()
    book = IncidentBook(ttl_s=600.0, window_s=60.0, clock=clock, registry=registry)
    xid = gpu_finding(check="xid")
    obs = book.observe(xid, "agent", clock.t)
    assert obs is not None and obs.opened and obs.tracked.state == FindingState.FIRING
    assert registry.get_sample_value("forewarn_collector_findings_active",
                                     {"source": "agent"}) == 1
    clock.t += 10
    assert book.observe(msgspec.structs.replace(xid, health=Health.HEALTHY), "agent",
                        clock.t) is None
    assert obs.tracked.state == FindingState.RESOLVED and obs.incident.state == "resolved"
    assert registry.get_sample_value("forewarn_collector_findings_active",
                                     {"source": "agent"}) == 0
    # an alert finding: kept alive by re-sends, expired when they stop for ttl_s
    alert = gpu_finding(node="n2", check="alert:ForewarnGpuXidFatal")
    a = book.observe(alert, "alertmanager", clock.t)
    assert a is not None
    clock.t += 500
    book.refresh(alert, "alertmanager", clock.t)
    assert book.expire(clock.t + 500) == []
    # an agent finding: its node's batches keep it alive
    ecc = gpu_finding(node="n3", check="ecc")
    e = book.observe(ecc, "agent", clock.t)
    assert e is not None
    book.heard("agent:n3", clock.t + 500)
    expired = book.expire(clock.t + 700)
    assert [t.key for t in expired] == ["alertmanager|gpu:n2/1|alert:ForewarnGpuXidFatal"]
    assert a.tracked.state == FindingState.EXPIRED and a.incident.state == "expired"
    assert e.tracked.state == FindingState.FIRING
    assert [t.key for t in book.expire(clock.t + 1200)] == ["agent|gpu:n3/1|ecc"]
    assert registry.get_sample_value("forewarn_collector_findings_closed_total",
                                     {"state": "expired"}) == 2
