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


SYSTEM_FOLDERS = ("e2e", "chaos", "operator", "dashboards")
"""Folders whose tests start real servers, launchers or containers (Slurm, systemd,
Prometheus, Alertmanager, torchrun): marked ``system``, so ``pytest -m "not system"`` is the
quick loop while editing. CI runs everything."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = os.path.dirname(__file__)
    for item in items:
        rel = os.path.relpath(str(item.path), tests)
        if rel.split(os.sep, 1)[0] in SYSTEM_FOLDERS:
            item.add_marker(pytest.mark.system)
