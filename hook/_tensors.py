"""Reading loss and grad-norm values that arrive as 0-d tensors, without a device sync.

The choice (documented in :class:`forewarn.hook.Monitor`):

* Python numbers: used as they are.
* CPU tensors: ``.item()`` (no device involved, sub-microsecond).
* CUDA tensors: the value is copied with ``non_blocking=True`` into a slot of a small
  ring of pinned host buffers and a CUDA event is recorded behind the copy on the
  current stream. The step's record is held back (with its own step number, time and
  step seconds) and sent from a later ``step()`` call once ``event.query()`` says the
  copy has landed. ``query()`` never waits, so no step ever syncs the device; the agent
  sees the value of step *k* labelled as step *k*, typically one or two steps late. If
  the GPU falls more than ``depth`` steps behind the CPU, the newest step is sent without
  its values (counted as ``values_skipped``) rather than waiting.
* Other devices (MPS, XLA, ...): the values are omitted and counted; pass floats.

torch is imported only here, and only when a tensor is actually passed.
"""

from __future__ import annotations

import collections
from typing import Any

__all__ = ["DeferredValues", "PendingStep", "is_tensor", "read_now"]


def is_tensor(x: object) -> bool:
    """True for torch tensors, without importing torch."""
    return type(x).__module__.startswith("torch")


def read_now(x: Any) -> tuple[bool, float | None]:
    """``(ok, value)``: ``ok`` is False when reading would need a device sync."""
    if x is None:
        return True, None
    if type(x) is float:
        return True, x
    if not is_tensor(x):
        return True, float(x)
    if x.device.type == "cpu":
        return True, float(x.detach().item())
    return False, None


class PendingStep:
    """One step whose CUDA values are still being copied to the host."""

    __slots__ = ("event", "extras", "slot", "step", "step_seconds", "time")

    def __init__(
        self, step: int, time: float, step_seconds: float | None, extras: dict[str, float],
        slot: int, event: Any,
    ) -> None:
        self.step, self.time, self.step_seconds, self.extras = step, time, step_seconds, extras
        self.slot, self.event = slot, event


class DeferredValues:
    """A ring of pinned host slots for CUDA loss/grad-norm copies (see module docstring)."""

    def __init__(self, depth: int = 8, event_factory: Any = None, pin_memory: bool = True) -> None:
        """``event_factory`` and ``pin_memory`` are the CUDA seam (tests pass a fake event
        factory and unpinned memory to run the queue logic on a machine without a GPU)."""
        import torch

        self.depth = depth
        self._event = event_factory if event_factory is not None else torch.cuda.Event
        # row i: [loss, grad_norm, has_loss, has_grad_norm] for slot i
        self._host = torch.zeros((depth, 4), dtype=torch.float64, pin_memory=pin_memory)
        self._free = collections.deque(range(depth))
        self._pending: collections.deque[PendingStep] = collections.deque()
        self.values_skipped = 0

    def submit(
        self, step: int, time: float, step_seconds: float | None, extras: dict[str, float],
        loss: Any, grad_norm: Any,
    ) -> tuple[float | None, float | None] | None:
        """Queue the copies; return ``None`` if deferred, else the values to send now
        (``(None, None)`` when no slot is free: the step goes out without them)."""
        if not self._free:
            self.values_skipped += 1
            return None, None
        slot = self._free.popleft()
        row = self._host[slot]
        for col, value in ((0, loss), (1, grad_norm)):
            if value is None:
                row[col + 2] = 0.0
            elif is_tensor(value):
                row[col].copy_(value.detach().reshape(()), non_blocking=True)
                row[col + 2] = 1.0
            else:
                row[col] = float(value)
                row[col + 2] = 1.0
        event = self._event()
        event.record()
        self._pending.append(PendingStep(step, time, step_seconds, extras, slot, event))
        return None

    def ready(self, wait: bool = False) -> list[tuple[PendingStep, float | None, float | None]]:
        """Steps whose copies have landed, oldest first (``wait=True`` at close only)."""
        out = []
        while self._pending:
            head = self._pending[0]
            if wait:
                head.event.synchronize()
            elif not head.event.query():
                break
            self._pending.popleft()
            loss, gn, has_loss, has_gn = self._host[head.slot].tolist()
            self._free.append(head.slot)
            out.append((head, loss if has_loss else None, gn if has_gn else None))
        return out

    def __len__(self) -> int:
        return len(self._pending)
