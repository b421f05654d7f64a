"""The job map: which ranks of which job run on which node and GPU.

Built from the agents' :class:`~forewarn.wire.RankSummary` reports, so a finding about
GPU 3 of node 7 becomes a decision about every job using it (:func:`jobs_on`).
A job's ranks are those of its newest rendezvous round: a live rank reporting another
world size than the job's rows (torchrun elastic shrink or grow) replaces the rows of
the previous round at once, and a report from a rank of a previous round (a node's agent
that still holds a departed rank) is not stored (:func:`current_round`).
The ``apply_*`` functions run inside the ingest transaction; the queries read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from forewarn.wire import CheckpointReport, RankSummary

from ..storage.state import StateStore, Transaction
from .jobview import JobInfo

__all__ = [
    "StoreJobView",
    "apply_checkpoints",
    "apply_ranks",
    "current_round",
    "job_detail",
    "job_nodes",
    "jobs_on",
    "list_jobs",
    "numerics_state",
]

_RANK_UPSERT = """
INSERT INTO ranks (job, rank, node, gpu, local_rank, world_size, pid, last_step,
    last_step_time, last_beat, step_seconds_p50, step_seconds_p99, loss, grad_norm, alive,
    last_checkpoint_step, last_checkpoint_time, checkpoint_seconds, updated, finished, phase)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (job, rank) DO UPDATE SET node=excluded.node, gpu=excluded.gpu,
    local_rank=excluded.local_rank, world_size=excluded.world_size, pid=excluded.pid,
    last_step=excluded.last_step, last_step_time=excluded.last_step_time,
    last_beat=excluded.last_beat, step_seconds_p50=excluded.step_seconds_p50,
    step_seconds_p99=excluded.step_seconds_p99, loss=excluded.loss,
    grad_norm=excluded.grad_norm, alive=excluded.alive,
    last_checkpoint_step=COALESCE(excluded.last_checkpoint_step, ranks.last_checkpoint_step),
    last_checkpoint_time=COALESCE(excluded.last_checkpoint_time, ranks.last_checkpoint_time),
    checkpoint_seconds=COALESCE(excluded.checkpoint_seconds, ranks.checkpoint_seconds),
    updated=excluded.updated, finished=excluded.finished, phase=excluded.phase
"""

_JOB_UPSERT = """
INSERT INTO jobs (job, world_size, first_seen, last_seen, last_step, last_checkpoint_step,
    last_checkpoint_time, checkpoint_seconds)
