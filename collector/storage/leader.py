"""Which replica runs the policy: leader election, and the findings feed the leader reads.

With the embedded SQLite state there is one collector, always the leader
(:class:`SoleLeader`). With shared PostgreSQL state several replicas ingest, serve the read
API and the agents' long polls, but only one decides (policy, orders, actions):

* :class:`AdvisoryLockLeader` holds ``pg_try_advisory_lock(POLICY_LOCK)`` on a dedicated
  session (its own connection, outside the pool). PostgreSQL releases the lock when that
  session ends: the process died (a SIGKILL closes its socket at once), the server
  restarted, or the connection was cut (TCP keepalives and ``tcp_user_timeout`` bound how
  long a silent network takes). The other replicas try the lock every ``interval_s`` and
  one of them takes over. The holder checks its session every ``interval_s`` too and steps
  down when that fails, but another replica may hold the lock before that check: so the
  writes only the leader may make are fenced (:mod:`.fence`): a replica that takes the lock
  increments the stored lead epoch, and the store refuses a fenced write of any other
  epoch; the refused replica steps down at once.
* :class:`FindingsFeed`: the leader reads every finding stored by any replica from the
  ``findings`` table in id order, and records in ``policy_cursor`` how far it got, so a new
  leader goes on where the old one stopped. Identity values become visible out of order
  (a transaction that took id 10 may commit after the one that took id 11), so an id the
  feed skipped is looked for again until ``gap_s`` has passed (a rolled-back insert leaves
  a gap that never fills).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from forewarn.wire import Finding

from .fence import LEAD_SQL, Fence
from .state import StateStore

__all__ = ["POLICY_LOCK", "AdvisoryLockLeader", "FindingsFeed", "Leadership", "SoleLeader",
           "leads_in"]

log = logging.getLogger(__name__)

POLICY_LOCK = 0x666F7265_706F6C69
"""Advisory lock key ("forepoli") whose holder runs the policy."""

LOCAL_ORIGINS = frozenset({"operator", "expiry", "peers", "predictor"})
"""Findings decided by the replica that stored them, not through the feed: an operator's
order that came in on the leader is answered with its decisions (a follower stores one it
receives under another origin, which the feed hands to the leader:
:mod:`forewarn.collector.decide.policy_service`); the collector's own findings (the
expiry of a silent source, the job-peers comparison, the predictor) are made only while a
replica leads, and that leader runs them through its policy as it stores them. Read back,
they would be decided a second time, as an agent's."""

FIRST_WINDOW_S = 60.0
"""With no saved cursor, the feed starts with the findings received this recently."""

_finding_decoder = msgspec.json.Decoder(Finding)


class Leadership(Protocol):
    """Whether this replica runs the policy now."""

    @property
    def is_leader(self) -> bool:
        """True while this replica may decide; may turn false at any time."""
        ...

    @property
    def term(self) -> int:
        """How many times this replica became the leader: work begun as leader may keep
        its effects (a saved cursor, an acknowledgement) only while the term it began in
        goes on (:func:`leads_in`)."""
        ...

    @property
    def shared(self) -> bool:
        """Whether other replicas share the state (the leader then reads findings from the
        store's feed instead of from its own ingest)."""
        ...

    def status(self) -> dict[str, Any]:
        """For /readyz: role, since when, and the last error."""
        ...

    def start(self) -> None:
        """Begin campaigning (returns at once)."""
        ...

    def stop(self) -> None:
        """Give up leadership and end the session."""
        ...


class SoleLeader:
    """The embedded collector: the only replica, always the leader."""

    is_leader = True
    term = 1
    shared = False

    def status(self) -> dict[str, Any]:
        return {"role": "leader", "election": "none (embedded state)"}

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


