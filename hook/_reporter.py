"""The reporting path: step records and checkpoint reports, encoded and queued.

``Monitor.step()`` keeps its fast path (Python floats after the first step: one tuple
and one deque append; the background thread packs it) in
:class:`~forewarn.hook.monitor.Monitor` itself, to spare the training loop a call; every
other report is made here: values read now or deferred until
their CUDA copy lands (:mod:`._tensors`), the general :class:`~forewarn.wire.StepRecord`,
checkpoint reports, and the bounded queue that the background thread (:mod:`._sender`)
drains. Errors propagate to the Monitor's public methods, which count and log them.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from forewarn import wire

from ._channel import AgentChannel
from ._identity import RankIdentity
from ._sender import Sender, Urgent
from ._tensors import DeferredValues, read_now

__all__ = ["Reporter", "checked_step", "passed_step"]


def checked_step(step: Any) -> int:
    """``step`` as an index (``operator.index``: ints, 0-d int tensors); ValueError when
    negative."""
    index = operator.index(step)
    if index < 0:
        raise ValueError(f"step must be >= 0, got {index}")
    return index


def passed_step(step: Any) -> int | None:
    """The last step passed as an int, for the background thread's beats and reports:
    ``step()``'s fast path keeps what it was given (a ``numpy.int64`` from ``np.arange``,
    say), which no wire record can carry. None before the first step, or when the step is
    no index at all (that step's record was left out)."""
    if step is None or type(step) is int:
        return step
    try:
        return checked_step(step)
    except (TypeError, ValueError):
        return None


class Reporter:
    """Encodes one rank's reports and queues them for the :class:`._sender.Sender`.

    ``on_nonfinite_loss(step)`` is called for every NaN/Inf loss this path reads, as it
    reads it: a value read now (even when the grad norm's CUDA copy defers the record), or
    a CUDA value once landed.
    """

    def __init__(
        self,
        identity: RankIdentity,
        channel: AgentChannel,
        sender: Sender,
        *,
        clock: Callable[[], float],
        cuda_depth: int,
        on_nonfinite_loss: Callable[[int], None],
    ) -> None:
        self.identity = identity
        self.pack = sender.pack_step
        self.queue = sender.queue
        self.queue_limit = sender.queue_limit
        self.deferred: DeferredValues | None = None
        """Tensor values waiting for their device copy (created at the first CUDA value)."""
        self.dropped = 0
        """Reports not queued: no agent, or the queue full (the sender counts its own)."""
        self._values_skipped = 0
        self._ch = channel
        self._sender = sender
        self._time = clock
        self._cuda_depth = cuda_depth
        self._nonfinite_loss = on_nonfinite_loss

    @property
    def values_skipped(self) -> int:
        """Values left out: unreadable extras, tensors on other devices, and CUDA values
        that did not land in time."""
        if self.deferred is None:
            return self._values_skipped
        return max(self._values_skipped, self.deferred.values_skipped)

    def send(self, data: bytes, urgent: bool = False) -> None:
        """Queue one datagram for the background thread (off the hot path)."""
        if not self._ch.up or len(self.queue) >= self.queue_limit:
            self.dropped += 1
            return
        if urgent:
            self.queue.append(Urgent(data))
            self._sender.kick()
        else:
            self.queue.append(data)

    def record(
        self, step: int, now: float, ss: float | None, loss: Any, grad_norm: Any,
        extras: dict[str, Any],
    ) -> bytes | None:
        """The encoded record of ``step``; None when a CUDA value defers it (a later call
        sends it once the copy has landed)."""
        ex: dict[str, float] = {}
        for key, value in extras.items():
            ok, f = read_now(value)
            if ok and f is not None:
                ex[str(key)[:64]] = f
            else:
                self._values_skipped += 1
        if self.deferred is not None:
            self.flush_deferred(wait=False)
        ok_l, lv = self._read(loss)
        if lv is not None and lv - lv != 0.0:
            self._nonfinite_loss(step)
        ok_g, gv = self._read(grad_norm)
        if not (ok_l and ok_g):
            if self.deferred is None:
                self.deferred = DeferredValues(self._cuda_depth)
            got = self.deferred.submit(
                step, now, ss, ex, loss if not ok_l else lv, grad_norm if not ok_g else gv
            )
            if got is None:
                return None
            lv, gv = got
        return self._encode_step(step, now, ss, lv, gv, ex)

    def _read(self, x: Any) -> tuple[bool, float | None]:
        """``(False, None)`` only for CUDA tensors (deferred); other devices are skipped."""
        ok, v = read_now(x)
        if ok:
            return ok, v
        if x.device.type == "cuda":
            return False, None
        self._values_skipped += 1
        return True, None

    def _encode_step(
        self, step: int, now: float, ss: float | None, loss: float | None, gn: float | None,
        extras: dict[str, float],
    ) -> bytes:
        if ss is not None and loss is not None and gn is not None and not extras:
            return self.pack(step, now, ss, loss, gn)
        i = self.identity
        return wire.encode(
            wire.StepRecord(
                job=i.job, rank=i.rank, local_rank=i.local_rank, world_size=i.world_size,
                pid=i.pid, host=i.host, step=step, time=now, step_seconds=ss,
                loss=loss, grad_norm=gn, extras=extras,
            )
        )

    def flush_deferred(self, wait: bool) -> None:
        """Send the deferred records whose values have landed (all of them with ``wait``)."""
        d = self.deferred
        if d is None or not len(d):
            return
        for p, lv, gv in d.ready(wait=wait):
            if lv is not None and lv - lv != 0.0:
                self._nonfinite_loss(p.step)  # a CUDA loss, landed now
            self.send(self._encode_step(p.step, p.time, p.step_seconds, lv, gv, p.extras))
        self._values_skipped = max(self._values_skipped, d.values_skipped)

    def checkpoint(
        self, step: int, phase: str, request_id: str, *, seconds: float | None = None,
        nbytes: int | None = None, path: str = "",
    ) -> None:
        """Send a checkpoint report at once (the agent's orders wait on them)."""
        i = self.identity
        rep = wire.CheckpointReport(
            job=i.job, rank=i.rank, host=i.host, request_id=request_id[:128],
            step=max(0, int(step)), phase=phase, seconds=seconds, bytes=nbytes,
            time=self._time(), path=path,
        )
        self.send(wire.encode(rep), urgent=True)