VALUES (?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (job) DO UPDATE SET world_size=excluded.world_size,
    last_seen=MAX(jobs.last_seen, excluded.last_seen),
    last_step=MAX(COALESCE(jobs.last_step, 0), COALESCE(excluded.last_step, 0)),
    last_checkpoint_step=COALESCE(excluded.last_checkpoint_step, jobs.last_checkpoint_step),
    last_checkpoint_time=COALESCE(excluded.last_checkpoint_time, jobs.last_checkpoint_time),
    checkpoint_seconds=COALESCE(excluded.checkpoint_seconds, jobs.checkpoint_seconds)
"""


def _finite(x: float | None) -> float | None:
    # SQLite stores NaN as NULL anyway; keep Inf out of JSON answers too.
    if x is None or x != x or x in (float("inf"), float("-inf")):
        return None
    return x


_SPOKE = "MAX(COALESCE(last_beat, 0), COALESCE(last_step_time, 0))"
"""When a stored rank last spoke (its own clock, as :func:`_spoke`)."""


def _spoke(r: RankSummary) -> float:
    return max(r.last_beat or 0.0, r.last_step_time or 0.0)


def current_round(conn: Transaction, ranks: Sequence[RankSummary]
                  ) -> list[RankSummary]:
    """Apply the job's round to its rows, returning the summaries still worth storing.

    A summary whose job has a live rank of another world size that spoke after it comes
    from a previous round: dropped. A live summary drops the job's rows of another world
    size that spoke before it (the previous round's ranks, wherever they ran)."""
    out = []
    for r in ranks:
        newer = conn.execute(
            f"SELECT 1 FROM ranks WHERE job = ? AND world_size != ? AND alive = 1"
            f" AND {_SPOKE} > ? LIMIT 1", (r.job, r.world_size, _spoke(r))).fetchone()
        if newer is not None:
            continue
        if r.alive:
            conn.execute(f"DELETE FROM ranks WHERE job = ? AND world_size != ? AND {_SPOKE} <= ?",
                         (r.job, r.world_size, _spoke(r)))
        out.append(r)
    return out


def apply_ranks(conn: Transaction, ranks: Sequence[RankSummary], now: float) -> None:
    """Upsert rank rows and their jobs (inside the caller's transaction)."""
    ranks = current_round(conn, ranks)
    if not ranks:
        return
    conn.executemany(_RANK_UPSERT, [
        (r.job, r.rank, r.node, r.gpu, r.local_rank, r.world_size, r.pid, r.last_step,
         r.last_step_time, r.last_beat, r.step_seconds_p50, r.step_seconds_p99,
         _finite(r.loss), _finite(r.grad_norm), int(r.alive), r.last_checkpoint_step,
         r.last_checkpoint_time, r.checkpoint_seconds, now, int(r.finished), r.phase)
        for r in ranks
    ])
    jobs: dict[str, RankSummary] = {}
    for r in ranks:
        seen = jobs.get(r.job)
        if seen is None or (r.last_step or 0) > (seen.last_step or 0):
            jobs[r.job] = r
    conn.executemany(_JOB_UPSERT, [
        (r.job, r.world_size, now, now, r.last_step, r.last_checkpoint_step,
         r.last_checkpoint_time, r.checkpoint_seconds)
        for r in jobs.values()
    ])


def apply_checkpoints(conn: Transaction, node: str,
                      reports: Sequence[CheckpointReport]) -> None:
    """Store checkpoint reports; a ``done`` report advances the job's last checkpoint."""
    if not reports:
        return
    conn.executemany(
        "INSERT INTO checkpoints (job, rank, node, request_id, step, phase, seconds, bytes,"
        " time, path) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [(c.job, c.rank, node, c.request_id, c.step, c.phase, c.seconds, c.bytes, c.time,
          c.path) for c in reports],
    )
    for c in reports:
        if c.phase != "done":
            continue
        conn.execute(
            "INSERT INTO jobs (job, world_size, first_seen, last_seen, last_checkpoint_step,"
            " last_checkpoint_time, checkpoint_seconds) VALUES (?, 1, ?, ?, ?, ?, ?)"
            " ON CONFLICT (job) DO UPDATE SET"
            " last_checkpoint_step = MAX(COALESCE(jobs.last_checkpoint_step, 0),"
            "                            excluded.last_checkpoint_step),"
            " last_checkpoint_time = MAX(COALESCE(jobs.last_checkpoint_time, 0),"
            "                            excluded.last_checkpoint_time),"
            " checkpoint_seconds = COALESCE(excluded.checkpoint_seconds, jobs.checkpoint_seconds)",
            (c.job, c.time, c.time, c.step, c.time, c.seconds),
        )
        conn.execute(
            "UPDATE ranks SET last_checkpoint_step = ?, last_checkpoint_time = ?,"
            " checkpoint_seconds = COALESCE(?, checkpoint_seconds) WHERE job = ? AND rank = ?",
            (c.step, c.time, c.seconds, c.job, c.rank),
        )


def jobs_on(store: StateStore, node: str, gpu: int | None = None) -> list[str]:
    """Jobs with a rank on ``node`` (on GPU ``gpu`` when given; a rank whose GPU is
    unknown counts as on every GPU of its node)."""
    if gpu is None:
        rows = store.query("SELECT DISTINCT job FROM ranks WHERE node = ? ORDER BY job", (node,))
    else:
        rows = store.query(
            "SELECT DISTINCT job FROM ranks WHERE node = ? AND (gpu = ? OR gpu IS NULL)"
            " ORDER BY job", (node, gpu))
    return [str(r["job"]) for r in rows]


