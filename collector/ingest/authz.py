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
from forewarn.wire import AgentBatch, Health, RankSummary

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
    node = batch.node
    held = _holders(conn, jobs)
    ignored: collections.Counter[str] = collections.Counter()
    ranks: list[RankSummary] = []
    waiting: set[tuple[str, int]] = set()
    mine = {key for key, h in held.items() if h[0] == node}
    for r in batch.ranks:
        verdict = _claim(r, held.get((r.job, r.rank)), node, now)
        if verdict == "apply":
            ranks.append(r)
            mine.add((r.job, r.rank))
        else:
            ignored[verdict] += 1
            if verdict == "rank_held":
                waiting.add((r.job, r.rank))
    mine_jobs = {job for job, _ in mine}
    waiting_jobs = {job for job, _ in waiting}

    def where(job: str, rank: int | None) -> str:
        nodes = sorted({h[0] for (j, r), h in held.items()
                        if j == job and (rank is None or r == rank)})
        return f"on {', '.join(map(repr, nodes))}" if nodes else "unknown to the job map"

    checkpoints = []
    for i, c in enumerate(batch.checkpoints):
        if (c.job, c.rank) in mine:
            checkpoints.append(c)
        elif (c.job, c.rank) in waiting:
            ignored["rank_held"] += 1
        else:
            raise NotYourJob(f"$.checkpoints[{i}]: job {c.job!r} rank {c.rank} does not run on "
                             f"node {node!r} ({where(c.job, c.rank)})")
    findings = []
    for i, f in enumerate(batch.findings):
        s = f.subject
        if not s.job:
            findings.append(f)
            continue
        if s.kind == "rank" and s.rank is not None:
            ok, wait = (s.job, s.rank) in mine, (s.job, s.rank) in waiting
        else:
            ok, wait = s.job in mine_jobs, s.job in waiting_jobs
        if ok:
            findings.append(f)
        elif wait:
            ignored["rank_held"] += 1
        elif f.health in (Health.HEALTHY, Health.UNKNOWN):
            ignored["other_node"] += 1  # asks for nothing: never worth the batch
        else:
            rank = s.rank if s.kind == "rank" else None
            what = f"job {s.job!r}" + ("" if rank is None else f" rank {rank}")
            raise NotYourJob(f"$.findings[{i}].subject: {what} does not run on node "
                             f"{node!r} ({where(s.job, rank)})")
    if not ignored:
        return batch, {}
    return msgspec.structs.replace(batch, ranks=ranks, checkpoints=checkpoints,
                                   findings=findings), dict(ignored)
