"""Rank hang: a rank that still beats but makes no step progress.

The timeout is learned per job: ``max(floor, factor × p99 step time of the job's ranks
on this node)`` (defaults: floor 2 s = AgentConfig.hang_floor_s, factor 3). NVIDIA's
resiliency extension learns 5× the longest gap and starts at 45-60 min; PyTorch's NCCL
watchdog fires after 10 min (docs/reference.md): a p99-derived timeout catches the same hang
in seconds. Before a rank has ``min_steps`` step times the startup timeout applies (data
loading and compilation are slow), and a rank that reported a checkpoint ``started`` is
given ``checkpoint_timeout_s`` to finish (saving is a legitimate stall).

A rank in a phase its hook marked (``with monitor.phase("eval")``: evaluation, data
loading, compilation, an unordered save) is timed from the phase's start against a bound
learned per phase: ``max(floor, factor × the longest earlier stay in that phase by any rank
of the job)``; the first stay gets the startup timeout. An 8 s evaluation pass is then no
hang, while the training steps keep their own bound. A rank that finished cleanly is
never hung.

A rank whose beats stopped too is not hung but gone (:mod:`.rank_gone`).
"""

from __future__ import annotations

from forewarn.agent.checks.common import RankCheck
from forewarn.agent.rank_state import RankView, by_job, quantile, rank_finding
from forewarn.agent.ranks import RankTable
from forewarn.agent.state import AgentState
from forewarn.wire import Finding, Health, SuggestedAction

__all__ = ["RankHangCheck", "hang_deadline", "hang_timeout"]


def hang_timeout(table: RankTable, job_views: list[RankView]) -> tuple[float, float | None]:
    """``(timeout_s, p99_s)`` for a job: ``max(floor, factor × p99)``, or the startup
    timeout while the job has fewer than ``min_steps`` step times."""
    lim = table.limits
    samples = [s for v in job_views for s in v.step_seconds]
    p99 = quantile(samples, 0.99)
    if p99 is None or len(samples) < lim.min_steps:
        return lim.startup_timeout_s, p99
    return max(lim.hang_floor_s, lim.hang_factor * p99), p99


def hang_deadline(table: RankTable, job_views: list[RankView], v: RankView,
                  timeout: float, now: float) -> tuple[float, float]:
    """``(since, limit)`` for rank ``v`` of a job whose step timeout is ``timeout``: the
    rank is hung once ``now - since > limit``."""
    lim = table.limits
    since = v.last_progress if v.last_progress is not None else v.first_seen
    started = None if v.phase_started is None else min(now, v.phase_started)
    if v.phase:
        longest = max((s for w in job_views for p, s in w.phase_longest if p == v.phase),
                      default=None)
        limit = (lim.startup_timeout_s if longest is None
                 else max(lim.hang_floor_s, lim.hang_factor * longest))
        since = started if started is not None else since
    else:
        limit = timeout
        if started is not None:
            since = max(since, started)  # the time of a phase just left is not a stall
    if v.checkpointing is not None and v.checkpoint_started is not None:
        limit = max(limit, v.checkpoint_started - since + lim.checkpoint_timeout_s)
    return since, limit


class RankHangCheck(RankCheck):
    """No step progress for longer than the job's learned timeout while beats arrive."""

    name = "rank_hang"

    def run(self, state: AgentState, now: float) -> list[Finding]:
        table = state.ranks
        if table is None:
            return []
        out = []
        for _job, views in by_job(table.views()).items():
            timeout, p99 = hang_timeout(table, views)
            for v in views:
                if not table.alive(v, now):
                    continue  # rank_gone judges it (a finished rank is not alive either)
                since, limit = hang_deadline(table, views, v, timeout, now)
                stalled = max(0.0, now - since)
                evidence = {"stalled_s": round(stalled, 3), "timeout_s": round(timeout, 3),
                            "p99_step_s": p99, "checkpointing": v.checkpointing is not None,
                            "phase": v.phase, "limit_s": round(limit, 3)}
                if stalled > limit:
                    out.append(rank_finding(
                        self.name, v, state.node, now, Health.UNHEALTHY,
                        f"rank {v.rank} of job {v.job} made no progress past step "
                        f"{v.last_step} for {stalled:.1f}s (timeout {limit:.1f}s = max(floor, "
                        f"{table.limits.hang_factor:g} x "
                        + (f"longest {v.phase} phase" if v.phase else "p99 step time")
                        + ")) while still beating: hung (a stuck collective or a deadlock); "
                        "it cannot checkpoint",
                        SuggestedAction.RESTART_JOB, evidence,
                    ))
                else:
                    out.append(rank_finding(
                        self.name, v, state.node, now, Health.HEALTHY,
                        f"rank {v.rank} of job {v.job} progressing", evidence=evidence,
                    ))
        return out
