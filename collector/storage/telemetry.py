"""Telemetry history: GPU samples in Parquet, partitioned by day, with retention.

Layout: ``<data_dir>/telemetry/date=YYYY-MM-DD/part-<first>-<last>.parquet`` (merged into
one ``compact-...parquet`` per day once the day is over), one row per
GPU per sample time, columns named as :class:`~forewarn.wire.GpuSample` fields (the
agent's replay schema; NVLink counters summed over links) plus ``agent_id`` and ``seq`` of
the batch that carried the row. This is the data models train on.

Crash safety ("kill -9 during ingest: every batch stored exactly once"): ingest never
writes Parquet. It stages the batch body (in the staging log, :mod:`.staging`, fsync'd,
and a ``staged_samples`` row pointing at it) in the same SQLite transaction that records
``(agent_id, seq)``, and only then acknowledges the agent.
:meth:`TelemetryWriter.flush` later writes the staged rows it read (ids ``first..last``) to
Parquet (temp file, fsync, rename), then in ONE transaction records the file in
``telemetry_files`` and deletes those rows by id (on PostgreSQL an id inside the range may
belong to another replica's row that committed after the read: it stays staged). A crash
before that transaction leaves a file that no table names; :meth:`TelemetryWriter.recover`
finds it at start-up, and since every row it holds is still staged (written again by the
next flush), deletes it. So every sample is in
exactly one of staging or a recorded file.

Damage: files are written with page checksums and verified after writing
(:func:`verify_parquet`: the footer read back, its row count and columns); the periodic
:meth:`TelemetryWriter.scrub` reads every recorded file in full and moves a damaged one to
the quarantine (:mod:`.datadir`); :meth:`TelemetryWriter.read` skips (logs and counts) a
damaged or missing file and returns the rest.

Replicas: each recorded file names the ``replica`` whose data_dir holds it. With shared
PostgreSQL state the replicas share ``telemetry_files`` but each writes Parquet into its
own data_dir (the one that led at the time), so a writer scrubs, compacts, prunes, reads
and recovers the files of its own ``replica`` only, and :meth:`TelemetryWriter.read` logs
what the other replicas hold. Embedded state records every file under ``''``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forewarn.wire import DECODE_ERRORS, GpuSample

from ..metrics import CollectorMetrics
from .datadir import Quarantine
from .parquet_layout import (
    COLUMNS,
    WRITE_OPTIONS,
    TelemetryError,
    day_of_time,
    decode_samples,
    load_checked,
    samples_to_columns,
    scan_checked,
    verify_parquet,
    writable,
)
from .staging import StagingError, StagingLog
from .state import StateStore, Transaction
from .telemetry_recovery import Recovered, TelemetryRecovery

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Recovered", "TelemetryWriter"]

log = logging.getLogger(__name__)


class TelemetryWriter:
    """Moves staged samples to daily Parquet partitions; prunes old days; reads history."""

    def __init__(self, store: StateStore, root: Path, metrics: CollectorMetrics, *,
                 retention_days: int = 30, clock: Callable[[], float] = time.time,
                 cache_max_samples: int = 500_000, staging: StagingLog | None = None,
                 quarantine_dir: Path | None = None, replica: str = "") -> None:
        self.store = store
        # The owner of the files under root (datadir.telemetry_replica).
        self.replica = replica
        self.root = Path(root)
        self.metrics = metrics
        self.quarantine = Quarantine(quarantine_dir or self.root.parent / "quarantine",
                                     metrics)
        self.retention_days = retention_days
        self.clock = clock
        self.root.mkdir(parents=True, exist_ok=True)
        self.staging = staging
        self._flush_lock = threading.Lock()
        self._cache_lock = threading.Lock()
        self._cache: dict[int, tuple[str, int, list[GpuSample]]] = {}
        self._cached = 0
        self.cache_max_samples = cache_max_samples

    def _schema(self) -> Any:
        import pyarrow as pa

        types = {"float64": pa.float64(), "int64": pa.int64(), "bool": pa.bool_(),
                 "string": pa.string()}
        return pa.schema([(name, types[kind]) for name, kind in COLUMNS])

    def remember(self, staged: Sequence[tuple[int, str, int, list[GpuSample]]]) -> None:
        """Keep committed staged rows' decoded samples (staged id, agent_id, seq, samples)
        so the next flush need not decode them again; bounded, best effort."""
        with self._cache_lock:
            for staged_id, agent_id, seq, samples in staged:
                if self._cached + len(samples) > self.cache_max_samples:
                    return
                self._cache[staged_id] = (agent_id, seq, samples)
                self._cached += len(samples)

    def _forget(self, ids: Sequence[int]) -> None:
        with self._cache_lock:
            for staged_id in ids:
                entry = self._cache.pop(staged_id, None)
                if entry is not None:
                    self._cached -= len(entry[2])

    def _samples_of(self, row: dict[str, Any]) -> list[GpuSample]:
        """The samples of one ``staged_samples`` row (body in the row or the staging log)."""
        if row["segment"] is None:
            body = bytes(row["body"])
        elif self.staging is None:
            raise RuntimeError("staged rows point into a staging log, but none was given")
        else:
            body = self.staging.read(int(row["segment"]), int(row["offset"]),
                                     int(row["length"]))
        samples, bad = decode_samples(body)
        for why in bad:
            self._bad_row(row["agent_id"], row["seq"], why)
        return samples

    def _bad_row(self, agent_id: str, seq: int, why: str) -> None:
        """Count and log one staged row that cannot be written (it is left out)."""
        self.metrics.bad_rows.inc()
        log.error("staged batch %s/%s: a sample cannot be written and is left out: %s",
                  agent_id, seq, why)

    def drop_segments(self) -> list[int]:
        """Delete staging segments no staged row refers to any more."""
        if self.staging is None:
            return []
        referenced = [r["segment"] for r in self.store.query(
            "SELECT DISTINCT segment FROM staged_samples WHERE segment IS NOT NULL")]
        return self.staging.drop_unreferenced(referenced)

    def recover(self) -> Recovered:
        """Start-up: account for every file the database does not name (left by a crash,
        or newer than a restored database); see :mod:`.telemetry_recovery`."""
        with self._flush_lock:
            return TelemetryRecovery(self.store, self.root, self.staging,
                                     self.quarantine, self.replica).run()

    def staged_samples(self) -> int:
        """Samples waiting in SQLite staging."""
        return int(self.store.scalar("SELECT COALESCE(SUM(samples), 0) FROM staged_samples")
                   or 0)

    def flush(self, *, max_rows: int = 1_000_000) -> int:
        """Write staged samples (up to about ``max_rows``) to Parquet; returns rows written.

        Flushes never overlap (a lock): two at once would write the same staged rows twice.
        """
        with self._flush_lock:
            try:
                return self._flush(max_rows)
            except Exception:
                self.metrics.flush_errors.inc()
                raise

    def _flush(self, max_rows: int) -> int:
        import pyarrow as pa
        import pyarrow.parquet as pq

        sizes = self.store.query("SELECT id, samples FROM staged_samples ORDER BY id")
        if not sizes:
            self.metrics.staged.set(0)
            return 0
        budget, last = 0, int(sizes[-1]["id"])
        for row in sizes:
            budget += int(row["samples"])
            if budget >= max_rows:
                last = int(row["id"])
                break
        started = time.perf_counter()
        first = int(sizes[0]["id"])
        with self._cache_lock:
            cached = {i: v for i, v in self._cache.items() if first <= i <= last}
        ids = [int(r["id"]) for r in sizes if first <= int(r["id"]) <= last]
        by_day: dict[str, tuple[list[GpuSample], list[str], list[int]]] = {}
        for staged_id in ids:
            entry_ = cached.get(staged_id)
            if entry_ is None:  # not decoded in this process (e.g. staged before a restart)
                row = self.store.query("SELECT agent_id, seq, body, segment, \"offset\", length"
                                       " FROM staged_samples WHERE id = ?", (staged_id,))[0]
                try:
                    got = self._samples_of(row)
                except (StagingError, *DECODE_ERRORS) as exc:
                    # Unreadable (a damaged staging segment): say which batch, count it,
                    # skip it, so one bad row never stalls every later flush.
                    log.error("staged batch %s/%s unreadable, its samples are lost: %s",
                              row["agent_id"], row["seq"], exc)
                    self.metrics.flush_errors.inc()
                    got = []
                entry_ = (row["agent_id"], int(row["seq"]), got)
            agent_id, seq, samples = entry_
            for s in samples:
                try:
                    day = day_of_time(s.time)
                except (ValueError, OverflowError, OSError):  # not Unix seconds
                    self._bad_row(agent_id, seq, f"time {s.time!r}")
                    continue
                entry = by_day.setdefault(day, ([], [], []))
                entry[0].append(s)
                entry[1].append(agent_id)
                entry[2].append(seq)
        schema = self._schema()
        written: list[tuple[str, str, int]] = []
        try:
            for day, (samples, agents, seqs) in sorted(by_day.items()):
                try:
                    table = pa.Table.from_pydict(samples_to_columns(samples, agents, seqs),
                                                 schema=schema)
                except (pa.ArrowException, OverflowError, TypeError, ValueError):
                    # A value Arrow cannot hold: leave out the rows that cause it.
                    keep = [i for i, s in enumerate(samples) if writable(s)]
                    for i in sorted(set(range(len(samples))) - set(keep)):
                        self._bad_row(agents[i], seqs[i], f"gpu {samples[i].gpu}: a value"
                                      " out of range")
                    table = pa.Table.from_pydict(samples_to_columns(
                        [samples[i] for i in keep], [agents[i] for i in keep],
                        [seqs[i] for i in keep]), schema=schema)
                folder = self.root / f"date={day}"
                folder.mkdir(parents=True, exist_ok=True)
                name = f"part-{first:012d}-{last:012d}.parquet"
                tmp = folder / (name + ".tmp")
                pq.write_table(table, tmp, **WRITE_OPTIONS)
                with open(tmp, "rb") as fh:
                    os.fsync(fh.fileno())
                verify_parquet(tmp, table.num_rows)
                os.replace(tmp, folder / name)
                written.append((f"date={day}/{name}", day, table.num_rows))
            with contextlib.suppress(OSError):
                fd = os.open(self.root, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            with self.store.write() as conn:
                self._record(conn, [(rel, day, first, last, n) for rel, day, n in written])
                # The rows read, not the range first..last: on PostgreSQL another
                # replica's row with an id inside it may have committed since the read.
                conn.executemany("DELETE FROM staged_samples WHERE id = ?",
                                 [(i,) for i in ids])
        except BaseException:
            for rel, *_rest in written:
                (self.root / rel).unlink(missing_ok=True)
            raise
        self._forget(ids)
        self.drop_segments()
        total = sum(n for _r, _d, n in written)
        self.metrics.telemetry_rows.inc(total)
        self.metrics.flush_seconds.observe(time.perf_counter() - started)
        self.metrics.staged.set(self.staged_samples())
        return total

    def prune(self, now: float | None = None) -> list[str]:
        """Delete day partitions older than ``retention_days``; returns the days removed."""
        now = self.clock() if now is None else now
        cutoff = day_of_time(now - self.retention_days * 86400.0)
        removed = []
        with self._flush_lock:
            for folder in sorted(self.root.glob("date=*")):
                day = folder.name.removeprefix("date=")
                if day < cutoff:
                    mine = (day, self.replica)
                    rows = self.store.scalar("SELECT COALESCE(SUM(rows), 0) FROM"
                                             " telemetry_files WHERE day = ? AND replica = ?",
                                             mine)
                    with self.store.write() as conn:
                        conn.execute("DELETE FROM telemetry_files WHERE day = ? AND"
                                     " replica = ?", mine)
                    shutil.rmtree(folder, ignore_errors=True)
                    self.metrics.pruned.labels("telemetry").inc(int(rows or 0))
                    removed.append(day)
        return removed

    def compact(self, day: str) -> int:
        """Merge a day's files into one (streamed file by file: memory stays at one file);
        returns the files merged (0: nothing to do).

        Crash-safe like :meth:`flush`: the merged file is written and renamed, then ONE
        transaction swaps the recorded names; files left unrecorded either way are
        removed by :meth:`recover`.
        """
        import pyarrow.parquet as pq

        with self._flush_lock:
            rows = self.store.query("SELECT name, first_id, last_id, rows FROM telemetry_files"
                                    " WHERE day = ? AND replica = ? ORDER BY first_id, name",
                                    (day, self.replica))
            if len(rows) < 2:
                return 0
            first = min(int(r["first_id"]) for r in rows)
            last = max(int(r["last_id"]) for r in rows)
            name = f"date={day}/compact-{first:012d}-{last:012d}-{len(rows)}.parquet"
            target = self.root / name
            tmp = target.with_name(target.name + ".tmp")
            schema = self._schema()
            total = sum(int(r["rows"]) for r in rows)
            with pq.ParquetWriter(tmp, schema, **WRITE_OPTIONS) as out:
                for r in rows:
                    try:
                        table = load_checked(self.root / r["name"], int(r["rows"]), schema)
                    except TelemetryError as exc:
                        # A damaged source: set it aside, merge the rest next time. A
                        # missing one keeps its record, as in the scrub (a disk comes back).
                        out.close()
                        tmp.unlink(missing_ok=True)
                        if (self.root / r["name"]).exists():
                            self._quarantine_damaged(r["name"], exc)
                        else:
                            log.error("telemetry file %s is recorded but missing; day %s"
                                      " is not merged", r["name"], day)
                        return 0
                    out.write_table(table)
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            verify_parquet(tmp, total)
            os.replace(tmp, target)
            with self.store.write() as conn:
                conn.executemany("DELETE FROM telemetry_files WHERE name = ?",
                                 [(r["name"],) for r in rows])
                self._record(conn, [(name, day, first, last, total)])
            for r in rows:
                (self.root / r["name"]).unlink(missing_ok=True)
            return len(rows)

    def compact_old_days(self, now: float | None = None) -> dict[str, int]:
        """:meth:`compact` every day before today that has more than one file."""
        today = day_of_time(self.clock() if now is None else now)
        days = [r["day"] for r in self.store.query(
            "SELECT day FROM telemetry_files WHERE day < ? AND replica = ? GROUP BY day"
            " HAVING COUNT(*) > 1 ORDER BY day", (today, self.replica))]
        return {day: self.compact(day) for day in days}

    def scrub(self) -> list[str]:
        """Read every recorded file in full (page CRCs, row count); move each damaged one
        to the quarantine and forget it; returns their names (relative to the root).

        Files are read without the flush lock (flushes go on); a file found bad is
        checked again under the lock before it moves, since a compaction may have
        replaced it meanwhile. A recorded file that is missing is counted in
        ``telemetry_missing_files`` and logged, and its row kept (an unmounted disk comes
        back; recovery then finds nothing to do).
        """
        damaged, missing = [], 0
        for row in self.store.query("SELECT name, rows FROM telemetry_files WHERE replica = ?"
                                    " ORDER BY name", (self.replica,)):
            path = self.root / row["name"]
            if not path.exists():
                missing += 1
                log.error("telemetry file %s is recorded but missing", path)
                continue
            try:
                scan_checked(path, int(row["rows"]))
            except TelemetryError:
                with self._flush_lock:
                    still = self.store.scalar("SELECT rows FROM telemetry_files WHERE name = ?",
                                              (row["name"],))
                    if still is None or not path.exists():
                        continue  # compacted away meanwhile
                    try:
                        scan_checked(path, int(still))
                    except TelemetryError as exc:
                        self._quarantine_damaged(row["name"], exc)
                        damaged.append(row["name"])
        self.metrics.missing_files.set(missing)
        return damaged

    def _record(self, conn: Transaction,
                files: Sequence[tuple[str, str, int, int, int]]) -> None:
        """Record files (name, day, first_id, last_id, rows) as this replica's."""
        now = self.clock()
        conn.executemany(
            "INSERT OR REPLACE INTO telemetry_files (name, day, first_id, last_id, rows,"
            " created, replica) VALUES (?, ?, ?, ?, ?, ?, ?)",
            [(*f, now, self.replica) for f in files])

    def _quarantine_damaged(self, name: str, exc: TelemetryError) -> None:
        """Move recorded file ``name`` to the quarantine and forget it (flush lock held)."""
        log.error("telemetry file %s is damaged (%s); its rows are lost to reads", name, exc)
        self.quarantine.move(self.root / name, f"telemetry/{name}", reason="damaged",
                             why=str(exc))
        with self.store.write() as conn:
            conn.execute("DELETE FROM telemetry_files WHERE name = ?", (name,))

    def read(self, *, start: float | None = None, end: float | None = None,
             node: str | None = None, include_staged: bool = True) -> pd.DataFrame:
        """History as a DataFrame: this replica's Parquet files plus, by default, staged
        samples. Files other replicas hold in their data_dirs are left out, and logged."""
        import pandas as pd
        import pyarrow as pa
        import pyarrow.parquet as pq

        self._log_elsewhere()
        names = [r["name"] for r in self.store.query(
            "SELECT name FROM telemetry_files WHERE replica = ? ORDER BY day, first_id",
            (self.replica,))]
        tables = []
        for name in names:
            try:
                tables.append(pq.read_table(self.root / name, page_checksum_verification=True))
            except (OSError, pa.ArrowException) as exc:
                # One damaged or missing file costs its own rows only; the scrub moves it.
                self.metrics.read_errors.inc()
                log.error("telemetry file %s skipped by a read: %s", name, exc)
        if include_staged:
            samples: list[GpuSample] = []
            agents: list[str] = []
            seqs: list[int] = []
            for row in self.store.query(
                    "SELECT agent_id, seq, body, segment, \"offset\", length FROM staged_samples"
                    " ORDER BY id"):
                got = self._samples_of(row)
                samples.extend(got)
                agents.extend([row["agent_id"]] * len(got))
                seqs.extend([int(row["seq"])] * len(got))
            if samples:
                tables.append(pa.Table.from_pydict(samples_to_columns(samples, agents, seqs),
                                                   schema=self._schema()))
        if not tables:
            return pd.DataFrame({name: pd.Series(dtype="object") for name, _k in COLUMNS})
        df = pa.concat_tables(tables).to_pandas()
        if start is not None:
            df = df[df["time"] >= start]
        if end is not None:
            df = df[df["time"] < end]
        if node is not None:
            df = df[df["node"] == node]
        return df.reset_index(drop=True)

    def _log_elsewhere(self) -> None:
        """Say what a read leaves out: the files recorded by other replicas (scale-out:
        each keeps the Parquet it wrote in its own data_dir)."""
        other = self.store.query("SELECT COUNT(*) AS files, COALESCE(SUM(rows), 0) AS rows"
                                 " FROM telemetry_files WHERE replica != ?", (self.replica,))[0]
        if other["files"]:
            log.warning("this read leaves out %d files (%d rows) recorded by other replicas:"
                        " they are in those replicas' data_dirs (docs/scale.md)",
                        other["files"], other["rows"])
