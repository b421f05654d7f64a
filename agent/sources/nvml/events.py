"""XID errors from NVML's event set (``nvmlEventTypeXidCriticalError``): a daemon thread
waits on the set with a timeout (so :meth:`XidEvents.stop` ends it promptly) and queues
each event, bounded, until the poll loop drains them."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, Final

import pynvml

from forewarn.agent.sources.nvml.fields import UNSUPPORTED, NvmlGpu, address
from forewarn.wire import XidEvent

__all__ = ["XidEvents"]

log = logging.getLogger(__name__)

XID_EVENT: Final[int] = pynvml.nvmlEventTypeXidCriticalError
MAX_XID_QUEUE: Final = 10_000


class XidEvents:
    """The event set of one NVML session and the thread that waits on it.

    ``gpu_at`` maps a device handle's address to its GPU (None: not one of ours); ``clock``
    dates the events; ``wait_ms`` bounds each wait and so how long :meth:`stop` may take.
    """

    def __init__(self, node: str, source: str, *, gpu_at: Callable[[int], NvmlGpu | None],
                 clock: Callable[[], float], wait_ms: int) -> None:
        self.node = node
        self.source = source
        self.gpu_at = gpu_at
        self.clock = clock
        self.wait_ms = wait_ms
        self.dropped = 0
        """Events dropped because nobody drained the queue (bounded)."""
        self.wait_errors = 0
        """nvmlEventSetWait failures other than timeouts."""
        self._queue: collections.deque[XidEvent] = collections.deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._event_set: Any = None
        self._thread: threading.Thread | None = None

    def start(self, gpus: Iterable[NvmlGpu]) -> None:
        """Create the event set, register every attached GPU and start the thread."""
        try:
            self._event_set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            log.warning("nvml: no event set, XIDs only from the kernel log: %s", exc)
            return
        registered = [self.register(gpu) for gpu in gpus if gpu.handle is not None]
        if not any(registered):
            pynvml.nvmlEventSetFree(self._event_set)
            self._event_set = None
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="nvml-xid", daemon=True)
        self._thread.start()

    def add(self, gpu: NvmlGpu, gpus: Iterable[NvmlGpu]) -> None:
        """``gpu`` was attached late: register it, or start the events for all ``gpus``
        when no GPU had them before."""
        if self._event_set is None:
            self.start(gpus)
        else:
            self.register(gpu)

    def register(self, gpu: NvmlGpu) -> bool:
        """Ask for this GPU's XID events on the event set; False where it has none."""
        try:
            if not pynvml.nvmlDeviceGetSupportedEventTypes(gpu.handle) & XID_EVENT:
                gpu.mark_unsupported("xid_events")
                return False
            pynvml.nvmlDeviceRegisterEvents(gpu.handle, XID_EVENT, self._event_set)
            return True
        except pynvml.NVMLError as exc:
            if exc.value in UNSUPPORTED:
                gpu.mark_unsupported("xid_events")
            else:
                log.warning("nvml: GPU %d: XID events not registered: %s", gpu.index, exc)
            return False

    def stop(self) -> None:
        """End the thread and free the event set (before nvmlShutdown). Safe to call twice."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=self.wait_ms / 1000.0 + 5.0)
        if self._event_set is not None:
            if thread is not None and thread.is_alive():
                log.warning("nvml: XID thread still waiting; event set left allocated")
            else:
                try:
                    pynvml.nvmlEventSetFree(self._event_set)
                except pynvml.NVMLError as exc:
                    log.warning("nvml: nvmlEventSetFree: %s", exc)
            self._event_set = None

    def drain(self) -> list[XidEvent]:
        """XID events since the last call, oldest first. Never blocks for long."""
        with self._lock:
            events = list(self._queue)
            self._queue.clear()
        return events

    def _loop(self) -> None:
        event_set = self._event_set
        while not self._stop.is_set():
            try:
                data = pynvml.nvmlEventSetWait(event_set, self.wait_ms)
            except pynvml.NVMLError as exc:
                if exc.value == pynvml.NVML_ERROR_TIMEOUT:
                    continue
                self.wait_errors += 1
                if self.wait_errors in (1, 10, 100) or self.wait_errors % 1000 == 0:
                    log.warning("nvml: nvmlEventSetWait failed (%d times): %s",
                                self.wait_errors, exc)
                self._stop.wait(1.0)
                continue
            if data.eventType & XID_EVENT:
                self._queue_event(data)

    def _queue_event(self, data: Any) -> None:
        gpu = self.gpu_at(address(data.device))
        code = int(data.eventData)
        event = XidEvent(
            node=self.node,
            gpu=gpu.index if gpu else None,
            pci_bus_id=gpu.info.pci_bus_id if gpu else "",
            code=min(code, 100_000),
            text=f"Xid {code} (NVML event nvmlEventTypeXidCriticalError)",
            time=self.clock(),
            source=self.source,
        )
        with self._lock:
            if len(self._queue) >= MAX_XID_QUEUE:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append(event)
