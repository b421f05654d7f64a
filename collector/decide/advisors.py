"""The collector's own detectors and advice, fed from the stored batches: the live failure
predictor (:mod:`.predict`: its findings go through the policy, so the cost-aware
checkpoint decision uses the predicted probability), peer comparison of the ranks of every
job across its nodes (:mod:`.stragglers`) and goodput accounting with checkpoint-interval
advice (:mod:`.goodput_service`). The service runs their findings through the policy;
:meth:`Advisors.refresh_goodput` sends the advice to the hooks that follow it.

Runs on the policy thread only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any

from forewarn.wire import AgentBatch, Finding

from ..storage.fence import NotLeaderError
from .costmodel import CheckpointCostTracker
from .goodput_service import AdviceSender, GoodputService
from .predict import PredictorService
from .scorer_state import ScorerSnapshots
from .stragglers import StragglerService

if TYPE_CHECKING:
    from ..jobs.jobview import JobView
    from .seam import DecideContext

__all__ = ["Advisors"]

TICK_WITHOUT_PREDICTOR_S = 10.0
"""How often goodput advice is refreshed when no predictor sets the pace."""


@dataclasses.dataclass
class Advisors:
    """Any of the predictor, the straggler detector and goodput (``None``: off);
    ``advice`` sends goodput's interval advice to the ranks (``None``: shadow mode or
    ``advise_hooks`` off); ``tracker``: the measured checkpoint costs the policy keeps."""

    tracker: CheckpointCostTracker
    predictor: PredictorService | None = None
    goodput: GoodputService | None = None
    stragglers: StragglerService | None = None
    advice: AdviceSender | None = None
    _ctx: DecideContext | None = dataclasses.field(default=None, init=False)

    @property
    def tick_s(self) -> float | None:
        """How often :meth:`due` work is checked (``None``: nothing to tick)."""
        if self.predictor is not None:
            return self.predictor.interval_s
        return TICK_WITHOUT_PREDICTOR_S if self.goodput is not None else None

    def start(self, ctx: DecideContext) -> None:
        """Register the predictor's and goodput's metrics; the predictor's learned state
        kept in the store (:mod:`.scorer_state`)."""
        self._ctx = ctx
        for part in (self.predictor, self.goodput):
            if part is not None:
                part.register(ctx.metrics.registry)
        if self.predictor is not None:
            self.predictor.keep_state(ScorerSnapshots(ctx.store), ctx.clock)

    def take_over(self) -> None:
        """This replica starts to lead: the predictor's learned state from the store."""
        if self.predictor is not None:
            self.predictor.take_over()

    def save_state(self, now: float) -> None:
        """Save the predictor's learned state when due (leader only)."""
        if self.predictor is not None:
            self.predictor.save_state(now)

    def stop(self, leading: bool) -> None:
        """The predictor's state written a last time (when ``leading``), its writer ended."""
        predictor = self.predictor
        if predictor is None or predictor.snapshots is None:
            return
        if leading:
            predictor.save_state(self._ctx.clock() if self._ctx else 0.0, wait=True)
        predictor.snapshots.close()

    def observe(self, batches: Sequence[AgentBatch], now: float) -> list[Finding]:
        """Samples and XIDs to the predictor, rank summaries to goodput and the peer
        comparison; the straggler findings when a comparison is due."""
        if self.predictor is not None:
            self.predictor.observe(batches)
        if self.goodput is not None:
            self.goodput.on_batches(batches)
        if self.stragglers is None:
            return []
        self.stragglers.observe(batches)
        return self.stragglers.findings(now) if self.stragglers.due(now) else []

    def on_findings(self, findings: Sequence[Finding], jobs: JobView) -> None:
        """Findings the policy sees: goodput notes when a job stopped."""
        if self.goodput is not None:
            self.goodput.on_findings(findings, jobs)

    def scoring_due(self, now: float) -> bool:
        """Whether the predictor should score the fleet now."""
        return self.predictor is not None and self.predictor.due(now)

    def score_parts(self, now: float) -> Generator[None, None, list[Finding]]:
        """The predictor's findings when a scoring is due (else none), in parts
        (:meth:`.PredictorService.score_parts`); :meth:`to_submit` picks those to pass on."""
        if self.predictor is None or not self.predictor.due(now):
            return []
        return (yield from self.predictor.score_parts(now))

    def to_submit(self, findings: list[Finding], now: float) -> list[Finding]:
        """Of a scoring's ``findings``, those to pass to the policy now
        (:meth:`.PredictorService.to_submit`)."""
        return [] if self.predictor is None else self.predictor.to_submit(findings, now)

    def refresh_goodput(self, now: float) -> None:
        """Recompute goodput advice with the job's cost, risk and the fleet failure rate;
        tell the job's agents when the advice changed (only while this replica leads; a
        stale leader's advice refused by the fence stays due)."""
        ctx, goodput, predictor = self._ctx, self.goodput, self.predictor
        if ctx is None or goodput is None:
            return
        goodput.refresh(
            now, ctx.jobs, self.tracker,
            risk=predictor.scores.job_risk if predictor is not None else None,
            gpu_mtbf_h=predictor.fleet_gpu_mtbf_h() if predictor is not None else None,
            horizon_s=predictor.horizon_s if predictor is not None else 3600.0,
        )
        if self.advice is not None and ctx.leader.is_leader:
            # Hooks that follow the advice save at the advised steps: tell the job's agents
            # (the leader alone: a GET on a follower, or on a replica that lost the lead,
            # only reports).
            queued = self.advice.due(goodput.advice, ctx.jobs, now)
            try:
                ctx.commands.enqueue_many(queued)
            except NotLeaderError:
                return  # counted and said by the fence; the advice stays due
            self.advice.sent(queued)

    def goodput_report(self, job: str | None, now: float) -> list[dict[str, Any]]:
        """``GET /api/v1/goodput``: goodput refreshed now, of ``job`` or of every job."""
        self.refresh_goodput(now)
        return self.goodput.report_for(job) if self.goodput is not None else []
