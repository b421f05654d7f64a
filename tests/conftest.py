"""Shared fixtures. Tests that need a real binary (Prometheus, Alertmanager, promtool,
Chromium, gcc, systemd-analyze) skip when it is missing on a developer's machine, but fail
under CI (CI=true), where .ci/run installs them: a missing binary must not pass silently."""

from __future__ import annotations

import os

# One OpenMP thread per test process, set before anything loads an OpenMP runtime: the
# suite runs two workers on CI's two cores, and scikit-learn's OpenMP threads spin-waiting
# on the oversubscribed machine made one models test nine times slower (318 s against
# 37 s, measured) until it timed out under CI's load. Subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from forewarn.demo.servers import PostgresServer, find_postgres_bin

# Property tests assert properties, never speed: on a loaded machine (CI's two workers on
# two cores) a slow example is not a failure.
settings.register_profile("forewarn", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("forewarn")


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


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A real PostgreSQL for the session (:class:`forewarn.demo.servers.PostgresServer`);
    skips when its binaries are missing (fails under CI)."""
    bin_dir = find_postgres_bin()
    if bin_dir is None:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL is not installed; .ci/run must install postgresql")
        pytest.skip("PostgreSQL is not installed")
    server = PostgresServer(bin_dir)
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def state_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
                  ) -> dict[str, Any]:
    """Run the test once per state backend: the config keys that choose it (also set for
    every collector tests/support/collector.py starts); PostgreSQL gets an empty database
    of its own per test."""
    import support.collector

    overrides: dict[str, Any] = {}
    if request.param == "postgresql":
        server: PostgresServer = request.getfixturevalue("postgres_server")
        overrides = {"state": "postgresql", "postgres_dsn": server.database()}
    monkeypatch.setattr(support.collector, "STATE", overrides)
    return overrides


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


SHARED_GROUPS = ("operator",)
"""Folders whose files share a machine-wide resource (the operator tests: the wheelhouse
and the cached Debian root in /var/cache/forewarn), so their files run on one worker."""


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``pytest -n N`` (``./dev test`` runs two workers) a worker takes a whole
    test file at a time, so module fixtures (one chaos lab, one Slurm cluster) start once,
    and the whole folder for those in ``SHARED_GROUPS``. (xdist's own ``loadgroup`` marks
    do not group under pytest 9.2, which no longer reads the node id they rewrite.)"""
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class ByFile(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            parts = path.split("/")
            if len(parts) > 2 and parts[1] in SHARED_GROUPS:
                return "/".join(parts[:2])
            return path

    return ByFile(config, log)
