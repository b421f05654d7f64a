"""Agent batch ingest: validate, then store exactly once with group commit.

:func:`check_batch` decodes and bounds a request body. A bad *record* (one sample, XID,
finding, rank summary or checkpoint report: a wrong type, a value out of range, NaN/Inf,
a time outside the window around the collector's clock) is left out and reported
(:class:`Refusal`: the field, ``$.samples[3].power_w``, and why), and the rest of the
batch is stored: one broken sensor never costs a node its findings. A bad *batch* (its
own fields, undecodable bytes, another node's identity) is refused whole with a 4xx.
:class:`IngestWriter` owns a thread
that takes queued batches (urgent ones first), writes up to ``group_commit_max`` of them in
ONE SQLite transaction (one fsync for the group) and only then answers each request: a
batch is acknowledged only once it is durable. ``(agent_id, seq)`` is the primary key of
``batches``: a batch seen before is answered ``duplicate`` and stores nothing, so an agent
that never got its answer simply sends the batch again.

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
import dataclasses
import enum
import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from forewarn.errors import InputError
from forewarn.wire import (
    DECODE_ERRORS,
    AgentBatch,
    CheckpointReport,
    Finding,
    GpuSample,
    Health,
    RankSummary,
    XidEvent,
    decode_error_message,
    encode,
)

from ..jobs.jobmap import apply_checkpoints, apply_ranks
from ..metrics import CollectorMetrics
from ..storage.staging import StagingLog
from ..storage.state import StateStore, Transaction
from .authz import NotYourJob, authorise_batch

__all__ = ["CheckedBatch", "IngestError", "IngestResult", "IngestWriter", "Refusal",
           "TimeWindow", "accept_batch", "check_batch", "count_refusals", "count_rejection",
           "store_findings"]

log = logging.getLogger(__name__)

_batch_decoder = msgspec.msgpack.Decoder(AgentBatch)
_RECORDS: dict[str, type[Any]] = {"samples": GpuSample, "xids": XidEvent, "findings": Finding,
                                  "ranks": RankSummary, "checkpoints": CheckpointReport}
"""The record lists of a batch and their types: each record is refused on its own."""
_record_decoders = {name: msgspec.msgpack.Decoder(t) for name, t in _RECORDS.items()}


def _envelope_fields() -> list[Any]:
    """AgentBatch's fields with each record list left undecoded (``msgspec.Raw``)."""
    out: list[Any] = []
    for f in msgspec.structs.fields(AgentBatch):
        if f.name in _RECORDS:
            out.append((f.name, list[msgspec.Raw], msgspec.field(default_factory=list)))
        else:
            out.append((f.name, f.type) if f.required else (f.name, f.type, f.default))
    return out


_envelope_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(
    msgspec.defstruct("_BatchEnvelope", _envelope_fields(), kw_only=True))


class IngestError(InputError, ValueError):
    """A request was refused; ``status`` is the HTTP status, the message names the problem."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class IngestResult(enum.StrEnum):
    STORED = "stored"
    DUPLICATE = "duplicate"


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One record left out of a batch. ``reason`` (a metric label) is ``time`` (outside
    the window, or not Unix seconds), ``non_finite`` (NaN/Inf), ``range`` (a number out of
    its range) or ``type`` (anything else the decoder refused)."""

    record: str
    field: str
    reason: str
    message: str

    def as_json(self) -> dict[str, str]:
        return {"field": self.field, "reason": self.reason, "error": self.message}


@dataclasses.dataclass(frozen=True)
class TimeWindow:
    """Record times accepted: ``max_age_s`` before the collector's clock ``now`` up to
    ``max_future_s`` after it. A future time would freeze a GPU's latest row (later real
    samples look older); an ancient one is a unit error or a broken clock."""

    now: float
    max_age_s: float
    max_future_s: float

    def check(self, t: float) -> str | None:
        """Why ``t`` is outside the window (None when inside)."""
        if t > self.now + self.max_future_s:
            return (f"{t:.3f} is {t - self.now:.0f} s in the future of the collector's clock"
                    f" (at most {self.max_future_s:g} s allowed: check the agent's clock)")
        if t < self.now - self.max_age_s:
            return (f"{t:.3f} is {self.now - t:.0f} s older than the collector's clock"
                    f" (at most {self.max_age_s:g} s allowed)")
        return None


@dataclasses.dataclass(frozen=True)
class CheckedBatch:
    """A batch fit to store: ``body`` is the request body, or the batch re-encoded without
    the ``refused`` records (what the staging log keeps must decode)."""

    batch: AgentBatch
    body: bytes
    refused: tuple[Refusal, ...] = ()


