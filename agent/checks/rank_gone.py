"""Rank gone: the rank's process exited or its beats stopped.

Gone when no datagram came for ``beat_misses`` (3) beat intervals (the interval is learned
from the beats themselves) or when the pid no longer exists with the start time first seen
(``/proc/<pid>/stat``). A gone rank whose peers on this node are still alive leaves a job
that will hang at its next collective: unhealthy, restart the job. When every local rank of
a job is gone the job most likely finished (or was stopped): degraded, nothing to do. A
rank gone for less than ``grace_s`` while peers live is degraded: a job that is ending
loses its ranks within a moment of each other, not all in the same poll. A rank whose
hook said it finished cleanly (``Monitor.close()``, atexit) is healthy, never gone.
"""

from __future__ import annotations

from forewarn.agent.checks.common import RankCheck
from forewarn.agent.rank_state import by_job, rank_finding
from forewarn.agent.state import AgentState
from forewarn.wire import Finding, Health, SuggestedAction

__all__ = ["RankGoneCheck"]


class RankGoneCheck(RankCheck):
    """Beats stopped or the process is gone."""

    name = "rank_gone"

    def __init__(self, *, grace_s: float = 3.0) -> None:
        self.grace_s = grace_s
        self._gone_since: dict[tuple[str, int], float] = {}

    def run(self, state: AgentState, now: float) -> list[Finding]:
        table = state.ranks
        if table is None:
            return []
        out = []
        seen = set()
        for _job, views in by_job(table.views()).items():
            alive = {v.rank: table.alive(v, now) for v in views}
            for v in views:
                seen.add(v.key)
                silent = now - v.last_msg
                evidence = {"silent_s": round(silent, 3),
                            "gone_after_s": round(table.gone_after(v.beat_interval_s), 3)}
                if alive[v.rank] or v.finished:
                    self._gone_since.pop(v.key, None)
                    state_text = "finished cleanly" if v.finished else "alive"
                    out.append(rank_finding(self.name, v, state.node, now, Health.HEALTHY,
                                            f"rank {v.rank} of job {v.job} {state_text}",
                                            evidence=evidence))
                    continue
                since = self._gone_since.setdefault(v.key, now)
                peers = [r for r, a in alive.items() if a and r != v.rank]
                pid_gone = not table.proc.alive(v.os_pid, v.start_time)
                why = (f"process {v.os_pid} exited" if pid_gone
                       else f"no beat for {silent:.1f}s")
                if not peers:
                    out.append(rank_finding(
                        self.name, v, state.node, now, Health.DEGRADED,
                        f"rank {v.rank} of job {v.job} gone ({why}); no rank of the job is "
                        "alive on this node: finished or stopped", SuggestedAction.NONE, evidence))
                elif now - since < self.grace_s:
                    out.append(rank_finding(
                        self.name, v, state.node, now, Health.DEGRADED,
                        f"rank {v.rank} of job {v.job} gone ({why}); peers still alive",
                        SuggestedAction.WATCH, evidence))
                else:
                    out.append(rank_finding(
                        self.name, v, state.node, now, Health.UNHEALTHY,
                        f"rank {v.rank} of job {v.job} gone ({why}) while ranks "
                        f"{', '.join(map(str, peers))} still run: the job will hang at its next "
                        "collective", SuggestedAction.RESTART_JOB, evidence))
        for key in [k for k in self._gone_since if k not in seen]:
            del self._gone_since[key]
        return out
