"""Agent batch ingest: validate, then store exactly once with group commit.

:func:`check_batch` decodes and bounds a request body; :class:`IngestWriter` owns a thread
that takes queued batches (urgent ones first), writes up to ``group_commit_max`` of them in
ONE SQLite transaction (one fsync for the group) and only then answers each request: a
batch is acknowledged only once it is durable. ``(agent_id, seq)`` is the primary key of
``batches``: a batch seen before is answered ``duplicate`` and stores nothing, so an agent
that never got its answer simply sends the batch again.

Per batch, inside the transaction: its jobs authorised against the job map
(:mod:`forewarn.collector.authz`: another node's job is refused with 403, a rank another
node holds is not applied); the ``batches`` row; the body in ``staged_samples``
(GPU samples go on to Parquet, :mod:`forewarn.collector.telemetry`); the latest sample
per GPU in ``gpus``; XIDs; findings (GPU findings also set that GPU's health); rank
summaries and checkpoint reports (the job map, :mod:`forewarn.collector.jobs`); the node.
"""

from __future__ import annotations

import collections
import concurrent.futures
import enum
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence

import msgspec

from forewarn.collector.authz import NotYourJob, authorise_batch
from forewarn.collector.jobs import apply_checkpoints, apply_ranks
from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.staging import StagingLog
from forewarn.collector.store import Store
from forewarn.wire import AgentBatch, Finding, GpuSample, Health, WireError

__all__ = ["IngestError", "IngestResult", "IngestWriter", "check_batch", "store_findings"]

log = logging.getLogger(__name__)

_batch_decoder = msgspec.msgpack.Decoder(AgentBatch)
_LISTS = ("samples", "xids", "findings", "ranks", "checkpoints")


