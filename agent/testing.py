"""Test doubles for the agent's hardware seam, named as such (STYLE.md: "a fake only at a
hardware seam").

:class:`ScriptedBackend` implements :class:`forewarn.agent.backend.GpuBackend` from a
script: a function of (GPU index, time) that returns the sample's field values. Tests and
benchmarks use it to drive the daemon, the checks and the exporter deterministically,
without NVML and without the simulator's noise. :class:`FakeClock` is a clock tests step
by hand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from forewarn.agent.backend import GpuInfo, SourceUnavailable
from forewarn.wire import GpuSample, XidEvent

__all__ = ["FakeClock", "ScriptedBackend", "ScriptedXidSource"]

Script = Callable[[int, float], Mapping[str, Any]]
"""(gpu index, wall time) -> GpuSample field values for that poll."""


@dataclasses.dataclass
class FakeClock:
    """A clock that moves only when told (``advance``)."""

    now: float = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


class ScriptedBackend:
    """A GPU source whose values come from ``script`` (a test double, not hardware).

    ``fail_open`` / ``fail_sample`` make :meth:`open` / :meth:`sample` raise
    :class:`SourceUnavailable` while true (tests flip them to exercise retries).
    ``queue_xid`` schedules an XID for the next :meth:`drain_xids`.
    """

    def __init__(
        self,
        script: Script,
        *,
        gpus: int = 2,
        node: str = "node0",
        name: str = "scripted",
        simulated: bool = True,
    ) -> None:
        self.script = script
        self.gpus = gpus
        self.node = node
        self.name = name
        self.simulated = simulated
        self.fail_open = False
        self.fail_sample = False
        self.opens = 0
        self.samples_taken = 0
        self.closed = 0
        self._xids: list[XidEvent] = []

    def info(self, index: int) -> GpuInfo:
        return GpuInfo(index=index, uuid=f"GPU-{index:08d}-test", name="Scripted GPU",
                       pci_bus_id=f"00000000:{0x10 + index:02X}:00.0",
                       memory_total_bytes=80 * 2**30)

    def open(self) -> list[GpuInfo]:
        self.opens += 1
        if self.fail_open:
            raise SourceUnavailable("scripted backend told to fail open")
        return [self.info(i) for i in range(self.gpus)]

    def sample(self, now: float) -> list[GpuSample]:
        if self.fail_sample:
            raise SourceUnavailable("scripted backend told to fail sample")
        self.samples_taken += 1
        out = []
        for i in range(self.gpus):
            info = self.info(i)
            out.append(GpuSample(node=self.node, gpu=i, uuid=info.uuid,
                                 pci_bus_id=info.pci_bus_id, name=info.name, time=now,
                                 source=self.name, simulated=self.simulated,
                                 **dict(self.script(i, now))))
        return out

    def queue_xid(self, code: int, gpu: int | None, time: float, bus_id: str = "") -> None:
        self._xids.append(XidEvent(node=self.node, gpu=gpu, code=code, time=time,
                                   pci_bus_id=bus_id, source=self.name,
                                   simulated=self.simulated, text=f"scripted XID {code}"))

    def drain_xids(self) -> list[XidEvent]:
        out, self._xids = self._xids, []
        return out

    def close(self) -> None:
        self.closed += 1


class ScriptedXidSource:
    """An extra XID source (like the kernel log) fed by the test."""

    def __init__(self, name: str = "kmsg") -> None:
        self.name = name
        self.skipped = 0
        self.events: list[XidEvent] = []
        self.fail = False

    def drain(self) -> list[XidEvent]:
        if self.fail:
            raise OSError("scripted XID source told to fail")
        out, self.events = self.events, []
        return out

    def close(self) -> None:
        pass
