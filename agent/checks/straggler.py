"""Straggler: a rank much slower than its peers of the same job on this node.

Each rank's pace is the median of its last ``window`` step times (``compute_seconds`` from
the step record's extras when the hook sends it: in synchronous data parallelism every
rank's wall step time is equal, because the fast ranks wait in the all-reduce, so only the
compute part tells who is slow). A rank is a straggler when its pace exceeds ``factor``
(1.5) × the median pace of its peers for ``continuity`` consecutive polls (the continuity
requirement of Minder, NSDI 2025, against one-off noise). Degraded, watch: the collector
compares across nodes and decides.
"""

from __future__ import annotations

from forewarn.agent.checks.common import RankCheck
from forewarn.agent.rank_state import RankView, by_job, quantile, rank_finding
from forewarn.agent.state import AgentState
from forewarn.wire import Finding, Health, SuggestedAction

__all__ = ["StragglerCheck"]


class StragglerCheck(RankCheck):
    """A rank's step (or compute) time above ``factor`` × its node peers' median."""

    name = "straggler"
    min_ranks = 2

    def __init__(self, *, factor: float = 1.5, window: int = 8, continuity: int = 3) -> None:
        self.factor = factor
        self.window = window
        self.continuity = continuity
        self._streak: dict[tuple[str, int], int] = {}

    def _pace(self, v: RankView) -> float | None:
        series = v.compute_seconds if len(v.compute_seconds) >= self.window else v.step_seconds
        if len(series) < self.window:
            return None
        return quantile(series[-self.window :], 0.5)

    def run(self, state: AgentState, now: float) -> list[Finding]:
        table = state.ranks
        if table is None:
            return []
        out = []
        seen = set()
        for _job, views in by_job(table.views()).items():
            paces = {v.rank: self._pace(v) for v in views if table.alive(v, now)}
            known = {r: p for r, p in paces.items() if p is not None}
            if len(known) < 2:
                continue
            for v in views:
                pace = known.get(v.rank)
                if pace is None:
                    continue
                seen.add(v.key)
                peers = quantile([p for r, p in known.items() if r != v.rank], 0.5) or 0.0
                ratio = pace / peers if peers > 0 else 1.0
                slow = ratio > self.factor
                streak = self._streak.get(v.key, 0) + 1 if slow else 0
                self._streak[v.key] = streak
                evidence = {"pace_s": pace, "peers_pace_s": peers, "ratio": round(ratio, 3),
                            "streak": streak}
                if streak >= self.continuity:
                    out.append(rank_finding(
                        self.name, v, state.node, now, Health.DEGRADED,
                        f"rank {v.rank} of job {v.job} steps in {pace:.3g}s, {ratio:.2f}x its "
                        f"node peers' median {peers:.3g}s for {streak} polls",
                        SuggestedAction.WATCH, evidence))
                else:
                    out.append(rank_finding(
                        self.name, v, state.node, now, Health.HEALTHY,
                        f"rank {v.rank} of job {v.job} keeps pace ({ratio:.2f}x peers)",
                        evidence=evidence))
        for key in [k for k in self._streak if k not in seen]:
            del self._streak[key]
        return out
