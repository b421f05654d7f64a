"""What the agent knows right now: recent samples per GPU and recent XID events.

Checks read this; only the daemon's poll loop writes it (one thread), so it needs no lock
for the checks. The exporter reads the cached copies the loop publishes.
"""

from __future__ import annotations

import collections
import dataclasses

from forewarn.agent.backend import GpuInfo
from forewarn.agent.ranks import RankTable
from forewarn.wire import GpuSample, XidEvent

__all__ = ["AgentState", "GpuHistory"]

HISTORY_S = 15 * 60.0
"""Seconds of samples kept per GPU: enough for rate checks over a few minutes."""
XID_WINDOW_S = 24 * 3600.0
"""XID events are kept a day: repeat escalation counts within 24 h (docs/reference.md)."""
MAX_XIDS = 10_000


@dataclasses.dataclass
class GpuHistory:
    """Recent samples of one GPU, oldest first, pruned to :data:`HISTORY_S`."""

    info: GpuInfo
    samples: collections.deque[GpuSample] = dataclasses.field(default_factory=collections.deque)

    @property
    def last(self) -> GpuSample | None:
        return self.samples[-1] if self.samples else None

    def add(self, sample: GpuSample) -> None:
        self.samples.append(sample)
        horizon = sample.time - HISTORY_S
        while self.samples and self.samples[0].time < horizon:
            self.samples.popleft()


@dataclasses.dataclass
class AgentState:
    """The node as the agent sees it."""

    node: str
    gpus: dict[int, GpuHistory] = dataclasses.field(default_factory=dict)
    xids: collections.deque[XidEvent] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=MAX_XIDS)
    )
    ranks: RankTable | None = None
    """Training ranks heard on the agent socket (set by the rank component; its own lock)."""

    def add_inventory(self, infos: list[GpuInfo]) -> None:
        for info in infos:
            self.gpus.setdefault(info.index, GpuHistory(info=info))

    def add_samples(self, samples: list[GpuSample]) -> None:
        for sample in samples:
            hist = self.gpus.get(sample.gpu)
            if hist is None:
                hist = self.gpus[sample.gpu] = GpuHistory(
                    info=GpuInfo(index=sample.gpu, uuid=sample.uuid, name=sample.name,
                                 pci_bus_id=sample.pci_bus_id)
                )
            hist.add(sample)

    def add_xids(self, events: list[XidEvent], now: float) -> None:
        self.xids.extend(events)
        while self.xids and self.xids[0].time < now - XID_WINDOW_S:
            self.xids.popleft()

    def gpu_for_bus_id(self, pci_bus_id: str) -> int | None:
        """Map a PCI bus id from the kernel log (``0000:3b:00.0`` or ``3b:00``) to a GPU."""
        want = _norm_bus_id(pci_bus_id)
        for index, hist in self.gpus.items():
            if want and _norm_bus_id(hist.info.pci_bus_id) == want:
                return index
        return None


def _norm_bus_id(bus_id: str) -> str:
    """Normalise ``00000000:3B:00.0`` / ``0000:3b:00.0`` / ``3b:00`` to ``3b:00``."""
    s = bus_id.strip().lower()
    if s.count(":") == 2:
        s = s.split(":", 1)[1]
    return s.split(".", 1)[0]
