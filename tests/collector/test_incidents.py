"""Findings with an identity and a lifecycle, incidents, and the policy's one order per job
and incident (issue 13 points 4 and 5, issue 14's row_remap_failure)."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
from prometheus_client import CollectorRegistry

from forewarn.collector.decide.incidents import FindingState, IncidentBook
from forewarn.collector.decide.policy import PlannedAction, Policy, PolicySettings
from forewarn.collector.decide.severity import ActionKind
from forewarn.escalation import escalates
from forewarn.wire import Finding, GpuSample, Health, Subject, SuggestedAction

from support.collector import ranks_on, start_service, stop_service
from support.policy import T0, Clock, fleet, gpu_finding
from support.polling import poll


def make(**settings: object) -> tuple[Policy, Clock, CollectorRegistry]:
    clock = Clock()
    registry = CollectorRegistry()
    policy = Policy(PolicySettings(**settings), fleet(), clock=clock,  # type: ignore[arg-type]
                    registry=registry)
    return policy, clock, registry


def checkpoints(planned: list[PlannedAction]) -> int:
    return sum(1 for p in planned
               if p.kind == ActionKind.CHECKPOINT and p.decision.outcome == "act")


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
    assert obs is not None and obs.opened
    tracked = obs.tracked
    assert tracked.state == FindingState.FIRING
    assert registry.get_sample_value("forewarn_collector_findings_active",
                                     {"source": "agent"}) == 1
    clock.t += 10
    assert book.observe(msgspec.structs.replace(xid, health=Health.HEALTHY), "agent",
                        clock.t) is None
    assert book.incidents()[0].findings[tracked.key].state == FindingState.RESOLVED
    assert obs.incident.state == "resolved"
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


# -- through the running collector (real HTTP, real SQLite) ---------------------------------


def test_collector_orders_once_for_one_double_bit_error(tmp_path: Path) -> None:
    """The agent sends both findings of one DBE in one urgent batch; with no cooldown
    between orders the collector used to order the job twice (two saves)."""
    svc = start_service(tmp_path, policy_cooldown_checkpoint_s=0.0, policy_dedup_s=0.0)
    try:
        now = time.time()
        svc.push("node1", ranks=ranks_on("node1", 0, now))
        svc.push("node2", ranks=ranks_on("node2", 2, now))
        dbe = [Finding(check=check, health=Health.UNHEALTHY, action=SuggestedAction.RESET_GPU,
                       subject=Subject(kind="gpu", node="node2", gpu=1), time=now,
                       reason=f"{check}: double-bit error") for check in ("xid", "ecc")]
        svc.push("node2", urgent=True, findings=dbe)
        first = svc.commands("node2", wait=10)
        time.sleep(1.0)  # a second order would follow at once
        orders = first + svc.commands("node2")
        assert len(orders) == 1, [o["order"]["reason"] for o in orders]
        (incident,) = poll(lambda: svc.client.get("/api/v1/incidents").json(), 10)
        assert incident["orders"] == 1 and incident["checks"] == "ecc,xid"
        assert {f["state"] for f in incident["findings"]} == {"firing"}
        decisions = [d for d in svc.client.get("/api/v1/decisions").json()
                     if d["decision"].startswith("checkpoint:")]
        assert sorted(d["decision"] for d in decisions) == ["checkpoint:act",
                                                            "checkpoint:suppressed"]
    finally:
        stop_service(svc)


def test_findings_of_a_silent_agent_expire_and_clear_the_gpu(tmp_path: Path) -> None:
    svc = start_service(tmp_path, finding_ttl_s=1.0)
    try:
        now = time.time()
        bad = Finding(check="ecc", health=Health.UNHEALTHY, action=SuggestedAction.RESET_GPU,
                      subject=Subject(kind="gpu", node="node3", gpu=0), time=now,
                      reason="uncorrectable ECC")
        svc.push("node3", findings=[bad],
                 samples=[GpuSample(node="node3", gpu=0, time=now, source="test")])
        gpu = svc.client.get("/api/v1/gpus", params={"node": "node3"}).json()[0]
        assert gpu["health"] == "unhealthy"
        # node3 sends nothing more: after finding_ttl_s (and the next expiry check) the
        # finding expires, its incident with it, and the GPU is no longer red
        expired = poll(lambda: [i for i in svc.client.get("/api/v1/incidents").json()
                                if i["state"] == "expired"], 20)
        assert expired and expired[0]["findings"][0]["state"] == "expired"
        gpu = svc.client.get("/api/v1/gpus", params={"node": "node3"}).json()[0]
        assert gpu["health"] == "unknown" and gpu["health_reason"] == "no current finding"
        metrics = svc.client.get("/metrics").text
        assert 'forewarn_collector_findings_closed_total{state="expired"} 1.0' in metrics
        assert "forewarn_collector_incidents_open 0.0" in metrics
    finally:
        stop_service(svc)


def test_an_open_incident_survives_a_restart_and_resolves_after_it(tmp_path: Path) -> None:
    """The agent sends a finding only when it changes: after a collector restart the open
    incident is taken back from the store, so the agent's later healthy finding still
    resolves it (rather than a red GPU and an open incident forever)."""
    bad = Finding(check="ecc", health=Health.UNHEALTHY, action=SuggestedAction.RESET_GPU,
                  subject=Subject(kind="gpu", node="node1", gpu=0), time=time.time(),
                  reason="uncorrectable ECC")
    svc = start_service(tmp_path)
    try:
        svc.push("node1", findings=[bad])
        (before,) = poll(lambda: svc.client.get("/api/v1/incidents").json(), 10)
        assert before["state"] == "open"
    finally:
        stop_service(svc)
    svc = start_service(tmp_path)
    try:
        svc.seq["node1"] = 1
        metrics = svc.client.get("/metrics").text
        assert "forewarn_collector_incidents_open 1.0" in metrics
        good = msgspec.structs.replace(bad, health=Health.HEALTHY, time=time.time(),
                                       action=SuggestedAction.NONE, reason="no new errors")
        svc.push("node1", findings=[good])
        after = poll(lambda: [i for i in svc.client.get("/api/v1/incidents").json()
                              if i["state"] == "resolved"], 10)
        assert after and after[0]["id"] == before["id"]
    finally:
        stop_service(svc)
