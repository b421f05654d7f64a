"""A simulated fleet for the status page at scale: ``nodes`` nodes of ``gpus`` GPUs each and
``jobs`` jobs spread over them, pushed into a real collector through its ingest API, one
agent batch per node with that node's token, as the agents would send them.

Used by tests/collector/test_status_page_browser.py and bench/statuspage_render.py."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import httpx

from forewarn.collector.cli import ServerThread
from forewarn.collector.storage.state import StateStore
from forewarn.wire import (
    AgentBatch,
    Finding,
    GpuSample,
    Health,
    RankSummary,
    Subject,
    SuggestedAction,
    encode,
)

from support.collector import serve

__all__ = ["Fleet", "fleet_tokens", "node_name", "push_fleet", "start_fleet_collector"]


@dataclasses.dataclass(frozen=True)
class Fleet:
    """The shape of the fleet and where it is sick: every ``sick_every``-th node has an
    unhealthy GPU 3 (XID 79) and a degraded GPU 5; node 0's GPU 0 repeats XID 48
    ``repeats`` times (the duplicate rows that once made the page 6,000 px tall)."""

    nodes: int = 1000
    gpus: int = 8
    jobs: int = 200
    sick_every: int = 97
    repeats: int = 300

    @property
    def nodes_per_job(self) -> int:
        return max(1, self.nodes // self.jobs)

    def job_of(self, node: int) -> str:
        return f"job-{min(node // self.nodes_per_job, self.jobs - 1):03d}"

    def sick(self, node: int) -> bool:
        return node % self.sick_every == self.sick_every - 1


def node_name(i: int) -> str:
    return f"gpu-node-{i:04d}"


def fleet_tokens(fleet: Fleet) -> dict[str, str]:
    """One agent token per node."""
    return {node_name(i): f"token-{node_name(i)}-0123456789" for i in range(fleet.nodes)}


def _batch(fleet: Fleet, i: int, now: float) -> AgentBatch:
    node = node_name(i)
    samples = [GpuSample(node=node, gpu=g, time=now, source="dcgm", uuid=f"GPU-{i:04d}-{g}",
                         name="NVIDIA H100 80GB HBM3", temperature_c=40.0 + g,
                         power_w=300.0, gpu_util_pct=95.0) for g in range(fleet.gpus)]
    findings = []
    for g in range(fleet.gpus):
        if i == 0 and g == 0:
            continue  # its repeated XID 48 below is its newest word
        health, reason = Health.HEALTHY, "no XID"
        if fleet.sick(i) and g == 3:
            health, reason = Health.UNHEALTHY, "XID 79: GPU has fallen off the bus"
        elif fleet.sick(i) and g == 5:
            health, reason = Health.DEGRADED, "XID 94: contained ECC error"
        findings.append(Finding(check="xid", health=health, reason=reason, time=now,
                                subject=Subject(kind="gpu", node=node, gpu=g)))
    if i == 0:
        findings += [Finding(check="xid", health=Health.UNHEALTHY, time=now - k * 0.01,
                             reason="XID 48: double-bit ECC error",
                             action=SuggestedAction.RESET_GPU,
                             subject=Subject(kind="gpu", node=node, gpu=0))
                     for k in range(fleet.repeats, 0, -1)]
    job = fleet.job_of(i)
    first = (i % fleet.nodes_per_job) * fleet.gpus
    world = fleet.nodes_per_job * fleet.gpus
    ranks = [RankSummary(job=job, rank=first + g, local_rank=g, world_size=world, node=node,
                         gpu=g, pid=1000 + g, last_step=5000, last_step_time=now,
                         step_seconds_p50=0.5, last_checkpoint_step=4800,
                         last_checkpoint_time=now - 100, checkpoint_seconds=20.0)
             for g in range(fleet.gpus)]
    return AgentBatch(node=node, agent_id=f"agent-{node}", seq=0, created=now,
                      samples=samples, findings=findings, ranks=ranks)


def push_fleet(client: httpx.Client, fleet: Fleet, tokens: dict[str, str]) -> None:
    """Post one batch per node (its GPUs, their checks' findings, its ranks)."""
    now = time.time()
    for i in range(fleet.nodes):
        r = client.post("/api/v1/ingest", content=encode(_batch(fleet, i, now)), headers={
            "content-type": "application/msgpack",
            "authorization": f"Bearer {tokens[node_name(i)]}"})
        assert r.status_code == 200, r.text


def start_fleet_collector(tmp_path: Path, fleet: Fleet
                          ) -> tuple[ServerThread, StateStore, httpx.Client]:
    """A collector (see :func:`support.collector.serve`) filled with ``fleet``."""
    tokens = fleet_tokens(fleet)
    server, store, client = serve(tmp_path, tokens, advise_hooks=False)
    push_fleet(client, fleet, tokens)
    return server, store, client