def job_nodes(store: StateStore, job: str) -> list[str]:
    """Nodes that run at least one rank of ``job``: where its checkpoint order must go."""
    rows = store.query("SELECT DISTINCT node FROM ranks WHERE job = ? ORDER BY node", (job,))
    return [str(r["node"]) for r in rows]


_JOB_LIST = """
SELECT j.*, COUNT(r.rank) AS ranks, COUNT(DISTINCT r.node) AS nodes,
    COALESCE(SUM(r.alive), 0) AS alive, COALESCE(SUM(r.finished), 0) AS finished
FROM jobs j LEFT JOIN ranks r ON r.job = j.job GROUP BY j.job ORDER BY j.job
"""

_GPU_SEVERITY = """
SELECT r.job, CASE WHEN g.node IS NULL THEN 1 WHEN g.state != 'ok' THEN 3
    WHEN g.health = 'unhealthy' THEN 3 WHEN g.health = 'degraded' THEN 2
    WHEN g.health = 'healthy' THEN 0 ELSE 1 END AS severity,
    r.node || '/' || r.gpu AS gpu
FROM ranks r LEFT JOIN gpus g ON g.node = r.node AND g.gpu = r.gpu
WHERE r.gpu IS NOT NULL ORDER BY r.job, r.rank
"""
"""The severity of every job's GPUs: a GPU that stopped answering is unhealthy whatever
its checks last said, a GPU nothing is known about yet is unknown (the same rule as the
status page's grid). The worst per job is picked in Python (a bare column beside MAX is
SQLite's, not PostgreSQL's)."""

_HEALTH_OF = ("healthy", "unknown", "degraded", "unhealthy")


def _state(alive: int, finished: int, ranks: int) -> str:
    """``running`` while a rank is alive, ``finished`` once every rank ended cleanly
    (``RankSummary.finished``), else ``stopped`` (ranks gone without saying so)."""
    if alive > 0:
        return "running"
    return "finished" if ranks > 0 and finished == ranks else "stopped"


def _worst_gpus(store: StateStore) -> dict[str, tuple[int, str]]:
    """Per job, (severity, ``node/gpu``) of its worst GPU (the lowest rank's on a tie)."""
    worst: dict[str, tuple[int, str]] = {}
    for r in store.query(_GPU_SEVERITY):
        job, severity = str(r["job"]), int(r["severity"])
        if job not in worst or severity > worst[job][0]:
            worst[job] = (severity, str(r["gpu"]))
    return worst


def list_jobs(store: StateStore) -> list[dict[str, Any]]:
    """Every job with its rank and node counts, its ``state`` (:func:`_state`), ranks
    ``alive`` and ``finished``, and ``health``: the worst of its GPUs' (``worst_gpu`` names
    one, ``node/gpu``)."""
    worst = _worst_gpus(store)
    rows = store.query(_JOB_LIST)
    for row in rows:
        h = worst.get(str(row["job"]))
        row["state"] = _state(int(row["alive"]), int(row["finished"]), int(row["ranks"]))
        row["health"] = _HEALTH_OF[h[0]] if h is not None else "unknown"
        row["worst_gpu"] = h[1] if h is not None else ""
    return rows


