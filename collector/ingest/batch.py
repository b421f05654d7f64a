"""Agent batch ingest: store exactly once with group commit, after :mod:`.validate` checked
the body (:func:`accept_batch` is the one path of HTTP and the NATS bus).

:class:`IngestWriter` owns a thread that takes queued batches (urgent ones first, each kind
in order), writes up to ``group_commit_max`` of them in ONE SQLite transaction (one fsync
for the group) and only then answers each request: a batch is acknowledged only once it
is durable. Urgent batches form groups of their own, and a telemetry group is committed
early, at a batch boundary, when an urgent batch or another transaction waits
(:meth:`IngestWriter._make_way`), so a finding waits for one batch's write, not a group's.
``(agent_id, seq)`` is the primary key of ``batches``: a batch seen before is answered
``duplicate`` and stores nothing, so an agent that never got its answer simply sends the
batch again.

Per batch, inside the transaction: its jobs authorised against the job map
(:mod:`forewarn.collector.ingest.authz`: another node's job is refused with 403, a rank another
node holds is not applied); the ``batches`` row; the body in ``staged_samples``
(GPU samples go on to Parquet, :mod:`forewarn.collector.storage.telemetry`); the latest sample
per GPU in ``gpus``; XIDs; findings (GPU findings also set that GPU's health); rank
summaries and checkpoint reports (the job map, :mod:`forewarn.collector.jobs.jobmap`); the node.
An ``agent_id`` belongs to the node that first sent it: another node's batch under it is
refused (403), so no node can make another's batches look like duplicates. A batch whose
write fails for a reason of its own (not the store's) is rolled back alone, its body kept
in ``quarantine_dir`` for the operator, and answered 422; the rest of its group commits.
"""

from __future__ import annotations

import collections
import concurrent.futures
import enum
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from forewarn.wire import (
    AgentBatch,
    Finding,
    GpuSample,
    Health,
)

from ..jobs.jobmap import apply_checkpoints, apply_ranks
from ..metrics import CollectorMetrics
from ..storage.staging import StagingLog
from ..storage.state import StateStore, Transaction
from .authz import NotYourJob, authorise_batch
from .validate import (
    CheckedBatch,
    IngestError,
    TimeWindow,
    check_batch,
    count_refusals,
)

__all__ = ["POLICY_PART", "IngestResult", "IngestWriter", "accept_batch",
           "finding_rows_json", "store_findings"]

log = logging.getLogger(__name__)

class IngestResult(enum.StrEnum):
    STORED = "stored"
    DUPLICATE = "duplicate"


