"""The ``sim`` source's scenario format: a simulated node's GPUs, their healthy baseline
and the faults to play, read from TOML (format in ``docs/sources.md``) and validated with
errors that name the file, the key (``faults[2].gpu``) and the line. What each fault kind
does to the signals is :mod:`forewarn.agent.sources.sim`'s business.
"""

from __future__ import annotations

import importlib.resources
import re
import tomllib
from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta, Struct, field

from forewarn.agent.backend import SourceUnavailable

__all__ = [
    "DEFAULT_SCENARIO",
    "Baseline",
    "EccBurst",
    "EccStorm",
    "Fault",
    "NvlinkCrc",
    "PcieReplay",
    "PowerBrake",
    "RemapGrowth",
    "RetiredPages",
    "Scenario",
    "ScenarioError",
    "Sudden",
    "ThermalRunaway",
    "default_scenario",
    "load_scenario",
    "parse_scenario",
]

DEFAULT_SCENARIO = "default.toml"
"""Name of the embedded scenario (``agent/sources/scenarios/``) used when none is given."""



Pos = Annotated[float, Meta(gt=0.0)]
NonNeg = Annotated[float, Meta(ge=0.0)]
Count = Annotated[int, Meta(ge=0)]


class ScenarioError(SourceUnavailable, ValueError):
    """A scenario file is unreadable or invalid; the message names the file, the key
    (``faults[2].gpu``) and, where it can be found, the line."""


