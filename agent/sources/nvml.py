"""The ``nvml`` GPU source: NVIDIA's management library through nvidia-ml-py.

This is the only module in forewarn that imports :mod:`pynvml`. It turns NVML's answers
into :class:`forewarn.wire.GpuSample` records and NVML error codes into the typed outcomes
of :mod:`forewarn.agent.backend`:

* ``NVML_ERROR_NOT_SUPPORTED`` (and ``FUNCTION_NOT_FOUND`` from an older driver): the
  field is listed in ``GpuSample.unsupported`` and never asked again for that GPU.
* ``NVML_ERROR_GPU_IS_LOST`` / ``NVML_ERROR_RESET_REQUIRED``: the GPU's sample has
  ``state`` ``lost`` / ``reset_required``; the other GPUs keep sampling and the GPU is
  tried again at the next poll.
* any other error of one field: a ``"field: reason"`` entry in ``GpuSample.errors``.
* a value at NVML's "not available" sentinel (:data:`NVML_VALUE_NOT_AVAILABLE`,
  :data:`NVML_PSTATE_UNKNOWN`): the field is missing (``None``) in that sample.
* no library / no kernel driver at :meth:`NvmlBackend.open`:
  :class:`~forewarn.agent.backend.SourceUnavailable` with a message that says so.

Cost per poll and GPU: one ``nvmlDeviceGetFieldValues`` call for the ECC, retired-page,
row-remap, PCIe-replay, memory-temperature and per-link NVLink counters (NVML_FI_DEV_*),
plus one call per remaining getter. Handles, field lists and static facts (max PCIe link,
slowdown threshold, NVLink link count) are read once in :meth:`NvmlBackend.open`.

XID errors arrive through an NVML event set (``nvmlEventTypeXidCriticalError``) waited
on by a daemon thread with a timeout, so :meth:`NvmlBackend.close` ends it promptly.

NVML entry points used (for the record of what a driver must provide):
``nvmlInitWithFlags``, ``nvmlShutdown``, ``nvmlSystemGetDriverVersion``,
``nvmlDeviceGetCount_v2``, ``nvmlDeviceGetHandleByIndex_v2``, ``nvmlDeviceGetName``,
``nvmlDeviceGetUUID``, ``nvmlDeviceGetPciInfo_v3``, ``nvmlDeviceGetSerial``,
``nvmlDeviceGetTemperature``, ``nvmlDeviceGetTemperatureThreshold``,
``nvmlDeviceGetMarginTemperature``, ``nvmlDeviceGetPowerUsage``,
``nvmlDeviceGetEnforcedPowerLimit``, ``nvmlDeviceGetClockInfo``,
``nvmlDeviceGetUtilizationRates``, ``nvmlDeviceGetMemoryInfo``,
``nvmlDeviceGetCurrentClocksEventReasons``, ``nvmlDeviceGetPerformanceState``,
``nvmlDeviceGetCurrPcieLinkGeneration``, ``nvmlDeviceGetCurrPcieLinkWidth``,
``nvmlDeviceGetMaxPcieLinkGeneration``, ``nvmlDeviceGetMaxPcieLinkWidth``,
``nvmlDeviceGetTotalEnergyConsumption``,
``nvmlDeviceGetFieldValues``, ``nvmlDeviceGetNvLinkErrorCounter`` (links 12 and up only),
``nvmlEventSetCreate``, ``nvmlDeviceGetSupportedEventTypes``, ``nvmlDeviceRegisterEvents``,
``nvmlEventSetWait_v2``, ``nvmlEventSetFree``, ``nvmlErrorString``.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import logging
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import pynvml

from forewarn.agent.backend import GpuInfo, SourceUnavailable
from forewarn.gpu import NVML_VALUE_NOT_AVAILABLE
from forewarn.wire import GpuSample, GpuState, NvlinkCounters, XidEvent

__all__ = ["NVML_PSTATE_UNKNOWN", "NvmlBackend"]

log = logging.getLogger(__name__)

_UNSUPPORTED: Final = frozenset(
    {pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND}
)
_XID_EVENT: Final[int] = pynvml.nvmlEventTypeXidCriticalError
_MAX_XID_QUEUE: Final = 10_000

# NVML's "not available" answers: forewarn.gpu.NVML_VALUE_NOT_AVAILABLE (nvidia-ml-py's
# NVML_VALUE_NOT_AVAILABLE_uint and _ulonglong; a test checks they agree).
# nvmlDeviceGetPerformanceState answers NVML_PSTATE_UNKNOWN (32) when it cannot tell.
NVML_PSTATE_UNKNOWN: Final = int(pynvml.NVML_PSTATE_UNKNOWN)


def _available(value: int) -> int | None:
    """An integer NVML answer, or None for :data:`NVML_VALUE_NOT_AVAILABLE`."""
    return None if value in NVML_VALUE_NOT_AVAILABLE else int(value)


def _measure(value: int, divisor: float = 1.0) -> float | None:
    """A measurement in our units (NVML's divided by ``divisor``), None when not available."""
    return None if value in NVML_VALUE_NOT_AVAILABLE else value / divisor


def _pstate(value: int) -> int | None:
    return None if value == NVML_PSTATE_UNKNOWN else _available(value)


# Getters called once per poll: (key, sample fields they fill, call). Units are converted
# here: NVML reports power in milliwatts, clocks in MHz, temperatures in degrees C.
_Getter = tuple[str, tuple[str, ...], Callable[[Any], tuple[Any, ...]]]
_GETTERS: Final[tuple[_Getter, ...]] = (
    ("temperature_c", ("temperature_c",),
     lambda h: (_measure(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),)),
    ("power_w", ("power_w",), lambda h: (_measure(pynvml.nvmlDeviceGetPowerUsage(h), 1000.0),)),
    ("power_limit_w", ("power_limit_w",),
     lambda h: (_measure(pynvml.nvmlDeviceGetEnforcedPowerLimit(h), 1000.0),)),
    ("sm_clock_mhz", ("sm_clock_mhz",),
     lambda h: (_measure(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),)),
    ("mem_clock_mhz", ("mem_clock_mhz",),
     lambda h: (_measure(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)),)),
    ("utilization", ("gpu_util_pct", "mem_util_pct"), lambda h: _utilization(h)),
    ("memory", ("memory_used_bytes", "memory_total_bytes"), lambda h: _memory(h)),
    # Clock-event ("throttle") reasons bitmask, nvmlClocksEventReason* (e.g. 0x40 HW
    # thermal slowdown, 0x80 HW power brake): the thermal and power-brake checks read it.
    ("throttle_reasons", ("throttle_reasons",),
     lambda h: (_available(pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)),)),
    ("pstate", ("pstate",), lambda h: (_pstate(pynvml.nvmlDeviceGetPerformanceState(h)),)),
    ("pcie_link_gen", ("pcie_link_gen",),
     lambda h: (_available(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h)),)),
    ("pcie_link_width", ("pcie_link_width",),
     lambda h: (_available(pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)),)),
    # Millijoules since the driver loaded (Volta and later): the exporter's energy counter.
    ("energy_mj", ("energy_mj",),
     lambda h: (_available(pynvml.nvmlDeviceGetTotalEnergyConsumption(h)),)),
)

