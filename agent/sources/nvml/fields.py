"""What the nvml source asks NVML for each GPU, and how it reads the answers: the getters
called every poll and once, the counters read in one ``nvmlDeviceGetFieldValues`` call
(with its request built once and its answer decoded in one pass), the NVLink counters per
link, NVML's sentinels and error codes turned into our outcomes, and the state cached per
GPU between polls (:class:`NvmlGpu`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import struct
from collections.abc import Callable
from typing import Any, Final

import pynvml

from forewarn.agent.backend import GpuInfo
from forewarn.gpu import NVML_VALUE_NOT_AVAILABLE
from forewarn.wire import GpuState, NvlinkCounters

UNSUPPORTED: Final = frozenset(
    {pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND}
)

# NVML's "not available" answers: forewarn.gpu.NVML_VALUE_NOT_AVAILABLE (nvidia-ml-py's
# NVML_VALUE_NOT_AVAILABLE_uint and _ulonglong; a test checks they agree).
# nvmlDeviceGetPerformanceState answers NVML_PSTATE_UNKNOWN (32) when it cannot tell.
NVML_PSTATE_UNKNOWN: Final = int(pynvml.NVML_PSTATE_UNKNOWN)


def available(value: int) -> int | None:
    """An integer NVML answer, or None for :data:`NVML_VALUE_NOT_AVAILABLE`."""
    return None if value in NVML_VALUE_NOT_AVAILABLE else int(value)


def _measure(value: int, divisor: float = 1.0) -> float | None:
    """A measurement in our units (NVML's divided by ``divisor``), None when not available."""
    return None if value in NVML_VALUE_NOT_AVAILABLE else value / divisor


def _pstate(value: int) -> int | None:
    return None if value == NVML_PSTATE_UNKNOWN else available(value)


# Getters called once per poll: (key, sample fields they fill, call). Units are converted
# here: NVML reports power in milliwatts, clocks in MHz, temperatures in degrees C.
Getter = tuple[str, tuple[str, ...], Callable[[Any], tuple[Any, ...]]]
GETTERS: Final[tuple[Getter, ...]] = (
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
     lambda h: (available(pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)),)),
    ("pstate", ("pstate",), lambda h: (_pstate(pynvml.nvmlDeviceGetPerformanceState(h)),)),
    ("pcie_link_gen", ("pcie_link_gen",),
     lambda h: (available(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h)),)),
    ("pcie_link_width", ("pcie_link_width",),
     lambda h: (available(pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)),)),
    # Millijoules since the driver loaded (Volta and later): the exporter's energy counter.
    ("energy_mj", ("energy_mj",),
     lambda h: (available(pynvml.nvmlDeviceGetTotalEnergyConsumption(h)),)),
)

# Facts that do not change while the driver runs, read once per GPU.
STATIC_GETTERS: Final[tuple[Getter, ...]] = (
    ("pcie_link_gen_max", ("pcie_link_gen_max",),
     lambda h: (available(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h)),)),
    ("pcie_link_width_max", ("pcie_link_width_max",),
     lambda h: (available(pynvml.nvmlDeviceGetMaxPcieLinkWidth(h)),)),
)

# Counters read in one nvmlDeviceGetFieldValues call: sample field -> NVML_FI_DEV_* id.
FIELDS: Final[tuple[tuple[str, int], ...]] = (
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
BOOL_FIELDS: Final = frozenset({"retired_pages_pending", "remap_pending", "remap_failure"})
FLOAT_FIELDS: Final = frozenset({"memory_temperature_c"})

# NVLink error counters per link. NVML has per-link field ids for links 0..11 only
# (NVML_FI_DEV_NVLINK_*_L0..L11); links 12 and up (H100: 18 links) are read with
# nvmlDeviceGetNvLinkErrorCounter(link, NVML_NVLINK_ERROR_DL_*).
NVLINK_FIELD_LINKS: Final = 12
NVLINK_COUNTERS: Final[tuple[tuple[str, str, int], ...]] = (
    # (NvlinkCounters attribute, NVML_FI_DEV_NVLINK_<name>_L<n> stem, NVML_NVLINK_ERROR_DL_*)
    ("crc_flit", "CRC_FLIT_ERROR_COUNT", pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT),
    ("crc_data", "CRC_DATA_ERROR_COUNT", pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA),
    ("replay", "REPLAY_ERROR_COUNT", pynvml.NVML_NVLINK_ERROR_DL_REPLAY),
    ("recovery", "RECOVERY_ERROR_COUNT", pynvml.NVML_NVLINK_ERROR_DL_RECOVERY),
)


def nvlink_field_id(stem: str, link: int) -> int:
    return int(getattr(pynvml, f"NVML_FI_DEV_NVLINK_{stem}_L{link}"))


def _utilization(h: Any) -> tuple[float | None, float | None]:
    u = pynvml.nvmlDeviceGetUtilizationRates(h)
    return _measure(u.gpu), _measure(u.memory)


def _memory(h: Any) -> tuple[int | None, int | None]:
    m = pynvml.nvmlDeviceGetMemoryInfo(h)
    return available(m.used), available(m.total)


def text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def field_value(fv: Any) -> int | float:
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


def decode_fields(results: Any) -> list[tuple[int, int | float]]:
    """(nvmlReturn, value) per entry of an nvmlDeviceGetFieldValues result."""
    if not _FV_FAST:
        return [(int(fv.nvmlReturn), field_value(fv)) for fv in results]
    out: list[tuple[int, int | float]] = []
    for _, _, _, _, vtype, ret, raw in _FV_LAYOUT.iter_unpack(bytes(results)):
        value = _VALUE_FORMATS.get(vtype, _ULL).unpack_from(raw)[0] if ret == 0 else 0
        out.append((ret, value))
    return out


class FieldRequest:
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


def address(handle: Any) -> int:
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


class _Vanished(Exception):
    """The GPU answered GPU_IS_LOST or RESET_REQUIRED: stop asking it this poll."""

    def __init__(self, state: GpuState, reason: str) -> None:
        super().__init__(reason)
        self.state = state
        self.reason = reason


@dataclasses.dataclass
class NvmlGpu:
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
    request: FieldRequest | None = None
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


def vanished(exc: Any) -> _Vanished | None:
    if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
        return _Vanished(GpuState.LOST, str(exc))
    if exc.value == pynvml.NVML_ERROR_RESET_REQUIRED:
        return _Vanished(GpuState.RESET_REQUIRED, str(exc))
    return None


def error_string(code: int) -> str:
    try:
        return text(pynvml.nvmlErrorString(code))
    except pynvml.NVMLError:
        return f"NVML error {code}"


def init_message(exc: Any) -> str:
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
