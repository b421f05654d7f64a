"""What an agent may do: act on the jobs its own node hosts, nothing else.

A node's token authenticates one node (:mod:`..http.auth`), and :func:`~.batch.check_batch`
binds every node name in a batch to it. This module binds the *jobs*: a batch's rank
summaries, checkpoint reports and findings about a job are checked against the job map
(the ``ranks`` table, :mod:`..jobs.jobmap`) inside the ingest transaction, so the decision and
the write see the same map.

Rules, for a batch from node N:

* **Rank summaries** of ``(job, rank)``: applied when no node holds the rank yet or N
  does. When another node M holds it, a *live* summary from N takes the rank over only
  once M reported it gone (``alive`` false) or has not reported it for
  :data:`RANK_TAKEOVER_S` seconds (a job restarted with its ranks placed differently);
  before that it is ignored and counted (``rank_held``), never stored. A *dead* summary
  from N about a rank M holds is old news of N's and is ignored (``rank_moved``): without
  this rule the old node's reports of its dead rank would move the rank back.
* **Checkpoint reports** must be about a rank N holds (after this batch's summaries);
  a report about a rank whose takeover is waiting is ignored with it (``rank_held``).
* **Findings** naming a job (``subject.job``, for subjects of kind ``job`` and ``rank``,
  which order checkpoints of that job) must name a job N hosts a rank of, and for a
  ``rank`` subject that very rank. One that asks for nothing (``healthy`` or ``unknown``:
  the old node clearing its finding about a rank that has moved) is ignored instead
  (``other_node``); a degraded or unhealthy one is refused.

Anything else raises :class:`NotYourJob` naming the field: the whole batch is refused
with 403 and nothing of it is stored (``forewarn_collector_ingest_rejected_total
{reason="not_your_job"}``). Ignored records are counted in
``forewarn_collector_ingest_ignored_records_total{reason}``; the rest of their batch is
stored.
"""

from __future__ import annotations

import collections

import msgspec

from forewarn.errors import InputError
from forewarn.wire import AgentBatch, CheckpointReport, Finding, Health, RankSummary

from ..storage.state import Transaction

__all__ = ["RANK_TAKEOVER_S", "NotYourJob", "authorise_batch"]

RANK_TAKEOVER_S = 60.0
"""A rank whose node has not reported it for this long may be taken over by another
node (agents report their ranks every ``push_interval_s``, 5 s by default)."""

_Holder = tuple[str, bool, float]  # node, alive, collector time of its last report


class NotYourJob(InputError, ValueError):
    """A record acts on a job or rank the sending node does not host."""


def _holders(conn: Transaction, jobs: set[str]) -> dict[tuple[str, int], _Holder]:
    out: dict[tuple[str, int], _Holder] = {}
    for job in sorted(jobs):
        for row in conn.execute("SELECT rank, node, alive, updated FROM ranks WHERE job = ?",
                                (job,)).fetchall():
            out[(job, int(row[0]))] = (str(row[1]), bool(row[2]), float(row[3]))
    return out


def _claim(r: RankSummary, holder: _Holder | None, node: str, now: float) -> str:
    """``apply``, ``rank_held`` or ``rank_moved`` for one rank summary from ``node``."""
    if holder is None or holder[0] == node:
        return "apply"
    if not r.alive:
        return "rank_moved"
    _, alive, updated = holder
    if not alive or now - updated > RANK_TAKEOVER_S:
        return "apply"
    return "rank_held"


def authorise_batch(conn: Transaction, batch: AgentBatch, now: float
                    ) -> tuple[AgentBatch, dict[str, int]]:
    """``batch`` without the records its node may not apply, and how many were ignored
    by reason; raises :class:`NotYourJob` for a record acting on another node's job."""
    named = {f.subject.job for f in batch.findings if f.subject.job}
    jobs = {r.job for r in batch.ranks} | {c.job for c in batch.checkpoints} | named
    if not jobs:
        return batch, {}
    claims = _Claims(batch.node, _holders(conn, jobs))
    ranks = claims.take_ranks(batch.ranks, now)
    checkpoints = claims.checkpoints(batch.checkpoints)
    findings = claims.findings(batch.findings)
    if not claims.ignored:
        return batch, {}
    return msgspec.structs.replace(batch, ranks=ranks, checkpoints=checkpoints,
                                   findings=findings), dict(claims.ignored)


class _Claims:
    """Which ranks of the batch's jobs ``node`` holds (``mine``) or waits for while
    another live node holds them (``waiting``), and what was ignored by reason."""

    def __init__(self, node: str, held: dict[tuple[str, int], _Holder]) -> None:
        self.node = node
        self.held = held
        self.mine = {key for key, h in held.items() if h[0] == node}
        self.waiting: set[tuple[str, int]] = set()
        self.ignored: collections.Counter[str] = collections.Counter()

    def take_ranks(self, ranks: list[RankSummary], now: float) -> list[RankSummary]:
        """The rank summaries ``node`` may apply (it then holds those ranks)."""
        out = []
        for r in ranks:
            verdict = _claim(r, self.held.get((r.job, r.rank)), self.node, now)
            if verdict == "apply":
                out.append(r)
                self.mine.add((r.job, r.rank))
            else:
                self.ignored[verdict] += 1
                if verdict == "rank_held":
                    self.waiting.add((r.job, r.rank))
        return out

    def checkpoints(self, reports: list[CheckpointReport]) -> list[CheckpointReport]:
        """The checkpoint reports of ranks ``node`` holds."""
        out = []
        for i, c in enumerate(reports):
            if (c.job, c.rank) in self.mine:
                out.append(c)
            elif (c.job, c.rank) in self.waiting:
                self.ignored["rank_held"] += 1
            else:
                raise NotYourJob(f"$.checkpoints[{i}]: job {c.job!r} rank {c.rank} does not "
                                 f"run on node {self.node!r} ({self._where(c.job, c.rank)})")
        return out

    def findings(self, findings: list[Finding]) -> list[Finding]:
        """Findings about no job, or about a job (rank) ``node`` runs; a healthy or unknown
        finding about another node's job is ignored (it asks for nothing)."""
        out = []
        mine_jobs = {job for job, _ in self.mine}
        waiting_jobs = {job for job, _ in self.waiting}
        for i, f in enumerate(findings):
            s = f.subject
            if not s.job:
                out.append(f)
                continue
            if s.kind == "rank" and s.rank is not None:
                ok, wait = (s.job, s.rank) in self.mine, (s.job, s.rank) in self.waiting
            else:
                ok, wait = s.job in mine_jobs, s.job in waiting_jobs
            if ok:
                out.append(f)
            elif wait:
                self.ignored["rank_held"] += 1
            elif f.health in (Health.HEALTHY, Health.UNKNOWN):
                self.ignored["other_node"] += 1  # asks for nothing: never worth the batch
            else:
                rank = s.rank if s.kind == "rank" else None
                what = f"job {s.job!r}" + ("" if rank is None else f" rank {rank}")
                raise NotYourJob(f"$.findings[{i}].subject: {what} does not run on node "
                                 f"{self.node!r} ({self._where(s.job, rank)})")
        return out

    def _where(self, job: str, rank: int | None) -> str:
        nodes = sorted({h[0] for (j, r), h in self.held.items()
                        if j == job and (rank is None or r == rank)})
        return f"on {', '.join(map(repr, nodes))}" if nodes else "unknown to the job map"
