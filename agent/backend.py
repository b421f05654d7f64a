"""The hardware seam. Every GPU source implements :class:`GpuBackend`; everything else in
the agent takes a backend object and never imports a vendor library.

Vendor errors that stop a source are classified once, here, as :class:`SourceUnavailable`
(a GPU that stops answering is a finding, not an error: the ``gpu_lost`` check).
"Not supported" is not an error at all: the field is listed in
:attr:`forewarn.wire.GpuSample.unsupported`.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from forewarn.errors import UnavailableError
from forewarn.wire import GpuSample, XidEvent

__all__ = [
    "BackendError",
    "GpuBackend",
    "GpuInfo",
    "SourceUnavailable",
    "XidSource",
]


class BackendError(UnavailableError):
    """Base of the typed errors a GPU source raises."""


class SourceUnavailable(BackendError):
    """The source cannot run on this machine (no driver, no endpoint, bad file)."""


class GpuInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Static facts about one GPU, read once when the source opens."""

    index: int
    uuid: str = ""
    name: str = ""
    pci_bus_id: str = ""
    serial: str = ""
    memory_total_bytes: int | None = None


class GpuBackend(Protocol):
    """A GPU telemetry source.

    Contract: :meth:`open` is called once and returns the inventory (raises
    :class:`SourceUnavailable` when the source cannot run here). :meth:`sample` never
    raises for a single GPU's trouble: a GPU that vanished yields a sample whose
    ``state`` is ``lost`` or ``reset_required``. It may raise :class:`SourceUnavailable`
    when the whole source broke. :meth:`drain_xids` returns XID events seen since the
    last call (possibly from a background thread) and never blocks.
    """

    name: str
    """Short source name, written into every sample (``nvml``, ``sim``...)."""
    simulated: bool
    """True when values are made up (sim); marked on every sample and metric."""

    def open(self) -> list[GpuInfo]: ...

    def sample(self, now: float) -> list[GpuSample]: ...

    def drain_xids(self) -> list[XidEvent]: ...

    def close(self) -> None: ...


class XidSource(Protocol):
    """An extra source of XID events (the kernel log). Never raises from ``drain``;
    malformed input is counted in ``skipped`` and logged at a limited rate."""

    skipped: int

    def drain(self) -> list[XidEvent]: ...

    def close(self) -> None: ...
