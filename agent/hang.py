"""The hang terminator: what the agent does about a confirmed-hung job's local ranks.

A hang is confirmed when the rank_hang finding stays unhealthy for ``confirm_polls`` (2)
consecutive polls. ``hang_action = shadow``: logged, the finding stands. ``terminate``:
SIGTERM to the job's local rank processes, SIGKILL after ``hang_grace_s`` to those still
alive, so the launcher restarts them from the last checkpoint minutes before NCCL's 10-min
timeout. A pid is signalled only when it is still the process the agent saw (same
``/proc/<pid>/stat`` start time, same uid as its kernel-verified credentials), through a
pidfd (``pidfd_send_signal``) opened after that check, so pid reuse cannot redirect it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable

from forewarn.agent.rank_state import RankView
from forewarn.agent.ranks import RankTable
from forewarn.wire import Finding, Health

__all__ = ["HangTerminator"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Kill:
    job: str
    pidfd: int
    pid: int
    deadline: float


class HangTerminator:
    """Ends a confirmed-hung job's local ranks (or only reports it, in shadow mode)."""

    def __init__(
        self,
        table: RankTable,
        *,
        action: str = "shadow",
        grace_s: float = 30.0,
        confirm_polls: int = 2,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if action not in ("shadow", "terminate"):
            raise ValueError(f"hang_action must be shadow or terminate, got {action!r}")
        self.table = table
        self.action = action
        self.grace_s = grace_s
        self.confirm_polls = confirm_polls
        self.monotonic = monotonic
        self._streak: dict[tuple[str, int], int] = {}
        self._handled: dict[str, frozenset[int]] = {}
        self._kills: list[_Kill] = []
        self.signals_total: collections.Counter[tuple[str, str]] = collections.Counter()
        """``(job, SIGTERM|SIGKILL|refused)`` -> count."""
        self.confirmed_total: collections.Counter[str] = collections.Counter()

    def on_findings(self, findings: Iterable[Finding], now: float) -> list[str]:
        """Feed one poll's rank_hang findings; returns jobs whose hang was confirmed now."""
        hung_jobs: set[str] = set()
        seen = set()
        for f in findings:
            if f.check != "rank_hang" or f.subject.kind != "rank" or f.subject.rank is None:
                continue
            key = (f.subject.job, f.subject.rank)
            seen.add(key)
            if f.health == Health.UNHEALTHY:
                self._streak[key] = self._streak.get(key, 0) + 1
                if self._streak[key] >= self.confirm_polls:
                    hung_jobs.add(f.subject.job)
            else:
                self._streak.pop(key, None)
        for key in [k for k in self._streak if k not in seen]:
            del self._streak[key]
        confirmed = []
        for job in sorted(hung_jobs):
            views = [v for v in self.table.job_views(job) if self.table.alive(v, now)]
            episode = frozenset(v.os_pid for v in views)
            handled = self._handled.get(job)
            # ranks that ended since (on the SIGTERM) leave the same episode: only a new
            # process (a restart) makes a new one
            if not views or (handled is not None and episode <= handled):
                continue
            self._handled[job] = episode
            self.confirmed_total[job] += 1
            confirmed.append(job)
            if self.action == "shadow":
                log.warning("job %s hung (ranks %s on this node); hang_action=shadow: not "
                            "ending it", job, ", ".join(str(v.rank) for v in views))
                continue
            log.warning("job %s hung: SIGTERM to local ranks %s (SIGKILL after %gs)", job,
                        ", ".join(f"{v.rank}/pid {v.os_pid}" for v in views), self.grace_s)
            for v in views:
                self._terminate(v)
        self._reap()
        return confirmed

    def _open_verified(self, v: RankView) -> int | None:
        """A pidfd for the rank's process if it is still the one seen; None otherwise."""
        proc = self.table.proc
        pid = v.os_pid
        if pid <= 1 or pid == os.getpid() or v.start_time is None:
            return None
        if proc.start_time(pid) != v.start_time or proc.uid(pid) != v.uid:
            return None
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return None
        # re-check after opening: the pidfd now pins whichever process has this pid
        if proc.start_time(pid) != v.start_time:
            os.close(fd)
            return None
        return fd

    def _terminate(self, v: RankView) -> None:
        fd = self._open_verified(v)
        if fd is None:
            self.signals_total[(v.job, "refused")] += 1
            log.error("not signalling pid %d (rank %d of job %s): not verified as that rank "
                      "any more", v.os_pid, v.rank, v.job)
            return
        try:
            signal.pidfd_send_signal(fd, signal.SIGTERM)
            self.signals_total[(v.job, "SIGTERM")] += 1
        except OSError as exc:
            log.warning("SIGTERM to pid %d failed: %s", v.os_pid, exc)
            os.close(fd)
            return
        self._kills.append(_Kill(v.job, fd, v.os_pid, self.monotonic() + self.grace_s))

    def _reap(self) -> None:
        """SIGKILL ranks still alive after the grace period (pidfd: no pid reuse)."""
        now = self.monotonic()
        keep = []
        for k in self._kills:
            if now < k.deadline:
                keep.append(k)
                continue
            try:
                signal.pidfd_send_signal(k.pidfd, signal.SIGKILL)
                self.signals_total[(k.job, "SIGKILL")] += 1
                log.warning("pid %d of hung job %s ignored SIGTERM for %gs: SIGKILL",
                            k.pid, k.job, self.grace_s)
            except ProcessLookupError:
                pass  # it exited on SIGTERM
            except OSError as exc:
                log.warning("SIGKILL to pid %d failed: %s", k.pid, exc)
            os.close(k.pidfd)
        self._kills = keep

    def ending(self, job: str) -> bool:
        """True while this terminator is ending ``job`` (its SIGTERM is no preemption)."""
        return any(k.job == job for k in list(self._kills))

    def tick(self) -> None:
        """Send due SIGKILLs (call every poll)."""
        self._reap()

    def close(self) -> None:
        for k in self._kills:
            os.close(k.pidfd)
        self._kills = []


