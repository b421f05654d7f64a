"""Start-up recovery of the telemetry files: account for every file the database does not
name (left by a crash, or newer than a restored database), never deleting data on a guess.
:meth:`~.telemetry.TelemetryWriter.recover` runs it under the flush lock.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from .datadir import Quarantine
from .staging import StagingLog
from .state import StateStore

__all__ = ["Recovered", "TelemetryRecovery"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Recovered:
    """What start-up recovery did (:meth:`TelemetryWriter.recover`)."""

    removed: list[Path] = dataclasses.field(default_factory=list)
    """Temp files, and Parquet files whose every row is held elsewhere."""
    quarantined: list[Path] = dataclasses.field(default_factory=list)
    """Files held nowhere else, moved to the quarantine (their original paths)."""


class TelemetryRecovery:
    """One recovery of the Parquet files under ``root`` and the staging segments."""

    def __init__(self, store: StateStore, root: Path, staging: StagingLog | None,
                 quarantine: Quarantine, replica: str = "") -> None:
        self.store = store
        self.replica = replica
        self.root = root
        self.staging = staging
        self.quarantine = quarantine

    def run(self) -> Recovered:
        """Start-up: account for every file the database does not name (left by a crash,
        or newer than a restored database). Never deletes data on a guess:

        * ``*.tmp`` files are deleted: never renamed, so never data of record (their rows
          are still staged, or still in the files a compaction was merging);
        * an unrecorded Parquet file is deleted when every batch it holds on its day is
          still staged or in a recorded file of that day (a flush or compaction cut short),
          otherwise moved to the quarantine;
        * a staging segment no staged row refers to is deleted when a recorded flush
          came after its last write (so its bodies were flushed), otherwise quarantined.
        """
        recovered = Recovered()
        self._claim_unowned()
        known = {r["name"] for r in self.store.query(
            "SELECT name FROM telemetry_files WHERE replica = ?", (self.replica,))}
        staged = self._readable_staged()
        for path in sorted(self.root.glob("date=*/*")):
            rel = path.relative_to(self.root).as_posix()
            if path.suffix == ".tmp":
                path.unlink(missing_ok=True)
                recovered.removed.append(path)
            elif path.suffix == ".parquet" and rel not in known:
                self._account(recovered, path, f"telemetry/{rel}",
                              redundant=self._held_elsewhere(path, staged),
                              why="the database does not name it and holds its rows "
                                  "nowhere else (a database older than the data?)")
        self._recover_segments(recovered)
        if recovered.removed:
            log.info("recovery removed %d files whose rows are held elsewhere: %s",
                     len(recovered.removed), ", ".join(p.name for p in recovered.removed))
        return recovered

    def _claim_unowned(self) -> None:
        """Rows recorded before files named their replica (``''``, PostgreSQL migration
        0008) become this replica's where its data_dir holds the file."""
        if not self.replica:
            return
        mine = [(self.replica, r["name"]) for r in self.store.query(
            "SELECT name FROM telemetry_files WHERE replica = ''")
            if (self.root / r["name"]).exists()]
        if mine:
            with self.store.write() as conn:
                conn.executemany("UPDATE telemetry_files SET replica = ? WHERE name = ?"
                                 " AND replica = ''", mine)
            log.info("recovery: %d telemetry files recorded before replicas were named are"
                     " this replica's (its data_dir holds them)", len(mine))

    def _readable_staged(self) -> set[tuple[str, int]]:
        """The staged batches whose bodies can still be read: in SQLite, or in a staging
        segment that exists and is long enough. A database older than the data can name
        batches staged in a segment a later flush deleted; those hold their rows nowhere."""
        out: set[tuple[str, int]] = set()
        sizes: dict[int, int] = {}
        for r in self.store.query(
                "SELECT agent_id, seq, segment, \"offset\", length FROM staged_samples"):
            segment = r["segment"]
            if segment is not None:
                if self.staging is None:
                    continue
                if segment not in sizes:
                    path = self.staging.path(segment)
                    sizes[segment] = path.stat().st_size if path.exists() else -1
                if sizes[segment] < int(r["offset"] or 0) + int(r["length"] or 0):
                    continue
            out.add((r["agent_id"], int(r["seq"])))
        return out

    def _batches_in(self, path: Path) -> set[tuple[str, int]]:
        """The (agent_id, seq) pairs of the rows of a Parquet file."""
        import pyarrow.parquet as pq

        table = pq.read_table(path, columns=["agent_id", "seq"])
        return set(zip(table["agent_id"].to_pylist(), table["seq"].to_pylist(), strict=True))

    def _held_elsewhere(self, path: Path, staged: set[tuple[str, int]]) -> bool:
        """Whether every batch in ``path`` is staged or in a recorded file of its day (a
        flush writes all of a batch's rows of one day to one file; compaction keeps
        files whole)."""
        import pyarrow as pa

        try:
            wanted = self._batches_in(path) - staged
            day = path.parent.name.removeprefix("date=")
            for row in self.store.query("SELECT name FROM telemetry_files WHERE day = ? AND"
                                        " replica = ?", (day, self.replica)):
                if not wanted:
                    break
                wanted -= self._batches_in(self.root / row["name"])
        except (OSError, pa.ArrowException):
            return False  # unreadable: nothing proves it redundant
        return not wanted

    def _recover_segments(self, recovered: Recovered) -> None:
        if self.staging is None:
            return
        referenced = {r["segment"] for r in self.store.query(
            "SELECT DISTINCT segment FROM staged_samples WHERE segment IS NOT NULL")}
        flushed = float(self.store.scalar("SELECT MAX(created) FROM telemetry_files WHERE"
                                          " replica = ?", (self.replica,)) or 0)
        for segment in self.staging.segments():
            if segment in referenced:
                continue
            path = self.staging.path(segment)
            self._account(recovered, path, f"staging/{path.name}",
                          redundant=path.stat().st_mtime <= flushed,
                          why="no staged row refers to it and no recorded flush came after "
                              "its last write (a database older than the data?)")

    def _account(self, recovered: Recovered, path: Path, relative: str, *, redundant: bool,
                 why: str) -> None:
        """Delete ``path`` when ``redundant`` (held elsewhere), else quarantine it."""
        if redundant:
            path.unlink(missing_ok=True)
            recovered.removed.append(path)
        else:
            self.quarantine.move(path, relative, reason="unrecorded", why=why)
            recovered.quarantined.append(path)