_PATH = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def _value_at(raw: bytes, path: str) -> Any:
    """The value at msgspec error path ``path`` (``$.nvlink[2].replay``) of a raw record."""
    try:
        value: Any = msgspec.msgpack.decode(raw)
    except DECODE_ERRORS:
        return None
    for key, index in _PATH.findall(path[1:]):
        try:
            value = value[int(index)] if index else value[key]
        except (KeyError, IndexError, TypeError):
            return None
    return value


def _refusal(exc: Exception, raw: bytes, record: str, i: int) -> Refusal:
    """Explain why record ``i`` of list ``record`` did not decode."""
    text = decode_error_message(exc, record[:-1]).partition(": ")[2]
    what, sep, where = text.rpartition(" - at `")
    path = where.rstrip("`") if sep else "$"
    what = what if sep else text
    field = f"$.{record}[{i}]{path[1:]}"
    value = _value_at(raw, path) if sep else None
    if isinstance(value, float) and not math.isfinite(value):
        return Refusal(record, field, "non_finite", f"{field}: {value} is not a finite number")
    if field.endswith("time") and isinstance(value, int | float):
        return Refusal(record, field, "time",
                       f"{field}: {value!r} is not Unix seconds before 2100 ({what})")
    reason = "range" if "<=" in what or ">=" in what else "type"
    shown = f" (got {value!r:.60})" if value is not None and reason == "range" else ""
    return Refusal(record, field, reason, f"{field}: {what}{shown}")


def _check_lengths(batch: Any, max_items: int) -> None:
    for name in _RECORDS:
        n = len(getattr(batch, name))
        if n > max_items:
            raise IngestError(413, "limits",
                              f"$.{name}: {n} items, more than the limit of {max_items}")


Origin = dict[str, list[int]]
"""Per record list, the index in the request of each record decoded (some were left out)."""


def _at(origin: Origin | None, name: str, i: int) -> int:
    """Index in the request of record ``i`` of the decoded list ``name``."""
    return origin[name][i] if origin else i


def _decode_by_record(body: bytes, max_items: int
                      ) -> tuple[AgentBatch, list[Refusal], Origin]:
    """Decode the batch's own fields, then each record alone, leaving out bad records."""
    try:
        envelope = _envelope_decoder.decode(body)
    except DECODE_ERRORS as exc:
        raise IngestError(400, "decode", decode_error_message(exc, "AgentBatch")) from None
    _check_lengths(envelope, max_items)
    refused: list[Refusal] = []
    origin: Origin = {}
    fields: dict[str, Any] = {}
    for name in envelope.__struct_fields__:
        if name not in _RECORDS:
            fields[name] = getattr(envelope, name)
            continue
        kept = fields[name] = []
        where = origin[name] = []
        decoder = _record_decoders[name]
        for i, raw in enumerate(getattr(envelope, name)):
            try:
                kept.append(decoder.decode(raw))
                where.append(i)
            except DECODE_ERRORS as exc:
                refused.append(_refusal(exc, raw, name, i))
    return AgentBatch(**fields), refused, origin


def _outside_window(batch: AgentBatch, window: TimeWindow, origin: Origin | None
                    ) -> list[tuple[int, Refusal]]:
    """Records whose times lie outside ``window``: (index in ``batch``, refusal naming the
    index in the request). Rank summaries: future times only (a last checkpoint may be old)."""
    out: list[tuple[int, Refusal]] = []

    def refuse(name: str, i: int, key: str, why: str) -> None:
        field = f"$.{name}[{_at(origin, name, i)}].{key}"
        out.append((i, Refusal(name, field, "time", f"{field}: {why}")))

    lo, hi = window.now - window.max_age_s, window.now + window.max_future_s
    for name in ("samples", "xids", "findings", "checkpoints"):
        items = getattr(batch, name)
        times = [item.time for item in items]
        if not times or (lo <= min(times) and max(times) <= hi):  # the usual case, cheap
            continue
        for i, item in enumerate(items):
            why = window.check(item.time)
            if why is not None:
                refuse(name, i, "time", why)
    future = dataclasses.replace(window, max_age_s=math.inf)
    for i, rank in enumerate(batch.ranks):
        for key in ("last_step_time", "last_beat"):
            t = getattr(rank, key)
            why = None if t is None else future.check(t)
            if why is not None:
                refuse("ranks", i, key, why)
                break
    return out


