"""The collector's data directory: the start-up check and the quarantine.

Layout of ``data_dir``: ``collector.db`` (SQLite, :mod:`.store`), ``staging/`` (batch
bodies waiting for Parquet, :mod:`.staging`), ``telemetry/`` (Parquet history,
:mod:`.telemetry`) and ``quarantine/`` (files the collector could not account for or found
damaged, under their original relative path: kept for the operator, never read, never
deleted by the collector), and, with shared PostgreSQL state, ``replica-id``
(:func:`replica_id`: the name this data_dir's telemetry files are recorded under).

The rule: the collector never deletes data on a guess. Before it serves,
:func:`check_data_dir` refuses a database that cannot be the one these files belong to
(a missing or empty ``collector.db`` beside Parquet files), and start-up
recovery (:meth:`~forewarn.collector.storage.telemetry.TelemetryWriter.recover`) deletes only what
it can prove is held elsewhere; the rest goes to :class:`Quarantine`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from forewarn.files import fsync_dir, write_atomic

from ..metrics import CollectorMetrics
from .state import StateStore
from .store import StoreError

if TYPE_CHECKING:
    from ..config import CollectorConfig

__all__ = ["DataDirError", "Quarantine", "check_data_dir", "data_sizes", "replica_id",
           "telemetry_replica"]

REPLICA_FILE = "replica-id"
REPLICA_ID_MAX = 64
REPLICA_ID = re.compile(rf"[A-Za-z0-9._-]{{1,{REPLICA_ID_MAX}}}")
"""What a replica id may be (:func:`replica_id` makes 32 hex digits)."""

log = logging.getLogger(__name__)


class DataDirError(StoreError):
    """The database and the files of the data directory do not belong together; the
    message names both and says what to do. The collector does not start."""


class Quarantine:
    """``<data_dir>/quarantine``: where files go instead of being deleted."""

    def __init__(self, root: Path, metrics: CollectorMetrics) -> None:
        self.root = Path(root)
        self.metrics = metrics

    def move(self, path: Path, relative: str, *, reason: str, why: str) -> Path:
        """Move ``path`` to ``quarantine/<relative>`` (a numbered name if taken), log it
        with ``why`` and count it under ``reason``; returns the new path."""
        target = self.root / relative
        n = 0
        while target.exists():
            n += 1
            target = self.root / f"{relative}.{n}"
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.replace(path, target)  # same file system: data_dir holds both
        fsync_dir(target.parent)
        fsync_dir(path.parent)
        self.metrics.quarantined.labels(reason).inc()
        log.warning("moved %s to quarantine %s: %s; the collector no longer reads it. "
                    "Inspect it, then delete it or put it back with a matching database.",
                    path, target, why)
        return target


def check_data_dir(store: StateStore, telemetry_dir: Path) -> None:
    """Raise :class:`DataDirError` when ``store`` knows nothing (a missing, empty or
    replaced database) but ``telemetry_dir`` holds Parquet files.

    Staging segments alone do not stop start-up: a collector killed in its very first
    group commit leaves a segment beside an empty database; recovery quarantines it.
    """
    parquet = len(list(telemetry_dir.glob("date=*/*.parquet"))) if telemetry_dir.is_dir() else 0
    if not parquet:
        return
    known = store.scalar(
        "SELECT (SELECT COUNT(*) FROM telemetry_files) + (SELECT COUNT(*) FROM batches)"
        " + (SELECT COUNT(*) FROM staged_samples)")
    if known:
        return
    raise DataDirError(
        f"{store.location} records no telemetry and no batches, but {telemetry_dir} holds "
        f"{parquet} Parquet files: the database is missing, empty or not the one this data "
        "belongs to. Nothing was moved or deleted. Restore the collector.db that belongs "
        "to this data (with its -wal file, replacing the empty one), or, to start empty "
        f"and keep the old data aside, move {telemetry_dir} out of the data directory.")


def data_sizes(data_dir: Path) -> dict[str, int]:
    """Bytes on disk per part of ``data_dir``: sqlite (the database with its WAL),
    staging, telemetry, quarantine."""
    sizes = {"sqlite": 0, "staging": 0, "telemetry": 0, "quarantine": 0}
    for name in ("collector.db", "collector.db-wal", "collector.db-shm"):
        with contextlib.suppress(OSError):
            sizes["sqlite"] += (data_dir / name).stat().st_size
    for part in ("staging", "telemetry", "quarantine"):
        for dirpath, _dirs, files in os.walk(data_dir / part):
            for f in files:
                with contextlib.suppress(OSError):
                    sizes[part] += os.stat(os.path.join(dirpath, f)).st_size
    return sizes


def replica_id(data_dir: Path) -> str:
    """This data_dir's replica id: a random id kept in ``<data_dir>/replica-id``, made at
    the first call, the same after every restart on the same data_dir.
    :class:`DataDirError` when the file holds no id (empty, damaged, unreadable)."""
    path = Path(data_dir) / REPLICA_FILE
    with contextlib.suppress(FileNotFoundError):
        return _read_replica_id(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, uuid.uuid4().hex.encode() + b"\n", 0o600)
    fsync_dir(path.parent)
    return _read_replica_id(path)


def _read_replica_id(path: Path) -> str:
    """The id in ``path``. Never ``''``: that is embedded state's name for every file, and
    a replica taking it would take over files other replicas' data_dirs hold."""
    try:
        text = path.read_bytes()[:REPLICA_ID_MAX + 2].decode("ascii").strip()
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError) as exc:
        text, why = "", f"{type(exc).__name__}: {exc}"
    else:
        why = f"{text[:REPLICA_ID_MAX]!r}"
    if not REPLICA_ID.fullmatch(text):
        raise DataDirError(
            f"{path} holds no replica id ({why}; one is 1-{REPLICA_ID_MAX} of A-Z a-z 0-9 . _"
            " -). Restore it from a backup of this data_dir; else delete it, and a new id is"
            " made: the files recorded under the old one stay its (docs/storage.md)")
    return text


def telemetry_replica(config: CollectorConfig) -> str:
    """The name this collector records its telemetry files under: with shared PostgreSQL
    state, :func:`replica_id` of its data_dir (each replica keeps the files it wrote in its
    own data_dir); ``''`` with embedded state, whose one data_dir holds them all."""
    return replica_id(config.data_dir) if config.state == "postgresql" else ""
