"""The shared caches of the operator tests (``support/shared_cache.py``): two runs at once
take turns building the systemd test's root and filling the wheelhouse, and each gets its
own venv folder."""

from __future__ import annotations

import stat
import subprocess
import sys
import threading
from pathlib import Path

from support.shared_cache import filled_once, locked, private_dir

TRY_LOCK = ("import fcntl, sys\n"
            "with open(sys.argv[1], 'a') as f:\n"
            "    try:\n"
            "        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
            "    except BlockingIOError:\n"
            "        sys.exit(3)\n")


def _other_process_locks(path: Path) -> bool:
    """Whether another process gets ``path``'s lock at once."""
    r = subprocess.run([sys.executable, "-c", TRY_LOCK, str(path)], timeout=60)
    assert r.returncode in (0, 3)
    return r.returncode == 0


def test_another_run_waits_while_the_cache_is_built(tmp_path: Path) -> None:
    lock = tmp_path / "cache" / "root.lock"
    with locked(lock):
        assert not _other_process_locks(lock)
    assert _other_process_locks(lock)


def test_each_run_gets_its_own_readable_folder(tmp_path: Path) -> None:
    a, b = (private_dir(tmp_path / "cache", "venv-") for _ in range(2))
    assert a != b and a.parent == b.parent == tmp_path / "cache"
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o755 for p in (a, b))


def test_two_runs_at_once_fill_the_wheelhouse_once(tmp_path: Path) -> None:
    """Run A finds the wheelhouse lacking and fills it; run B looks while A is filling.
    B waits for A's fill and then uses what A filled: it neither fills it again nor
    reads it half-written."""
    lock, filled = tmp_path / "wheelhouse.lock", threading.Event()
    a_filling, b_looked = threading.Event(), threading.Event()
    fills: list[str] = []

    def fill(run: str) -> None:  # pip wheel -w: the wheelhouse complete at its end
        fills.append(run)
        if run == "A":
            a_filling.set()
            assert b_looked.wait(30), "B never looked"
        filled.set()

    def use(run: str) -> bool:  # pip install --no-index --find-links
        ok = filled.is_set()
        if run == "B":
            b_looked.set()
        return ok

    results: dict[str, bool] = {}
    a = threading.Thread(target=lambda: results.update(
        A=filled_once(lock, lambda: use("A"), lambda: fill("A"))))
    a.start()
    assert a_filling.wait(30)
    results["B"] = filled_once(lock, lambda: use("B"), lambda: fill("B"))
    a.join(30)
    assert results == {"A": True, "B": True}
    assert fills == ["A"], fills
