"""PyTorch Lightning integration: :class:`ForewarnCallback`.

``on_train_batch_end`` reports ``trainer.global_step`` with the batch loss (the tensor
Lightning returns; a CUDA tensor is read without a device sync, see
:class:`forewarn.hook.Monitor`). When the agent has ordered a checkpoint at this step (or
SIGTERM arrived), every rank calls ``trainer.save_checkpoint`` (which Lightning
coordinates across ranks) and the duration and size are reported.

Imports ``pytorch_lightning`` (or ``lightning.pytorch`` with ``package="lightning"``);
never imported by :mod:`forewarn.hook` itself.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

try:
    import pytorch_lightning as pl
except ImportError:  # pragma: no cover - the unified package
    import lightning.pytorch as pl  # type: ignore[no-redef]

from .monitor import Monitor

__all__ = ["ForewarnCallback"]


def _loss_of(outputs: Any) -> Any:
    if isinstance(outputs, dict):
        return outputs.get("loss")
    return outputs  # a tensor, or None when training_step returned nothing


class ForewarnCallback(pl.Callback):
    """Report steps to forewarn and save when told to.

    Args:
        monitor: a :class:`Monitor`; one is created (and closed at the end of fit) from
            ``monitor_kwargs`` if not given.
        checkpoint_dir: where ordered checkpoints go (``forewarn-step=<N>.ckpt``);
            default ``<trainer.default_root_dir>/forewarn``.
    """

    def __init__(
        self, monitor: Monitor | None = None, checkpoint_dir: str | os.PathLike[str] | None = None,
        **monitor_kwargs: Any,
    ) -> None:
        super().__init__()
        self._own = monitor is None
        self._monitor_kwargs = monitor_kwargs
        self.monitor = monitor
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self.saved: list[str] = []

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.monitor is None:
            kw = dict(self._monitor_kwargs)
            kw.setdefault("rank", trainer.global_rank)
            kw.setdefault("world_size", trainer.world_size)
            kw.setdefault("local_rank", trainer.local_rank)
            self.monitor = Monitor(**kw)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        mon = self.monitor
        if mon is None:
            return
        step = int(trainer.global_step)
        mon.step(step, loss=_loss_of(outputs))
        if not mon.should_checkpoint(step):
            return
        directory = self.checkpoint_dir or Path(trainer.default_root_dir) / "forewarn"
        path = directory / f"forewarn-step={step}.ckpt"
        t0 = time.monotonic()
        try:
            trainer.save_checkpoint(str(path))
        except Exception as exc:
            mon.checkpoint_failed(step, f"{type(exc).__name__}: {exc}")
            raise
        size = path.stat().st_size if path.is_file() else _tree_size(path)
        self.saved.append(str(path))
        mon.checkpoint_done(step, time.monotonic() - t0, size, str(path))

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._own and self.monitor is not None:
            self.monitor.close()
            self.monitor = None


def _tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0