def _without(batch: AgentBatch, drops: Sequence[tuple[int, Refusal]]) -> AgentBatch:
    """``batch`` without the records at ``drops`` (index in ``batch``, refusal)."""
    gone: dict[str, set[int]] = collections.defaultdict(set)
    for i, r in drops:
        gone[r.record].add(i)
    return msgspec.structs.replace(batch, **{
        name: [x for i, x in enumerate(getattr(batch, name)) if i not in drop]
        for name, drop in gone.items()})


def check_batch(body: bytes, *, node: str, max_items: int,
                window: TimeWindow | None = None) -> CheckedBatch:
    """Decode ``body`` as an :class:`AgentBatch` sent by ``node``'s agent and check limits.

    Bad records are left out (see the module docstring); records outside ``window`` too.
    Raises :class:`IngestError` (400 bad batch, 403 another node's batch, 413 a list
    longer than ``max_items``).
    """
    refused: list[Refusal] = []
    origin: Origin | None = None
    try:
        batch = _batch_decoder.decode(body)
    except msgspec.ValidationError:  # find the bad records (rare: the fast path is above)
        batch, refused, origin = _decode_by_record(body, max_items)
    except DECODE_ERRORS as exc:
        raise IngestError(400, "decode", decode_error_message(exc, "AgentBatch")) from None
    _check_lengths(batch, max_items)
    if batch.node != node:
        raise IngestError(403, "node_mismatch",
                          f"$.node: token is for node {node!r}, batch says {batch.node!r}")
    for name in ("samples", "xids", "ranks"):
        for i, item in enumerate(getattr(batch, name)):
            if item.node != node:
                raise IngestError(403, "node_mismatch",
                                  f"$.{name}[{_at(origin, name, i)}].node: {item.node!r} is"
                                  f" not this agent's node {node!r}")
    # An agent speaks for its own node only: a finding about another node's GPU would let
    # one compromised agent order checkpoints or drains elsewhere.
    for i, f in enumerate(batch.findings):
        if f.subject.node not in ("", node):
            raise IngestError(403, "node_mismatch",
                              f"$.findings[{_at(origin, 'findings', i)}].subject.node:"
                              f" {f.subject.node!r} is not this agent's node {node!r}")
    if window is not None:
        late = _outside_window(batch, window, origin)
        if late:
            batch = _without(batch, late)
            refused.extend(r for _i, r in late)
    if not refused:
        return CheckedBatch(batch, body)
    return CheckedBatch(batch, encode(batch), tuple(refused))


def accept_batch(writer: IngestWriter, metrics: CollectorMetrics, body: bytes, *, node: str,
                 window: TimeWindow, max_items: int, address: str = ""
                 ) -> tuple[CheckedBatch, concurrent.futures.Future[IngestResult]]:
    """The one ingest path of HTTP and the NATS bus: check ``body`` as ``node``'s batch
    (:func:`check_batch`), count the records left out, queue the rest for ``writer``.
    The future resolves once the batch is durable (or a duplicate); raises
    :class:`IngestError` for a batch refused whole (count it with :func:`count_rejection`)."""
    checked = check_batch(body, node=node, max_items=max_items, window=window)
    count_refusals(metrics, checked)
    return checked, writer.submit(checked.batch, checked.body, address=address)


def count_rejection(metrics: CollectorMetrics, exc: IngestError) -> None:
    """Count a batch refused whole (by reason)."""
    metrics.rejected.labels(exc.reason).inc()
    metrics.batches.labels("rejected").inc()


def count_refusals(metrics: CollectorMetrics, checked: CheckedBatch) -> None:
    """Count and log the records left out of a batch."""
    if not checked.refused:
        return
    for r in checked.refused:
        metrics.refused.labels(r.record, r.reason).inc()
    b = checked.batch
    log.warning("node %s batch %s/%s: %d record(s) refused: %s", b.node, b.agent_id, b.seq,
                len(checked.refused), "; ".join(r.message for r in checked.refused[:5]))


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


QUARANTINE_MAX_BATCHES = 1000
"""Poison batches kept in the quarantine folder; past this they are refused, not kept."""


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
        store: StateStore,
        metrics: CollectorMetrics,
        *,
        group_max: int = 256,
        on_stored: Callable[[list[AgentBatch]], None] | None = None,
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
        self._committed(group, results, staged, ignored, started)

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
        """One transaction for the group; per batch: its result (a placeholder for one
        refused, whose future is then done), its staged row, what was ignored of it."""
        results: list[IngestResult] = []
        staged: list[tuple[int, str, int, list[GpuSample]]] = []
        ignored: dict[int, dict[str, int]] = {}  # records not applied, by reason
        with self.store.write() as conn:
            for index, item in enumerate(group):
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
