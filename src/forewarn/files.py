"""File-system helpers the agent and the collector share (the hook keeps its own: it imports
nothing of forewarn but the wire records)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["fsync_dir", "write_all", "write_atomic"]


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (fsync of the directory); best
    effort: a file system that cannot fsync a directory is left as it is."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd``: ``write()`` may take only part (a file-size limit, or a
    disk that fills mid-write returns short before it fails), so loop until it is all written
    or the next write raises."""
    view = memoryview(data)
    written = 0
    while written < len(data):
        written += os.write(fd, view[written:])


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` all at once: written beside it (``mode``), fsync'd,
    renamed over it. A crash leaves the old file or the new one, never half of either; the
    caller makes the rename durable with :func:`fsync_dir` when it must survive power loss."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
