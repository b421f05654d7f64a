"""The storage seam for the collector's STATE: what every layer above ``storage/`` may use.

State is everything the collector keeps in tables: agent identity bindings (``batches``:
which node an ``agent_id`` belongs to, and every accepted ``(agent_id, seq)``), nodes,
GPUs, jobs and rank tables, findings, XIDs, checkpoints, decisions, actions, alerts, the
per-node command queues, and the bookkeeping of staged telemetry. Two implementations sit
behind :class:`StateStore`:

* :class:`~forewarn.collector.storage.store.Store`: SQLite in WAL mode, the embedded
  default (``state = "sqlite"``);
* :class:`~forewarn.collector.storage.postgres.PostgresStore`: PostgreSQL through psycopg 3
  with a connection pool, for the scale-out mode (``state = "postgresql"``).

The contract is SQL-shaped on purpose: the collector's queries are small and set-based,
and one dialect both engines run keeps one copy of each. That dialect is:

* ``?`` placeholders (positional parameters);
* ``INSERT ... ON CONFLICT (...) DO UPDATE SET col = excluded.col`` upserts, and
  ``INSERT OR IGNORE INTO`` (the PostgreSQL store rewrites it to ``ON CONFLICT DO
  NOTHING``) and ``INSERT OR REPLACE INTO telemetry_files`` (rewritten to an upsert);
* two-argument ``MAX(a, b)`` for the larger of two non-null values (rewritten to
  ``GREATEST``);
* ``SAVEPOINT name`` / ``ROLLBACK TO name`` / ``RELEASE name`` inside a write;
* booleans stored as integers 0/1, times as Unix seconds (double precision);
* ``cursor.lastrowid`` after an ``INSERT`` into a table whose ``id`` is generated.

Anything outside it (``json_each``, ``PRAGMA``, ``rowid``) belongs inside an implementation.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..config import CollectorConfig
    from .fence import Fence

__all__ = ["Cursor", "RecordsMixin", "StateStore", "Transaction", "insert_action", "open_state"]


class Cursor(Protocol):
    """The result of :meth:`Transaction.execute`. Rows index by position and by column
    name (``row[0]``, ``row["node"]``)."""

    @property
    def rowcount(self) -> int:
        """Rows the statement changed (0 for an ``INSERT OR IGNORE`` that found its key)."""
        ...

    @property
    def lastrowid(self) -> int | None:
        """The generated ``id`` of the row the last ``INSERT`` added."""
        ...

    def fetchone(self) -> Any:
        """The next row, or ``None``."""
        ...

    def fetchall(self) -> list[Any]:
        """The remaining rows."""
        ...


class Transaction(Protocol):
    """One open write transaction (see :meth:`StateStore.write`)."""

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Cursor:
        """Run one statement of the dialect in the module docstring."""
        ...

    def executemany(self, sql: str, params: Iterable[Sequence[Any]]) -> Any:
        """Run one statement once per parameter row."""
        ...


class StateStore(Protocol):
    """The collector's state. Thread-safe: any thread may read and write.

    ``unavailable`` names the exception types that mean the store itself is in trouble
    (disk, lock, lost connection): a caller fails its whole unit of work with them and
    retries later, where any other exception is the fault of the data at hand.
    """

    unavailable: tuple[type[BaseException], ...]

    fence: Fence
    """This replica's lead epoch, checked by ``write(lead=True)`` (:mod:`.fence`)."""

    @property
    def location(self) -> str:
        """Where the state lives, for messages (a path, or a DSN without its password)."""
        ...

    @property
    def schema_version(self) -> int:
        """How many schema migrations have run."""
        ...

    def write(self, *, lead: bool = False) -> contextlib.AbstractContextManager[Transaction]:
        """One write transaction: committed when the block ends, rolled back when it
        raises. Keep the body short: writers may be serialised.

        ``lead``: a write only the leader may make (commands with their action row, a
        queued webhook's row, the check before a drain, the feed's cursor). With shared
        state it raises :class:`~.fence.NotLeaderError`, storing nothing, once another
        replica has taken the lead since this one did (:mod:`.fence`)."""
        ...

    def write_waiters(self) -> int:
        """How many threads wait to begin a write transaction now (0 where writers are
        not serialised): a long writer (the ingest writer's group commit) ends its
        transaction early for them."""
        ...

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """Run a read-only query; rows as dicts."""
        ...

    def scalar(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """The first column of the first row of a read query, or ``None``."""
        ...

    def record_action(self, *, time: float, kind: str, subject: str = "", job: str = "",
                      node: str = "", status: str, shadow: bool = False,
                      detail: dict[str, Any] | None = None, lead: bool = False) -> int:
        """Store one action (taken, withheld or shadowed); returns its id. ``lead``: a
        fenced write (:meth:`write`)."""
        ...

    def record_decision(self, *, time: float, job: str = "", subject: str = "",
                        decision: str, reason: str, inputs: dict[str, Any]) -> int:
        """Store one policy decision with every input it used; returns its id."""
        ...

    def watch_commands(self, wake: Callable[[str], None]) -> None:
        """Call ``wake(node)`` (from another thread) whenever a process sharing this state
        queues a command for ``node``, so long polls held here answer at once. A store
        no other process shares does nothing (its one process wakes its own polls)."""
        ...

    def prune(self, before: float, *, chunk: int = 1000) -> dict[str, int]:
        """Delete what is older than ``before`` (Unix time), keeping live state (see
        :meth:`forewarn.collector.storage.store.Store.prune`); rows deleted per table."""
        ...

    def close(self) -> None:
        """Release connections; the store is unusable afterwards."""
        ...


class RecordsMixin:
    """The policy's records written through :meth:`StateStore.write`, shared by both
    implementations (the SQL is in the common dialect)."""

    def write(self, *, lead: bool = False) -> contextlib.AbstractContextManager[Transaction]:
        raise NotImplementedError

    def record_action(self, *, time: float, kind: str, subject: str = "", job: str = "",
                      node: str = "", status: str, shadow: bool = False,
                      detail: dict[str, Any] | None = None, lead: bool = False) -> int:
        """Store one action (taken, withheld or shadowed); returns its id. ``lead``: a
        fenced write (:meth:`StateStore.write`)."""
        with self.write(lead=lead) as conn:
            return insert_action(conn, time=time, kind=kind, subject=subject, job=job,
                                 node=node, status=status, shadow=shadow, detail=detail)

    def record_decision(self, *, time: float, job: str = "", subject: str = "",
                        decision: str, reason: str, inputs: dict[str, Any]) -> int:
        """Store one policy decision with every input it used, so it can be explained."""
        with self.write() as conn:
            cur = conn.execute(
                "INSERT INTO decisions (time, job, subject, decision, reason, inputs)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (time, job, subject, decision, reason, json.dumps(inputs, default=str)),
            )
            return int(cur.lastrowid or 0)


def insert_action(conn: Transaction, *, time: float, kind: str, subject: str = "",
                  job: str = "", node: str = "", status: str, shadow: bool = False,
                  detail: dict[str, Any] | None = None) -> int:
    """:meth:`StateStore.record_action` inside the open transaction ``conn`` (an order's
    action row goes with its commands: :meth:`.commands.CommandQueue.order_checkpoint`)."""
    cur = conn.execute(
        "INSERT INTO actions (time, kind, subject, job, node, status, shadow, detail)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (time, kind, subject, job, node, status, int(shadow),
         json.dumps(detail or {}, default=str)),
    )
    return int(cur.lastrowid or 0)


def open_state(config: CollectorConfig) -> StateStore:
    """The state store ``config.state`` names (psycopg is imported only for PostgreSQL).
    Raises :class:`~.store.StoreError` when it cannot be opened."""
    if config.state == "postgresql":
        try:
            from .postgres import PostgresStore
        except ImportError as exc:
            from .store import StoreError

            raise StoreError(f'state = "postgresql" needs psycopg 3 and psycopg-pool: pip '
                             f"install 'forewarn[scale]' ({exc})") from None

        return PostgresStore(config.postgres_dsn, pool_max=config.postgres_pool_max)
    from .store import Store

    return Store(config.db_path, synchronous=config.sqlite_synchronous)
