"""Helpers for tests that run real processes and servers on loopback: a free port, and
polling until a condition holds."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

__all__ = ["START_TIMEOUT_S", "free_port", "poll", "wait_for"]

START_TIMEOUT_S = 120.0
"""How long a test waits for a real process (a collector, an agent, a server) to start: its
imports alone take tens of seconds on a 2-core CI machine running two test workers."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def poll(fn: Callable[[], Any], timeout: float = 20.0, interval: float = 0.05) -> Any:
    """Call ``fn`` every ``interval`` s until it returns something truthy or ``timeout`` s
    have passed; its last result (falsy on a timeout: the caller asserts on it)."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def wait_for(cond: Callable[[], Any], timeout: float = 60.0, what: str = "a condition",
             interval: float = 0.05) -> Any:
    """Call ``cond`` every ``interval`` s until it returns something truthy, and return
    that; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
