"""Who sent a datagram, and whether that process still lives: kernel-verified sender
credentials (``SCM_CREDENTIALS``) and a view of ``/proc`` that tells a live rank from a
reused pid. The rank table admits records by them; the hang terminator signals only a
process they verify."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

__all__ = ["Credentials", "ProcView"]


@dataclasses.dataclass(frozen=True)
class Credentials:
    """Sender credentials from ``SCM_CREDENTIALS`` (kernel-verified, see unix(7))."""

    pid: int
    uid: int
    gid: int


class ProcView:
    """Reads ``/proc`` (root injectable for tests) to tell a live rank from a reused pid.

    ``start_time`` is field 22 of ``/proc/<pid>/stat`` (clock ticks since boot, proc(5)):
    a pid and its start time identify one process for its whole life.
    """

    def __init__(self, root: Path = Path("/proc")) -> None:
        self.root = root

    def start_time(self, pid: int) -> int | None:
        """The process's start time in clock ticks, or ``None`` if there is no such pid."""
        try:
            raw = (self.root / str(pid) / "stat").read_bytes()
        except OSError:
            return None
        # comm (field 2) may hold spaces and parentheses: split after the last ')'.
        rest = raw[raw.rfind(b")") + 2 :].split()
        try:
            return int(rest[19])  # fields 3.. -> index 0..; starttime is field 22
        except (IndexError, ValueError):
            return None

    def uid(self, pid: int) -> int | None:
        """Real uid of the process, or ``None``."""
        try:
            for line in (self.root / str(pid) / "status").read_text().splitlines():
                if line.startswith("Uid:"):
                    return int(line.split()[1])
        except (OSError, ValueError, IndexError):
            return None
        return None

    def alive(self, pid: int, start_time: int | None) -> bool:
        """True when ``pid`` exists and (if known) is still the process started then."""
        now_start = self.start_time(pid)
        if now_start is None:
            return False
        return start_time is None or now_start == start_time

    def same_pid_namespace(self, pid: int) -> bool:
        """True when ``pid`` lives in the agent's pid namespace (or we cannot tell)."""
        try:
            theirs = os.readlink(self.root / str(pid) / "ns" / "pid")
            ours = os.readlink(self.root / "self" / "ns" / "pid")
        except OSError:
            return True
        return theirs == ours
