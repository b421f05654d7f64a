"""The agent's sources as the poll loop runs them: the GPU backend opened, sampled and
retried when it fails, the XID sources drained, their events mapped to GPUs and deduplicated
across sources; the health of each for ``/metrics`` and ``/readyz``.

A source that fails is logged, counted, marked down and retried later: the daemon never
dies of a source.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import msgspec

from forewarn.agent.backend import GpuBackend, SourceUnavailable, XidSource
from forewarn.agent.exporter import SourceStatus
from forewarn.agent.state import AgentState
from forewarn.wire import GpuSample, XidEvent

__all__ = ["XID_DEDUP_S", "SourceHealth", "SourceRunner"]

log = logging.getLogger(__name__)

XID_DEDUP_S = 5.0
"""The same XID (GPU, code) reported by two sources (NVML event set and kernel log)
within this many seconds is counted once."""


@dataclasses.dataclass
class SourceHealth:
    """How one source is doing."""

    name: str
    up: bool = False
    opened: bool = False
    poll_seconds: float = 0.0
    errors: int = 0
    retry_at: float = 0.0
    last_error: str = ""

    def status(self, skipped: int = 0) -> SourceStatus:
        """This source's health as the exporter shows it."""
        return SourceStatus(name=self.name, up=self.up, poll_seconds=self.poll_seconds,
                            errors_total=self.errors, skipped_total=skipped,
                            last_error=self.last_error)


class SourceRunner:
    """Runs ``backend`` and ``xid_sources`` for the poll loop (its thread only), feeding
    the inventory into ``state``. ``monotonic`` times retries, ``timer`` the polls."""

    def __init__(self, backend: GpuBackend, xid_sources: Sequence[tuple[str, XidSource]],
                 state: AgentState, *, retry_s: float, monotonic: Callable[[], float],
                 timer: Callable[[], float]) -> None:
        self.backend = backend
        self.xid_sources = list(xid_sources)
        self.state = state
        self.retry_s = retry_s
        self.monotonic = monotonic
        self.timer = timer
        self.health = SourceHealth(backend.name)
        self.xid_health = {name: SourceHealth(name, up=True, opened=True)
                           for name, _ in self.xid_sources}
        self._recent_xids: list[XidEvent] = []

    def statuses(self) -> tuple[tuple[SourceStatus, ...], tuple[SourceStatus, ...]]:
        """(the GPU source's status, each XID source's status) for the exporter."""
        return ((self.health.status(),),
                tuple(self.xid_health[name].status(xs.skipped) for name, xs in self.xid_sources))

    def open(self) -> None:
        """Open the backend; a failure is logged and retried after ``retry_s``."""
        src = self.health
        try:
            inventory = self.backend.open()
        except SourceUnavailable as exc:
            self._failed(f"cannot open: {exc}")
            return
        except Exception as exc:  # a source bug must not kill the daemon either
            log.exception("source %s failed to open", src.name)
            self._failed(f"cannot open: {type(exc).__name__}: {exc}")
            return
        self.state.add_inventory(inventory)
        src.opened = True
        src.up = True
        log.info("source %s: %d GPU(s)", src.name, len(inventory))

    def close(self) -> None:
        """Close every source (errors logged)."""
        for closer in [self.backend.close, *(xs.close for _, xs in self.xid_sources)]:
            try:
                closer()
            except Exception:
                log.exception("closing a source failed")

    def _failed(self, message: str) -> None:
        src = self.health
        if src.up or message != src.last_error:
            log.error("source %s: %s (retrying every %gs)", src.name, message, self.retry_s)
        src.up = False
        src.errors += 1
        src.last_error = message
        src.retry_at = self.monotonic() + self.retry_s

    def sample(self, now: float) -> list[GpuSample]:
        """This cycle's samples; none while the source is down (reopened when due)."""
        src = self.health
        if not src.opened:
            if self.monotonic() < src.retry_at:
                return []
            self.open()
            if not src.opened:
                return []
        start = self.timer()
        try:
            samples = list(self.backend.sample(now))
        except SourceUnavailable as exc:
            src.opened = False
            try:
                self.backend.close()
            except Exception:
                log.debug("close after failure raised", exc_info=True)
            self._failed(f"became unavailable: {exc}")
            return []
        except Exception as exc:
            log.exception("source %s failed to sample", src.name)
            src.errors += 1
            src.up = False
            src.last_error = f"{type(exc).__name__}: {exc}"
            return []
        finally:
            src.poll_seconds = self.timer() - start
        if not src.up:
            log.info("source %s is back", src.name)
        src.up = True
        return samples

    def drain_xids(self, now: float) -> list[XidEvent]:
        """New XID events of every source: bus ids mapped to GPU indexes, an event another
        source reported within :data:`XID_DEDUP_S` dropped."""
        out: list[XidEvent] = []
        self._recent_xids = [e for e in self._recent_xids if e.time >= now - 60.0]
        for ev in self._collect_xids():
            if ev.gpu is None and ev.pci_bus_id:
                gpu = self.state.gpu_for_bus_id(ev.pci_bus_id)
                if gpu is not None:
                    ev = msgspec.structs.replace(ev, gpu=gpu)
            if any(r.gpu == ev.gpu and r.code == ev.code and r.source != ev.source
                   and abs(r.time - ev.time) <= XID_DEDUP_S for r in self._recent_xids):
                continue
            self._recent_xids.append(ev)
            out.append(ev)
        return out

    def _collect_xids(self) -> list[XidEvent]:
        """Every source's new events, the backend's first; a failing source is marked down."""
        events: list[XidEvent] = []
        if self.health.opened:
            try:
                events.extend(self.backend.drain_xids())
            except Exception as exc:
                log.warning("source %s: draining XIDs failed: %s", self.health.name, exc)
        for name, xs in self.xid_sources:
            health = self.xid_health[name]
            try:
                events.extend(xs.drain())
                health.up = True
            except Exception as exc:
                if health.up:
                    log.warning("XID source %s failed: %s", name, exc)
                health.up = False
                health.errors += 1
        return events