class IngestError(ValueError):
    """A request was refused; ``status`` is the HTTP status, the message names the problem."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class IngestResult(enum.StrEnum):
    STORED = "stored"
    DUPLICATE = "duplicate"


def check_batch(body: bytes, *, node: str, max_items: int) -> AgentBatch:
    """Decode ``body`` as an :class:`AgentBatch` sent by ``node``'s agent and check limits.

    Raises :class:`IngestError` (400 bad record, 403 another node's batch, 413 a list
    longer than ``max_items``).
    """
    try:
        batch = _batch_decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise IngestError(400, "decode", str(WireError(f"invalid AgentBatch: {exc}"))) from None
    for name in _LISTS:
        n = len(getattr(batch, name))
        if n > max_items:
            raise IngestError(413, "limits",
                              f"$.{name}: {n} items, more than the limit of {max_items}")
    if batch.node != node:
        raise IngestError(403, "node_mismatch",
                          f"$.node: token is for node {node!r}, batch says {batch.node!r}")
    for name in ("samples", "xids", "ranks"):
        for i, item in enumerate(getattr(batch, name)):
            if item.node != node:
                raise IngestError(403, "node_mismatch",
                                  f"$.{name}[{i}].node: {item.node!r} is not this agent's "
                                  f"node {node!r}")
    # An agent speaks for its own node only: a finding about another node's GPU would let
    # one compromised agent order checkpoints or drains elsewhere.
    for i, f in enumerate(batch.findings):
        if f.subject.node not in ("", node):
            raise IngestError(403, "node_mismatch",
                              f"$.findings[{i}].subject.node: {f.subject.node!r} is not this "
                              f"agent's node {node!r}")
    return batch


_FINDING_INSERT = (
    "INSERT INTO findings (time, received, node, origin, check_name, health, subject_kind,"
    " subject_key, subject_node, gpu, job, rank, reason, action, probability, horizon_s,"
    " simulated, body) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


_WORST_HEALTH = (
    "SELECT f.health, f.reason, f.time FROM findings f JOIN (SELECT MAX(id) AS id FROM findings"
    " WHERE subject_key = ? GROUP BY check_name) m ON f.id = m.id WHERE f.health != 'unknown'"
)
_RANK = {Health.HEALTHY.value: 0, Health.DEGRADED.value: 1, Health.UNHEALTHY.value: 2}


def store_findings(conn: sqlite3.Connection, findings: Sequence[Finding], *, node: str,
                   origin: str, received: float) -> None:
    """Insert findings (inside the caller's transaction); GPU findings set GPU health."""
    if not findings:
        return
    conn.executemany(_FINDING_INSERT, [
        (f.time, received, node, origin, f.check, f.health.value, f.subject.kind,
         f.subject.key(), f.subject.node, f.subject.gpu, f.subject.job, f.subject.rank,
         f.reason, f.action.value, f.probability, f.horizon_s, int(f.simulated),
         msgspec.json.encode(f).decode())
        for f in findings
    ])
    gpus = {(f.subject.node or node, f.subject.gpu, f.subject.key()) for f in findings
            if f.subject.kind == "gpu" and f.subject.gpu is not None}
    for gpu_node, gpu, key in gpus:
        # A GPU is as healthy as its worst current check: the newest finding of each check
        # (``unknown`` = that check cannot tell, so it does not count).
        rows = conn.execute(_WORST_HEALTH, (key,)).fetchall()
        worst = max(rows, key=lambda r: (_RANK.get(r[0], 0), r[2]), default=None)
        if worst is not None:
            conn.execute("UPDATE gpus SET health = ?, health_reason = ?, health_time = ?"
                         " WHERE node = ? AND gpu = ?", (*worst, gpu_node, gpu))


_GPU_UPSERT = """
INSERT INTO gpus (node, gpu, uuid, name, pci_bus_id, state, source, simulated, last_seen,
    temperature_c, power_w, gpu_util_pct) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (node, gpu) DO UPDATE SET uuid=excluded.uuid, name=excluded.name,
    pci_bus_id=excluded.pci_bus_id, state=excluded.state, source=excluded.source,
    simulated=excluded.simulated, last_seen=excluded.last_seen,
    temperature_c=excluded.temperature_c, power_w=excluded.power_w,
    gpu_util_pct=excluded.gpu_util_pct
WHERE excluded.last_seen >= gpus.last_seen
"""

_NODE_UPSERT = """
INSERT INTO nodes (node, agent_id, first_seen, last_seen, last_seq, batches, samples, address)
VALUES (?, ?, ?, ?, ?, 1, ?, ?)
ON CONFLICT (node) DO UPDATE SET agent_id=excluded.agent_id, last_seen=excluded.last_seen,
    last_seq=excluded.last_seq, batches=nodes.batches + 1,
    samples=nodes.samples + excluded.samples, address=excluded.address
"""


def _write_batch(conn: sqlite3.Connection, batch: AgentBatch, body: bytes, received: float,
                 address: str, ref: tuple[int, int, int] | None = None
                 ) -> tuple[bool, int | None]:
    """Store one batch; (stored, id of its staged_samples row). ``ref`` is where the
    staging log holds the body; without it the body goes into the row."""
    cur = conn.execute(
        "INSERT OR IGNORE INTO batches (agent_id, seq, node, created, received, urgent,"
        " samples, xids, findings, ranks, checkpoints) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
        (batch.agent_id, batch.seq, batch.node, batch.created, received, int(batch.urgent),
         len(batch.samples), len(batch.xids), len(batch.findings), len(batch.ranks),
         len(batch.checkpoints)),
    )
    if cur.rowcount == 0:
        return False, None
    staged_id = None
    if batch.samples:
        segment, offset, length = ref if ref is not None else (None, None, None)
        staged = conn.execute(
            "INSERT INTO staged_samples (agent_id, seq, samples, body, segment, offset, length)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (batch.agent_id, batch.seq, len(batch.samples), b"" if ref else body, segment,
             offset, length))
        staged_id = staged.lastrowid
        latest: dict[int, GpuSample] = {}
        for s in batch.samples:
            seen = latest.get(s.gpu)
            if seen is None or s.time >= seen.time:
                latest[s.gpu] = s
        conn.executemany(_GPU_UPSERT, [
            (s.node, s.gpu, s.uuid, s.name, s.pci_bus_id, s.state.value, s.source,
             int(s.simulated), s.time, s.temperature_c, s.power_w, s.gpu_util_pct)
            for s in latest.values()
        ])
    if batch.xids:
        conn.executemany(
            "INSERT INTO xids (node, gpu, pci_bus_id, code, text, time, source, simulated)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [(x.node, x.gpu, x.pci_bus_id, x.code, x.text, x.time, x.source, int(x.simulated))
             for x in batch.xids])
    store_findings(conn, batch.findings, node=batch.node, origin=f"agent:{batch.node}",
                   received=received)
    apply_ranks(conn, batch.ranks, received)
    apply_checkpoints(conn, batch.node, batch.checkpoints)
    conn.execute(_NODE_UPSERT, (batch.node, batch.agent_id, received, received, batch.seq,
                                len(batch.samples), address))
    return True, staged_id


class _Item:
    __slots__ = ("address", "batch", "body", "future", "received")

    def __init__(self, batch: AgentBatch, body: bytes, received: float, address: str) -> None:
        self.batch = batch
        self.body = body
        self.received = received
        self.address = address
        self.future: concurrent.futures.Future[IngestResult] = concurrent.futures.Future()


