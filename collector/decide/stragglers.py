"""Stragglers across the nodes of a job: :class:`forewarn.models.peers.JobStragglers` live
inside the collector.

An agent compares the ranks of a job on its own node only; a job spread over nodes needs
the collector, which hears every node. :class:`StragglerService` takes every stored
batch's rank summaries (each rank's pace: recent compute time per step, else step time)
and GPU samples from the policy thread, and every ``bucket_s`` runs the peer comparison
over all ranks of every job with at least three ranks reporting a pace. A rank named
suspect becomes a ``job_straggler`` finding (degraded, watch: the policy sends a webhook)
whose reason names the rank, its node and GPU, how much slower it is than its peers, and
what its GPU's telemetry shows that its peers' do not (thermal slowdown, power capping,
low clocks, PCIe or NVLink errors).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from forewarn.wire import AgentBatch, Finding

if TYPE_CHECKING:
    from forewarn.models.peers import JobStragglers

    from ..config import CollectorConfig

__all__ = ["StragglerService"]


class StragglerService:
    """See the module docstring. Call from the policy thread."""

    def __init__(self, bucket_s: float = 5.0) -> None:
        self.bucket_s = bucket_s
        self._peers: JobStragglers | None = None
        self._last: float | None = None

    @classmethod
    def from_config(cls, config: CollectorConfig) -> StragglerService | None:
        """``None`` when ``stragglers_enabled`` is off."""
        return cls(config.straggler_bucket_s) if config.stragglers_enabled else None

    @property
    def peers(self) -> JobStragglers:
        """The comparison, built at first use: its module imports pandas, which the
        collector's start does not wait for."""
        if self._peers is None:
            from forewarn.models.peers import JobStragglers

            self._peers = JobStragglers(bucket_s=self.bucket_s)
        return self._peers

    def observe(self, batches: Sequence[AgentBatch]) -> None:
        """Rank summaries and GPU samples of newly stored batches."""
        for b in batches:
            for s in b.samples:
                self.peers.observe_gpu(s)
            for r in b.ranks:
                # the agent's time of the batch: the time base of its GPU samples
                self.peers.observe_rank(r, b.created)

    def due(self, now: float) -> bool:
        """Whether a comparison is due (once per bucket)."""
        return self._last is None or not 0 <= now - self._last < self.bucket_s

    def findings(self, now: float) -> list[Finding]:
        """Compare now: the stragglers newly named."""
        self._last = now
        return self.peers.findings(now)
