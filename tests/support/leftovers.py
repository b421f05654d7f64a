"""Processes a test started through a command, found by a marker in their command line (a
work dir): to check that nothing is left running."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["leftovers", "wait_gone", "wait_started"]


def leftovers(marker: str) -> list[str]:
    """Processes whose command line mentions ``marker``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmd:
            found.append(f"{pid}: {cmd}")
    return found


def wait_gone(marker: str, timeout: float = 10.0, *,
              pause: Callable[[float], None] = time.sleep) -> list[str]:
    """Wait until no process mentions ``marker``; what is left after ``timeout``.
    ``pause`` sleeps between two looks (a test's own steps it there)."""
    deadline = time.monotonic() + timeout
    while (left := leftovers(marker)) and time.monotonic() < deadline:
        pause(0.2)
    return left


def wait_started(marker: str, timeout: float = 10.0) -> list[str]:
    """Wait until some process mentions ``marker``; those found (empty after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not (found := leftovers(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return found
