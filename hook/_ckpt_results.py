"""What a checkpoint save or load returns (re-exported by :mod:`forewarn.hook.checkpoint`)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class CheckpointResult:
    """What a save cost: pass ``seconds`` and ``bytes`` to ``Monitor.checkpoint_done``."""

    step: int
    path: str
    seconds: float
    bytes: int
    """Bytes this rank wrote (rank 0 includes the metadata and manifest)."""
    suspect: bool = False
    """Saved from a suspect training state (marked; ``load_latest`` skips it by default)."""
    refused: str = ""
    """Why nothing was saved (the monitor holds saves); empty when the save happened."""


@dataclasses.dataclass(frozen=True)
class LoadedCheckpoint:
    """A verified checkpoint and the state read from it."""

    step: int
    path: str
    state: dict[str, Any]
    skipped: tuple[tuple[str, str], ...] = ()
    """Newer checkpoints that failed verification or are suspect: ``(path, reason)``."""
    suspect: bool = False
    """The loaded checkpoint is marked suspect (only with ``allow_suspect=True``)."""