# Facts that do not change while the driver runs, read once per GPU.
_STATIC_GETTERS: Final[tuple[_Getter, ...]] = (
    ("pcie_link_gen_max", ("pcie_link_gen_max",),
     lambda h: (_available(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h)),)),
    ("pcie_link_width_max", ("pcie_link_width_max",),
     lambda h: (_available(pynvml.nvmlDeviceGetMaxPcieLinkWidth(h)),)),
)

# Counters read in one nvmlDeviceGetFieldValues call: sample field -> NVML_FI_DEV_* id.
_FIELDS: Final[tuple[tuple[str, int], ...]] = (
    ("ecc_corrected_volatile", pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL),
    ("ecc_uncorrected_volatile", pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL),
    ("ecc_corrected_aggregate", pynvml.NVML_FI_DEV_ECC_SBE_AGG_TOTAL),
    ("ecc_uncorrected_aggregate", pynvml.NVML_FI_DEV_ECC_DBE_AGG_TOTAL),
    ("retired_pages_sbe", pynvml.NVML_FI_DEV_RETIRED_SBE),
    ("retired_pages_dbe", pynvml.NVML_FI_DEV_RETIRED_DBE),
    ("retired_pages_pending", pynvml.NVML_FI_DEV_RETIRED_PENDING),
    # Row remapping (A100 and later), same as nvmlDeviceGetRemappedRows in one call.
    ("remapped_rows_correctable", pynvml.NVML_FI_DEV_REMAPPED_COR),
    ("remapped_rows_uncorrectable", pynvml.NVML_FI_DEV_REMAPPED_UNC),
    ("remap_pending", pynvml.NVML_FI_DEV_REMAPPED_PENDING),
    ("remap_failure", pynvml.NVML_FI_DEV_REMAPPED_FAILURE),
    ("pcie_replay_total", pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER),
    ("memory_temperature_c", pynvml.NVML_FI_DEV_MEMORY_TEMP),
)
_BOOL_FIELDS: Final = frozenset({"retired_pages_pending", "remap_pending", "remap_failure"})
_FLOAT_FIELDS: Final = frozenset({"memory_temperature_c"})

