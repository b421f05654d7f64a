"""File-system helpers the agent and the collector share (the hook keeps its own: it imports
nothing of forewarn but the wire records)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["fsync_dir", "write_all"]


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
