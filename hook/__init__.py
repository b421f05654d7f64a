"""forewarn.hook: the training-side client.

Standard library (and msgspec) only at import time; torch is imported lazily when a
tensor is passed, a checkpoint is written or loaded (:class:`TrainingState` too) or
agreement mode runs. The Lightning and Hugging Face integrations live in
:mod:`forewarn.hook.lightning` and :mod:`forewarn.hook.huggingface` and are never
imported from here.
"""

from __future__ import annotations

from .checkpoint import CheckpointResult, CheckpointWriter, LoadedCheckpoint, PendingCheckpoint
from .monitor import Monitor, MonitorStats
from .state import ResumableSampler, TrainingState

__all__ = [
    "CheckpointResult", "CheckpointWriter", "LoadedCheckpoint", "Monitor", "MonitorStats",
    "PendingCheckpoint", "ResumableSampler", "TrainingState",
]
