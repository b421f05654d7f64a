"""Hugging Face Transformers integration: :class:`ForewarnTrainerCallback`.

* ``on_step_end`` reports ``state.global_step`` (step time only: the Trainer has not
  computed the loss of this step as a float yet). If a checkpoint is due at this step
  (agent order or SIGTERM) it sets ``control.should_save = True``, so the Trainer's own
  save path runs (model, optimizer, scheduler, RNG state, ``checkpoint-<step>``).
* ``on_log`` sends the logged ``loss`` and ``grad_norm`` for the step they belong to
  (:meth:`forewarn.hook.Monitor.report_values`): set ``logging_steps`` to how often the
  agent should see them; the Trainer already syncs the device to log them.
* ``on_save`` reports ``checkpoint_done`` (every save, ordered or scheduled by the
  Trainer) with the time since ``on_step_end`` and the size of the checkpoint directory.

Imports ``transformers``; never imported by :mod:`forewarn.hook` itself.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from .monitor import Monitor

__all__ = ["ForewarnTrainerCallback"]


class ForewarnTrainerCallback(TrainerCallback):
    """Report steps to forewarn; make the Trainer save when a checkpoint is ordered.

    Args:
        monitor: a :class:`Monitor`; created at train begin (rank and world size from the
            Trainer's arguments) from ``monitor_kwargs`` if not given, closed at train end.
    """

    def __init__(self, monitor: Monitor | None = None, **monitor_kwargs: Any) -> None:
        self._own = monitor is None
        self._monitor_kwargs = monitor_kwargs
        self.monitor = monitor
        self._step_end: tuple[int, float] | None = None  # (step, monotonic) of on_step_end
        self.saved_steps: list[int] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is None:
            kw = dict(self._monitor_kwargs)
            kw.setdefault("rank", args.process_index)
            kw.setdefault("world_size", args.world_size)
            kw.setdefault("local_rank", max(0, args.local_process_index))
            self.monitor = Monitor(**kw)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        mon = self.monitor
        if mon is None:
            return
        step = int(state.global_step)
        mon.step(step)
        if mon.should_checkpoint(step):
            control.should_save = True
        # the Trainer saves right after on_step_end (and logging): time from here
        self._step_end = (step, time.monotonic())

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if self.monitor is None or not logs:
            return
        loss, gn = logs.get("loss"), logs.get("grad_norm")
        if loss is not None or gn is not None:
            self.monitor.report_values(int(state.global_step), loss=loss, grad_norm=gn)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        mon = self.monitor
        if mon is None:
            return
        step = int(state.global_step)
        path = Path(args.output_dir) / f"checkpoint-{step}"
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0
        mark = self._step_end
        # includes logging (and evaluation, if one ran at this step): an upper bound
        seconds = time.monotonic() - mark[1] if mark is not None and mark[0] == step else 0.0
        self.saved_steps.append(step)
        mon.checkpoint_done(step, seconds, size, os.fspath(path))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._own and self.monitor is not None:
            self.monitor.close()
            self.monitor = None
