"""File-system helpers the agent and the collector share (the hook keeps its own: it imports
nothing of forewarn but the wire records)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["fsync_dir"]


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (fsync of the directory); best
    effort: a file system that cannot fsync a directory is left as it is."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
