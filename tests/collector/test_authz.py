"""Authorisation over real HTTP with enrolled node tokens: an agent acts only on the jobs
its node hosts (the job map), and operator actions need the operator token."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from forewarn.wire import (
    CheckpointReport,
    Finding,
    Health,
    RankSummary,
    Subject,
    SuggestedAction,
    encode,
)

from support.collector import TOKENS, Service, ranks_on, start_service, stop_service
from support.polling import poll

pytestmark = pytest.mark.usefixtures("state_backend")  # both state backends

MSGPACK = {"content-type": "application/msgpack"}


def post(svc: Service, node: str, **kw: object) -> tuple[int, str]:
    """Post one batch of ``node`` with its own token; (status, error or result)."""
    from forewarn.wire import AgentBatch

    seq = svc.seq.get(node, 0)
    svc.seq[node] = seq + 1
    b = AgentBatch(node=node, agent_id=f"agent-{node}", seq=seq, created=time.time(),
                   **kw)  # type: ignore[arg-type]
    r = svc.client.post("/api/v1/ingest", content=encode(b), headers={
        **MSGPACK, "authorization": f"Bearer {TOKENS[node]}"})
    body = r.json()
    return r.status_code, str(body.get("error", body.get("result")))


def rank(job: str, r: int, node: str, now: float, *, alive: bool = True) -> RankSummary:
    return RankSummary(job=job, rank=r, world_size=4, node=node, gpu=r % 2, pid=100 + r,
                       last_step=500, last_step_time=now, step_seconds_p50=0.2,
                       last_checkpoint_step=100, last_checkpoint_time=now - 3600,
                       checkpoint_seconds=30.0, alive=alive)


def job_row(svc: Service, job: str) -> dict[str, object]:
    rows = svc.store.query("SELECT * FROM jobs WHERE job = ?", (job,))
    return rows[0]


def holders(svc: Service, job: str) -> dict[int, str]:
    return {int(r["rank"]): str(r["node"]) for r in
            svc.store.query("SELECT rank, node FROM ranks WHERE job = ?", (job,))}


def test_node_cannot_forge_checkpoints_order_or_move_ranks_of_another_nodes_job(
        tmp_path: Path) -> None:
    svc = start_service(tmp_path)
    try:
        now = time.time()
        assert post(svc, "node1", ranks=ranks_on("node1", 0, now))[0] == 200  # train-1 r0, r1
        train2 = [rank("train-2", r, "node2", now) for r in (2, 3)]
        assert post(svc, "node2", ranks=train2)[0] == 200

        # forge checkpoint-done for train-1 (runs on node1 only)
        done = CheckpointReport(job="train-1", rank=0, step=999, phase="done", time=now)
        status, error = post(svc, "node2", checkpoints=[done])
        assert status == 403, error
        assert "$.checkpoints[0]" in error and "node2" in error and "train-1" in error
        assert job_row(svc, "train-1")["last_checkpoint_step"] == 100

        # order a checkpoint of train-1 through a finding about the job or one of its ranks
        for subject in (Subject(kind="job", job="train-1"),
                        Subject(kind="rank", job="train-1", rank=0, node="node2")):
            bad = Finding(check="nan_loss", health=Health.UNHEALTHY, reason="forged",
                          action=SuggestedAction.CHECKPOINT, subject=subject, time=now)
            status, error = post(svc, "node2", urgent=True, findings=[bad])
            assert status == 403, error
            assert "$.findings[0].subject" in error and "train-1" in error
        assert svc.commands("node1", wait=0.5) == []
        # a finding that asks for nothing (the agent clearing a rank that moved away) is
        # not stored, and costs its batch nothing
        cleared = Finding(check="rank_gone", health=Health.UNKNOWN, reason="no longer judged",
                          subject=Subject(kind="rank", job="train-1", rank=0, node="node2"),
                          time=now)
        assert post(svc, "node2", findings=[cleared], ranks=train2)[0] == 200
        assert svc.store.scalar("SELECT COUNT(*) FROM findings") == 0

        # move a live rank of train-1 onto node2: not applied, the rest of the batch is kept
        status, _ = post(svc, "node2", ranks=[rank("train-1", 0, "node2", now), *train2])
        assert status == 200
        assert holders(svc, "train-1") == {0: "node1", 1: "node1"}
        assert svc.metric("forewarn_collector_ingest_rejected_total", reason="not_your_job") == 3
        ignored = "forewarn_collector_ingest_ignored_records_total"
        assert svc.metric(ignored, reason="rank_held") == 1
        assert svc.metric(ignored, reason="other_node") == 1

        # node1's finding orders train-1; node2's reports about its own job (ranks 2 and 3
        # of train-2) cannot complete train-1's order
        own = Finding(check="grad_spike", health=Health.UNHEALTHY, reason="grad spike",
                      action=SuggestedAction.CHECKPOINT, time=now,
                      subject=Subject(kind="job", job="train-1"))
        assert post(svc, "node1", urgent=True, findings=[own])[0] == 200
        orders = svc.commands("node1", wait=10)
        assert len(orders) == 1
        request_id = orders[0]["order"]["request_id"]
        forged = [CheckpointReport(job="train-2", rank=r, step=999, phase="done", time=now,
                                   request_id=request_id) for r in (2, 3)]
        assert post(svc, "node2", checkpoints=forged)[0] == 200
        for r in range(2):
            real = CheckpointReport(job="train-1", rank=r, step=600, phase="done",
                                    time=now, request_id=request_id)
            assert post(svc, "node1", checkpoints=[real])[0] == 200
        # world size 4: two real reports of four do not complete it, two forged ones neither
        time.sleep(0.5)
        assert svc.metric("forewarn_collector_checkpoint_orders_total", event="done") == 0
    finally:
        stop_service(svc)


def test_a_rank_moves_when_its_old_node_reports_it_gone(tmp_path: Path) -> None:
    """A job restarted with its ranks placed differently: the new node takes the rank over
    once the old node reported it gone, and the old node's later reports of the dead
    rank do not move it back."""
    svc = start_service(tmp_path)
    try:
        now = time.time()
        assert post(svc, "node1", ranks=[rank("train-1", 0, "node1", now)])[0] == 200
        assert post(svc, "node2", ranks=[rank("train-1", 0, "node2", now)])[0] == 200
        assert holders(svc, "train-1") == {0: "node1"}
        assert post(svc, "node1", ranks=[rank("train-1", 0, "node1", now, alive=False)])[0] == 200
        assert post(svc, "node2", ranks=[rank("train-1", 0, "node2", now)])[0] == 200
        assert holders(svc, "train-1") == {0: "node2"}
        assert post(svc, "node1", ranks=[rank("train-1", 0, "node1", now, alive=False)])[0] == 200
        assert holders(svc, "train-1") == {0: "node2"}
        assert poll(lambda: svc.metric("forewarn_collector_ingest_ignored_records_total",
                                       reason="rank_moved") == 1)
        # the new holder's checkpoint report is accepted
        done = CheckpointReport(job="train-1", rank=0, step=700, phase="done", time=now)
        assert post(svc, "node2", checkpoints=[done])[0] == 200
        assert job_row(svc, "train-1")["last_checkpoint_step"] == 700
    finally:
        stop_service(svc)


OPERATOR = "operator-token-0123456789"


def test_operator_actions_need_the_operator_token(tmp_path: Path) -> None:
    svc = start_service(tmp_path, operator_token=OPERATOR)
    try:
        now = time.time()
        assert post(svc, "node1", ranks=ranks_on("node1", 0, now))[0] == 200
        order = {"job": "train-1", "reason": "maintenance at 14:00"}
        refused = [
            ({}, 401, "missing or wrong operator token"),
            ({"authorization": "Bearer nope"}, 401, "missing or wrong operator token"),
            ({"authorization": f"Bearer {TOKENS['node1']}"}, 403, "node 'node1'"),
            ({"authorization": "Bearer alert-token-0123456789"}, 401, "wrong operator token"),
        ]
        for headers, status, words in refused:
            r = svc.client.post("/api/v1/orders", json=order, headers=headers)
            assert r.status_code == status and words in r.json()["error"], r.text
        assert svc.commands("node1", wait=0.2) == []
        assert svc.metric("forewarn_collector_ingest_rejected_total",
                          reason="operator_auth") == len(refused)

        op = {"authorization": f"Bearer {OPERATOR}"}
        bad = svc.client.post("/api/v1/orders", json={"node": "node1"}, headers=op)
        assert bad.status_code == 400 and "$.job" in bad.json()["error"]
        r = svc.client.post("/api/v1/orders", json=order, headers=op)
        assert r.status_code == 200, r.text
        assert [d["outcome"] for d in r.json()["decisions"] if d["action"] == "checkpoint"] == [
            "act"]
        got = svc.commands("node1", wait=10)
        assert [c["order"]["job"] for c in got] == ["train-1"]
        assert "maintenance at 14:00" in got[0]["order"]["reason"]
        # a drain goes through the policy too: shadow until drain_enabled
        r = svc.client.post("/api/v1/drains", json={"node": "node1", "reason": "PSU"},
                            headers=op)
        assert r.status_code == 200, r.text
        assert {d["action"]: d["outcome"] for d in r.json()["decisions"]}["drain"] == "shadow"
    finally:
        stop_service(svc)


def test_operator_actions_refused_without_a_token_and_tokens_stay_distinct(
        tmp_path: Path) -> None:
    from forewarn.collector.config import CollectorConfig
    from forewarn.config import ConfigError

    svc = start_service(tmp_path)
    try:
        r = svc.client.post("/api/v1/orders", json={"job": "train-1"},
                            headers={"authorization": "Bearer anything"})
        assert r.status_code == 403 and "set operator_token" in r.json()["error"]
    finally:
        stop_service(svc)
    for other in ("api_token", "alert_token"):
        overrides: dict[str, Any] = {other: "same-secret"}
        with pytest.raises(ConfigError, match=other):
            CollectorConfig(operator_token="same-secret", **overrides)


def test_an_operator_drain_may_name_the_gpu_pulled_and_then_labels_it(tmp_path: Path) -> None:
    # A GPU pulled for repair is an outcome retraining learns from (docs/models.md): the
    # drain that ran names it, so the fleet's history reads it as that GPU's failure.
    from forewarn.collector.metrics import CollectorMetrics
    from forewarn.collector.storage.history import read_history
    from forewarn.collector.storage.telemetry import TelemetryWriter

    svc = start_service(tmp_path, operator_token=OPERATOR, drain_enabled=True,
                        drain_command=("true", "{node}"))
    try:
        op = {"authorization": f"Bearer {OPERATOR}"}
        assert post(svc, "node1")[0] == 200
        bad = svc.client.post("/api/v1/orders", json={"job": "train-1", "gpu": 3}, headers=op)
        assert bad.status_code == 400 and "$.gpu" in bad.json()["error"]
        r = svc.client.post("/api/v1/drains", json={"node": "node1", "gpu": 3,
                                                    "reason": "HBM errors"}, headers=op)
        assert r.status_code == 200, r.text
        assert {d["action"]: d["outcome"] for d in r.json()["decisions"]}["drain"] == "act"
        tel = TelemetryWriter(svc.store, tmp_path / "data" / "telemetry", CollectorMetrics())
        drains = poll(lambda: read_history(svc.store, tel).drains[
            ["node", "gpu", "cause"]].to_dict("records"))
        assert drains == [{"node": "node1", "gpu": 3, "cause": "drain"}]
    finally:
        stop_service(svc)