# NVLink error counters per link. NVML has per-link field ids for links 0..11 only
# (NVML_FI_DEV_NVLINK_*_L0..L11); links 12 and up (H100: 18 links) are read with
# nvmlDeviceGetNvLinkErrorCounter(link, NVML_NVLINK_ERROR_DL_*).
_NVLINK_FIELD_LINKS: Final = 12
_NVLINK_COUNTERS: Final[tuple[tuple[str, str, int], ...]] = (
    # (NvlinkCounters attribute, NVML_FI_DEV_NVLINK_<name>_L<n> stem, NVML_NVLINK_ERROR_DL_*)
    ("crc_flit", "CRC_FLIT_ERROR_COUNT", pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT),
    ("crc_data", "CRC_DATA_ERROR_COUNT", pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA),
    ("replay", "REPLAY_ERROR_COUNT", pynvml.NVML_NVLINK_ERROR_DL_REPLAY),
    ("recovery", "RECOVERY_ERROR_COUNT", pynvml.NVML_NVLINK_ERROR_DL_RECOVERY),
)


def _nvlink_field_id(stem: str, link: int) -> int:
    return int(getattr(pynvml, f"NVML_FI_DEV_NVLINK_{stem}_L{link}"))


def _utilization(h: Any) -> tuple[float | None, float | None]:
    u = pynvml.nvmlDeviceGetUtilizationRates(h)
    return _measure(u.gpu), _measure(u.memory)


def _memory(h: Any) -> tuple[int | None, int | None]:
    m = pynvml.nvmlDeviceGetMemoryInfo(h)
    return _available(m.used), _available(m.total)


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _field_value(fv: Any) -> int | float:
    """The value of one nvmlFieldValue_t according to its NVML_VALUE_TYPE_*."""
    t = fv.valueType
    v = fv.value
    if t == pynvml.NVML_VALUE_TYPE_DOUBLE:
        return float(v.dVal)
    if t == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT:
        return int(v.uiVal)
    if t == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG:
        return int(v.ulVal)
    if t == pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
        return int(v.sllVal)
    if t == pynvml.NVML_VALUE_TYPE_SIGNED_INT:
        return int(v.siVal)
    if t == pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT:
        return int(v.usVal)
    return int(v.ullVal)


