"""The policy: severity rules, dedup, cooldown, rate limits, circuit breaker, shadow mode,
and decisions stored with their inputs."""

from __future__ import annotations

import msgspec
from prometheus_client import CollectorRegistry

from forewarn.collector.decide.limits import CircuitBreaker, TokenBucket
from forewarn.collector.decide.policy import Decision, Policy, PolicySettings
from forewarn.collector.decide.severity import ActionKind, Outcome, actions_for
from forewarn.collector.jobs.jobview import RankTable
from forewarn.wire import Finding, Health, Subject, SuggestedAction

from support.policy import T0, Clock, fleet, gpu_finding


def make(settings: PolicySettings | None = None, table: RankTable | None = None
         ) -> tuple[Policy, Clock, list[Decision]]:
    clock = Clock()
    stored: list[Decision] = []
    policy = Policy(settings or PolicySettings(), table or fleet(), record=stored.append,
                    clock=clock, registry=CollectorRegistry())
    return policy, clock, stored


def outcomes(stored: list[Decision], kind: ActionKind) -> list[str]:
    return [d.outcome for d in stored if d.action == kind.value]


def test_severity_rules() -> None:
    assert actions_for(gpu_finding(health=Health.HEALTHY)) == ()
    assert actions_for(gpu_finding(health=Health.UNKNOWN)) == ()
    assert actions_for(gpu_finding(health=Health.DEGRADED, action=SuggestedAction.WATCH)) == (
        ActionKind.WEBHOOK,)
    assert actions_for(gpu_finding(health=Health.DEGRADED)) == (ActionKind.CHECKPOINT,
                                                                 ActionKind.WEBHOOK)
    assert actions_for(gpu_finding(action=SuggestedAction.INSPECT_HARDWARE)) == (
        ActionKind.CHECKPOINT, ActionKind.WEBHOOK, ActionKind.DRAIN)


def test_unhealthy_gpu_orders_checkpoint_for_its_job_with_inputs_stored() -> None:
    policy, _, stored = make()
    planned = policy.evaluate(gpu_finding(node="n3", gpu=2))
    kinds = {(p.kind, p.decision.outcome) for p in planned}
    assert kinds == {(ActionKind.CHECKPOINT, "act"), (ActionKind.WEBHOOK, "act")}
    ckpt = next(p for p in planned if p.kind == ActionKind.CHECKPOINT)
    assert ckpt.job is not None and ckpt.job.job == "job3"
    d = ckpt.decision
    assert d in stored and d.target == "job:job3" and d.job == "job3"
    # explainable: every input of the cost model is in the decision
    for key in ("probability", "work_s", "gpus", "checkpoint_s", "expected_loss_gpu_s",
                "cost_gpu_s", "cooldown_s", "breaker_limit", "finding_reason"):
        assert key in d.inputs, key
    assert d.inputs["gpus"] == 4 and d.inputs["work_s"] == 7200


def test_below_cost_is_suppressed_and_explained() -> None:
    policy, _, stored = make()
    planned = policy.evaluate(gpu_finding(p=0.001))  # 0.001 x 7200 = 7 s < 60 s
    assert [p.kind for p in planned] == [ActionKind.WEBHOOK]
    d = next(d for d in stored if d.action == "checkpoint")
    assert d.outcome == "suppressed" and "<= checkpoint cost" in d.reason
    assert d.inputs["probability"] == 0.001


def test_no_job_on_subject() -> None:
    policy, _, stored = make()
    policy.evaluate(gpu_finding(node="idle-node"))
    d = next(d for d in stored if d.action == "checkpoint")
    assert d.outcome == "suppressed" and d.reason == "no job runs on the subject"


def test_dedup_same_check_and_subject_until_window_or_worse() -> None:
    policy, clock, stored = make(PolicySettings(dedup_s=300, cooldown_s={}))
    f = gpu_finding(health=Health.DEGRADED, action=SuggestedAction.WATCH)
    assert len(policy.evaluate(f)) == 1
    clock.t += 10
    assert policy.evaluate(f) == []  # duplicate, not even a decision stored
    assert len(stored) == 1
    # another check on the same subject is not a duplicate
    assert len(policy.evaluate(msgspec.structs.replace(f, check="other"))) == 1
    # worse health is not a duplicate
    assert policy.evaluate(msgspec.structs.replace(f, health=Health.UNHEALTHY))
    # after the window it counts again
    clock.t += 301
    assert len(policy.evaluate(f)) == 1
    # a healthy finding clears dedup at once
    clock.t += 1
    policy.evaluate(msgspec.structs.replace(f, health=Health.HEALTHY))
    assert len(policy.evaluate(f)) == 1


def test_cooldown_per_target_and_kind() -> None:
    policy, clock, stored = make(PolicySettings(dedup_s=0, cooldown_s={"checkpoint": 600}))
    assert any(p.kind == ActionKind.CHECKPOINT for p in policy.evaluate(gpu_finding(gpu=1)))
    clock.t += 60
    # another GPU of the same job: the job is cooling down
    planned = policy.evaluate(gpu_finding(gpu=2, check="ecc"))
    assert not any(p.kind == ActionKind.CHECKPOINT for p in planned)
    assert stored[-2].outcome == "suppressed" and stored[-2].reason.startswith("cooldown")
    # another job is not
    assert any(p.kind == ActionKind.CHECKPOINT for p in policy.evaluate(gpu_finding(node="n1")))
    clock.t += 600
    assert any(p.kind == ActionKind.CHECKPOINT
               for p in policy.evaluate(gpu_finding(gpu=3, check="pcie")))


