"""What the policy and the order book need to know about jobs, and nothing more.

The collector's job map (``forewarn.collector.jobs.jobmap``) is the source of truth: which ranks
of which job run on which node and GPU, built from the agents' :class:`RankSummary`
reports. The policy only reads it through :class:`JobView`, so it can be tested against
:class:`RankTable` (a small in-memory job map fed with the same reports) and adapted to
the service's store without changing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Protocol

from forewarn.ordering import RankProgress, estimated_step
from forewarn.wire import RankSummary

__all__ = ["JobInfo", "JobView", "RankTable", "node_of_instance"]


@dataclasses.dataclass(frozen=True)
class JobInfo:
    """A snapshot of one job: its ranks as last reported, and when it was first seen."""

    job: str
    ranks: tuple[RankSummary, ...]
    first_seen: float
    """Unix time the collector first heard of the job (work-at-risk origin before any
    checkpoint is known)."""

    @property
    def nodes(self) -> tuple[str, ...]:
        """Nodes the job runs on, sorted."""
        return tuple(sorted({r.node for r in self.ranks}))

    @property
    def gpu_count(self) -> int:
        """GPUs the job holds: distinct (node, gpu) pairs; a rank without a GPU index
        counts as one GPU of its own (one rank per GPU is the norm)."""
        seen: set[tuple[str, int]] = set()
        loose = 0
        for r in self.ranks:
            if r.gpu is None:
                loose += 1
            else:
                seen.add((r.node, r.gpu))
        return max(1, len(seen) + loose)

    @property
    def world_size(self) -> int:
        """Ranks expected in the job: the largest reported world size, at least the ranks seen."""
        return max([len(self.ranks), *(r.world_size for r in self.ranks)])

    @property
    def last_checkpoint_time(self) -> float | None:
        """When the job as a whole last finished a checkpoint: the oldest of the ranks'
        latest checkpoints (a checkpoint is only usable once every rank has saved)."""
        times = [r.last_checkpoint_time for r in self.ranks]
        if not times or any(t is None for t in times):
            return None
        return min(t for t in times if t is not None)

    @property
    def checkpoint_seconds(self) -> float | None:
        """The slowest rank's last checkpoint duration, as the ranks reported it."""
        secs = [r.checkpoint_seconds for r in self.ranks if r.checkpoint_seconds is not None]
        return max(secs) if secs else None

    @property
    def step_seconds_p50(self) -> float | None:
        """The fastest rank's median step time (the rank that reaches a step first)."""
        vals = [
            r.step_seconds_p50
            for r in self.ranks
            if r.step_seconds_p50 is not None and r.step_seconds_p50 > 0
        ]
        return min(vals) if vals else None

    def estimated_step(self, now: float) -> int | None:
        """The furthest step any rank has probably reached by ``now``: its last reported
        step plus the steps it made since the report at its own median pace."""
        return estimated_step(
            (RankProgress(r.last_step, r.last_step_time, r.step_seconds_p50) for r in self.ranks),
            now)


class JobView(Protocol):
    """Read access to the job map.

    Contract: methods are cheap, never raise on unknown names (they return empty
    results), and return snapshots the caller may keep.
    """

    def jobs_on(self, node: str, gpu: int | None = None) -> list[str]:
        """Jobs with a rank on ``node`` (on GPU ``gpu`` when given), sorted."""
        ...

    def job(self, job: str) -> JobInfo | None:
        """The job's snapshot, or ``None`` when unknown."""
        ...

    def node_count(self) -> int:
        """Nodes in the fleet (the population the drain circuit breaker measures against)."""
        ...

    def job_count(self) -> int:
        """Jobs running (the population the checkpoint circuit breaker measures against)."""
        ...

    def resolve_uuid(self, uuid: str) -> tuple[str, int] | None:
        """(node, gpu index) of a GPU UUID, when known."""
        ...


class RankTable:
    """An in-memory :class:`JobView` fed with :class:`RankSummary` reports.

    Used by tests and as the policy's own view when the service hands over reports
    directly; the service's SQLite-backed job map implements the same protocol.
    """

    def __init__(self, nodes: Iterable[str] = ()) -> None:
        self._ranks: dict[str, dict[int, RankSummary]] = {}
        self._first_seen: dict[str, float] = {}
        self._nodes: set[str] = set(nodes)
        self._uuids: dict[str, tuple[str, int]] = {}

    def update(self, summaries: Sequence[RankSummary], now: float) -> None:
        """Record the latest summary of each rank."""
        for s in summaries:
            self._ranks.setdefault(s.job, {})[s.rank] = s
            self._first_seen.setdefault(s.job, now)
            self._nodes.add(s.node)

    def add_gpu(self, node: str, gpu: int, uuid: str) -> None:
        """Remember a GPU's UUID (alert labels from DCGM name GPUs by UUID)."""
        if uuid:
            self._uuids[uuid] = (node, gpu)
        self._nodes.add(node)

    def jobs_on(self, node: str, gpu: int | None = None) -> list[str]:
        return sorted(
            job
            for job, ranks in self._ranks.items()
            if any(r.node == node and (gpu is None or r.gpu == gpu) for r in ranks.values())
        )

    def job(self, job: str) -> JobInfo | None:
        ranks = self._ranks.get(job)
        if not ranks:
            return None
        ordered = tuple(ranks[k] for k in sorted(ranks))
        return JobInfo(job=job, ranks=ordered, first_seen=self._first_seen[job])

    def node_count(self) -> int:
        return len(self._nodes)

    def job_count(self) -> int:
        return len(self._ranks)

    def resolve_uuid(self, uuid: str) -> tuple[str, int] | None:
        return self._uuids.get(uuid)


def node_of_instance(instance: str) -> str:
    """The host part of a Prometheus ``instance`` label (``node7:9400`` -> ``node7``,
    ``[::1]:9400`` -> ``::1``)."""
    value = instance.strip()
    if value.startswith("["):
        end = value.find("]")
        return value[1:end] if end > 0 else value
    host, sep, port = value.rpartition(":")
    if sep and port.isdigit() and host and ":" not in host:
        return host
    return value