class IngestWriter:
    """The single writer thread with group commit. See the module docstring."""

    def __init__(
        self,
        store: Store,
        metrics: CollectorMetrics,
        *,
        group_max: int = 256,
        on_stored: Callable[[list[AgentBatch]], None] | None = None,
        on_staged: Callable[[list[tuple[int, str, int, list[GpuSample]]]], None] | None = None,
        staging: StagingLog | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.group_max = group_max
        self.on_stored = on_stored
        self.on_staged = on_staged
        self.staging = staging
        self.clock = clock
        self._queue: collections.deque[_Item] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="forewarn-ingest", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """The writer thread runs (for /readyz)."""
        return self._thread.is_alive()

    @property
    def queued(self) -> int:
        """Batches waiting to be committed."""
        return len(self._queue)

    def submit(self, batch: AgentBatch, body: bytes, *, address: str = ""
               ) -> concurrent.futures.Future[IngestResult]:
        """Queue ``batch`` (urgent ones ahead of the rest); the future resolves once it is
        committed (or found to be a duplicate)."""
        item = _Item(batch, body, self.clock(), address)
        with self._cond:
            if self._stopping:
                raise IngestError(503, "store", "collector is shutting down")
            if batch.urgent:
                self._queue.appendleft(item)
            else:
                self._queue.append(item)
            self._cond.notify()
        return item.future

    def stop(self, timeout: float = 30.0) -> None:
        """Finish what is queued, then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue and self._stopping:
                    return
                group = [self._queue.popleft()
                         for _ in range(min(self.group_max, len(self._queue)))]
            self._commit(group)

    def _commit(self, group: list[_Item]) -> None:
        started = time.perf_counter()
        results: list[IngestResult] = []
        staged: list[tuple[int, str, int, list[GpuSample]]] = []
        refs: dict[int, tuple[int, int, int]] = {}
        ignored: dict[int, dict[str, int]] = {}  # records not applied, by reason
        try:
            if self.staging is not None:
                # Bodies first, one fsync for the group; the transaction then points at them.
                with_samples = [i for i, item in enumerate(group) if item.batch.samples]
                written = self.staging.append([group[i].body for i in with_samples])
                refs = dict(zip(with_samples, written, strict=True))
            with self.store.write() as conn:
                for index, item in enumerate(group):
                    conn.execute("SAVEPOINT b")
                    try:
                        # Jobs are authorised against the map this transaction writes.
                        item.batch, ignored[index] = authorise_batch(conn, item.batch,
                                                                     item.received)
                        stored, staged_id = _write_batch(conn, item.batch, item.body,
                                                         item.received, item.address,
                                                         refs.get(index))
                    except NotYourJob as exc:
                        conn.execute("ROLLBACK TO b")
                        conn.execute("RELEASE b")
                        results.append(IngestResult.DUPLICATE)
                        item.future.set_exception(IngestError(403, "not_your_job", str(exc)))
                        continue
                    except sqlite3.IntegrityError as exc:
                        conn.execute("ROLLBACK TO b")
                        conn.execute("RELEASE b")
                        results.append(IngestResult.DUPLICATE)
                        log.warning("batch %s/%s refused by the store: %s",
                                    item.batch.agent_id, item.batch.seq, exc)
                        item.future.set_exception(
                            IngestError(422, "store", f"batch not storable: {exc}"))
                        continue
                    conn.execute("RELEASE b")
                    if staged_id is not None:
                        staged.append((staged_id, item.batch.agent_id, item.batch.seq,
                                       item.batch.samples))
                    results.append(IngestResult.STORED if stored else IngestResult.DUPLICATE)
        except Exception as exc:
            log.exception("group commit of %d batches failed", len(group))
            for item in group:
                if not item.future.done():
                    item.future.set_exception(
                        IngestError(503, "store", f"store unavailable: {exc}"))
            return
        self.metrics.commit_seconds.observe(time.perf_counter() - started)
        if staged and self.on_staged is not None:
            self.on_staged(staged)  # committed: the flush may use the decoded samples
        self.metrics.group_size.observe(len(group))
        stored_batches = []
        for index, (item, result) in enumerate(zip(group, results, strict=True)):
            if item.future.done():
                continue
            self.metrics.batches.labels(result.value).inc()
            if result is IngestResult.STORED:
                b = item.batch
                stored_batches.append(b)
                for reason, n in ignored.get(index, {}).items():
                    self.metrics.ignored_records.labels(reason).inc(n)
                self.metrics.samples.inc(len(b.samples))
                self.metrics.xids.inc(len(b.xids))
                self.metrics.bytes.inc(len(item.body))
                self.metrics.lag.observe(max(0.0, item.received - b.created))
                for f in b.findings:
                    self.metrics.findings.labels(f.health.value, "agent").inc()
            item.future.set_result(result)
        if stored_batches and self.on_stored is not None:
            try:
                self.on_stored(stored_batches)
            except Exception:
                log.exception("on_stored hook failed")


def finding_rows_json(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """Expand the stored JSON body of finding rows (for the read API)."""
    for row in rows:
        body = row.pop("body", None)
        if isinstance(body, str):
            row["finding"] = json.loads(body)
    return rows
