"""The live scorer's learned state kept in the store, so that a collector restart (an
upgrade, a crash, a node reboot) or a scale-out takeover keeps every GPU's own baseline,
its alarm memory and the shadow counts (:mod:`forewarn.models.live_state` says what is in a
snapshot and what is refused).

:class:`ScorerSnapshots` keeps one row of the ``scorer_state`` table (migration 6 in
SQLite, ``0007_scorer_state.sql`` in PostgreSQL), replaced at every save, never
accumulated:

* :meth:`ScorerSnapshots.save`: every :data:`SNAPSHOT_EVERY_S` after a scoring, by the
  leader only. The policy thread copies the scorer's arrays (:func:`~forewarn.models.
  live_state.capture`: a few milliseconds at 20,000 GPUs, bench/RESULTS.md); compressing
  and writing them runs on a thread of its own, one write at a time (a save due while the
  last one is still writing is skipped). At a clean stop the last state is written before
  the collector exits, so an upgrade loses nothing.
* :meth:`ScorerSnapshots.load`: when this replica starts to lead (at start, at a takeover),
  before the predictor sees a batch. A snapshot that does not fit (another feature grid, a
  corrupt blob, over a week old, a row over :data:`MAX_BYTES`: refused from its length,
  unread) is logged with the reason and counted, and the scorer
  starts fresh: the collector never fails to start on it. A store that cannot be read
  (a database failing over) is tried again at the next batch, and nothing is saved over
  the row until it was read: a transient error delays the restore, never loses the state.

The row's ``time`` is the end of the last minute the saved scorer held: a save replaces
the row only when it is not older (a replica that lost the lead and has not noticed yet
does not replace the new leader's state; counted ``superseded``). A refused row is
deleted (a corrupt one, or one too old for any replica), except a snapshot another
forewarn version wrote (:class:`~forewarn.models.live_state.ForeignSnapshot`: another
format, feature grid or set of state arrays): during a rolling upgrade an older replica
that leads refuses the newer replicas' snapshot and starts fresh, but leaves the row in
place and saves nothing over it until it is :data:`~forewarn.models.live_state.MAX_AGE_S`
older than what it would save (counted ``superseded``), so the newer replicas restore
their state when they lead again; after a rollback, the older version's saves resume
once the newer snapshot is a week stale, when no replica could restore it anyway.
Counted in ``forewarn_collector_predictor_state_snapshots_total{result}``:
``saved``, ``restored``, ``refused``, ``failed`` (the store could not be read or written),
``skipped`` (the last write still under way), ``superseded``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from forewarn.models.live import LiveScorer
    from forewarn.models.live_state import Captured

    from ..storage.state import StateStore

__all__ = ["MAX_BYTES", "SNAPSHOT_EVERY_S", "ScorerSnapshots"]

log = logging.getLogger(__name__)

SNAPSHOT_EVERY_S: Final = 300.0
"""How often the leader saves the scorer's state: what a crash can lose at most."""
MAX_BYTES: Final = 256 << 20
"""Largest row read (a 20,000-GPU snapshot is 2.5 MiB): a larger one is refused from its
length, never read into the collector's memory."""
_NAME: Final = "live_scorer"