# nvmlFieldValue_t laid out as in nvml.h: fieldId, scopeId, timestamp, latencyUsec,
# valueType, nvmlReturn, value (an 8-byte union). Decoding the returned array with one
# struct.iter_unpack costs a fraction of pynvml's per-attribute Structure access, which
# dominated the poll (bench/agent_poll.py). Used only when the sizes agree.
_FV_LAYOUT: Final = struct.Struct("@IIqqII8s")
_FV_FAST: Final = _FV_LAYOUT.size == ctypes.sizeof(pynvml.c_nvmlFieldValue_t)
_VALUE_FORMATS: Final[dict[int, struct.Struct]] = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: struct.Struct("@d"),
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: struct.Struct("@I"),
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: struct.Struct("@L"),
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: struct.Struct("@Q"),
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: struct.Struct("@q"),
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: struct.Struct("@i"),
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: struct.Struct("@H"),
}
_ULL: Final = _VALUE_FORMATS[pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG]


def _decode_fields(results: Any) -> list[tuple[int, int | float]]:
    """(nvmlReturn, value) per entry of an nvmlDeviceGetFieldValues result."""
    if not _FV_FAST:
        return [(int(fv.nvmlReturn), _field_value(fv)) for fv in results]
    out: list[tuple[int, int | float]] = []
    for _, _, _, _, vtype, ret, raw in _FV_LAYOUT.iter_unpack(bytes(results)):
        value = _VALUE_FORMATS.get(vtype, _ULL).unpack_from(raw)[0] if ret == 0 else 0
        out.append((ret, value))
    return out


class _FieldRequest:
    """One GPU's nvmlDeviceGetFieldValues request, built once and reused every poll.

    nvidia-ml-py's nvmlDeviceGetFieldValues allocates the nvmlFieldValue_t array and sets
    fieldId and scopeId on it entry by entry (through its Structure ``__setattr__``) on
    every call: for 13 counters and 48 NVLink fields on 8 GPUs, ~1,000 attribute writes a
    second, over a quarter of the source's poll in a profile. Here the filled-in array is
    kept as bytes, copied back over the answer array before each call (NVML writes into
    the same array), and passed to the binding's own function pointer and return check.
    Where the binding lacks those helpers, its public call is used.
    """

    def __init__(self, fields: list[tuple[int, int]]) -> None:
        self.fields = fields
        values = (pynvml.c_nvmlFieldValue_t * len(fields))()
        for entry, (field_id, scope_id) in zip(values, fields, strict=True):
            entry.fieldId = field_id
            entry.scopeId = scope_id
        self.values = values
        self.template = bytes(values)
        self.count = ctypes.c_int32(len(fields))

    def read(self, handle: Any) -> Any:
        """The answered array (raises pynvml.NVMLError like the binding's call)."""
        if not _DIRECT_FIELDS:
            return pynvml.nvmlDeviceGetFieldValues(handle, self.fields)
        ctypes.memmove(self.values, self.template, len(self.template))
        fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetFieldValues")
        pynvml._nvmlCheckReturn(fn(handle, self.count, ctypes.byref(self.values)))
        return self.values


_DIRECT_FIELDS = hasattr(pynvml, "_nvmlGetFunctionPointer") and hasattr(
    pynvml, "_nvmlCheckReturn")


def _address(handle: Any) -> int:
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


class _Vanished(Exception):
    """The GPU answered GPU_IS_LOST or RESET_REQUIRED: stop asking it this poll."""

    def __init__(self, state: GpuState, reason: str) -> None:
        super().__init__(reason)
        self.state = state
        self.reason = reason


