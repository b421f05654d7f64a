"""Polling helpers for tests that wait on real processes and servers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["poll"]


def poll(fn: Callable[[], Any], timeout: float = 20.0, interval: float = 0.05) -> Any:
    """Call ``fn`` every ``interval`` s until it returns something truthy or ``timeout`` s
    have passed; its last result (falsy on a timeout: the caller asserts on it)."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
