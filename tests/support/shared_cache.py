"""A cache that several test runs on one machine share (``/var/cache/forewarn``: the
systemd test's Debian root; the operator tests' wheelhouse): what is built once is built
under a lock, and what each run writes is its own folder, so two runs at once neither
build it twice nor clobber each other's."""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["filled_once", "locked", "private_dir"]


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the block; another
    process waits for it. The kernel releases it if the holder dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def private_dir(parent: Path, prefix: str) -> Path:
    """A new folder under ``parent`` that no other run gets, readable by every user (the
    services' dynamic users read what is in it)."""
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    path.chmod(0o755)
    return path


def filled_once(lock: Path, use: Callable[[], bool], fill: Callable[[], None]) -> bool:
    """``use()`` the cache (true: it held what was needed); when that fails, take
    ``lock``, ``use()`` it again (another run may have filled it while this one waited),
    and only then ``fill()`` it and ``use()`` it once more. Two runs at once fill it once,
    and a ``use()`` that read a half-written file fails and is tried again after the
    fill."""
    if use():
        return True
    with locked(lock):
        if use():
            return True
        fill()
        return use()
