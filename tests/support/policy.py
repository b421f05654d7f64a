"""A small fleet, a clock and findings for policy and incident tests."""

from __future__ import annotations

from forewarn.collector.jobs.jobview import RankTable
from forewarn.wire import Finding, Health, RankSummary, Subject, SuggestedAction

T0 = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t


def fleet(nodes: int = 10, jobs: int = 10) -> RankTable:
    """``jobs`` one-node jobs on nodes n0.., 4 GPUs each, started two hours ago."""
    table = RankTable(nodes=[f"n{i}" for i in range(nodes)])
    for j in range(jobs):
        table.update(
            [RankSummary(job=f"job{j}", rank=g, world_size=4, node=f"n{j % nodes}", gpu=g,
                         pid=1000 + g, last_step=500, last_step_time=T0, step_seconds_p50=1.0)
             for g in range(4)],
            now=T0 - 7200,
        )
    return table


def gpu_finding(node: str = "n0", gpu: int = 1, health: Health = Health.UNHEALTHY,
                action: SuggestedAction = SuggestedAction.CHECKPOINT, check: str = "xid",
                p: float | None = None) -> Finding:
    return Finding(check=check, health=health, subject=Subject(kind="gpu", node=node, gpu=gpu),
                   reason=f"{check} on {node}/{gpu}", action=action, time=T0, probability=p)
