"""Fixtures of the operator tests: the built distribution, and a function that installs
the wheel with its dependencies into a fresh virtual environment.

Dependencies come from the package index the first time and are kept as wheels in a
wheelhouse (``FOREWARN_WHEELHOUSE``, default ``~/.cache/forewarn/wheelhouse``); later runs
install from it with ``--no-index`` and fall back to the index when it lacks something.
The wheelhouse is filled under a lock (``wheelhouse.lock`` beside it): two runs at once
fill it once, and neither installs from wheels the other is half-way through writing.
The environment is made ``--without-pip`` and filled by this interpreter's pip
(``--python``): the packages are installed into it, nothing is borrowed from the dev venv.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from support.shared_cache import filled_once

REPO = Path(__file__).resolve().parents[2]
WHEELHOUSE = Path(os.environ.get("FOREWARN_WHEELHOUSE",
                                 Path.home() / ".cache" / "forewarn" / "wheelhouse"))


def run(argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (no shell), capturing its output as text."""
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``python -m build`` output folder (sdist and wheel) and its log."""
    out = tmp_path_factory.mktemp("dist")
    r = run([sys.executable, "-m", "build", "--outdir", str(out), str(REPO)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, r.stdout + r.stderr


@pytest.fixture(scope="session")
def install_wheel(dist: tuple[Path, str]) -> Callable[[Path], None]:
    """``install(env_dir)``: pip installs the wheel with the collector extra (which
    includes the agent's) into the existing environment ``env_dir``."""
    (wheel,) = dist[0].glob("forewarn-*.whl")
    want = f"{wheel}[collector]"

    def install(env_dir: Path) -> None:
        pip = [sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"),
               "install", "-q", "--no-compile", "--no-index", "--find-links",
               str(WHEELHOUSE), want]
        last: list[subprocess.CompletedProcess[str]] = []

        def use() -> bool:
            last.append(run(pip))
            return last[-1].returncode == 0

        def fill() -> None:  # first run, or the dependencies changed
            WHEELHOUSE.mkdir(parents=True, exist_ok=True)
            w = run([sys.executable, "-m", "pip", "wheel", "-q", "-w", str(WHEELHOUSE), want])
            assert w.returncode == 0, w.stdout[-3000:] + w.stderr[-3000:]

        lock = WHEELHOUSE.with_name(WHEELHOUSE.name + ".lock")
        assert filled_once(lock, use, fill), last[-1].stdout[-3000:] + last[-1].stderr[-3000:]

    return install