def numerics_state(store: StateStore, job: str) -> dict[str, Any] | None:
    """The job's bad numerics as the policy saw them (its ``hold`` actions, shadow ones
    too), or None: ``onset_step`` (first suspect step), ``held_from_step`` (where the
    ranks stop saving; None in shadow mode), ``last_good_step`` (the newest checkpoint
    before the onset: what a restart should resume from), ``since`` (time) and ``check``."""
    rows = store.query("SELECT time, status, subject, detail FROM actions WHERE job = ?"
                       " AND kind = 'hold' ORDER BY time, id", (job,))
    onsets: list[int] = []
    holds: dict[Any, int] = {}
    for r in rows:
        detail = json.loads(r["detail"])
        if isinstance(detail.get("onset_step"), int):
            onsets.append(detail["onset_step"])
        if r["status"] in ("ordered", "reissued") and isinstance(detail.get("step"), int):
            holds.pop(detail.get("replaces"), None)  # a re-issued hold moves its step
            holds[detail.get("request_id")] = detail["step"]
    if not onsets:
        return None
    onset = min(onsets)
    # reports of finished saves, and what the ranks say they saved last (a rank reports
    # its newest checkpoint; one from before the onset is good)
    good = store.query(
        "SELECT MAX(step) AS step FROM (SELECT step FROM checkpoints WHERE job = ? AND"
        " phase = 'done' AND step < ? UNION ALL SELECT last_checkpoint_step FROM ranks"
        " WHERE job = ? AND last_checkpoint_step < ?) AS good", (job, onset, job, onset))
    return {"onset_step": onset, "held_from_step": min(holds.values()) if holds else None,
            "last_good_step": good[0]["step"] if good else None,
            "since": rows[0]["time"], "subject": rows[0]["subject"]}


def job_detail(store: StateStore, job: str) -> dict[str, Any] | None:
    """One job, its ranks (node, GPU, progress), its latest checkpoint reports and its bad
    numerics (:func:`numerics_state`: the last good step)."""
    rows = store.query("SELECT * FROM jobs WHERE job = ?", (job,))
    if not rows:
        return None
    out = rows[0]
    out["ranks"] = store.query("SELECT * FROM ranks WHERE job = ? ORDER BY rank", (job,))
    out["nodes"] = job_nodes(store, job)
    out["checkpoints"] = store.query(
        "SELECT * FROM checkpoints WHERE job = ? ORDER BY time DESC, id DESC LIMIT 200", (job,))
    out["numerics"] = numerics_state(store, job)
    return out


_RANK_FIELDS = ("job", "rank", "local_rank", "world_size", "node", "gpu", "pid", "last_step",
                "last_step_time", "last_beat", "step_seconds_p50", "step_seconds_p99", "loss",
                "grad_norm", "last_checkpoint_step", "last_checkpoint_time",
                "checkpoint_seconds", "phase")


def _summary(row: dict[str, Any]) -> RankSummary:
    values = {k: row[k] for k in _RANK_FIELDS}
    return RankSummary(alive=bool(row["alive"]), finished=bool(row["finished"]), **values)


class StoreJobView:
    """The job map in SQLite as a :class:`forewarn.collector.jobs.jobview.JobView` (what the
    policy and the order book read). Snapshots; safe from any thread."""

    def __init__(self, store: StateStore) -> None:
        self.store = store

    def jobs_on(self, node: str, gpu: int | None = None) -> list[str]:
        return jobs_on(self.store, node, gpu)

    def job(self, job: str) -> JobInfo | None:
        head = self.store.query("SELECT first_seen FROM jobs WHERE job = ?", (job,))
        rows = self.store.query("SELECT * FROM ranks WHERE job = ? ORDER BY rank", (job,))
        if not rows:
            return None
        first_seen = float(head[0]["first_seen"]) if head else float(rows[0]["updated"])
        return JobInfo(job=job, ranks=tuple(_summary(r) for r in rows), first_seen=first_seen)

    def node_count(self) -> int:
        return int(self.store.scalar(
            "SELECT COUNT(*) FROM (SELECT node FROM nodes UNION SELECT node FROM ranks) AS u") or 0)

    def job_count(self) -> int:
        return int(self.store.scalar("SELECT COUNT(DISTINCT job) FROM ranks") or 0)

    def resolve_uuid(self, uuid: str) -> tuple[str, int] | None:
        if not uuid:
            return None
        rows = self.store.query("SELECT node, gpu FROM gpus WHERE uuid = ? ORDER BY last_seen"
                                " DESC LIMIT 1", (uuid,))
        return (str(rows[0]["node"]), int(rows[0]["gpu"])) if rows else None
