"""The staging log: batch bodies waiting for Parquet, in append-only segment files.

Why not in SQLite: a batch of 80 full GPU samples is ~128 KiB of msgpack. As a SQLite blob
it is written to the WAL, copied into the database at checkpoint, then freed page by page
when the flush deletes it: three times the I/O and most of the ingest CPU. Here a body is
written once, sequentially; the group commit calls :meth:`StagingLog.append` for the whole
group (one ``fsync``), then records ``(segment, offset, length)`` in ``staged_samples`` in
its SQLite transaction. Bytes no committed row points at (a crash between the two steps)
are never read. A segment is deleted once no staged row refers to it
(:meth:`StagingLog.drop_unreferenced`, after each flush). A new process never appends to
an old segment.

Files: ``<data_dir>/staging/seg-<n>.log`` (mode 0600).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from forewarn.errors import StorageError
from forewarn.files import write_all

__all__ = ["StagingError", "StagingLog"]

_NAME = re.compile(r"^seg-(\d{12})\.log$")


class StagingError(StorageError, OSError):
    """A body could not be written or read back; the message names the segment."""


class StagingLog:
    """Append-only segments of staged bodies. Thread-safe."""

    def __init__(self, root: Path, *, segment_bytes: int = 64 * 1024 * 1024) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.segment_bytes = segment_bytes
        self._lock = threading.Lock()
        existing = self.segments()
        self._active = (max(existing) + 1) if existing else 1
        self._fd: int | None = None
        self._size = 0

    def path(self, segment: int) -> Path:
        """The file of ``segment``."""
        return self.root / f"seg-{segment:012d}.log"

    def segments(self) -> list[int]:
        """Segment numbers on disk, oldest first."""
        return sorted(int(m.group(1)) for p in self.root.iterdir()
                      if (m := _NAME.match(p.name)))

    def _open_active(self) -> int:
        if self._fd is None or self._size >= self.segment_bytes:
            if self._fd is not None:
                os.close(self._fd)
                self._active += 1
            self._fd = os.open(self.path(self._active),
                               os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self._size = os.fstat(self._fd).st_size
            with contextlib.suppress(OSError):
                dfd = os.open(self.root, os.O_RDONLY)
                os.fsync(dfd)
                os.close(dfd)
        return self._fd

    def append(self, bodies: Sequence[bytes]) -> list[tuple[int, int, int]]:
        """Write ``bodies`` and ``fsync`` once; returns ``(segment, offset, length)`` each."""
        if not bodies:
            return []
        with self._lock:
            try:
                fd = self._open_active()
                refs = []
                for body in bodies:
                    refs.append((self._active, self._size, len(body)))
                    self._size += len(body)
                write_all(fd, b"".join(bodies))
                os.fsync(fd)
            except OSError as exc:
                # The segment may now hold a torn tail: start a fresh one next time.
                self._close_active()
                raise StagingError(f"staging segment {self._active}: {exc}") from exc
            return refs

    def _close_active(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
            self._active += 1
            self._size = 0

    def read(self, segment: int, offset: int, length: int) -> bytes:
        """The body at ``(segment, offset, length)``."""
        try:
            with open(self.path(segment), "rb") as fh:
                data = os.pread(fh.fileno(), length, offset)
        except OSError as exc:
            raise StagingError(f"staging segment {segment}: {exc}") from exc
        if len(data) != length:
            raise StagingError(f"staging segment {segment}: short read at {offset}")
        return data

    def drop_unreferenced(self, referenced: Iterable[int]) -> list[int]:
        """Delete segments no staged row refers to (never the one being appended to)."""
        keep = set(referenced)
        with self._lock:
            active = self._active if self._fd is not None else None
            dropped = [s for s in self.segments() if s not in keep and s != active]
            for segment in dropped:
                self.path(segment).unlink(missing_ok=True)
        return dropped

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