def test_rate_limit_token_bucket() -> None:
    bucket = TokenBucket(rate=1.0, burst=2, now=0.0)
    assert bucket.take(0.0) and bucket.take(0.0) and not bucket.take(0.0)
    assert not bucket.take(0.5) and bucket.take(1.0)
    settings = PolicySettings(rate_per_minute={"webhook": 1.0}, burst={"webhook": 2.0},
                              cooldown_s={})
    policy, _, stored = make(settings)
    for i in range(4):
        policy.evaluate(gpu_finding(node=f"x{i}", health=Health.DEGRADED,
                                    action=SuggestedAction.WATCH))
    assert outcomes(stored, ActionKind.WEBHOOK) == ["act", "act", "suppressed", "suppressed"]
    assert "rate limit" in stored[-1].reason


def test_circuit_breaker_refuses_mass_drain_and_alerts_once() -> None:
    settings = PolicySettings(breaker_share={"drain": 0.2}, shadow_actions=frozenset(),
                              rate_per_minute={"drain": 1000.0}, burst={"drain": 1000.0})
    policy, clock, stored = make(settings, fleet(nodes=10, jobs=0))
    alerts = []
    drains = []
    for i in range(5):
        clock.t += 1
        planned = policy.evaluate(gpu_finding(node=f"n{i}", action=SuggestedAction.DRAIN))
        drains += [p for p in planned if p.kind == ActionKind.DRAIN]
        alerts += [p for p in planned if p.decision.target == "breaker:drain"]
    # 20% of 10 nodes = 2 drains; the rest refused, one alert for the trip
    assert [p.node for p in drains] == ["n0", "n1"]
    assert outcomes(stored, ActionKind.DRAIN) == ["act", "act", "refused", "refused", "refused"]
    refused = [d for d in stored if d.outcome == "refused"]
    assert refused[0].inputs["breaker_limit"] == 2 and "circuit breaker" in refused[0].reason
    assert len(alerts) == 1 and alerts[0].decision.outcome == "act"
    # once the window has passed, draining is allowed again
    clock.t += settings.breaker_window_s + 1
    planned = policy.evaluate(gpu_finding(node="n7", action=SuggestedAction.DRAIN))
    assert any(p.kind == ActionKind.DRAIN and p.decision.outcome == "act" for p in planned)


def test_breaker_counts_a_target_once() -> None:
    b = CircuitBreaker(share=0.1, window_s=60, minimum=1)
    assert b.check("job:a", 5, 0.0)[0]
    b.note("job:a", 0.0)
    assert b.check("job:a", 5, 1.0)[0]  # the same job again is not "more" of the fleet
    allowed, first, _ = b.check("job:b", 5, 2.0)
    assert not allowed and first
    assert b.check("job:c", 5, 3.0)[1] is False  # still the same trip


def test_checkpoint_breaker_across_jobs() -> None:
    settings = PolicySettings(breaker_share={"checkpoint": 0.5}, dedup_s=0)
    policy, clock, stored = make(settings, fleet(nodes=4, jobs=4))
    for i in range(4):
        clock.t += 1
        policy.evaluate(gpu_finding(node=f"n{i}"))
    assert outcomes(stored, ActionKind.CHECKPOINT) == ["act", "act", "refused", "refused"]


def test_shadow_global_and_per_kind() -> None:
    # drain is shadow by default
    policy, _, stored = make()
    planned = policy.evaluate(gpu_finding(action=SuggestedAction.DRAIN))
    drain = next(p for p in planned if p.kind == ActionKind.DRAIN)
    assert drain.decision.outcome == Outcome.SHADOW and "shadow mode" in drain.decision.reason
    assert next(p for p in planned if p.kind == ActionKind.CHECKPOINT).decision.outcome == "act"
    # global shadow: everything recorded, nothing to act on
    policy, _, stored = make(PolicySettings(shadow=True))
    planned = policy.evaluate(gpu_finding(action=SuggestedAction.DRAIN))
    assert planned and all(p.decision.outcome == "shadow" for p in planned)
    assert {d.action for d in stored} == {"checkpoint", "webhook", "drain"}


def test_job_subject_and_forced_checkpoint() -> None:
    table = fleet()
    policy, _, _ = make(table=table)
    f = Finding(check="alert:GpuHot", health=Health.DEGRADED, action=SuggestedAction.CHECKPOINT,
                subject=Subject(kind="job", job="job5"), reason="alert", time=T0,
                probability=0.0)
    planned = policy.evaluate(f, source="alertmanager", force_checkpoint=True)
    ckpt = next(p for p in planned if p.kind == ActionKind.CHECKPOINT)
    assert ckpt.decision.outcome == "act" and ckpt.decision.source == "alertmanager"
    assert "bypassed" in ckpt.decision.inputs["cost_model"]


def test_decisions_metric() -> None:
    registry = CollectorRegistry()
    policy = Policy(PolicySettings(), fleet(), clock=Clock(), registry=registry)
    policy.evaluate(gpu_finding())
    value = registry.get_sample_value("forewarn_collector_decisions_total",
                                      {"action": "checkpoint", "outcome": "act"})
    assert value == 1.0