@dataclasses.dataclass
class _Gpu:
    """Everything cached about one GPU between polls."""

    index: int
    info: GpuInfo
    handle: Any = None
    skip: set[str] = dataclasses.field(default_factory=set)
    """Getter keys answered NOT_SUPPORTED: never asked again."""
    unsupported: tuple[str, ...] = ()
    static: dict[str, Any] = dataclasses.field(default_factory=dict)
    slowdown_threshold_c: float | None = None
    margin_api: bool = True
    """nvmlDeviceGetMarginTemperature works; else margin = slowdown threshold - temp."""
    request: _FieldRequest | None = None
    """The (NVML_FI_DEV_* id, scope) pairs asked with nvmlDeviceGetFieldValues, as a
    reusable request; None when no field is left to ask."""
    targets: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    """Per entry of ``request.fields``: sample field (or NvlinkCounters attribute) and link
    (-1)."""
    link_counters: list[tuple[int, str, int]] = dataclasses.field(default_factory=list)
    """(link, attribute, NVML_NVLINK_ERROR_DL_*) read one by one (links >= 12)."""
    nvlinks: int = 0
    last_nvlink: tuple[NvlinkCounters, ...] = ()
    """The NVLink counters of the previous sample (reused while they do not change)."""

    def mark_unsupported(self, *names: str) -> None:
        new = set(self.unsupported).union(names)
        if len(new) != len(self.unsupported):
            self.unsupported = tuple(sorted(new))


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
        self.xid_dropped = 0
        """XID events dropped because nobody drained the queue (bounded)."""
        self.xid_wait_errors = 0
        """nvmlEventSetWait failures other than timeouts."""
        self._clock = clock
        self._xid_wait_ms = xid_wait_ms
        self._gpus: list[_Gpu] = []
        self._by_address: dict[int, _Gpu] = {}
        self._xids: collections.deque[XidEvent] = collections.deque()
        self._xid_lock = threading.Lock()
        self._stop = threading.Event()
        self._event_set: Any = None
        self._thread: threading.Thread | None = None
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
            raise SourceUnavailable(_init_message(exc)) from None
        self._open = True
        try:
            self.driver_version = _text(pynvml.nvmlSystemGetDriverVersion())
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            self.close()
            raise SourceUnavailable(f"nvml: cannot enumerate GPUs: {exc}") from None
        self._gpus = [_Gpu(index=i, info=GpuInfo(index=i)) for i in range(count)]
        for gpu in self._gpus:
            try:
                self._attach(gpu)
            except _Vanished as exc:
                log.warning("nvml: GPU %d did not answer at start: %s", gpu.index, exc.reason)
        self._start_events()
        log.info("nvml: driver %s, %d GPU(s)", self.driver_version, count)
        return [gpu.info for gpu in self._gpus]

    def close(self) -> None:
        """Stop the event thread and shut NVML down. Safe to call twice."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=self._xid_wait_ms / 1000.0 + 5.0)
        if self._event_set is not None:
            if thread is not None and thread.is_alive():
                log.warning("nvml: XID thread still waiting; event set left allocated")
            else:
                try:
                    pynvml.nvmlEventSetFree(self._event_set)
                except pynvml.NVMLError as exc:
                    log.warning("nvml: nvmlEventSetFree: %s", exc)
            self._event_set = None
        if self._open:
            self._open = False
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as exc:
                log.warning("nvml: nvmlShutdown: %s", exc)

    # -- inventory -------------------------------------------------------------------

    def _attach(self, gpu: _Gpu) -> None:
        """Get the handle, identity and static facts of one GPU (raises _Vanished)."""
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(gpu.index)
        except pynvml.NVMLError as exc:
            raise _vanished(exc) or _Vanished(GpuState.OK, f"handle: {exc}") from None
        ident: dict[str, str] = {}
        for key, call in (
            ("name", pynvml.nvmlDeviceGetName),
            ("uuid", pynvml.nvmlDeviceGetUUID),
            ("pci_bus_id", lambda h: pynvml.nvmlDeviceGetPciInfo(h).busId),
            ("serial", pynvml.nvmlDeviceGetSerial),
        ):
            try:
                ident[key] = _text(call(handle))
            except pynvml.NVMLError as exc:
                lost = _vanished(exc)
                if lost is not None:
                    raise lost from None
                log.debug("nvml: GPU %d %s: %s", gpu.index, key, exc)
        total: int | None = None
        try:
            total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        except pynvml.NVMLError as exc:
            lost = _vanished(exc)
            if lost is not None:
                raise lost from None
        gpu.info = GpuInfo(index=gpu.index, memory_total_bytes=total, **ident)
        errors: list[str] = []
        static: dict[str, Any] = {}
        for getter in _STATIC_GETTERS:
            self._call(gpu, handle, getter, static, errors)
        try:
            gpu.slowdown_threshold_c = float(pynvml.nvmlDeviceGetTemperatureThreshold(
                handle, pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN))
        except pynvml.NVMLError as exc:
            lost = _vanished(exc)
            if lost is not None:
                raise lost from None
        gpu.static = static
        gpu.nvlinks = self._nvlink_count(gpu, handle)
        self._build_fields(gpu)
        gpu.handle = handle
        self._by_address[_address(handle)] = gpu
        for err in errors:
            log.warning("nvml: GPU %d: %s", gpu.index, err)

    def _nvlink_count(self, gpu: _Gpu, handle: Any) -> int:
        try:
            (fv,) = pynvml.nvmlDeviceGetFieldValues(handle, [pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT])
        except pynvml.NVMLError as exc:
            lost = _vanished(exc)
            if lost is not None:
                raise lost from None
            return 0
        if fv.nvmlReturn != pynvml.NVML_SUCCESS:
            gpu.mark_unsupported("nvlink")
            return 0
        return min(int(_field_value(fv)), int(pynvml.NVML_NVLINK_MAX_LINKS))

    def _build_fields(self, gpu: _Gpu) -> None:
        fields = [(fid, 0) for _, fid in _FIELDS]
        gpu.targets = [(name, -1) for name, _ in _FIELDS]
        gpu.link_counters = []
        for link in range(gpu.nvlinks):
            for attr, stem, counter in _NVLINK_COUNTERS:
                if link < _NVLINK_FIELD_LINKS:
                    fields.append((_nvlink_field_id(stem, link), 0))
                    gpu.targets.append((attr, link))
                else:
                    gpu.link_counters.append((link, attr, counter))
        gpu.request = _FieldRequest(fields)

    # -- polling ---------------------------------------------------------------------

    def sample(self, now: float) -> list[GpuSample]:
        """One sample per GPU; a vanished GPU yields ``state`` lost / reset_required."""
        if not self._open:
            raise SourceUnavailable("nvml: source is not open")
        return [self._sample_one(gpu, now) for gpu in self._gpus]

    def _sample_one(self, gpu: _Gpu, now: float) -> GpuSample:
        values: dict[str, Any] = {}
        errors: list[str] = []
        links: dict[int, dict[str, int]] = {}
        try:
            if gpu.handle is None:
                self._attach_late(gpu)
            h = gpu.handle
            for getter in _GETTERS:
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

    def _vanished_sample(self, gpu: _Gpu, now: float, exc: _Vanished) -> GpuSample:
        info = gpu.info
        state = exc.state
        return GpuSample(
            node=self.node, gpu=gpu.index, uuid=info.uuid, pci_bus_id=info.pci_bus_id,
            name=info.name, time=now, source=self.name, state=state,
            unsupported=gpu.unsupported, errors=(f"gpu: {exc.reason}",),
        )

    def _call(self, gpu: _Gpu, h: Any, getter: _Getter, out: dict[str, Any],
              errors: list[str]) -> None:
        key, names, call = getter
        try:
            result = call(h)
        except pynvml.NVMLError as exc:
            self._classify(gpu, key, names, exc, errors)
            return
        for name, value in zip(names, result, strict=True):
            out[name] = value

    def _classify(self, gpu: _Gpu, key: str, names: tuple[str, ...], exc: Any,
                  errors: list[str]) -> None:
        code = exc.value
        if code in _UNSUPPORTED:
            gpu.skip.add(key)
            gpu.mark_unsupported(*names)
            return
        lost = _vanished(exc)
        if lost is not None:
            raise lost
        if code == pynvml.NVML_ERROR_UNINITIALIZED:
            raise SourceUnavailable(f"nvml: library no longer initialised ({exc})")
        errors.append(f"{names[0]}: {exc}")

    def _margin(self, gpu: _Gpu, h: Any, values: dict[str, Any], errors: list[str]) -> None:
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
                if exc.value not in _UNSUPPORTED:
                    self._classify(gpu, "slowdown_margin_c", ("slowdown_margin_c",), exc, errors)
                    return
                gpu.margin_api = False
        temp = values.get("temperature_c")
        if gpu.slowdown_threshold_c is None:
            gpu.mark_unsupported("slowdown_margin_c")
        elif temp is not None:
            values["slowdown_margin_c"] = gpu.slowdown_threshold_c - temp

    def _read_fields(self, gpu: _Gpu, h: Any, values: dict[str, Any], errors: list[str],
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
        for i, (ret, value) in enumerate(_decode_fields(results)):
            name, link = targets[i]
            if ret == pynvml.NVML_SUCCESS:
                if value in NVML_VALUE_NOT_AVAILABLE:
                    continue  # missing this poll, not a reading
                if link >= 0:
                    links.setdefault(link, {})[name] = int(value)
                elif name in _BOOL_FIELDS:
                    values[name] = bool(value)
                elif name in _FLOAT_FIELDS:
                    values[name] = float(value)
                else:
                    values[name] = int(value)
            elif ret in _UNSUPPORTED:
                dropped.append(i)
            elif ret == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise _Vanished(GpuState.LOST, "GPU is lost")
            elif ret == pynvml.NVML_ERROR_RESET_REQUIRED:
                raise _Vanished(GpuState.RESET_REQUIRED, "GPU requires reset")
            else:
                label = name if link < 0 else f"nvlink[{link}].{name}"
                errors.append(f"{label}: {_error_string(ret)}")
        if dropped:
            self._drop_fields(gpu, dropped)

    def _drop_fields(self, gpu: _Gpu, dropped: list[int]) -> None:
        """Stop asking fields answered NOT_SUPPORTED; report the ones now never read."""
        gone = set(dropped)
        names = [gpu.targets[i] for i in dropped]
        assert gpu.request is not None  # only fields that were asked are dropped
        fields = [f for i, f in enumerate(gpu.request.fields) if i not in gone]
        gpu.request = _FieldRequest(fields) if fields else None
        gpu.targets = [t for i, t in enumerate(gpu.targets) if i not in gone]
        still = {name for name, link in gpu.targets if link >= 0}
        still.update(attr for _, attr, _ in gpu.link_counters)
        for name, link in names:
            if link < 0:
                gpu.mark_unsupported(name)
            elif name not in still:
                gpu.mark_unsupported(f"nvlink.{name}")

    def _read_link_counters(self, gpu: _Gpu, h: Any, errors: list[str],
                            links: dict[int, dict[str, int]]) -> None:
        dropped = []
        for item in gpu.link_counters:
            link, attr, counter = item
            try:
                value = _available(pynvml.nvmlDeviceGetNvLinkErrorCounter(h, link, counter))
                if value is not None:
                    links.setdefault(link, {})[attr] = value
            except pynvml.NVMLError as exc:
                if exc.value in _UNSUPPORTED:
                    dropped.append(item)
                    continue
                self._classify(gpu, attr, (f"nvlink[{link}].{attr}",), exc, errors)
        if dropped:
            gpu.link_counters = [c for c in gpu.link_counters if c not in dropped]

    # -- XID events ------------------------------------------------------------------

    def _start_events(self) -> None:
        """Create the XID event set, register every attached GPU and start the thread."""
        try:
            self._event_set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            log.warning("nvml: no event set, XIDs only from the kernel log: %s", exc)
            return
        registered = [self._register_events(gpu) for gpu in self._gpus
                      if gpu.handle is not None]
        if not any(registered):
            pynvml.nvmlEventSetFree(self._event_set)
            self._event_set = None
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._xid_loop, name="nvml-xid", daemon=True)
        self._thread.start()

    def _register_events(self, gpu: _Gpu) -> bool:
        """Ask for this GPU's XID events on the event set; False where it has none."""
        try:
            if not pynvml.nvmlDeviceGetSupportedEventTypes(gpu.handle) & _XID_EVENT:
                gpu.mark_unsupported("xid_events")
                return False
            pynvml.nvmlDeviceRegisterEvents(gpu.handle, _XID_EVENT, self._event_set)
            return True
        except pynvml.NVMLError as exc:
            if exc.value in _UNSUPPORTED:
                gpu.mark_unsupported("xid_events")
            else:
                log.warning("nvml: GPU %d: XID events not registered: %s", gpu.index, exc)
            return False

    def _attach_late(self, gpu: _Gpu) -> None:
        """A GPU that did not answer at :meth:`open` is back: attach it and register it
        for XID events (starting the event thread if no GPU had it before)."""
        self._attach(gpu)
        log.info("nvml: GPU %d answers again", gpu.index)
        if self._event_set is None:
            self._start_events()
        else:
            self._register_events(gpu)

    def _xid_loop(self) -> None:
        event_set = self._event_set
        while not self._stop.is_set():
            try:
                data = pynvml.nvmlEventSetWait(event_set, self._xid_wait_ms)
            except pynvml.NVMLError as exc:
                if exc.value == pynvml.NVML_ERROR_TIMEOUT:
                    continue
                self.xid_wait_errors += 1
                if self.xid_wait_errors in (1, 10, 100) or self.xid_wait_errors % 1000 == 0:
                    log.warning("nvml: nvmlEventSetWait failed (%d times): %s",
                                self.xid_wait_errors, exc)
                self._stop.wait(1.0)
                continue
            if not data.eventType & _XID_EVENT:
                continue
            gpu = self._by_address.get(_address(data.device))
            code = int(data.eventData)
            event = XidEvent(
                node=self.node,
                gpu=gpu.index if gpu else None,
                pci_bus_id=gpu.info.pci_bus_id if gpu else "",
                code=min(code, 100_000),
                text=f"Xid {code} (NVML event nvmlEventTypeXidCriticalError)",
                time=self._clock(),
                source=self.name,
            )
            with self._xid_lock:
                if len(self._xids) >= _MAX_XID_QUEUE:
                    self._xids.popleft()
                    self.xid_dropped += 1
                self._xids.append(event)

    def drain_xids(self) -> list[XidEvent]:
        """XID events since the last call, oldest first. Never blocks for long."""
        with self._xid_lock:
            events = list(self._xids)
            self._xids.clear()
        return events


def _vanished(exc: Any) -> _Vanished | None:
    if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
        return _Vanished(GpuState.LOST, str(exc))
    if exc.value == pynvml.NVML_ERROR_RESET_REQUIRED:
        return _Vanished(GpuState.RESET_REQUIRED, str(exc))
    return None


def _error_string(code: int) -> str:
    try:
        return _text(pynvml.nvmlErrorString(code))
    except pynvml.NVMLError:
        return f"NVML error {code}"


def _init_message(exc: Any) -> str:
    code = exc.value
    if code == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
        return ("nvml: libnvidia-ml.so.1 not found: the NVIDIA driver is not installed or "
                "not on the library path (use --source sim, dcgm or replay without it)")
    if code == pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
        return "nvml: the NVIDIA kernel driver is not loaded (nvmlInit: Driver Not Loaded)"
    if code == pynvml.NVML_ERROR_NO_PERMISSION:
        return "nvml: no permission to open /dev/nvidia* (nvmlInit: Insufficient Permissions)"
    if code == pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH:
        return "nvml: NVML library and kernel driver versions differ (reboot or reload driver)"
    return f"nvml: nvmlInit failed: {exc}"