_FINDING_INSERT = (
    "INSERT INTO findings (time, received, node, origin, check_name, health, subject_kind,"
    " subject_key, subject_node, gpu, job, rank, reason, action, probability, horizon_s,"
    " simulated, body) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


_WORST_HEALTH = (
    "SELECT f.health, f.reason, f.time FROM findings f JOIN (SELECT MAX(id) AS id FROM findings"
    " WHERE subject_key = ? GROUP BY check_name) m ON f.id = m.id WHERE f.health != 'unknown'"
)


def store_findings(conn: Transaction, findings: Sequence[Finding], *, node: str,
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
        worst = max(rows, key=lambda r: (Health(r[0]).severity, r[2]), default=None)
        if worst is None:  # its last finding expired (or no check can tell): not red
            worst = ("unknown", "no current finding", max(f.time for f in findings))
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


def _write_batch(conn: Transaction, batch: AgentBatch, body: bytes, received: float,
                 address: str, ref: tuple[int, int, int] | None = None
                 ) -> tuple[bool, int | None]:
    """Store one batch; (stored, id of its staged_samples row). ``ref`` is where the
    staging log holds the body; without it the body goes into the row."""
    owner = conn.execute("SELECT node FROM batches WHERE agent_id = ? LIMIT 1",
                         (batch.agent_id,)).fetchone()
    if owner is not None and owner[0] != batch.node:
        raise IngestError(403, "identity_mismatch",
                          f"$.agent_id: {batch.agent_id!r} is node {owner[0]!r}'s agent; node"
                          f" {batch.node!r} may not send as it")
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
            "INSERT INTO staged_samples (agent_id, seq, samples, body, segment, \"offset\", length)"
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


POLICY_PART = 32
"""Stored batches handed to the policy in one call at most (the policy thread runs urgent
work between calls, so a fatal finding waits for one part of telemetry, not a whole
group commit's 256 batches)."""

QUARANTINE_MAX_BATCHES = 1000
"""Poison batches kept in the quarantine folder; past this they are refused, not kept."""


class _Item:
    __slots__ = ("address", "batch", "body", "future", "queued_at", "received")

    def __init__(self, batch: AgentBatch, body: bytes, received: float, address: str) -> None:
        self.batch = batch
        self.body = body
        self.received = received
        self.address = address
        self.queued_at = time.perf_counter()  # for urgent_seconds{stage="queued"}
        self.future: concurrent.futures.Future[IngestResult] = concurrent.futures.Future()


class IngestWriter:
    """The single writer thread with group commit. See the module docstring.

    ``on_stored(batches, addresses)`` hears every newly stored batch and where it came
    from (the client's address, or :data:`forewarn.bus.BUS_ADDRESS`)."""

    def __init__(
        self,
        store: StateStore,
        metrics: CollectorMetrics,
        *,
        group_max: int = 256,
        on_stored: Callable[[list[AgentBatch], list[str]], None] | None = None,
        on_staged: Callable[[list[tuple[int, str, int, list[GpuSample]]]], None] | None = None,
        staging: StagingLog | None = None,
        clock: Callable[[], float] = time.time,
        quarantine_dir: Path | None = None,
        retry_s: float = 5.0,
    ) -> None:
        self.store = store
        self.retry_s = retry_s
        self.store_error = ""
        """Why the store refused the last commit attempt ("" once one worked), for /readyz."""
        self.quarantine_dir = quarantine_dir
        self.metrics = metrics
        self.group_max = group_max
        self.on_stored = on_stored
        self.on_staged = on_staged
        self.staging = staging
        self.clock = clock
        # Urgent batches go first, each queue in the order it came: a GPU's findings
        # reach the policy in order (they all ride urgent).
        self._urgent: collections.deque[_Item] = collections.deque()
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
        return len(self._urgent) + len(self._queue)

    def submit(self, batch: AgentBatch, body: bytes, *, address: str = ""
               ) -> concurrent.futures.Future[IngestResult]:
        """Queue ``batch`` (urgent ones ahead of the rest, each in order); the future
        resolves once it is committed (or found to be a duplicate)."""
        item = _Item(batch, body, self.clock(), address)
        with self._cond:
            if self._stopping:
                raise IngestError(503, "store", "collector is shutting down")
            (self._urgent if batch.urgent else self._queue).append(item)
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
                while not self.queued and not self._stopping:
                    self._cond.wait()
                if not self.queued and self._stopping:
                    return
                # Urgent batches in a group of their own: they are answered (and go to
                # the policy) once their small commit is durable, not after the telemetry
                # queued behind them.
                lane = self._urgent or self._queue
                group = [lane.popleft() for _ in range(min(self.group_max, len(lane)))]
            self._commit(group)

    def _refuse(self, item: _Item, exc: Exception) -> IngestError:
        """The answer to a batch that cannot be stored; a poison batch is quarantined."""
        if isinstance(exc, IngestError):
            return exc
        if isinstance(exc, NotYourJob):
            return IngestError(403, "not_your_job", str(exc))
        b = item.batch
        kept = self._quarantine(item, exc)
        log.error("batch %s/%s of node %s cannot be stored (%r); %s", b.agent_id, b.seq,
                  b.node, exc, f"kept in {kept}" if kept else "not kept")
        where = "kept for the operator in the collector's quarantine" if kept else "not kept"
        return IngestError(422, "quarantined", f"batch {b.agent_id}/{b.seq} cannot be stored"
                           f" ({type(exc).__name__}: {exc}); {where}; do not send it again")

    def _quarantine(self, item: _Item, exc: Exception) -> Path | None:
        """Keep a poison batch's body (and why) under ``quarantine_dir``; bounded."""
        if self.quarantine_dir is None:
            return None
        b = item.batch
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{b.node}-{b.agent_id}")[:120]
        path = self.quarantine_dir / f"{stem}-{b.seq}.msgpack"
        try:
            self.quarantine_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            if not path.exists() and sum(1 for _ in self.quarantine_dir.iterdir()) >= \
                    2 * QUARANTINE_MAX_BATCHES:
                return None
            path.write_bytes(item.body)
            path.with_suffix(".txt").write_text(
                f"node {b.node} agent_id {b.agent_id} seq {b.seq} received {item.received}:"
                f" {exc!r}\n")
        except OSError as err:
            log.error("cannot quarantine batch %s/%s: %s", b.agent_id, b.seq, err)
            return None
        self.metrics.quarantined.labels("poison_batch").inc()
        return path

    def _commit(self, group: list[_Item]) -> None:
        started = time.perf_counter()
        refs: dict[int, tuple[int, int, int]] = {}
        try:
            if self.staging is not None:
                # Bodies first, one fsync for the group; the transaction then points at them.
                with_samples = [i for i, item in enumerate(group) if item.batch.samples]
                written = self.staging.append([group[i].body for i in with_samples])
                refs = dict(zip(with_samples, written, strict=True))
            results, staged, ignored = self._write_retrying(group, refs)
        except Exception as exc:
            log.exception("group commit of %d batches failed", len(group))
            for item in group:
                if not item.future.done():
                    item.future.set_exception(
                        IngestError(503, "store", f"store unavailable: {exc}"))
            return
        if len(results) < len(group):  # cut short (:meth:`_make_way`): the rest next
            self.metrics.commits_cut.inc()
            self._requeue(group[len(results):])
        self._committed(group[:len(results)], results, staged, ignored, started)

    def _make_way(self, item: _Item) -> bool:
        """Whether to commit the batches written so far before ``item``: an urgent batch
        waits behind telemetry, or another transaction waits for the write lock (a
        decision's record and commands, the bus publisher's take). Either then waits for
        one batch, not for a group of up to ``group_max``; under plain load nothing waits
        and the group stays one commit."""
        return (not item.batch.urgent and bool(self._urgent)) or \
            self.store.write_waiters() > 0

    def _requeue(self, items: list[_Item]) -> None:
        """Put ``items`` back at the head of their queues, in their order. (Their bodies go
        to the staging log again with their next group: bytes no row points at are never
        read.)"""
        with self._cond:
            for item in reversed(items):
                (self._urgent if item.batch.urgent else self._queue).appendleft(item)

    def _write_retrying(self, group: list[_Item], refs: dict[int, tuple[int, int, int]]
                        ) -> tuple[list[IngestResult], list[tuple[int, str, int, list[GpuSample]]],
                                   dict[int, dict[str, int]]]:
        """:meth:`_write`, tried again while the store is unavailable (a database restart,
        a lost connection) with a bounded backoff for up to ``retry_s``; then it raises and
        the agents keep the batches in their spools."""
        deadline = time.monotonic() + self.retry_s
        delay = 0.05
        while True:
            try:
                return self._write(group, refs)
            except self.store.unavailable as exc:
                if time.monotonic() + delay > deadline:
                    raise
                self.metrics.store_retries.inc()
                self.store_error = f"{type(exc).__name__}: {exc}"[:500]
                log.warning("store unavailable (%s); group commit retried in %.2f s",
                            self.store_error, delay)
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _write(self, group: list[_Item], refs: dict[int, tuple[int, int, int]]
               ) -> tuple[list[IngestResult], list[tuple[int, str, int, list[GpuSample]]],
                          dict[int, dict[str, int]]]:
        """One transaction for the group, or for the part of it written before
        :meth:`_make_way` said to stop; per batch of that part: its result (a placeholder
        for one refused, whose future is then done), its staged row, what was ignored
        of it."""
        results: list[IngestResult] = []
        staged: list[tuple[int, str, int, list[GpuSample]]] = []
        ignored: dict[int, dict[str, int]] = {}  # records not applied, by reason
        with self.store.write() as conn:
            for index, item in enumerate(group):
                if index and self._make_way(item):
                    break
                if item.future.done():  # refused in an attempt cut short: answered
                    results.append(IngestResult.DUPLICATE)
                    continue
                conn.execute("SAVEPOINT b")
                try:
                    # Jobs are authorised against the map this transaction writes.
                    item.batch, ignored[index] = authorise_batch(conn, item.batch,
                                                                 item.received)
                    stored, staged_id = _write_batch(conn, item.batch, item.body,
                                                     item.received, item.address,
                                                     refs.get(index))
                except self.store.unavailable:
                    raise  # the store's own trouble (disk, lock): the whole group
                except Exception as exc:  # this batch's own: it alone is refused
                    conn.execute("ROLLBACK TO b")
                    conn.execute("RELEASE b")
                    results.append(IngestResult.DUPLICATE)  # placeholder; future done
                    item.future.set_exception(self._refuse(item, exc))
                    continue
                conn.execute("RELEASE b")
                if staged_id is not None:
                    staged.append((staged_id, item.batch.agent_id, item.batch.seq,
                                   item.batch.samples))
                results.append(IngestResult.STORED if stored else IngestResult.DUPLICATE)
        self.store_error = ""
        return results, staged, ignored

    def _committed(self, group: list[_Item], results: list[IngestResult],
                   staged: list[tuple[int, str, int, list[GpuSample]]],
                   ignored: dict[int, dict[str, int]], started: float) -> None:
        """After the commit: metrics, the futures, the hooks."""
        committed = time.perf_counter()
        self.metrics.commit_seconds.observe(committed - started)
        if staged:  # the flush sets the gauge from the store again (all replicas' rows)
            self.metrics.staged.inc(sum(len(samples) for *_, samples in staged))
        if staged and self.on_staged is not None:
            self.on_staged(staged)  # committed: the flush may use the decoded samples
        self.metrics.group_size.observe(len(group))
        stored_batches, addresses = [], []
        for index, (item, result) in enumerate(zip(group, results, strict=True)):
            if item.future.done():
                continue
            self.metrics.batches.labels(result.value).inc()
            if result is IngestResult.STORED:
                b = item.batch
                stored_batches.append(b)
                addresses.append(item.address)
                for reason, n in ignored.get(index, {}).items():
                    self.metrics.ignored_records.labels(reason).inc(n)
                self.metrics.samples.inc(len(b.samples))
                self.metrics.xids.inc(len(b.xids))
                self.metrics.bytes.inc(len(item.body))
                self.metrics.lag.observe(max(0.0, item.received - b.created))
                for f in b.findings:
                    self.metrics.findings.labels(f.health.value, "agent").inc()
                if b.urgent:
                    stage = self.metrics.urgent_seconds
                    stage.labels("queued").observe(started - item.queued_at)
                    stage.labels("commit").observe(committed - started)
            item.future.set_result(result)
        if stored_batches and self.on_stored is not None:
            try:
                self.on_stored(stored_batches, addresses)
            except Exception:
                log.exception("on_stored hook failed")


def finding_rows_json(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """Expand the stored JSON body of finding rows (for the read API)."""
    for row in rows:
        body = row.pop("body", None)
        if isinstance(body, str):
            row["finding"] = json.loads(body)
    return rows


def accept_batch(writer: IngestWriter, metrics: CollectorMetrics, body: bytes, *, node: str,
                 window: TimeWindow, max_items: int, address: str = ""
                 ) -> tuple[CheckedBatch, concurrent.futures.Future[IngestResult]]:
    """The one ingest path of HTTP and the NATS bus: check ``body`` as ``node``'s batch
    (:func:`check_batch`), count the records left out, queue the rest for ``writer``.
    The future resolves once the batch is durable (or a duplicate); raises
    :class:`IngestError` for a batch refused whole (count it with
    :func:`.validate.count_rejection`)."""
    checked = check_batch(body, node=node, max_items=max_items, window=window)
    return checked, submit_checked(writer, metrics, checked, address=address)


def submit_checked(writer: IngestWriter, metrics: CollectorMetrics, checked: CheckedBatch,
                   *, address: str = "") -> concurrent.futures.Future[IngestResult]:
    """The second half of :func:`accept_batch`, for a batch :func:`check_batch` passed:
    count the records left out, queue the rest for ``writer``."""
    count_refusals(metrics, checked)
    return writer.submit(checked.batch, checked.body, address=address)