class ScorerSnapshots:
    """See the module docstring. ``save`` and ``load`` run on the policy thread."""

    def __init__(self, store: StateStore, every_s: float = SNAPSHOT_EVERY_S,
                 max_bytes: int = MAX_BYTES) -> None:
        self.store = store
        self.every_s = every_s
        self.max_bytes = max_bytes
        self.counts = {"saved": 0, "restored": 0, "refused": 0, "failed": 0, "skipped": 0,
                       "superseded": 0}
        self.bytes = 0
        """Size of the last snapshot written."""
        self.capture_seconds = 0.0
        """The policy thread's share of the last save (copying the arrays)."""
        self.last_saved: float | None = None
        self._writer = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="forewarn-scorer-state")
        self._pending: concurrent.futures.Future[None] | None = None
        self._foreign = False
        """The last load found another version's snapshot: saves leave it in place."""

    def due(self, now: float) -> bool:
        """Whether a save is due at ``now``."""
        return self.last_saved is None or not 0 <= now - self.last_saved < self.every_s

    def save(self, scorer: LiveScorer, now: float, *, wait: bool = False) -> None:
        """Copy the scorer's state now and write it (in the background unless ``wait``)."""
        from forewarn.models.live_state import capture

        if self._pending is not None and not self._pending.done():
            if not wait:
                self.counts["skipped"] += 1
                return
            self._pending.result()
        started = time.perf_counter()
        captured = capture(scorer, now)
        self.capture_seconds = time.perf_counter() - started
        self.last_saved = now
        if wait:
            self._write(captured)
        else:
            self._pending = self._writer.submit(self._write, captured)

    def _write(self, captured: Captured) -> None:
        from forewarn.models.live_state import MAX_AGE_S, encode

        # never over a newer state: a replica that lost the lead and has not noticed yet
        # must not replace the new leader's; nor over another version's snapshot younger
        # than any replica would restore (the newer replicas of a rolling upgrade need it)
        over = captured.held - MAX_AGE_S if self._foreign else captured.held
        try:
            body = encode(captured)
            with self.store.write() as tx:
                done = tx.execute(
                    "INSERT INTO scorer_state (name, time, gpus, body) VALUES (?, ?, ?, ?)"
                    " ON CONFLICT (name) DO UPDATE SET time = excluded.time,"
                    " gpus = excluded.gpus, body = excluded.body"
                    " WHERE scorer_state.time <= ?",
                    (_NAME, captured.held, captured.gpus, body, over)).rowcount
        except Exception as exc:  # the store in trouble: the next save tries again
            self.counts["failed"] += 1
            log.warning("scorer state: snapshot not written: %s", exc)
            return
        if not done:
            self.counts["superseded"] += 1
            return
        self.bytes = len(body)
        self.counts["saved"] += 1

    def load(self, scorer: LiveScorer, now: float, own: float | None) -> bool | None:
        """Put the stored snapshot (if any, and not older than ``own``: the end of what the
        scorer held when this replica started to lead) into ``scorer``; False when there is
        none, it is older, or it is refused; None when the store could not be read (the
        caller tries again, and saves nothing over the row meanwhile)."""
        from forewarn.models.live_state import ForeignSnapshot, SnapshotError, restore

        self._foreign = False
        try:
            rows = self.store.query("SELECT time, length(body) AS size FROM scorer_state"
                                    " WHERE name = ?", (_NAME,))
            if not rows:
                return False
            if own is not None and float(rows[0]["time"]) < own:
                return False  # this scorer's own state is newer (it led until lately)
            if int(rows[0]["size"]) > self.max_bytes:
                log.error("scorer state: snapshot of %.0f refused unread: %d bytes, at most %d",
                          float(rows[0]["time"]), int(rows[0]["size"]), self.max_bytes)
                return self._refused(float(rows[0]["time"]))
            # the bound again: the row may have been replaced since
            rows = self.store.query("SELECT time, body FROM scorer_state WHERE name = ?"
                                    " AND length(body) <= ?", (_NAME, self.max_bytes))
        except Exception as exc:
            self.counts["failed"] += 1
            log.warning("scorer state: snapshot not read, tried again at the next batch: %s",
                        exc)
            return None
        if not rows:
            return False
        try:
            gpus = restore(scorer, bytes(rows[0]["body"]), now)
        except ForeignSnapshot as exc:
            log.error("scorer state: snapshot of %.0f written by another forewarn version, "
                      "refused and left in place for it; every GPU's baseline starts fresh:"
                      " %s", float(rows[0]["time"]), exc)
            self.counts["refused"] += 1
            self._foreign = True
            return False
        except SnapshotError as exc:
            log.error("scorer state: snapshot of %.0f refused, every GPU's baseline starts "
                      "fresh: %s", float(rows[0]["time"]), exc)
            return self._refused(float(rows[0]["time"]))
        except Exception:  # a snapshot never stops the collector (validated before use)
            log.exception("scorer state: snapshot of %.0f could not be restored",
                          float(rows[0]["time"]))
            return self._refused(float(rows[0]["time"]))
        self.counts["restored"] += 1
        log.info("scorer state: %d GPUs' baselines and alarm memory restored from the "
                 "snapshot of %.0f (%.0f s old)", gpus, float(rows[0]["time"]),
                 now - float(rows[0]["time"]))
        return True

    def _refused(self, held: float) -> bool:
        """Count a refused snapshot and delete it (a save replaces it only when newer)."""
        self.counts["refused"] += 1
        try:
            with self.store.write() as tx:
                tx.execute("DELETE FROM scorer_state WHERE name = ? AND time = ?", (_NAME, held))
        except Exception as exc:
            self.counts["failed"] += 1
            log.warning("scorer state: refused snapshot not deleted: %s", exc)
        return False

    def close(self) -> None:
        """Wait for a write under way; no more writes."""
        self._writer.shutdown(wait=True)
