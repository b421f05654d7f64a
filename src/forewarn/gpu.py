"""GPU facts, in one place: what an XID means, the clock-event (throttle) reason bits and
NVML's "not available" sentinels. Agent, collector and models read them from here.

Sources (docs/reference.md): NVIDIA's XID catalog as public tools classify it (application
codes 13, 31, 43, 45 are the job's error, not the GPU's); ``nvml.h`` for the
``nvmlClocksEventReason*`` bits and ``NVML_VALUE_NOT_AVAILABLE``. The order of health states
(healthy < unknown < degraded < unhealthy) is :attr:`forewarn.wire.Health.severity`.
"""

from __future__ import annotations

import dataclasses
from typing import Final

from forewarn.wire import Health, SuggestedAction

__all__ = [
    "CLOCK_EVENT_REASONS",
    "FATAL_XIDS",
    "GPU_IDLE",
    "HW_POWER_BRAKE_SLOWDOWN",
    "HW_SLOWDOWN",
    "HW_THERMAL_SLOWDOWN",
    "NVML_VALUE_NOT_AVAILABLE",
    "POWER_BITS",
    "SW_POWER_CAP",
    "SW_THERMAL_SLOWDOWN",
    "THERMAL_BITS",
    "XID_CATALOG",
    "XidClass",
    "classify_xid",
]

# -- XIDs ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class XidClass:
    """What an XID code means for the GPU."""

    cls: str
    """application, memory, interconnect, bus, gsp or other."""
    meaning: str
    health: Health
    action: SuggestedAction

    @property
    def fatal(self) -> bool:
        """The GPU itself is at fault (counts toward repeat escalation; a failure label)."""
        return self.health == Health.UNHEALTHY


_H, _D, _U = Health.HEALTHY, Health.DEGRADED, Health.UNHEALTHY
_A = SuggestedAction

XID_CATALOG: Final[dict[int, XidClass]] = {
    13: XidClass("application", "graphics engine exception", _H, _A.NONE),
    31: XidClass("application", "GPU memory page fault", _H, _A.NONE),
    43: XidClass("application", "GPU stopped processing", _H, _A.NONE),
    45: XidClass("application", "preemptive cleanup", _H, _A.NONE),
    48: XidClass("memory", "double-bit ECC error", _U, _A.RESET_GPU),
    63: XidClass("memory", "row remap / page retirement recorded", _D, _A.RESET_GPU),
    64: XidClass("memory", "row remap / page retirement failure", _U, _A.INSPECT_HARDWARE),
    # A correctable storm precedes uncorrectable errors (docs/reference.md, SC20): a precursor
    # worth a cost-aware checkpoint, not yet a broken GPU.
    92: XidClass("memory", "high single-bit ECC error rate", _D, _A.CHECKPOINT),
    94: XidClass("memory", "contained ECC error", _D, _A.RESET_GPU),
    95: XidClass("memory", "uncontained ECC error", _U, _A.RESET_GPU),
    74: XidClass("interconnect", "NVLink error", _U, _A.RESET_GPU),
    79: XidClass("bus", "GPU has fallen off the bus", _U, _A.REBOOT),
    119: XidClass("gsp", "GSP RPC timeout", _U, _A.RESET_GPU),
    120: XidClass("gsp", "GSP error", _U, _A.RESET_GPU),
}
"""The codes forewarn knows; others are class ``other`` (degraded, watch)."""

FATAL_XIDS: Final = frozenset(code for code, c in XID_CATALOG.items() if c.fatal)
"""XIDs that mean the GPU failed: 48, 64, 74, 79, 95, 119, 120."""


def classify_xid(code: int) -> XidClass:
    """The class of an XID code; unknown codes are ``other``: degraded, watch."""
    return XID_CATALOG.get(code) or XidClass("other", "not in forewarn's catalog", _D, _A.WATCH)


# -- clock-event (throttle) reasons, nvml.h nvmlClocksEventReason* -------------------------

GPU_IDLE: Final = 0x1
SW_POWER_CAP: Final = 0x4
HW_SLOWDOWN: Final = 0x8
"""Set for heat and for the external power brake alike: with 0x80 it is the brake's."""
SW_THERMAL_SLOWDOWN: Final = 0x20
HW_THERMAL_SLOWDOWN: Final = 0x40
HW_POWER_BRAKE_SLOWDOWN: Final = 0x80

CLOCK_EVENT_REASONS: Final[dict[str, int]] = {
    "gpu_idle": GPU_IDLE,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": SW_POWER_CAP,
    "hw_slowdown": HW_SLOWDOWN,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": SW_THERMAL_SLOWDOWN,
    "hw_thermal_slowdown": HW_THERMAL_SLOWDOWN,
    "hw_power_brake_slowdown": HW_POWER_BRAKE_SLOWDOWN,
    "display_clock_setting": 0x100,
}
"""Every reason bit by the name the exporter's ``reason`` label uses."""

THERMAL_BITS: Final = HW_SLOWDOWN | SW_THERMAL_SLOWDOWN | HW_THERMAL_SLOWDOWN
POWER_BITS: Final = SW_POWER_CAP | HW_POWER_BRAKE_SLOWDOWN

# -- NVML sentinels ------------------------------------------------------------------------

NVML_VALUE_NOT_AVAILABLE: Final = frozenset({0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF})
"""``NVML_VALUE_NOT_AVAILABLE`` (-1 in nvml.h) as the unsigned answers carry it: where the
driver has no value for a field (some GPUs, vGPU and MIG, briefly after a reset) the call
still succeeds and the value is all ones. Such a value is missing, never a reading: as a
counter it would report 2**64-1 errors, and no int64 store downstream can hold it."""
