"""The nvml source's :class:`NvmlBackend`: open NVML, read the inventory, sample every GPU
each poll (see the package docstring for what NVML's answers become)."""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml

from forewarn.agent.backend import GpuInfo, SourceUnavailable
from forewarn.agent.sources.nvml.events import XidEvents
from forewarn.agent.sources.nvml.fields import (
    BOOL_FIELDS,
    FIELDS,
    FLOAT_FIELDS,
    GETTERS,
    NVLINK_COUNTERS,
    NVLINK_FIELD_LINKS,
    STATIC_GETTERS,
    UNSUPPORTED,
    FieldRequest,
    Getter,
    NvmlGpu,
    _Vanished,
    address,
    available,
    decode_fields,
    error_string,
    field_value,
    init_message,
    nvlink_field_id,
    text,
    vanished,
)
from forewarn.gpu import NVML_VALUE_NOT_AVAILABLE
from forewarn.wire import GpuSample, GpuState, NvlinkCounters, XidEvent

__all__ = ["NvmlBackend"]

log = logging.getLogger(__name__)


class NvmlBackend:
    """GPU source over NVML (nvidia-ml-py), implementing
    :class:`forewarn.agent.backend.GpuBackend`.

    ``library_path`` loads a specific ``libnvidia-ml.so.1`` (e.g. a fake in tests) before
    pynvml looks the library up by name; ``None`` lets pynvml find the driver's library.
    ``clock`` gives the time of XID events; ``xid_wait_ms`` bounds each event wait and so
    how long :meth:`close` may take.
    """

    name = "nvml"
    simulated = False

    def __init__(
        self,
        node: str,
        library_path: Path | str | None = None,
        *,
        clock: Callable[[], float] = time.time,
        xid_wait_ms: int = 2000,
    ) -> None:
        self.node = node
        self.library_path = Path(library_path) if library_path is not None else None
        self.driver_version = ""
        self._gpus: list[NvmlGpu] = []
        self._by_address: dict[int, NvmlGpu] = {}
        self.xids = XidEvents(node, self.name, gpu_at=lambda a: self._by_address.get(a),
                              clock=clock, wait_ms=xid_wait_ms)
        """The XID event thread (its ``dropped`` and ``wait_errors`` count trouble)."""
        self._lib: ctypes.CDLL | None = None
        self._open = False

    # -- lifecycle -------------------------------------------------------------------

    def open(self) -> list[GpuInfo]:
        """Initialise NVML, read the inventory and start the XID event thread.

        May be called again (after :meth:`close` or a failure) to start afresh."""
        if self._open:
            self.close()
        self._by_address = {}
        if self.library_path is not None:
            try:
                # Loaded by path first: its SONAME libnvidia-ml.so.1 then satisfies
                # pynvml's own CDLL("libnvidia-ml.so.1") lookup.
                self._lib = ctypes.CDLL(str(self.library_path))
            except OSError as exc:
                raise SourceUnavailable(
                    f"nvml: cannot load NVML library {self.library_path}: {exc}"
                ) from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise SourceUnavailable(init_message(exc)) from None
        self._open = True
        try:
            self.driver_version = text(pynvml.nvmlSystemGetDriverVersion())
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            self.close()
            raise SourceUnavailable(f"nvml: cannot enumerate GPUs: {exc}") from None
        self._gpus = [NvmlGpu(index=i, info=GpuInfo(index=i)) for i in range(count)]
        for gpu in self._gpus:
            try:
                self._attach(gpu)
            except _Vanished as exc:
                log.warning("nvml: GPU %d did not answer at start: %s", gpu.index, exc.reason)
        self.xids.start(self._gpus)
        log.info("nvml: driver %s, %d GPU(s)", self.driver_version, count)
        return [gpu.info for gpu in self._gpus]

    def close(self) -> None:
        """Stop the event thread and shut NVML down. Safe to call twice."""
        self.xids.stop()
        if self._open:
            self._open = False
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as exc:
                log.warning("nvml: nvmlShutdown: %s", exc)

    # -- inventory -------------------------------------------------------------------

    def _attach(self, gpu: NvmlGpu) -> None:
        """Get the handle, identity and static facts of one GPU (raises _Vanished)."""
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(gpu.index)
        except pynvml.NVMLError as exc:
            raise vanished(exc) or _Vanished(GpuState.OK, f"handle: {exc}") from None
        ident: dict[str, str] = {}
        for key, call in (
            ("name", pynvml.nvmlDeviceGetName),
            ("uuid", pynvml.nvmlDeviceGetUUID),
            ("pci_bus_id", lambda h: pynvml.nvmlDeviceGetPciInfo(h).busId),
            ("serial", pynvml.nvmlDeviceGetSerial),
        ):
            try:
                ident[key] = text(call(handle))
            except pynvml.NVMLError as exc:
                lost = vanished(exc)
                if lost is not None:
                    raise lost from None
                log.debug("nvml: GPU %d %s: %s", gpu.index, key, exc)
        total: int | None = None
        try:
            total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        except pynvml.NVMLError as exc:
            lost = vanished(exc)
            if lost is not None:
                raise lost from None
        gpu.info = GpuInfo(index=gpu.index, memory_total_bytes=total, **ident)
        errors: list[str] = []
        static: dict[str, Any] = {}
        for getter in STATIC_GETTERS:
            self._call(gpu, handle, getter, static, errors)
        try:
            gpu.slowdown_threshold_c = float(pynvml.nvmlDeviceGetTemperatureThreshold(
                handle, pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN))
        except pynvml.NVMLError as exc:
            lost = vanished(exc)
            if lost is not None:
                raise lost from None
        gpu.static = static
        gpu.nvlinks = self._nvlink_count(gpu, handle)
        self._build_fields(gpu)
        gpu.handle = handle
        self._by_address[address(handle)] = gpu
        for err in errors:
            log.warning("nvml: GPU %d: %s", gpu.index, err)

    def _nvlink_count(self, gpu: NvmlGpu, handle: Any) -> int:
        try:
            (fv,) = pynvml.nvmlDeviceGetFieldValues(handle, [pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT])
        except pynvml.NVMLError as exc:
            lost = vanished(exc)
            if lost is not None:
                raise lost from None
            return 0
        if fv.nvmlReturn != pynvml.NVML_SUCCESS:
            gpu.mark_unsupported("nvlink")
            return 0
        return min(int(field_value(fv)), int(pynvml.NVML_NVLINK_MAX_LINKS))

    def _build_fields(self, gpu: NvmlGpu) -> None:
        fields = [(fid, 0) for _, fid in FIELDS]
        gpu.targets = [(name, -1) for name, _ in FIELDS]
        gpu.link_counters = []
        for link in range(gpu.nvlinks):
            for attr, stem, counter in NVLINK_COUNTERS:
                if link < NVLINK_FIELD_LINKS:
                    fields.append((nvlink_field_id(stem, link), 0))
                    gpu.targets.append((attr, link))
                else:
                    gpu.link_counters.append((link, attr, counter))
        gpu.request = FieldRequest(fields)

    # -- polling ---------------------------------------------------------------------

    def sample(self, now: float) -> list[GpuSample]:
        """One sample per GPU; a vanished GPU yields ``state`` lost / reset_required."""
        if not self._open:
            raise SourceUnavailable("nvml: source is not open")
        return [self._sample_one(gpu, now) for gpu in self._gpus]

    def _sample_one(self, gpu: NvmlGpu, now: float) -> GpuSample:
        values: dict[str, Any] = {}
        errors: list[str] = []
        links: dict[int, dict[str, int]] = {}
        try:
            if gpu.handle is None:
                self._attach_late(gpu)
            h = gpu.handle
            for getter in GETTERS:
                if getter[0] not in gpu.skip:
                    self._call(gpu, h, getter, values, errors)
            self._margin(gpu, h, values, errors)
            self._read_fields(gpu, h, values, errors, links)
            self._read_link_counters(gpu, h, errors, links)
        except _Vanished as exc:
            return self._vanished_sample(gpu, now, exc)
        values.update(gpu.static)
        if gpu.nvlinks:
            counters = tuple(
                NvlinkCounters(link=link, **links.get(link, {})) for link in range(gpu.nvlinks)
            )
            # Unchanged counters (the usual case) share the previous sample's records: the
            # agent keeps 15 minutes of samples, and 18 links' records are most of each.
            if counters == gpu.last_nvlink:
                counters = gpu.last_nvlink
            gpu.last_nvlink = counters
            values["nvlink"] = counters
        info = gpu.info
        return GpuSample(
            node=self.node, gpu=gpu.index, uuid=info.uuid, pci_bus_id=info.pci_bus_id,
            name=info.name, time=now, source=self.name, unsupported=gpu.unsupported,
            errors=tuple(errors), **values,
        )

    def _vanished_sample(self, gpu: NvmlGpu, now: float, exc: _Vanished) -> GpuSample:
        info = gpu.info
        state = exc.state
        return GpuSample(
            node=self.node, gpu=gpu.index, uuid=info.uuid, pci_bus_id=info.pci_bus_id,
            name=info.name, time=now, source=self.name, state=state,
            unsupported=gpu.unsupported, errors=(f"gpu: {exc.reason}",),
        )

    def _call(self, gpu: NvmlGpu, h: Any, getter: Getter, out: dict[str, Any],
              errors: list[str]) -> None:
        key, names, call = getter
        try:
            result = call(h)
        except pynvml.NVMLError as exc:
            self._classify(gpu, key, names, exc, errors)
            return
        for name, value in zip(names, result, strict=True):
            out[name] = value

    def _classify(self, gpu: NvmlGpu, key: str, names: tuple[str, ...], exc: Any,
                  errors: list[str]) -> None:
        code = exc.value
        if code in UNSUPPORTED:
            gpu.skip.add(key)
            gpu.mark_unsupported(*names)
            return
        lost = vanished(exc)
        if lost is not None:
            raise lost
        if code == pynvml.NVML_ERROR_UNINITIALIZED:
            raise SourceUnavailable(f"nvml: library no longer initialised ({exc})")
        errors.append(f"{names[0]}: {exc}")

    def _margin(self, gpu: NvmlGpu, h: Any, values: dict[str, Any], errors: list[str]) -> None:
        """Slowdown margin: degrees C left before HW slowdown.

        nvmlDeviceGetMarginTemperature (R550+) is nvidia-smi's "GPU T.Limit Temp";
        where it is missing, the slowdown threshold read at start minus the GPU
        temperature (NVML_TEMPERATURE_THRESHOLD_SLOWDOWN).
        """
        if gpu.margin_api:
            try:
                values["slowdown_margin_c"] = float(pynvml.nvmlDeviceGetMarginTemperature(h))
                return
            except pynvml.NVMLError as exc:
                if exc.value not in UNSUPPORTED:
                    self._classify(gpu, "slowdown_margin_c", ("slowdown_margin_c",), exc, errors)
                    return
                gpu.margin_api = False
        temp = values.get("temperature_c")
        if gpu.slowdown_threshold_c is None:
            gpu.mark_unsupported("slowdown_margin_c")
        elif temp is not None:
            values["slowdown_margin_c"] = gpu.slowdown_threshold_c - temp

    def _read_fields(self, gpu: NvmlGpu, h: Any, values: dict[str, Any], errors: list[str],
                     links: dict[int, dict[str, int]]) -> None:
        if gpu.request is None:
            return
        try:
            results = gpu.request.read(h)
        except pynvml.NVMLError as exc:
            self._classify(gpu, "field_values", ("field_values",), exc, errors)
            return
        dropped: list[int] = []
        targets = gpu.targets
        for i, (ret, value) in enumerate(decode_fields(results)):
            name, link = targets[i]
            if ret == pynvml.NVML_SUCCESS:
                if value in NVML_VALUE_NOT_AVAILABLE:
                    continue  # missing this poll, not a reading
                if link >= 0:
                    links.setdefault(link, {})[name] = int(value)
                elif name in BOOL_FIELDS:
                    values[name] = bool(value)
                elif name in FLOAT_FIELDS:
                    values[name] = float(value)
                else:
                    values[name] = int(value)
            elif ret in UNSUPPORTED:
                dropped.append(i)
            elif ret == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise _Vanished(GpuState.LOST, "GPU is lost")
            elif ret == pynvml.NVML_ERROR_RESET_REQUIRED:
                raise _Vanished(GpuState.RESET_REQUIRED, "GPU requires reset")
            else:
                label = name if link < 0 else f"nvlink[{link}].{name}"
                errors.append(f"{label}: {error_string(ret)}")
        if dropped:
            self._drop_fields(gpu, dropped)

    def _drop_fields(self, gpu: NvmlGpu, dropped: list[int]) -> None:
        """Stop asking fields answered NOT_SUPPORTED; report the ones now never read."""
        gone = set(dropped)
        names = [gpu.targets[i] for i in dropped]
        assert gpu.request is not None  # only fields that were asked are dropped
        fields = [f for i, f in enumerate(gpu.request.fields) if i not in gone]
        gpu.request = FieldRequest(fields) if fields else None
        gpu.targets = [t for i, t in enumerate(gpu.targets) if i not in gone]
        still = {name for name, link in gpu.targets if link >= 0}
        still.update(attr for _, attr, _ in gpu.link_counters)
        for name, link in names:
            if link < 0:
                gpu.mark_unsupported(name)
            elif name not in still:
                gpu.mark_unsupported(f"nvlink.{name}")

    def _read_link_counters(self, gpu: NvmlGpu, h: Any, errors: list[str],
                            links: dict[int, dict[str, int]]) -> None:
        dropped = []
        for item in gpu.link_counters:
            link, attr, counter = item
            try:
                value = available(pynvml.nvmlDeviceGetNvLinkErrorCounter(h, link, counter))
                if value is not None:
                    links.setdefault(link, {})[attr] = value
            except pynvml.NVMLError as exc:
                if exc.value in UNSUPPORTED:
                    dropped.append(item)
                    continue
                self._classify(gpu, attr, (f"nvlink[{link}].{attr}",), exc, errors)
        if dropped:
            gpu.link_counters = [c for c in gpu.link_counters if c not in dropped]

    def drain_xids(self) -> list[XidEvent]:
        """XID events since the last call, oldest first. Never blocks for long."""
        return self.xids.drain()

    def _attach_late(self, gpu: NvmlGpu) -> None:
        """A GPU that did not answer at :meth:`open` is back: attach it and register it
        for XID events (starting the event thread if no GPU had it before)."""
        self._attach(gpu)
        log.info("nvml: GPU %d answers again", gpu.index)
        self.xids.add(gpu, self._gpus)