class Baseline(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Healthy behaviour of every GPU (defaults: an H100 SXM under a training load)."""

    temperature_c: Annotated[float, Meta(ge=-20, le=150)] = 62.0
    temperature_noise_c: NonNeg = 1.5
    memory_temperature_c: Annotated[float, Meta(ge=-20, le=150)] = 70.0
    slowdown_temperature_c: Annotated[float, Meta(ge=0, le=150)] = 87.0
    """Temperature where HW slowdown starts; margin = this - temperature."""
    power_w: NonNeg = 520.0
    power_noise_w: NonNeg = 30.0
    power_limit_w: Pos = 700.0
    gpu_util_pct: Annotated[float, Meta(ge=0, le=100)] = 95.0
    util_noise_pct: NonNeg = 4.0
    mem_util_pct: Annotated[float, Meta(ge=0, le=100)] = 45.0
    sm_clock_mhz: Pos = 1980.0
    mem_clock_mhz: Pos = 2619.0
    memory_total_bytes: Count = 85_520_809_984
    memory_used_fraction: Annotated[float, Meta(ge=0, le=1)] = 0.85
    nvlinks: Annotated[int, Meta(ge=0, le=18)] = 18
    pcie_link_gen: Annotated[int, Meta(ge=1, le=6)] = 5
    pcie_link_width: Annotated[int, Meta(ge=1, le=32)] = 16
    correctable_ecc_per_h: NonNeg = 0.0
    """Background correctable-ECC rate of every GPU (benign)."""
    pstate: Annotated[int, Meta(ge=0, le=15)] = 0


class _FaultBase(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                 tag_field="kind"):
    gpu: Count
    """Index of the GPU the fault happens on."""
    start_s: NonNeg
    """Simulated seconds after the scenario starts."""
    duration_s: NonNeg = 60.0
    """Length of the precursor; the terminal event happens at ``start_s + duration_s``."""

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s

    def progress(self, t: float) -> float:
        """0 before the fault, 1 at and after its end, linear in between."""
        if t < self.start_s:
            return 0.0
        if self.duration_s <= 0 or t >= self.end_s:
            return 1.0
        return (t - self.start_s) / self.duration_s


class EccStorm(_FaultBase, frozen=True, tag="ecc_storm"):
    """Correctable-ECC rate growth ending in a double-bit error (XID 48)."""

    start_rate_per_s: Pos = 2.0
    peak_rate_per_s: Pos = 150.0
    end_with_dbe: bool = True
    xid92: bool = True
    """Emit XID 92 (high single-bit ECC rate) half way through, as the driver does."""


class RemapGrowth(_FaultBase, frozen=True, tag="remap_growth"):
    """Row remaps for correctable errors grow, pending, then remap failure (XID 64)."""

    rows: Annotated[int, Meta(ge=1, le=10_000)] = 8
    correctable_ecc_per_row: NonNeg = 20.0
    end_with_failure: bool = True


class RetiredPages(_FaultBase, frozen=True, tag="retired_pages"):
    """Pre-Ampere dynamic page retirement: SBE retired pages grow, retirement pending."""

    pages: Annotated[int, Meta(ge=1, le=10_000)] = 16
    end_with_dbe: bool = False


class ThermalRunaway(_FaultBase, frozen=True, tag="thermal_runaway"):
    """Temperature climbs past slowdown; throttle bits set; clocks drop."""

    overshoot_c: NonNeg = 4.0
    """How far past the slowdown temperature it climbs."""
    ramp_fraction: Annotated[float, Meta(gt=0, le=1)] = 0.7
    """Share of the duration spent climbing; the rest holds at the peak."""
    min_clock_fraction: Annotated[float, Meta(gt=0, le=1)] = 0.45
    recover: bool = True
    """Back to baseline after the duration (else it stays hot)."""


class PowerBrake(_FaultBase, frozen=True, tag="power_brake"):
    """HW power brake slowdown asserted for the duration."""

    clock_fraction: Annotated[float, Meta(gt=0, le=1)] = 0.3


class PcieReplay(_FaultBase, frozen=True, tag="pcie_replay"):
    """PCIe replays grow, the link downgrades, then off the bus (XID 79, lost)."""

    start_rate_per_s: Pos = 0.5
    peak_rate_per_s: Pos = 1000.0
    """Replay storms on a failing link reach thousands per second."""
    degraded_width: Annotated[int, Meta(ge=1, le=32)] = 8
    degraded_gen: Annotated[int, Meta(ge=1, le=6)] | None = None
    downgrade_at: Annotated[float, Meta(ge=0, le=1)] = 0.5
    """Share of the duration after which the link runs degraded."""
    end_lost: bool = True


class NvlinkCrc(_FaultBase, frozen=True, tag="nvlink_crc"):
    """CRC errors grow on one NVLink, ending in XID 74."""

    link: Annotated[int, Meta(ge=0, le=17)] = 0
    start_rate_per_s: Pos = 0.2
    peak_rate_per_s: Pos = 30.0
    end_with_xid: bool = True


class Sudden(_FaultBase, frozen=True, tag="sudden"):
    """A failure with no precursor at ``start_s`` (``duration_s`` is ignored)."""

    xid: Annotated[int, Meta(ge=1, le=100_000)] = 79


class EccBurst(_FaultBase, frozen=True, tag="ecc_burst"):
    """Benign: an isolated burst of correctable ECC errors that leads nowhere."""

    errors: Annotated[int, Meta(ge=1, le=1_000_000)] = 40


Fault = (EccStorm | RemapGrowth | RetiredPages | ThermalRunaway | PowerBrake | PcieReplay
         | NvlinkCrc | Sudden | EccBurst)
"""Any fault; TOML picks the type with ``kind = "..."``."""


class Scenario(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A simulated node: its GPUs, their healthy baseline and the faults to play."""

    name: Annotated[str, Meta(max_length=128)] = "custom"
    description: Annotated[str, Meta(max_length=4096)] = ""
    gpus: Annotated[int, Meta(ge=1, le=64)] | None = None
    """GPU count; none = the agent's ``sim_gpus``."""
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] = 0
    gpu_name: Annotated[str, Meta(max_length=128)] = "NVIDIA H100 80GB HBM3"
    baseline: Baseline = field(default_factory=Baseline)
    faults: list[Fault] = field(default_factory=list)
    start_file: Annotated[str, Meta(max_length=4096)] = ""
    """When set, the scenario's clock holds at its start (the baseline plays) until this
    file exists: a demo or test starts the faults once its workload runs, however long the
    workload took to start."""


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file; :class:`ScenarioError` names what is wrong."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"scenario {path}: cannot read: {exc}") from None
    return parse_scenario(text, origin=str(path))


def default_scenario() -> Scenario:
    """The embedded demo scenario (8 GPUs, several faults within ~3 minutes)."""
    res = importlib.resources.files("forewarn.agent.sources").joinpath(
        "scenarios", DEFAULT_SCENARIO)
    return parse_scenario(res.read_text(encoding="utf-8"), origin=f"<embedded {DEFAULT_SCENARIO}>")


