"""Processes a test started through a command, found by a marker in their command line (a
work dir): to check that nothing is left running.

A command line alone can miss one: between fork and exec a process has its parent's
command line (or, during exec, an empty one) for a moment, so a process that restarts
another can look gone. :func:`wait_gone` therefore also counts, once it has seen a marked
process, every process in that process's group and every descendant of a counted process
(not the test's own group, and not zombies: those have ended)."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["leftovers", "wait_gone", "wait_started"]


@dataclasses.dataclass(frozen=True)
class _Proc:
    ppid: int
    pgid: int
    cmd: str


def _processes() -> dict[int, _Proc]:
    """Live processes but this one (zombies left out), from /proc."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
        state, ppid, pgid = stat[stat.rindex(")") + 2:].split()[:3]
        if state != "Z":
            found[int(pid)] = _Proc(int(ppid), int(pgid), cmd)
    return found


def leftovers(marker: str) -> list[str]:
    """Processes whose command line mentions ``marker``."""
    return [f"{pid}: {p.cmd}" for pid, p in _processes().items() if marker in p.cmd]


def _left(procs: dict[int, _Proc], marker: str, groups: set[int]) -> list[str]:
    """Processes naming ``marker``, in ``groups`` (updated with the marked ones' groups
    but the test's own), and their descendants."""
    marked = {pid for pid, p in procs.items() if marker in p.cmd}
    groups |= {procs[pid].pgid for pid in marked} - {os.getpgrp()}
    left = marked | {pid for pid, p in procs.items() if p.pgid in groups}
    while more := {pid for pid, p in procs.items() if p.ppid in left} - left:
        left |= more
    return [f"{pid}: {procs[pid].cmd}" for pid in sorted(left)]


def wait_gone(marker: str, timeout: float = 10.0, *,
              pause: Callable[[float], None] = time.sleep) -> list[str]:
    """Wait until no process mentions ``marker`` and none is left of the groups and
    descendants of those seen (module docstring); what is left after ``timeout``.
    ``pause`` sleeps between two looks (a test's own steps it there)."""
    deadline = time.monotonic() + timeout
    groups: set[int] = set()
    while (left := _left(_processes(), marker, groups)) and time.monotonic() < deadline:
        pause(0.2)
    return left


def wait_started(marker: str, timeout: float = 10.0) -> list[str]:
    """Wait until some process mentions ``marker``; those found (empty after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not (found := leftovers(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return found
