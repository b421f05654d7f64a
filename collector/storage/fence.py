"""Fencing: a replica that lost the lead cannot write what only the leader may write.

The policy lock (:class:`~.leader.AdvisoryLockLeader`) says which replica leads, but a
replica learns that it lost the lock only at its next check (every ``interval_s``, later
on a stalled machine): its lock session may have been ended by the server (a network
cut, ``pg_terminate_backend``) while another replica already took the lock and leads. In
that window both would decide, and a job could get two checkpoint orders. Checking a flag
before writing cannot close it, so the store refuses the stale leader's write instead.

On PostgreSQL the ``leadership`` row (migration 0009) holds an *epoch*. A replica that
takes the lock increments it in its own transaction (to at least the server's clock in
milliseconds: :data:`LEAD_SQL`) and remembers the value (:meth:`Fence.hold`) before it
calls itself the leader. Every write only the leader may make (``store.write(lead=True)``:
commands with their ``actions`` row, the queued webhook's row, the check before a drain
runs, the feed's cursor) first reads that row ``FOR SHARE`` in its transaction and goes on
only while the epoch is still its own; else it raises :class:`NotLeaderError` and the
transaction is rolled back: nothing of it is stored. Row locks make this exact: the next
leader's increment waits for a fenced write in flight to end, and every fenced write after
the increment sees the new epoch. A fenced write that sits idle in its transaction longer
than :data:`IDLE_S` (its replica stalled) has its session ended by the server, so a stall
cannot hold a takeover for long; the stalled write is then not stored. The refused replica
steps down at once (:attr:`Fence.on_lost`), says why once in its log, and counts every
refused write (``forewarn_collector_fenced_writes_total``).

With the embedded SQLite state there is one replica: the fence is never checked; nor is it
on a PostgreSQL store that no leader election uses (:attr:`Fence.armed`: one process alone
on its database, as the tests' and tools' stores are).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from forewarn.errors import StorageError

__all__ = ["FENCE_SQL", "LEAD_SQL", "Fence", "NotLeaderError"]

log = logging.getLogger(__name__)

FENCE_SQL = ("SELECT epoch, set_config('idle_in_transaction_session_timeout', %s, true)"
             " FROM leadership WHERE name = 'policy' FOR SHARE")
"""The first statement of a fenced write: the epoch, locked against a takeover until the
transaction ends, and (the parameter, milliseconds) how long the transaction may sit idle
before the server ends its session (:attr:`Fence.idle_s`)."""

IDLE_S = 10.0
"""How long a fenced write may sit idle in its transaction (its replica stalled: SIGSTOP,
a swap storm) before PostgreSQL ends the session: the share lock would otherwise hold the
next leader's takeover for as long as the stall lasts."""

_CLOCK_MS = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
LEAD_SQL = ("INSERT INTO leadership (name, epoch)"
            f" VALUES ('policy', {_CLOCK_MS})"
            " ON CONFLICT (name) DO UPDATE"
            f" SET epoch = GREATEST(leadership.epoch + 1, {_CLOCK_MS}) RETURNING epoch")
"""Run by a replica that took the lock, before it leads: its epoch, at least the database
server's clock in milliseconds. Not merely the row plus one: the row may have lost the
last increment (a failover to an asynchronous standby, a crash with ``synchronous_commit =
off``), and the next leader would take the epoch the old leader still holds, both passing
the fence; nor may a row deleted by hand (made again by this upsert: an UPDATE returned
nothing, and the election died) start over at an epoch a stale leader holds. Still one more
than the row when the server's clock is behind it."""


class NotLeaderError(StorageError, RuntimeError):
    """A write only the leader may make was refused: another replica took the lead since
    this one did (or this one does not lead). Nothing of the write was stored."""


class Fence:
    """This replica's lead epoch, as the store checks it (see the module docstring).
    Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch = 0  # 0: this replica does not lead
        self.refused = 0
        """Fenced writes refused so far."""
        self.on_lost: Callable[[], None] | None = None
        """Set by the leader election that uses this fence (:meth:`arm`)."""
        self.on_refused: Callable[[], None] | None = None
        """Called for every refused write (a metric)."""
        self.idle_s = IDLE_S
        """How long a fenced write may sit idle in its transaction (:data:`IDLE_S`)."""

    @property
    def armed(self) -> bool:
        """Whether a leader election uses this fence: a store no election uses (one
        process alone on its database) writes without the check."""
        return self.on_lost is not None

    def arm(self, on_lost: Callable[[], None]) -> None:
        """A leader election uses this fence: ``on_lost`` is called once when a refusal
        shows that the epoch it held was taken over (it steps down)."""
        self.on_lost = on_lost

    @property
    def epoch(self) -> int:
        """The epoch this replica leads in (0: none)."""
        return self._epoch

    def hold(self, epoch: int) -> None:
        """This replica leads in ``epoch`` (it incremented the stored one to that)."""
        with self._lock:
            self._epoch = epoch

    def release(self) -> None:
        """This replica no longer leads."""
        with self._lock:
            self._epoch = 0

    def refuse(self, held: int, current: int) -> NotLeaderError:
        """A fenced write that held ``held`` found ``current`` stored: count it, and the
        first time for that epoch step down and say why; the error to raise."""
        with self._lock:
            lost = held != 0 and self._epoch == held
            if lost:
                self._epoch = 0
            self.refused += 1
        if self.on_refused is not None:
            self.on_refused()
        if held == 0:
            why = f"this replica does not lead (the lead is in epoch {current})"
        else:
            why = f"this replica led in epoch {held}; another took the lead in epoch {current}"
        if lost:
            log.warning("a leader-only write was refused (nothing stored): %s; stepping down",
                        why)
            if self.on_lost is not None:
                self.on_lost()
        return NotLeaderError(f"leader-only write refused: {why}")
