"""The wire's building blocks: version, ranges and the enums every record uses."""

from __future__ import annotations

import enum
import sys
from typing import Annotated, Final

from msgspec import Meta

from forewarn.errors import InputError

WIRE_VERSION: Final = 1
"""Current wire version. Decoders accept versions 1..WIRE_VERSION."""

INT64_MAX: Final = 2**63 - 1
"""Largest integer any record carries: SQLite INTEGER and Parquet int64 hold no more (a
counter at NVML's 2**64-1 "not available" sentinel would wedge every Parquet flush)."""
MAX_UNIX_TIME: Final = 4_102_444_800.0
"""2100-01-01 in Unix seconds: any time past it is a unit error (milliseconds) or garbage."""
_FLOAT_MAX: Final = sys.float_info.max

Version = Annotated[int, Meta(ge=1, le=WIRE_VERSION)]
NonNegInt = Annotated[int, Meta(ge=0, le=INT64_MAX)]
Rank = Annotated[int, Meta(ge=0, le=1_000_000)]
Name = Annotated[str, Meta(min_length=1, max_length=256)]
Text = Annotated[str, Meta(max_length=4096)]
# msgspec has no "finite" constraint; bounds at the largest float refuse NaN and +-Inf.
Finite = Annotated[float, Meta(ge=-_FLOAT_MAX, le=_FLOAT_MAX)]
Seconds = Annotated[float, Meta(ge=0.0, le=_FLOAT_MAX)]
Ratio = Annotated[float, Meta(ge=0.0, le=1.0)]
Rate = Annotated[float, Meta(ge=0.0, le=_FLOAT_MAX)]
UnixTime = Annotated[float, Meta(ge=0.0, le=MAX_UNIX_TIME)]
PhaseName = Annotated[str, Meta(max_length=32)]


class WireError(InputError, ValueError):
    """A record failed to decode; the message names the offending field."""


class Health(enum.StrEnum):
    """Health of a subject, from best to worst (unknown: could not tell)."""

    HEALTHY = "healthy"
    DEGRADED = "degraded"
    UNHEALTHY = "unhealthy"
    UNKNOWN = "unknown"

    @property
    def severity(self) -> int:
        """Order for "worst of": healthy 0 < unknown 1 < degraded 2 < unhealthy 3."""
        return _SEVERITY[self]


_SEVERITY: dict[Health, int] = {Health.HEALTHY: 0, Health.UNKNOWN: 1, Health.DEGRADED: 2,
                                 Health.UNHEALTHY: 3}


class SuggestedAction(enum.StrEnum):
    """What a person or the policy should do about a finding."""

    NONE = "none"
    WATCH = "watch"
    CHECKPOINT = "checkpoint"
    RESTART_JOB = "restart_job"
    RESET_GPU = "reset_gpu"
    REBOOT = "reboot"
    DRAIN = "drain"
    INSPECT_HARDWARE = "inspect_hardware"


class GpuState(enum.StrEnum):
    """Whether the GPU answered this poll (NVML_ERROR_GPU_IS_LOST etc. map here)."""

    OK = "ok"
    LOST = "lost"
    RESET_REQUIRED = "reset_required"
