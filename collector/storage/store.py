"""The collector's embedded store: SQLite in WAL mode, schema by numbered migrations.

Tables: ``nodes``, ``gpus``, ``jobs``, ``ranks`` (the job map), ``findings``, ``incidents``,
``xids``, ``actions``, ``decisions``, ``checkpoints``, ``commands``, ``batches`` (every accepted
agent batch by ``(agent_id, seq)``: the exactly-once record), ``staged_samples`` (raw
ingest bodies whose GPU samples are not yet in Parquet) and ``telemetry_files`` (the
Parquet files that hold compacted samples; see :mod:`forewarn.collector.storage.telemetry`).

Concurrency: one write connection behind a lock (every write is one transaction, see
:meth:`Store.write`), and one read connection per thread (WAL lets reads run beside the
writer). The lock is first come, first served: the ingest writer commits one group after
another under load, and a short transaction that waits (a decision's commands, the bus
publisher taking them) goes in before its next group instead of racing it for the lock.
Schema changes are appended to :data:`MIGRATIONS`; ``PRAGMA user_version`` says how many
have run.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

from forewarn.errors import StorageError

from .fence import Fence
from .state import RecordsMixin, Transaction

__all__ = ["MIGRATIONS", "Store", "StoreError"]


class StoreError(StorageError, RuntimeError):
    """The database could not be opened or migrated; the message says why."""


MIGRATIONS: tuple[tuple[str, ...], ...] = (
    # 1: the first schema.
    (
        """CREATE TABLE nodes (
            node TEXT PRIMARY KEY, agent_id TEXT NOT NULL, first_seen REAL NOT NULL,
            last_seen REAL NOT NULL, last_seq INTEGER NOT NULL, batches INTEGER NOT NULL,
            samples INTEGER NOT NULL, address TEXT NOT NULL DEFAULT '')""",
        """CREATE TABLE gpus (
            node TEXT NOT NULL, gpu INTEGER NOT NULL, uuid TEXT NOT NULL, name TEXT NOT NULL,
            pci_bus_id TEXT NOT NULL, state TEXT NOT NULL, source TEXT NOT NULL,
            simulated INTEGER NOT NULL, last_seen REAL NOT NULL, temperature_c REAL,
            power_w REAL, gpu_util_pct REAL, health TEXT NOT NULL DEFAULT 'unknown',
            health_reason TEXT NOT NULL DEFAULT '', health_time REAL,
            PRIMARY KEY (node, gpu)) WITHOUT ROWID""",
        """CREATE TABLE batches (
            agent_id TEXT NOT NULL, seq INTEGER NOT NULL, node TEXT NOT NULL,
            created REAL NOT NULL, received REAL NOT NULL, urgent INTEGER NOT NULL,
            samples INTEGER NOT NULL, xids INTEGER NOT NULL, findings INTEGER NOT NULL,
            ranks INTEGER NOT NULL, checkpoints INTEGER NOT NULL,
            PRIMARY KEY (agent_id, seq)) WITHOUT ROWID""",
        "CREATE INDEX batches_received ON batches (received)",
        """CREATE TABLE staged_samples (
            id INTEGER PRIMARY KEY AUTOINCREMENT, agent_id TEXT NOT NULL,
            seq INTEGER NOT NULL, samples INTEGER NOT NULL, body BLOB NOT NULL)""",
        """CREATE TABLE telemetry_files (
            name TEXT PRIMARY KEY, day TEXT NOT NULL, first_id INTEGER NOT NULL,
            last_id INTEGER NOT NULL, rows INTEGER NOT NULL, created REAL NOT NULL)""",
        """CREATE TABLE xids (
            id INTEGER PRIMARY KEY, node TEXT NOT NULL, gpu INTEGER, pci_bus_id TEXT NOT NULL,
            code INTEGER NOT NULL, text TEXT NOT NULL, time REAL NOT NULL,
            source TEXT NOT NULL, simulated INTEGER NOT NULL)""",
        "CREATE INDEX xids_time ON xids (time)",
        """CREATE TABLE findings (
            id INTEGER PRIMARY KEY, time REAL NOT NULL, received REAL NOT NULL,
            node TEXT NOT NULL, origin TEXT NOT NULL, check_name TEXT NOT NULL,
            health TEXT NOT NULL, subject_kind TEXT NOT NULL, subject_key TEXT NOT NULL,
            subject_node TEXT NOT NULL, gpu INTEGER, job TEXT NOT NULL, rank INTEGER,
            reason TEXT NOT NULL, action TEXT NOT NULL, probability REAL, horizon_s REAL,
            simulated INTEGER NOT NULL, body TEXT NOT NULL)""",
        "CREATE INDEX findings_time ON findings (time)",
        "CREATE INDEX findings_subject ON findings (subject_key, time)",
        """CREATE TABLE jobs (
            job TEXT PRIMARY KEY, world_size INTEGER NOT NULL, first_seen REAL NOT NULL,
            last_seen REAL NOT NULL, last_step INTEGER, last_checkpoint_step INTEGER,
            last_checkpoint_time REAL, checkpoint_seconds REAL)""",
        """CREATE TABLE ranks (
            job TEXT NOT NULL, rank INTEGER NOT NULL, node TEXT NOT NULL, gpu INTEGER,
            local_rank INTEGER NOT NULL, world_size INTEGER NOT NULL, pid INTEGER NOT NULL,
            last_step INTEGER, last_step_time REAL, last_beat REAL, step_seconds_p50 REAL,
            step_seconds_p99 REAL, loss REAL, grad_norm REAL, alive INTEGER NOT NULL,
            last_checkpoint_step INTEGER, last_checkpoint_time REAL,
            checkpoint_seconds REAL, updated REAL NOT NULL,
            PRIMARY KEY (job, rank)) WITHOUT ROWID""",
        "CREATE INDEX ranks_gpu ON ranks (node, gpu)",
        """CREATE TABLE checkpoints (
            id INTEGER PRIMARY KEY, job TEXT NOT NULL, rank INTEGER NOT NULL,
            node TEXT NOT NULL, request_id TEXT NOT NULL, step INTEGER NOT NULL,
            phase TEXT NOT NULL, seconds REAL, bytes INTEGER, time REAL NOT NULL,
            path TEXT NOT NULL)""",
        "CREATE INDEX checkpoints_job ON checkpoints (job, time)",
        """CREATE TABLE commands (
            id TEXT PRIMARY KEY, node TEXT NOT NULL, kind TEXT NOT NULL, body BLOB NOT NULL,
            created REAL NOT NULL, expires REAL NOT NULL, delivered_at REAL,
            deliveries INTEGER NOT NULL DEFAULT 0, acked_at REAL, ok INTEGER,
            detail TEXT NOT NULL DEFAULT '')""",
        "CREATE INDEX commands_pending ON commands (node, acked_at)",
        """CREATE TABLE actions (
            id INTEGER PRIMARY KEY, time REAL NOT NULL, kind TEXT NOT NULL,
            subject TEXT NOT NULL, job TEXT NOT NULL, node TEXT NOT NULL,
            status TEXT NOT NULL, shadow INTEGER NOT NULL, detail TEXT NOT NULL)""",
        "CREATE INDEX actions_time ON actions (time)",
        """CREATE TABLE decisions (
            id INTEGER PRIMARY KEY, time REAL NOT NULL, job TEXT NOT NULL,
            subject TEXT NOT NULL, decision TEXT NOT NULL, reason TEXT NOT NULL,
            inputs TEXT NOT NULL)""",
        "CREATE INDEX decisions_time ON decisions (time)",
    ),
    # 2: staged bodies live in the staging log (forewarn.collector.storage.staging); the row
    # points at them. ``body`` stays for rows staged before (and is empty otherwise).
    (
        "ALTER TABLE staged_samples ADD COLUMN segment INTEGER",
        "ALTER TABLE staged_samples ADD COLUMN offset INTEGER",
        "ALTER TABLE staged_samples ADD COLUMN length INTEGER",
        "CREATE INDEX staged_segment ON staged_samples (segment)",
    ),
    # 3: a rank that ended cleanly (``RankSummary.finished``): its job is finished, not gone.
    ("ALTER TABLE ranks ADD COLUMN finished INTEGER NOT NULL DEFAULT 0",),
    # 4: a rank's phase (RankSummary.phase: eval, data, ...).
    ("ALTER TABLE ranks ADD COLUMN phase TEXT NOT NULL DEFAULT ''",),
    # 5: incidents, correlated findings with their lifecycle
    # (forewarn.collector.decide.incidents); ``findings`` is a JSON list of tracked findings.
    (
        """CREATE TABLE incidents (
            id TEXT PRIMARY KEY, scope TEXT NOT NULL, kind TEXT NOT NULL, node TEXT NOT NULL,
            gpu INTEGER, job TEXT NOT NULL, state TEXT NOT NULL, health TEXT NOT NULL,
            worst TEXT NOT NULL, checks TEXT NOT NULL, opened REAL NOT NULL,
            updated REAL NOT NULL, closed REAL, orders INTEGER NOT NULL,
            findings TEXT NOT NULL)""",
        "CREATE INDEX incidents_updated ON incidents (updated)",
        "CREATE INDEX incidents_state ON incidents (state)",
    ),
    # 6: the live scorer's learned state, one row replaced at every save
    # (forewarn.collector.decide.scorer_state).
    ("""CREATE TABLE scorer_state (
            name TEXT PRIMARY KEY, time REAL NOT NULL, gpus INTEGER NOT NULL,
            body BLOB NOT NULL)""",),
    # 7: the replica whose data_dir holds each telemetry file ('' on embedded state, whose
    # one data_dir holds them all; forewarn.collector.storage.telemetry).
    (
        "ALTER TABLE telemetry_files ADD COLUMN replica TEXT NOT NULL DEFAULT ''",
        "CREATE INDEX telemetry_files_replica ON telemetry_files (replica, day)",
    ),
)
"""Schema migrations in order; never edit a released entry, append a new one."""


_OPEN_FINDINGS = (
    "SELECT f.id FROM findings f JOIN (SELECT MAX(id) AS id FROM findings"
    " GROUP BY subject_key, check_name) newest ON f.id = newest.id"
    " WHERE f.health IN ('degraded', 'unhealthy') AND CASE WHEN f.job != ''"
    " THEN f.job IN (SELECT job FROM jobs)"
    " ELSE COALESCE(NULLIF(f.subject_node, ''), f.node) IN (SELECT node FROM nodes) END"
)
"""The ids of open findings: the newest of its check about its subject, still degraded or
unhealthy (what the GPU's health says today), about a node or job that is still known.
Retention keeps them whatever their age; a newer finding of the same check (or its subject
leaving) closes one."""

_PRUNE: tuple[tuple[str, str], ...] = (
    # Subjects first, so findings about subjects that left are no longer open.
    ("nodes", "last_seen < :before"),
    ("gpus", "last_seen < :before AND node NOT IN (SELECT node FROM nodes)"),
    ("ranks", "updated < :before"),
    ("jobs", "last_seen < :before AND job NOT IN (SELECT job FROM ranks)"),
    # Collector time (``received``), not the agent's: a skewed clock neither keeps a
    # finding forever nor drops it at once.
    ("findings", "received < :before AND id NOT IN (SELECT value FROM json_each(:open))"),
    ("incidents", "updated < :before AND state != 'open'"),
    ("xids", "time < :before"),
    ("batches", "received < :before"),
    ("actions", "time < :before"),
    ("decisions", "time < :before"),
    ("checkpoints", "time < :before"),
    ("commands", "expires < :before AND created < :before"),
)
"""What :meth:`Store.prune` deletes: table, and which of its rows are older than ``:before``."""

class _FifoLock:
    """A reentrant lock granted in the order it was asked for. ``threading.RLock`` lets a
    thread that releases and asks again at once (the ingest writer between group commits)
    take it back before a waiter that was woken gets to run on a busy machine."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        self._next = 0  # the next ticket to hand out
        self._serving = 0  # the ticket whose turn it is
        self._gone: set[int] = set()  # tickets whose waiter gave up (interrupted)
        self.waiting = 0
        """Threads waiting for their turn (read without the lock: a hint)."""

    def __enter__(self) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return
            ticket, self._next = self._next, self._next + 1
            self.waiting += 1
            try:
                while self._serving != ticket:
                    self._cond.wait()
            except BaseException:  # the turn must not wait for a waiter that left
                self._gone.add(ticket)
                self._advance()
                raise
            finally:
                self.waiting -= 1
            self._owner, self._depth = me, 1

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._serving += 1
                self._advance()

    def _advance(self) -> None:
        """Skip the tickets of waiters that left; wake the one whose turn it is."""
        while self._owner is None and self._serving in self._gone:
            self._gone.discard(self._serving)
            self._serving += 1
        self._cond.notify_all()


_KEYS = {"batches": "agent_id, seq", "gpus": "node, gpu", "ranks": "job, rank"}
"""Primary keys of the ``WITHOUT ROWID`` tables (the others are deleted by rowid)."""


class Store(RecordsMixin):
    """SQLite (WAL) database of the collector, a :class:`~.state.StateStore`. Thread-safe;
    see the module docstring."""

    unavailable: tuple[type[BaseException], ...] = (sqlite3.OperationalError,)

    def __init__(self, path: Path, *, synchronous: str = "FULL") -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._synchronous = synchronous.upper()
        self._lock = _FifoLock()
        self._local = threading.local()
        self._closed = False
        self.fence = Fence()  # one replica: never checked
        try:
            self._conn = self._connect()
            self._migrate()
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: cannot open database: {exc}") from exc

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, one transaction per write.
        conn = sqlite3.connect(
            self.path, isolation_level=None, check_same_thread=False, timeout=30.0
        )
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={self._synchronous}")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.row_factory = sqlite3.Row
        return conn

    def _migrate(self) -> None:
        with self._lock:
            version = int(self._conn.execute("PRAGMA user_version").fetchone()[0])
            if version > len(MIGRATIONS):
                raise StoreError(
                    f"{self.path}: schema version {version} is newer than this forewarn "
                    f"({len(MIGRATIONS)}); upgrade forewarn"
                )
            for number in range(version, len(MIGRATIONS)):
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    for statement in MIGRATIONS[number]:
                        self._conn.execute(statement)
                    self._conn.execute(f"PRAGMA user_version={number + 1}")
                    self._conn.execute("COMMIT")
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise

    @property
    def location(self) -> str:
        return str(self.path)

    @property
    def schema_version(self) -> int:
        return int(self._reader().execute("PRAGMA user_version").fetchone()[0])

    @contextlib.contextmanager
    def write(self, *, lead: bool = False) -> Iterator[Transaction]:
        """One write transaction (``BEGIN IMMEDIATE`` ... ``COMMIT``, rolled back on error).

        Only one writer at a time across threads; keep the body short. ``lead`` (a write
        only the leader may make) changes nothing: the embedded collector is the only
        replica, always the leader.
        """
        with self._lock:
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def _reader(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            conn.row_factory = sqlite3.Row
            self._local.conn = conn
        return conn

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """Run a read-only query on this thread's read connection; rows as dicts."""
        return [dict(row) for row in self._reader().execute(sql, params).fetchall()]

    def scalar(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """The first column of the first row of a read query, or ``None``."""
        row = self._reader().execute(sql, params).fetchone()
        return None if row is None else row[0]

    def watch_commands(self, wake: Callable[[str], None]) -> None:
        """Nothing to watch: the embedded store has one process, which wakes its own polls."""

    def write_waiters(self) -> int:
        """Threads waiting for the write lock now (the ingest writer ends a group commit
        early for them)."""
        return self._lock.waiting

    def prune(self, before: float, *, chunk: int = 1000) -> dict[str, int]:
        """Delete what is older than ``before`` (Unix time); returns the rows deleted per table.

        Records (findings, XIDs, seen batches, actions, decisions, checkpoints, expired
        commands) go by their time; nodes, GPUs, jobs and ranks go once they stopped
        reporting before ``before``. Live state stays: a node or job still reporting, and
        an *open* finding (see :data:`_OPEN_FINDINGS`, found once per pass). Deletes run in
        transactions of at most ``chunk`` rows, so ingest never waits long behind a large
        prune.

        Pruning ``batches`` forgets seqs older than the retention: an agent replaying a
        batch older than that would be stored again (its spool never holds that long).
        """
        counts: dict[str, int] = {}
        params: dict[str, Any] = {"before": before, "open": "[]"}
        for table, where in _PRUNE:
            if table == "findings":  # once, on the read connection: no lock held meanwhile
                params["open"] = json.dumps([r["id"] for r in self.query(_OPEN_FINDINGS)])
            counts[table] = self._delete_chunked(table, where, params, chunk)
        return counts

    def _delete_chunked(self, table: str, where: str, params: dict[str, Any],
                        chunk: int) -> int:
        key = _KEYS.get(table, "rowid")
        total = 0
        while True:
            with self.write() as tx:
                conn = cast("sqlite3.Connection", tx)  # named parameters: SQLite's own
                n = conn.execute(
                    f"DELETE FROM {table} WHERE ({key}) IN"
                    f" (SELECT {key} FROM {table} WHERE {where} LIMIT {int(chunk)})",
                    params).rowcount
            total += n
            if n < chunk:
                return total

    def close(self) -> None:
        """Close the write connection (and this thread's reader)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
            self._conn.close()
            conn = getattr(self._local, "conn", None)
            if conn is not None:
                conn.close()
