"""Shared fixtures. Tests that need a real binary (Prometheus, Alertmanager, promtool,
Chromium, gcc, systemd-analyze) skip when it is missing on a developer's machine, but fail
under CI (CI=true), where .ci/run installs them: a missing binary must not pass silently."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import pytest


@pytest.fixture(scope="session")
def require_binary() -> Callable[[str], str]:
    """Return a function that gives the path of a binary, or skips (fails under CI)."""

    def find(name: str) -> str:
        path = shutil.which(name)
        if path:
            return path
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed; .ci/run must install it")
        pytest.skip(f"{name} is not installed")

    return find
