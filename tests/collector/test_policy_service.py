"""The policy inside the real collector service: an agent's finding becomes checkpoint
orders for every node of the job, a signed webhook (and its Slack form) at a real receiver,
and a drain command run as an argument list; deliveries and actions are stored."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from forewarn.collector.decide.webhooks import WebhookVerifier
from forewarn.wire import AgentBatch, Finding, Health, Subject, SuggestedAction, encode

from support.collector import TOKENS, ranks_on, start_service, stop_service
from support.polling import poll
from support.webhooks import Receiver

pytestmark = pytest.mark.usefixtures("state_backend")  # both state backends

SECRET = "webhook-secret-for-tests"


def recorder(tmp_path: Path) -> tuple[str, ...]:
    """A drain command that appends its arguments to drained.jsonl. It creates the file a
    moment before it writes its line, as a loaded machine may: a test polls for the line."""
    script = tmp_path / "drain.py"
    script.write_text(
        "import sys, json, pathlib, time\n"
        f"p = pathlib.Path({str(tmp_path / 'drained.jsonl')!r})\n"
        "with p.open('a') as f:\n"
        "    f.flush(); time.sleep(0.5); f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    return (sys.executable, str(script), "nodename={node}", "reason={reason}")


def drained_lines(tmp_path: Path) -> list[list[str]]:
    """The drain commands recorded so far: complete lines only."""
    path = tmp_path / "drained.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]


def test_finding_to_orders_signed_webhook_and_drain(tmp_path: Path) -> None:
    receiver = Receiver()
    svc = start_service(
        tmp_path, webhook_urls=(receiver.url,), webhook_slack_urls=(receiver.url + "/slack",),
        webhook_secret=SECRET, drain_command=recorder(tmp_path), drain_enabled=True,
        policy_breaker_drain_share=1.0,
    )
    try:
        now = time.time()
        svc.push("node1", ranks=ranks_on("node1", 0, now))
        svc.push("node2", ranks=ranks_on("node2", 2, now))
        bad = Finding(check="gpu_lost", health=Health.UNHEALTHY, action=SuggestedAction.DRAIN,
                      subject=Subject(kind="gpu", node="node2", gpu=1), time=now,
                      reason="GPU 1 lost (NVML_ERROR_GPU_IS_LOST); $(reboot)")
        svc.push("node2", urgent=True, findings=[bad])

        orders = [c["order"] for n in ("node1", "node2") for c in svc.commands(n, wait=10)]
        assert len(orders) == 2 and len({(o["request_id"], o["step"]) for o in orders}) == 1

        # webhooks: the signed JSON verifies, names the order; the Slack form arrives too
        assert poll(lambda: len(receiver.requests) >= 2)
        by_path = {("blocks" in json.loads(b)): (h, b) for h, b in receiver.requests}
        headers, body = by_path[False]
        WebhookVerifier(SECRET.encode()).verify(body, headers)
        event = json.loads(body)
        assert event["check"] == "gpu_lost" and event["subject"] == "gpu:node2/1"
        assert event["orders"][0]["request_id"] == orders[0]["request_id"]
        assert "gpu_lost" in json.loads(by_path[True][1])["text"]

        # the drain ran as an argument list, with the reason sanitised
        assert poll(lambda: drained_lines(tmp_path)) == [
            ["nodename=node2", "reason=GPU 1 lost NVML_ERROR_GPU_IS_LOST reboot"]]

        def statuses() -> dict[str, list[str]]:
            out: dict[str, list[str]] = {}
            for a in svc.client.get("/api/v1/actions").json():
                out.setdefault(a["kind"], []).append(a["status"])
            return out

        assert poll(lambda: statuses().get("webhook_delivery") == ["delivered"] * 2
                    and statuses().get("drain") == ["done"])
        got = statuses()
        assert got["checkpoint"] == ["ordered"] and got["webhook"] == ["queued"]
        metrics = svc.client.get("/metrics").text
        assert 'forewarn_collector_webhook_deliveries_total{status="delivered"} 2.0' in metrics
        assert 'forewarn_collector_decisions_total{action="drain",outcome="act"} 1.0' in metrics
        assert 'forewarn_collector_checkpoint_orders_total{event="issued"} 1.0' in metrics
    finally:
        stop_service(svc)
        receiver.close()


def test_injected_node_name_in_a_finding_runs_nothing(tmp_path: Path) -> None:
    """A finding naming another (here: a shell-injection) node is refused at ingest, before
    the policy; the drain layer's own refusal of such names is tested in test_drain.py."""
    svc = start_service(tmp_path, drain_command=recorder(tmp_path), drain_enabled=True,
                        policy_breaker_drain_share=1.0)
    try:
        evil = Finding(check="gpu_lost", health=Health.UNHEALTHY, action=SuggestedAction.DRAIN,
                       subject=Subject(kind="node", node="node1;reboot"), time=time.time(),
                       reason="x")
        batch = AgentBatch(node="node1", agent_id="agent-node1", seq=0, created=time.time(),
                           urgent=True, findings=[evil])
        r = svc.client.post("/api/v1/ingest", content=encode(batch), headers={
            "content-type": "application/msgpack", "authorization": f"Bearer {TOKENS['node1']}"})
        assert r.status_code == 403 and "subject.node" in r.json()["error"]
        time.sleep(0.5)
        assert svc.client.get("/api/v1/findings").json() == []
        assert [a for a in svc.client.get("/api/v1/actions").json() if a["kind"] == "drain"] == []
        assert not (tmp_path / "drained.jsonl").exists()
    finally:
        stop_service(svc)


def test_shadow_mode_records_and_does_nothing(tmp_path: Path) -> None:
    svc = start_service(tmp_path, policy_shadow=True, drain_command=recorder(tmp_path))
    try:
        now = time.time()
        svc.push("node1", ranks=ranks_on("node1", 0, now))
        f = Finding(check="gpu_lost", health=Health.UNHEALTHY, action=SuggestedAction.DRAIN,
                    subject=Subject(kind="gpu", node="node1", gpu=0), time=now, reason="lost")
        svc.push("node1", urgent=True, findings=[f])
        assert poll(lambda: len(svc.client.get("/api/v1/decisions").json()) >= 3)
        decisions = svc.client.get("/api/v1/decisions").json()
        assert {d["decision"] for d in decisions} == {
            "checkpoint:shadow", "webhook:shadow", "drain:shadow"}
        # decisions are stored before their actions are carried out: wait for the drain's
        drain = poll(lambda: next((a for a in svc.client.get("/api/v1/actions").json()
                                   if a["kind"] == "drain"), None))
        assert drain is not None, "no drain action recorded"
        assert drain["shadow"] == 1 and "nodename=node1" in drain["detail"]
        assert svc.commands("node1") == []
        assert not (tmp_path / "drained.jsonl").exists()
    finally:
        stop_service(svc)