class AdvisoryLockLeader:
    """Leader election on a PostgreSQL advisory lock; see the module docstring.

    ``on_change(is_leader)`` is called on every change (from the election thread, or from
    a thread whose fenced write was refused). ``fence``: the state store's
    (:attr:`~.state.StateStore.fence`); the replica takes a new lead epoch each time it
    takes the lock, and steps down when a fenced write finds another's."""

    shared = True

    def __init__(self, dsn: str, *, key: int = POLICY_LOCK, interval_s: float = 0.5,
                 on_change: Callable[[bool], None] | None = None,
                 clock: Callable[[], float] = time.time, fence: Fence | None = None) -> None:
        self.dsn = dsn
        self.key = key
        self.interval_s = interval_s
        self.on_change = on_change
        self.clock = clock
        self._leader = False
        self._term = 0
        self._since = clock()
        self._error = ""
        self._lock = threading.Lock()  # _set from the election thread and a refused write
        self.fence = fence
        if fence is not None:
            fence.arm(functools.partial(self._set, False))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="forewarn-leader", daemon=True)

    @property
    def is_leader(self) -> bool:
        return self._leader

    @property
    def term(self) -> int:
        return self._term

    def status(self) -> dict[str, Any]:
        return {"role": "leader" if self._leader else "follower", "since": self._since,
                "election": "postgresql advisory lock", "error": self._error}

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def _set(self, leader: bool) -> None:
        with self._lock:
            if leader == self._leader:
                return
            if leader:
                self._term += 1  # before _leader: a reader that sees it leading sees this
            elif self.fence is not None:
                self.fence.release()
            self._leader, self._since = leader, self.clock()
        log.warning("this replica is now the %s", "leader" if leader else "follower")
        if self.on_change is not None:
            self.on_change(leader)

    def _connect(self) -> Any:
        import psycopg

        # A silent network must not keep a dead leader's lock for long, nor let this
        # replica believe it leads: keepalives and tcp_user_timeout bound both (5 s).
        return psycopg.connect(self.dsn, autocommit=True, connect_timeout=5,
                               application_name="forewarn-leader", keepalives=1,
                               keepalives_idle=2, keepalives_interval=1, keepalives_count=3,
                               tcp_user_timeout=5000)

    def _take_epoch(self, conn: Any) -> None:
        """The lock is ours: a new lead epoch, before this replica leads (the increment
        waits for a fenced write of the last leader in flight; every later one is refused)."""
        if self.fence is None:
            return
        row = conn.execute(LEAD_SQL).fetchone()
        self.fence.hold(int(row[0]))

    def _run(self) -> None:
        import psycopg

        conn: Any = None
        while not self._stop.is_set():
            try:
                if conn is None:
                    conn = self._connect()
                if self._leader:
                    conn.execute("SELECT 1")  # the session lives, so the lock is still ours
                else:
                    row = conn.execute("SELECT pg_try_advisory_lock(%s)", (self.key,)).fetchone()
                    if row and row[0]:
                        self._take_epoch(conn)
                        self._set(True)
                self._error = ""
            except Exception as exc:  # the election must outlive any round
                # A round that fails, for whatever reason, steps down and starts again on
                # a fresh session (closing this one frees the lock if it was taken).
                self._error = f"{type(exc).__name__}: {exc}"[:500]
                if isinstance(exc, (psycopg.Error, OSError)):
                    log.warning("leader election: %s", self._error)
                else:
                    log.exception("leader election: an unforeseen error; trying again")
                with contextlib.suppress(Exception):
                    self._set(False)  # before the session ends and frees the lock
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.close()
                conn = None
            self._stop.wait(self.interval_s)
        self._set(False)
        if conn is not None:
            conn.close()  # the session ends: the lock goes to another replica at once


def leads_in(leader: Leadership, term: int) -> bool:
    """Whether ``leader`` still leads in ``term``: it has led without a break since then
    (a replica that lost the lock and took it again is in a later term: another may
    have decided meanwhile)."""
    return leader.is_leader and leader.term == term


class FindingsFeed:
    """The findings every replica stored, in id order, for the leader; see the module
    docstring. Not thread-safe: one caller (the leader's feed task)."""

    def __init__(self, store: StateStore, *, name: str = "policy", batch: int = 500,
                 gap_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.name = name
        self.batch = batch
        self.gap_s = gap_s
        self.clock = clock
        self._cursor: int | None = None
        self._gaps: dict[int, float] = {}  # skipped id -> when to stop looking for it

    def resume(self) -> None:
        """Start where the last leader stopped (or, the first time, with the findings of
        the last :data:`FIRST_WINDOW_S`: those that came in while it was being elected)."""
        saved = self.store.scalar("SELECT last_id FROM policy_cursor WHERE name = ?",
                                  (self.name,))
        if saved is None:  # the first leader ever: what arrived while it was elected
            saved = self.store.scalar("SELECT COALESCE(MAX(id), 0) FROM findings"
                                      " WHERE received < ?", (time.time() - FIRST_WINDOW_S,))
        self._cursor = int(saved or 0)
        self._gaps.clear()

    def take(self) -> list[tuple[str, Finding]]:
        """Findings stored since the last call (and skipped ids that became visible), each
        with the origin it was stored with."""
        if self._cursor is None:
            self.resume()
        assert self._cursor is not None
        now = self.clock()
        self._gaps = {i: t for i, t in self._gaps.items() if t > now}
        rows = self.store.query("SELECT id, origin, body FROM findings WHERE id > ? ORDER BY id"
                                " LIMIT ?", (self._cursor, self.batch))
        if self._gaps:
            late = sorted(self._gaps)
            marks = ", ".join("?" * len(late))
            rows += self.store.query(
                f"SELECT id, origin, body FROM findings WHERE id IN ({marks})", late)
        out = []
        for row in sorted(rows, key=lambda r: int(r["id"])):
            found = int(row["id"])
            self._gaps.pop(found, None)
            if found > self._cursor:
                for missing in range(self._cursor + 1, found):
                    self._gaps[missing] = now + self.gap_s
                self._cursor = found
            if row["origin"] in LOCAL_ORIGINS:
                continue
            try:
                out.append((str(row["origin"]), _finding_decoder.decode(row["body"])))
            except msgspec.DecodeError as exc:  # stored by ingest, so valid; never wedge
                log.error("finding %d cannot be decoded for the policy: %s", found, exc)
        return out

    def mark(self) -> int | None:
        """What :meth:`save` records now: below the oldest id still looked for (``None``
        before the first :meth:`resume`)."""
        if self._cursor is None:
            return None
        return min(self._gaps, default=self._cursor + 1) - 1

    def save(self, upto: int | None = None) -> None:
        """Record how far the policy got (:meth:`mark`), but not past ``upto`` when given
        (findings after it were handed over and are not all decided yet)."""
        mark = self.mark()
        if mark is None:
            return
        if upto is not None:
            mark = min(mark, upto)
        with self.store.write(lead=True) as tx:  # a stale leader's cursor is refused
            tx.execute("INSERT INTO policy_cursor (name, last_id, updated) VALUES (?, ?, ?)"
                       " ON CONFLICT (name) DO UPDATE SET last_id = excluded.last_id,"
                       " updated = excluded.updated", (self.name, mark, time.time()))