def parse_scenario(text: str, origin: str = "<scenario>") -> Scenario:
    """Parse scenario TOML ``text``; ``origin`` names it in errors."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # carries "(at line N, column M)"
        raise ScenarioError(f"scenario {origin}: not valid TOML: {exc}") from None
    try:
        scenario = msgspec.convert(data, Scenario)
    except msgspec.ValidationError as exc:
        raise ScenarioError(_explain(origin, text, str(exc))) from None
    n = scenario.gpus
    for i, fault in enumerate(scenario.faults):
        if n is not None and fault.gpu >= n:
            raise ScenarioError(_at(origin, text, f"faults[{i}].gpu",
                                    f"GPU {fault.gpu} does not exist (gpus = {n})"))
        if isinstance(fault, NvlinkCrc) and fault.link >= scenario.baseline.nvlinks:
            raise ScenarioError(_at(origin, text, f"faults[{i}].link",
                                    f"link {fault.link} does not exist "
                                    f"(baseline.nvlinks = {scenario.baseline.nvlinks})"))
        if (isinstance(fault, EccStorm | PcieReplay | NvlinkCrc)
                and fault.start_rate_per_s > fault.peak_rate_per_s):
            raise ScenarioError(_at(origin, text, f"faults[{i}].peak_rate_per_s",
                                    "must be >= start_rate_per_s"))
    return scenario


_PATH_RE = re.compile(r" - at `\$\.?([^`]*)`$")
_FIELD_RE = re.compile(r"(?:unknown|required) field `([^`]+)`")


def _explain(origin: str, text: str, message: str) -> str:
    """Turn msgspec's ``... - at `$.faults[0].gpu``` into ``faults[0].gpu: ...``."""
    m = _PATH_RE.search(message)
    path = m.group(1) if m else ""
    reason = message[: m.start()] if m else message
    f = _FIELD_RE.search(reason)
    if f and "unknown" in reason:
        path = f"{path}.{f.group(1)}" if path else f.group(1)
    if "Invalid enum value" in reason or ("Invalid value" in reason and path.endswith("kind")):
        kinds = ", ".join(sorted(t.__struct_config__.tag for t in _FAULT_TYPES))  # type: ignore[misc]
        reason = f"{reason} (known kinds: {kinds})"
    return _at(origin, text, path or "(top level)", reason)


def _at(origin: str, text: str, path: str, reason: str) -> str:
    line = _line_of(text, path)
    where = f", line {line}" if line else ""
    return f"scenario {origin}{where}: {path}: {reason}"


def _line_of(text: str, path: str) -> int | None:
    """Best-effort line number of ``path`` (``faults[2].gpu``, ``baseline.power_w``)."""
    parts = re.findall(r"([A-Za-z_][\w-]*)(?:\[(\d+)\])?", path)
    if not parts:
        return None
    lines = text.splitlines()
    start, end = 0, len(lines)
    key = parts[-1][0]
    table = parts[0] if len(parts) > 1 or parts[0][1] else None
    if table is not None:
        name, idx = table
        header = re.compile(rf"^\s*\[\[\s*{name}\s*\]\]" if idx else rf"^\s*\[\s*{name}\s*\]")
        hits = [i for i, ln in enumerate(lines) if header.match(ln)]
        n = int(idx) if idx else 0
        if n >= len(hits):
            return None
        start = hits[n]
        nxt = [i for i, ln in enumerate(lines) if i > start and re.match(r"^\s*\[", ln)]
        end = nxt[0] if nxt else len(lines)
        if len(parts) == 1:
            return start + 1
    else:
        nxt = [i for i, ln in enumerate(lines) if re.match(r"^\s*\[", ln)]
        end = nxt[0] if nxt else len(lines)
    keyre = re.compile(rf"^\s*{re.escape(key)}\s*=")
    for i in range(start, end):
        if keyre.match(lines[i]):
            return i + 1
    return start + 1 if table is not None else None


_FAULT_TYPES = (EccStorm, RemapGrowth, RetiredPages, ThermalRunaway, PowerBrake, PcieReplay,
                NvlinkCrc, Sudden, EccBurst)
