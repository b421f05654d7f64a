"""GPU facts live in forewarn.gpu (and the health order on wire.Health) and nowhere else."""

import re
from pathlib import Path

import pynvml

from forewarn import gpu
from forewarn.wire import Health

ROOT = Path(__file__).resolve().parent.parent
CODE = [p for d in ("agent", "collector", "models", "src", "hook")
        for p in (ROOT / d).rglob("*.py")
        if p.relative_to(ROOT).as_posix() not in ("src/forewarn/gpu.py",
                                                  "src/forewarn/wire/base.py")]


def test_nvml_sentinels_match_the_binding() -> None:
    assert {
        int(pynvml.NVML_VALUE_NOT_AVAILABLE_uint.value),
        int(pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value),
    } == gpu.NVML_VALUE_NOT_AVAILABLE


def test_fatal_xids_are_the_catalog_s_hardware_failures() -> None:
    assert {48, 64, 74, 79, 95, 119, 120} == gpu.FATAL_XIDS
    assert gpu.classify_xid(13).health == Health.HEALTHY  # the job's error, not the GPU's
    assert gpu.classify_xid(12345).cls == "other"


def test_health_order() -> None:
    order = sorted(Health, key=lambda h: h.severity)
    assert order == [Health.HEALTHY, Health.UNKNOWN, Health.DEGRADED, Health.UNHEALTHY]


def test_no_second_copy_of_a_gpu_fact() -> None:
    copies = {
        "health order": re.compile(r"Health\.HEALTHY(\.value)?: 0, Health\.\w+(\.value)?: 1\b"),
        "throttle bit": re.compile(
            r"^\s*\w*(THERMAL|SLOWDOWN|POWER_CAP|BRAKE)\w* *(: *\w+)? *= *0x", re.M),
        "fatal XID set": re.compile(r"\{48, 64, 74, 79"),
        "XID class table": re.compile(r"^\s*48: *(XidClass\(|\"memory\")", re.M),
    }
    found = [f"{p.relative_to(ROOT)}: {what}" for p in CODE for what, rx in copies.items()
             if rx.search(p.read_text())]
    assert not found, f"GPU facts copied outside forewarn/gpu.py: {found}"
