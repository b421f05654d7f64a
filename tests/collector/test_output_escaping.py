"""User-controlled strings (job names, GPU names, reasons) in every output: the read API,
Prometheus label values (agent and collector), webhook bodies (JSON and Slack). Each
hostile string comes out escaped, bounded and valid UTF-8, and never breaks the output
for anyone else. The status page in a browser: tests/collector/test_status_page_browser.py."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from forewarn.agent.backend import GpuInfo
from forewarn.agent.config import AgentConfig
from forewarn.agent.daemon import Agent
from forewarn.agent.testing import ScriptedBackend
from forewarn.chaos.exposition import samples
from forewarn.collector.decide.webhooks import WebhookEndpoint, WebhookSender, WebhookVerifier
from forewarn.labels import LABEL_MAX
from forewarn.wire import AgentBatch, RankSummary, encode

from support.collector import TOKENS, start_service, stop_service
from support.hostile import HOSTILE, TEN_KB
from support.polling import poll
from support.webhooks import Receiver


def labels_of(text: str, name: str) -> list[dict[str, str]]:
    return [labels for labels, _ in samples(text, name)]


class HostileBackend(ScriptedBackend):
    """A GPU whose reported name is 10 kB of quotes, newlines and markup, and whose UUID
    is not valid Unicode (a lone surrogate, as ``json.loads`` of a replay file gives)."""

    def info(self, index: int) -> GpuInfo:
        good = super().info(index)
        name = ('"}\nfake_metric 1\n# <script>' * 400)[:10_000] if index == 0 else good.name
        uuid = "GPU-\udc80-bad" if index == 1 else good.uuid
        return GpuInfo(index=index, uuid=uuid, name=name, pci_bus_id=good.pci_bus_id)


def test_agent_metrics_bound_and_escape_label_values() -> None:
    backend = HostileBackend(lambda gpu, now: {"temperature_c": 50.0}, gpus=3, node="node-a")
    agent = Agent(AgentConfig(node="node-a", listen="127.0.0.1:0", kmsg=False), backend,
                  checks=[])
    agent.start(serve=True)
    try:
        agent.poll_once()
        assert agent.server is not None
        host, port = agent.server.address
        r = httpx.get(f"http://{host}:{port}/metrics", timeout=10)
        assert r.status_code == 200, r.text
        text = r.content.decode("utf-8")  # valid UTF-8
        info = {lab["gpu"]: lab for lab in labels_of(text, "forewarn_gpu_info")}
        assert set(info) == {"0", "1", "2"}  # nothing injected, no GPU lost
        assert "fake_metric" not in {fam.name for fam in text_string_to_metric_families(text)}
        for lab in labels_of(text, "forewarn_gpu_info"):
            assert all(len(v) <= LABEL_MAX for v in lab.values()), lab
        assert info["0"]["name"].startswith('"}\nfake_metric 1\n# <script>')
        assert info["1"]["uuid"] == "GPU-\ufffd-bad"
        assert info["2"]["name"] == "Scripted GPU"
    finally:
        agent.stop()


def test_collector_metrics_bound_job_labels_and_keep_series_apart(tmp_path: Path) -> None:
    svc = start_service(tmp_path)
    try:
        now = time.time()
        long_a, long_b = "a" * 200 + "-one", "a" * 200 + "-two"
        jobs = [*HOSTILE, long_a, long_b]
        ranks = [RankSummary(job=job, rank=0, node="node1", gpu=0, pid=100 + i, last_step=10,
                             last_step_time=now, step_seconds_p50=1.0)
                 for i, job in enumerate(jobs)]
        svc.push("node1", ranks=ranks)
        # the policy thread takes the batch after it is stored
        assert poll(lambda: {g["job"] for g in svc.client.get("/api/v1/goodput").json()}
                    == set(jobs))
        r = svc.client.get("/metrics")
        assert r.status_code == 200
        text = r.content.decode("utf-8")
        got = [lab["training_job"] for lab in labels_of(text, "forewarn_job_goodput_ratio")]
        assert len(got) == len(set(got)) == len(jobs)  # two long names stay two series
        assert all(len(v) <= LABEL_MAX for v in got)
        short = {job for job in jobs if len(job) <= LABEL_MAX}
        assert short <= set(got)  # escaped in the text, the same value after parsing
    finally:
        stop_service(svc)


def test_job_detail_of_any_name_is_reachable(tmp_path: Path) -> None:
    """The read API answers ``job?name=<name>`` for every hostile name, ``..`` and a
    newline included (the status page asks for a job's detail this way; a 404 there once
    froze the page), and ``jobs/<name>`` for a name with ``/``."""
    svc = start_service(tmp_path)
    try:
        now = time.time()
        ranks = [RankSummary(job=job, rank=0, node="node1", gpu=0, pid=100 + i, last_step=10,
                             last_step_time=now) for i, job in enumerate(HOSTILE)]
        svc.push("node1", ranks=ranks)
        for job in HOSTILE:
            r = svc.client.get("/api/v1/job", params={"name": job})
            assert r.status_code == 200, (job, r.text)
            assert r.json()["job"] == job
        r = svc.client.get("/api/v1/jobs/" + urllib.parse.quote("team/a/run-1", safe=""))
        assert r.status_code == 200 and r.json()["job"] == "team/a/run-1", r.text
        # a 10 kB name never gets in: the wire bounds names to 256 characters
        long_rank = RankSummary(job=TEN_KB, rank=0, node="node1", pid=1)
        body = encode(AgentBatch(node="node1", agent_id="agent-node1", seq=99,
                                 created=now, ranks=[long_rank]))
        refused = svc.client.post("/api/v1/ingest", content=body, headers={
            "content-type": "application/msgpack",
            "authorization": f"Bearer {TOKENS['node1']}"})
        # the record is left out by name, the rest of the batch stored (a bad record never
        # costs a node its other records)
        assert refused.status_code == 200, refused.text
        assert [r["field"] for r in refused.json()["refused"]] == ["$.ranks[0].job"]
        assert svc.client.get("/api/v1/job", params={"name": TEN_KB}).status_code == 404
    finally:
        stop_service(svc)


async def _deliver(sender: WebhookSender, event: dict[str, Any]) -> None:
    await sender.start()
    sender.send(event)
    assert await sender.drain(10)
    await sender.stop()


def test_webhook_bodies_are_json_encoded_bounded_and_slack_escaped() -> None:
    receiver = Receiver()
    secret = b"s3cret"
    try:
        sender = WebhookSender([WebhookEndpoint(receiver.url, "json", secret),
                                WebhookEndpoint(receiver.url, "slack")],
                               registry=CollectorRegistry())
        event = {"id": "d1", "title": f"unhealthy: nan_loss on job:{HOSTILE[8]}",
                 "reason": TEN_KB, "job": "\n".join(HOSTILE), "action": "checkpoint",
                 "evidence": {"blob": TEN_KB * 10}, "orders": [{"nodes": ["n"] * 5000}]}
        asyncio.run(_deliver(sender, event))
        by_kind = {("blocks" in json.loads(b)): (h, b) for h, b in receiver.requests}
        headers, body = by_kind[False]
        WebhookVerifier(secret).verify(body, headers)
        assert len(body) <= 64 * 1024, len(body)
        got = json.loads(body)
        assert got["job"] == "\n".join(HOSTILE)  # JSON-encoded: every character survives
        assert got["reason"].startswith("n" * 1000) and len(got["reason"]) < len(TEN_KB)
        _, slack_body = by_kind[True]
        assert len(slack_body) <= 64 * 1024
        slack = json.loads(slack_body)
        text = slack["blocks"][0]["text"]["text"] + slack["text"]
        # Slack control sequences (mentions, links) arrive as text, not markup
        assert "<!channel>" not in text and "<https://evil" not in text
        assert "&lt;!channel&gt;" in text and "&lt;script&gt;" in text
    finally:
        receiver.close()
