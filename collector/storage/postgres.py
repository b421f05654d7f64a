"""The collector's state on PostgreSQL (scale-out mode): a :class:`~.state.StateStore`
through psycopg 3 and a connection pool.

Several collector replicas share one database. Every write is one transaction on a pooled
connection (PostgreSQL serialises conflicting rows itself, so writers need no process lock).
The statements are the shared dialect of :mod:`.state`, rewritten once per distinct
statement by :func:`to_postgres` (``?`` to ``%s``, ``INSERT OR IGNORE`` to ``ON CONFLICT DO
NOTHING``, two-argument ``MAX`` to ``GREATEST``).

Schema: the numbered files ``migrations/NNNN_*.sql`` run in order, each in its own
transaction that also records it in ``schema_version``; replicas that start together
serialise on a transaction-scoped advisory lock, so each file runs once.

Trouble with the server (down, restarting, failing over) raises
:class:`psycopg.OperationalError` (listed in :attr:`PostgresStore.unavailable`); the pool
reconnects on the next use, so callers retry their unit of work (see
:class:`~forewarn.collector.ingest.batch.IngestWriter`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.resources
import re
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import psycopg
from psycopg.adapt import Loader
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from .state import RecordsMixin, Transaction
from .store import _OPEN_FINDINGS, _PRUNE, StoreError

__all__ = ["MIGRATION_LOCK", "PostgresStore", "migrations", "to_postgres"]

MIGRATION_LOCK = 0x666F7265_7761726E & 0x7FFFFFFFFFFFFFFF
"""Advisory lock key ("forewarn") held while migrations run."""

READ_ATTEMPTS = 3
"""Tries of a read whose connection fails (a restarted server's pooled connections)."""

_REPLACE_KEYS = {"telemetry_files": "name"}
"""Primary key of each table the dialect's ``INSERT OR REPLACE`` is used on."""

_PRUNE_KEYS = {"nodes": "node", "gpus": "node, gpu", "ranks": "job, rank", "jobs": "job",
               "batches": "agent_id, seq", "commands": "id"}
"""Row keys for chunked deletes (tables not named here have an ``id``)."""


def migrations() -> list[tuple[int, str, str]]:
    """The schema migrations shipped with forewarn: (number, file name, SQL), in order."""
    folder = importlib.resources.files("forewarn.collector.storage.migrations")
    out = []
    for entry in folder.iterdir():
        match = re.fullmatch(r"(\d{4})_\w+\.sql", entry.name)
        if match:
            out.append((int(match.group(1)), entry.name, entry.read_text(encoding="utf-8")))
    out.sort()
    if [n for n, _name, _sql in out] != list(range(1, len(out) + 1)):
        raise StoreError(f"migrations are not numbered 1..{len(out)} without gaps: "
                         f"{[name for _n, name, _sql in out]}")
    return out


def _greatest(sql: str) -> str:
    """Two-argument ``MAX(a, b)`` (SQLite's scalar max) as ``GREATEST(a, b)``; the
    one-argument aggregate stays."""
    out, i = [], 0
    for match in re.finditer(r"\bMAX\(", sql, flags=re.IGNORECASE):
        start = match.end()
        depth, comma = 1, False
        for j in range(start, len(sql)):
            ch = sql[j]
            if ch == "(":
                depth += 1
            elif ch == ")":
                depth -= 1
                if depth == 0:
                    break
            elif ch == "," and depth == 1:
                comma = True
        if comma:
            out.append(sql[i:match.start()] + "GREATEST(")
            i = start
    out.append(sql[i:])
    return "".join(out)


@functools.lru_cache(maxsize=512)
def to_postgres(sql: str) -> str:
    """One statement of the :mod:`.state` dialect in PostgreSQL's (psycopg's) terms."""
    text = _greatest(sql)
    ignore = re.match(r"\s*INSERT\s+OR\s+IGNORE\s+INTO\b", text, flags=re.IGNORECASE)
    if ignore:
        text = "INSERT INTO" + text[ignore.end():] + " ON CONFLICT DO NOTHING"
    replace = re.match(r"\s*INSERT\s+OR\s+REPLACE\s+INTO\s+(\w+)\s*\(([^)]*)\)", text,
                       flags=re.IGNORECASE)
    if replace:
        table, columns = replace.group(1), [c.strip() for c in replace.group(2).split(",")]
        key = _REPLACE_KEYS[table]
        sets = ", ".join(f"{c} = excluded.{c}" for c in columns if c != key)
        text = (f"INSERT INTO {table} ({', '.join(columns)})" + text[replace.end():]
                + f" ON CONFLICT ({key}) DO UPDATE SET {sets}")
    return text.replace("%", "%%").replace("?", "%s")


def _params(params: Sequence[Any]) -> Sequence[Any]:
    # The schema keeps booleans as integers (as SQLite does); PostgreSQL will not cast.
    if any(type(p) is bool for p in params):
        return [int(p) if type(p) is bool else p for p in params]
    return params


class _Row(tuple[Any, ...]):
    """A row that indexes by position and by column name, as :class:`sqlite3.Row` does."""

    _index: dict[str, int]

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return tuple.__getitem__(self, self._index[key])
        return tuple.__getitem__(self, key)

    def keys(self) -> list[str]:
        return list(self._index)


def _row_factory(cursor: Any) -> Any:
    index = {c.name: i for i, c in enumerate(cursor.description or ())}

    def make(values: Sequence[Any]) -> _Row:
        row = _Row(values)
        row._index = index
        return row

    return make


class _FloatNumeric(Loader):
    """``numeric`` (what ``SUM`` of bigints returns) as float, as SQLite answers."""

    def load(self, data: Any) -> float:
        return float(bytes(data))


class _Cursor:
    def __init__(self, cur: psycopg.Cursor[Any]) -> None:
        self._cur = cur

    @property
    def rowcount(self) -> int:
        return self._cur.rowcount

    @property
    def lastrowid(self) -> int | None:
        # The session's last generated identity value: the INSERT just run.
        row = self._cur.connection.execute("SELECT lastval()").fetchone()
        return None if row is None else int(row[0])

    def fetchone(self) -> Any:
        return self._cur.fetchone()

    def fetchall(self) -> list[Any]:
        return self._cur.fetchall()


class _Transaction:
    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> _Cursor:
        cur = self._conn.cursor(row_factory=_row_factory)
        cur.execute(to_postgres(sql), _params(params) or None)
        return _Cursor(cur)

    def executemany(self, sql: str, params: Iterable[Sequence[Any]]) -> None:
        with self._conn.cursor() as cur:
            cur.executemany(to_postgres(sql), [_params(p) for p in params])


def _redact(dsn: str) -> str:
    """``dsn`` without its password, for messages."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "postgresql (unparsable DSN)"
    info.pop("password", None)
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})


class PostgresStore(RecordsMixin):
    """The collector's state in PostgreSQL, a :class:`~.state.StateStore`. Thread-safe.

    ``dsn`` is a libpq connection string or URI. ``pool_max`` bounds the connections this
    replica opens. Raises :class:`~.store.StoreError` when the server cannot be reached
    within ``connect_timeout_s`` or the schema is newer than this forewarn.
    """

    unavailable: tuple[type[BaseException], ...] = (psycopg.OperationalError,)

    def __init__(self, dsn: str, *, pool_min: int = 1, pool_max: int = 8,
                 connect_timeout_s: float = 30.0) -> None:
        self.dsn = dsn
        self._closed = False
        self._close_lock = threading.Lock()
        self._pool = ConnectionPool(dsn, min_size=pool_min, max_size=pool_max, open=False,
                                    configure=self._configure, timeout=connect_timeout_s,
                                    name="forewarn-state")
        try:
            self._pool.open(wait=True, timeout=connect_timeout_s)
            self._migrate()
        except (psycopg.Error, OSError) as exc:
            self._pool.close()
            raise StoreError(f"{self.location}: cannot open database: {exc}") from exc

    @staticmethod
    def _configure(conn: psycopg.Connection[Any]) -> None:
        conn.adapters.register_loader("numeric", _FloatNumeric)

    @property
    def location(self) -> str:
        return _redact(self.dsn)

    def _migrate(self) -> None:
        wanted = migrations()
        with self._pool.connection() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY"
                         " KEY, name TEXT NOT NULL, applied DOUBLE PRECISION NOT NULL)")
        for number, name, text in wanted:
            with self._pool.connection() as conn:
                # Replicas starting together: one runs each file, the others then skip it.
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
                if number <= self._version(conn, len(wanted)):
                    continue
                conn.execute(text.encode())  # our own file: several statements
                conn.execute("INSERT INTO schema_version (version, name, applied)"
                             " VALUES (%s, %s, extract(epoch FROM now()))", (number, name))

        with self._pool.connection() as conn:
            self._version(conn, len(wanted))

    def _version(self, conn: psycopg.Connection[Any], known: int) -> int:
        """The schema version recorded; :class:`StoreError` when newer than ``known``."""
        row = conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()
        current = int(row[0]) if row else 0
        if current > known:
            raise StoreError(f"{self.location}: schema version {current} is newer than this "
                             f"forewarn ({known}); upgrade forewarn")
        return current

    @property
    def schema_version(self) -> int:
        return int(self.scalar("SELECT COALESCE(MAX(version), 0) FROM schema_version") or 0)

    @contextlib.contextmanager
    def write(self) -> Iterator[Transaction]:
        """One transaction on a pooled connection: committed at the end of the block,
        rolled back when it raises."""
        with self._pool.connection() as conn:
            yield _Transaction(conn)

    def _read(self, sql: str, params: Sequence[Any]) -> list[dict[str, Any]]:
        """A read, tried again on a fresh connection when a pooled one turns out dead
        (after a server restart every idle connection is): reads are idempotent."""
        for attempt in range(READ_ATTEMPTS):
            try:
                with self._pool.connection() as conn, \
                        conn.cursor(row_factory=dict_row) as cur:
                    cur.execute(to_postgres(sql), _params(params) or None)
                    return cur.fetchall()
            except psycopg.OperationalError:
                if attempt == READ_ATTEMPTS - 1:
                    raise
                time.sleep(0.1 * (attempt + 1))
        raise AssertionError("unreachable")

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """Run a read-only query; rows as dicts."""
        return self._read(sql, params)

    def scalar(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """The first column of the first row of a read query, or ``None``."""
        rows = self._read(sql, params)
        return next(iter(rows[0].values())) if rows else None

    def prune(self, before: float, *, chunk: int = 1000) -> dict[str, int]:
        """As :meth:`forewarn.collector.storage.store.Store.prune`, in chunks of ``chunk``."""
        counts: dict[str, int] = {}
        params: dict[str, Any] = {"before": before, "open": []}
        for table, where in _PRUNE:
            if table == "findings":
                params["open"] = [int(r["id"]) for r in self.query(_OPEN_FINDINGS)]
            condition = re.sub(r":(\w+)", r"%(\1)s", where.replace(
                "id NOT IN (SELECT value FROM json_each(:open))", "NOT (id = ANY(:open))"))
            key = _PRUNE_KEYS.get(table, "id")
            statement = (f"DELETE FROM {table} WHERE ({key}) IN (SELECT {key} FROM {table}"
                         f" WHERE {condition} LIMIT {int(chunk)})")
            total = 0
            while True:
                with self._pool.connection() as conn:
                    n = conn.execute(statement.encode(), params).rowcount
                total += n
                if n < chunk:
                    break
            counts[table] = total
        return counts

    def close(self) -> None:
        """Close the pool's connections."""
        with self._close_lock:
            if not self._closed:
                self._closed = True
                self._pool.close()
