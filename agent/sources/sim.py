"""``sim``: a simulated node of N GPUs that follows a scripted fault scenario.

Every value it produces is made up and marked so: each :class:`~forewarn.wire.GpuSample`
and :class:`~forewarn.wire.XidEvent` has ``simulated=True`` and ``source="sim"``.

A scenario (:mod:`forewarn.agent.sources.scenario`; TOML, format in ``docs/sources.md``)
gives node-level settings (GPU count, seed, a baseline of temperatures, power,
utilization and their noise) and a list of faults, each on one GPU with a kind, a start
time and a duration in *simulated* seconds after the scenario starts. The scenario
position at wall time ``now`` is ``offset_s + speed * (now - opened)``, where ``opened``
is read from the injected clock when the source opens: tests step a fake clock instead of
sleeping. Samples and XIDs are stamped with wall time, so at ``speed`` 1 rates are exact
and at higher speeds they are ``speed`` times steeper (a faster demo).

Every value is a pure function of (seed, GPU, scenario position): the same seed gives the
same numbers whatever the poll cadence.

Fault kinds and the signals they drive (NVML fields in brackets):

* ``ecc_storm``: correctable ECC count [NVML_MEMORY_ERROR_TYPE_CORRECTED] grows at an
  exponentially rising rate, then a double-bit error [..._UNCORRECTED] with XID 48 and an
  uncorrectable row remap pending reset (Ampere and later contain a DBE by remapping).
* ``remap_growth``: rows remapped for correctable errors
  [nvmlDeviceGetRemappedRows corrRows] grow, ``pending`` set, ending in a remap failure
  (``isFailureOccurred``) with XID 64.
* ``retired_pages``: pre-Ampere page retirement [nvmlDeviceGetRetiredPages]: single-bit
  retired pages grow with retirement pending.
* ``thermal_runaway``: GPU temperature climbs to and past the slowdown threshold, so the
  slowdown margin [nvmlDeviceGetMarginTemperature] reaches 0; SW thermal slowdown
  (0x20), then HW slowdown (0x08) and HW thermal slowdown (0x40) clock-event reasons
  are set and SM clocks and power drop.
* ``power_brake``: HW power brake slowdown (0x80, with HW slowdown 0x08): the external
  power-brake signal of the baseboard; clocks collapse for the duration.
* ``pcie_replay``: PCIe replay counter [nvmlDeviceGetPcieReplayCounter] grows, the link
  width [nvmlDeviceGetCurrPcieLinkWidth] downgrades, and the GPU ends off the bus:
  XID 79, ``state = lost``.
* ``nvlink_crc``: CRC flit/data, replay and recovery counters of one NVLink
  [NVML_NVLINK_ERROR_DL_CRC_FLIT/DATA/REPLAY/RECOVERY] grow, ending in XID 74.
* every GPU also reports its energy counter [nvmlDeviceGetTotalEnergyConsumption, the
  baseline power times the scenario position] and, as a node with DCGM's profiling
  metrics would, SM / tensor pipe / memory interface activity and PCIe / NVLink bytes per
  second, following its utilization.
* ``sudden``: no precursor at all: XID 79 (lost), 48 (DBE), 95 (uncontained ECC, reset
  required) or any other code, at ``start_s``.
* ``ecc_burst``: benign: an isolated burst of correctable ECC errors that leads nowhere.

XID meanings follow NVIDIA's catalog as summarised in docs/reference.md.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

from forewarn.agent.backend import GpuInfo
from forewarn.agent.sources.scenario import (
    Baseline,
    EccBurst,
    EccStorm,
    Fault,
    NvlinkCrc,
    PcieReplay,
    PowerBrake,
    RemapGrowth,
    RetiredPages,
    Scenario,
    ScenarioError,
    Sudden,
    ThermalRunaway,
    default_scenario,
)
from forewarn.gpu import (
    HW_POWER_BRAKE_SLOWDOWN,
    HW_SLOWDOWN,
    HW_THERMAL_SLOWDOWN,
    SW_THERMAL_SLOWDOWN,
)
from forewarn.wire import GpuSample, GpuState, NvlinkCounters, XidEvent

__all__ = ["SimBackend"]

# XID texts as the driver prints them (NVIDIA XID catalog).
XID_TEXT = {
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer.",
    63: "ECC page retirement or row remapping recording event.",
    64: "ECC page retirement or row remapper recording failure.",
    74: "NVLink Error.",
    79: "GPU has fallen off the bus.",
    92: "High single-bit ECC error rate.",
    94: "Contained ECC error.",
    95: "Uncontained ECC error.",
    119: "Timeout waiting for RPC from GSP!",
}

# ---------------------------------------------------------------- deterministic noise

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64 finaliser: a cheap, well-spread 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _knot(seed: int, gpu: int, channel: int, k: int) -> float:
    h = _mix(_mix(_mix(seed) ^ (gpu * 0x100000001B3)) ^ (channel << 40) ^ (k & 0xFFFFFFFFFF))
    return (h / _MASK) * 2.0 - 1.0


def _noise(seed: int, gpu: int, channel: int, t: float, knot_s: float = 2.0) -> float:
    """Smooth noise in [-1, 1]: linear interpolation between seeded knots."""
    x = t / knot_s
    k = math.floor(x)
    f = x - k
    a = _knot(seed, gpu, channel, k)
    b = _knot(seed, gpu, channel, k + 1)
    return a + (b - a) * f


def _grown(t: float, fault: Fault, r0: float, r1: float) -> float:
    """Events counted by ``t`` at a rate rising exponentially from r0 to r1 per second."""
    if t <= fault.start_s:
        return 0.0
    d = fault.duration_s
    if d <= 0:
        return 0.0
    s = min(t, fault.end_s) - fault.start_s
    if r1 == r0:
        return r0 * s
    lk = math.log(r1 / r0)
    return r0 * d * (math.exp(lk * s / d) - 1.0) / lk


# ---------------------------------------------------------------- the backend


class _Vals:
    """Mutable per-GPU values while the faults are applied to the baseline."""

    __slots__ = (
        "dbe", "ecc_corr", "lost", "mem_clock", "nvlink", "pcie_gen", "pcie_replay",
        "pcie_width", "power", "remap_corr", "remap_failure", "remap_pending",
        "remap_uncorr", "reset_required", "retired_dbe", "retired_pending", "retired_sbe",
        "sm_clock", "temp", "throttle", "util",
    )

    def __init__(self) -> None:
        self.ecc_corr = 0
        self.dbe = 0
        self.retired_sbe = 0
        self.retired_dbe = 0
        self.retired_pending = False
        self.remap_corr = 0
        self.remap_uncorr = 0
        self.remap_pending = False
        self.remap_failure = False
        self.pcie_replay = 0
        self.pcie_width = 0
        self.pcie_gen = 0
        self.nvlink: dict[int, list[int]] = {}
        self.temp = 0.0
        self.power = 0.0
        self.util = 0.0
        self.sm_clock = 0.0
        self.mem_clock = 0.0
        self.throttle = 0
        self.lost = False
        self.reset_required = False


class SimBackend:
    """A simulated GPU node (implements :class:`forewarn.agent.backend.GpuBackend`).

    ``clock`` is read once, at :meth:`open`; :meth:`sample` places the scenario at
    ``offset_s + speed * (now - opened)`` simulated seconds (with the scenario's
    ``start_file``, ``opened`` is the first sample that finds the file).
    """

    name = "sim"
    simulated = True

    def __init__(
        self,
        scenario: Scenario | None = None,
        *,
        node: str,
        speed: float = 1.0,
        gpus: int = 8,
        offset_s: float = 0.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if speed <= 0:
            raise ValueError(f"speed: must be positive, got {speed}")
        self.scenario = scenario if scenario is not None else default_scenario()
        self.node = node
        self.speed = speed
        self.offset_s = offset_s
        self.gpus = self.scenario.gpus or gpus
        for i, fault in enumerate(self.scenario.faults):
            if fault.gpu >= self.gpus:
                raise ScenarioError(f"scenario {self.scenario.name}: faults[{i}].gpu: GPU "
                                    f"{fault.gpu} does not exist (gpus = {self.gpus})")
        self._clock = clock or time.time
        self._opened: float | None = None
        self._waiting = False
        """The scenario's start_file is not there yet: the clock holds."""
        self._infos: list[GpuInfo] = []
        self._by_gpu: dict[int, list[Fault]] = {}
        self._xid_plan: list[tuple[float, int, int]] = []
        self._xid_next = 0
        self._xids: list[XidEvent] = []

    # -- GpuBackend

    def open(self) -> list[GpuInfo]:
        """Start the scenario clock (or wait for the scenario's ``start_file``) and return
        the simulated inventory."""
        self._opened = self._clock()
        self._waiting = bool(self.scenario.start_file)
        sc = self.scenario
        self._infos = [
            GpuInfo(index=i, uuid=_uuid(sc.seed, i), name=sc.gpu_name,
                    pci_bus_id=_bus_id(i), serial=f"SIM{_mix(sc.seed ^ i) % 10**12:012d}",
                    memory_total_bytes=sc.baseline.memory_total_bytes)
            for i in range(self.gpus)
        ]
        self._by_gpu = {i: [f for f in sc.faults if f.gpu == i] for i in range(self.gpus)}
        plan = sorted(self._xid_schedule())
        self._xid_plan = plan
        # Events scheduled before the starting offset "happened before we looked".
        self._xid_next = sum(1 for t, _, _ in plan if t < self.offset_s)
        return list(self._infos)

    def sim_time(self, now: float) -> float:
        """Scenario position (simulated seconds) at wall time ``now``."""
        if self._opened is None:
            raise RuntimeError("SimBackend.open() was not called")
        if self._waiting:
            return self.offset_s
        return self.offset_s + self.speed * max(0.0, now - self._opened)

    def wall_time(self, t: float) -> float:
        """Wall time at which the scenario reaches simulated second ``t``."""
        if self._opened is None:
            raise RuntimeError("SimBackend.open() was not called")
        return self._opened + (t - self.offset_s) / self.speed

    def sample(self, now: float) -> list[GpuSample]:
        """One sample per GPU at wall time ``now``; queues XIDs reached by then."""
        if self._waiting and os.path.exists(self.scenario.start_file):
            self._waiting = False
            self._opened = now
        t = self.sim_time(now)
        while self._xid_next < len(self._xid_plan) and self._xid_plan[self._xid_next][0] <= t:
            te, gpu, code = self._xid_plan[self._xid_next]
            self._xid_next += 1
            info = self._infos[gpu]
            self._xids.append(XidEvent(
                node=self.node, gpu=gpu, pci_bus_id=info.pci_bus_id, code=code,
                text=XID_TEXT.get(code, "Simulated XID.") + " (simulated)",
                time=max(0.0, self.wall_time(te)), source="sim", simulated=True))
        return [self.gpu_sample(i, t, now) for i in range(self.gpus)]

    def drain_xids(self) -> list[XidEvent]:
        out, self._xids = self._xids, []
        return out

    def close(self) -> None:
        self._xids = []

    # -- the model

    def _xid_schedule(self) -> list[tuple[float, int, int]]:
        plan: list[tuple[float, int, int]] = []
        for f in self.scenario.faults:
            if isinstance(f, EccStorm):
                if f.xid92:
                    plan.append((f.start_s + f.duration_s / 2, f.gpu, 92))
                if f.end_with_dbe:
                    plan.append((f.end_s, f.gpu, 48))
            elif isinstance(f, RemapGrowth):
                plan.append((f.start_s + f.duration_s / f.rows, f.gpu, 63))
                if f.end_with_failure:
                    plan.append((f.end_s, f.gpu, 64))
            elif isinstance(f, RetiredPages) and f.end_with_dbe:
                plan.append((f.end_s, f.gpu, 48))
            elif isinstance(f, PcieReplay) and f.end_lost:
                plan.append((f.end_s, f.gpu, 79))
            elif isinstance(f, NvlinkCrc) and f.end_with_xid:
                plan.append((f.end_s, f.gpu, 74))
            elif isinstance(f, Sudden):
                plan.append((f.start_s, f.gpu, f.xid))
        return plan

    def gpu_sample(self, gpu: int, t: float, wall: float) -> GpuSample:
        """The sample of ``gpu`` at scenario position ``t``, stamped ``wall``."""
        sc, b = self.scenario, self.scenario.baseline
        info = self._infos[gpu]
        v = _Vals()
        seed = sc.seed
        v.util = min(100.0, max(0.0, b.gpu_util_pct + b.util_noise_pct * _noise(seed, gpu, 1, t)))
        load = v.util / b.gpu_util_pct if b.gpu_util_pct > 0 else 1.0
        v.power = max(0.0, b.power_w * load + b.power_noise_w * _noise(seed, gpu, 2, t))
        v.temp = b.temperature_c + b.temperature_noise_c * _noise(seed, gpu, 3, t, 5.0)
        v.sm_clock = b.sm_clock_mhz
        v.mem_clock = b.mem_clock_mhz
        v.pcie_gen, v.pcie_width = b.pcie_link_gen, b.pcie_link_width
        v.ecc_corr = int(b.correctable_ecc_per_h * max(0.0, t) / 3600.0)
        for fault in self._by_gpu.get(gpu, ()):
            if t >= fault.start_s:
                _APPLY[type(fault)](fault, t, v, b)
        common = dict(node=self.node, gpu=gpu, uuid=info.uuid, pci_bus_id=info.pci_bus_id,
                      name=info.name, time=wall, source="sim", simulated=True)
        if v.lost:
            return GpuSample(**common, state=GpuState.LOST,  # type: ignore[arg-type]
                             errors=("gpu: GPU is lost (simulated)",))
        if v.reset_required:
            return GpuSample(**common, state=GpuState.RESET_REQUIRED,  # type: ignore[arg-type]
                             errors=("gpu: GPU requires reset (simulated)",))
        margin = max(0.0, b.slowdown_temperature_c - v.temp)
        mem_temp = b.memory_temperature_c + (v.temp - b.temperature_c) * 0.6 + (
            b.temperature_noise_c * _noise(seed, gpu, 4, t, 5.0))
        used = int(b.memory_total_bytes * b.memory_used_fraction)
        busy, nvlink_on = v.util / 100.0, 1.0 if b.nvlinks else 0.0
        links = tuple(
            NvlinkCounters(link=link, crc_flit=c[0], crc_data=c[1], replay=c[2], recovery=c[3])
            for link in range(b.nvlinks)
            for c in (v.nvlink.get(link, (0, 0, 0, 0)),)
        )
        return GpuSample(
            **common,  # type: ignore[arg-type]
            temperature_c=round(v.temp, 1),
            memory_temperature_c=round(mem_temp, 1),
            slowdown_margin_c=round(margin, 1),
            power_w=round(min(v.power, b.power_limit_w), 1),
            power_limit_w=b.power_limit_w,
            sm_clock_mhz=round(v.sm_clock),
            mem_clock_mhz=round(v.mem_clock),
            gpu_util_pct=round(v.util, 1),
            mem_util_pct=round(min(100.0, b.mem_util_pct * load), 1),
            memory_used_bytes=used,
            memory_total_bytes=b.memory_total_bytes,
            throttle_reasons=v.throttle,
            ecc_corrected_volatile=v.ecc_corr,
            ecc_uncorrected_volatile=v.dbe,
            ecc_corrected_aggregate=v.ecc_corr,
            ecc_uncorrected_aggregate=v.dbe,
            retired_pages_sbe=v.retired_sbe,
            retired_pages_dbe=v.retired_dbe,
            retired_pages_pending=v.retired_pending,
            remapped_rows_correctable=v.remap_corr,
            remapped_rows_uncorrectable=v.remap_uncorr,
            remap_pending=v.remap_pending,
            remap_failure=v.remap_failure,
            pcie_replay_total=v.pcie_replay,
            pcie_link_gen=v.pcie_gen,
            pcie_link_gen_max=b.pcie_link_gen,
            pcie_link_width=v.pcie_width,
            pcie_link_width_max=b.pcie_link_width,
            nvlink=links,
            pstate=b.pstate,
            energy_mj=int(1000.0 * b.power_w * max(0.0, t)),
            # DCGM profiling fields of a training GPU busy this share of the time: most SMs
            # occupied, the tensor pipe and HBM active part of it, gradients on the links.
            sm_active=round(0.95 * busy, 3),
            tensor_active=round(0.55 * busy, 3),
            dram_active=round(b.mem_util_pct / 100.0 * busy, 3),
            pcie_tx_bytes_per_s=round(2e9 * busy, -3),
            pcie_rx_bytes_per_s=round(3e9 * busy, -3),
            nvlink_tx_bytes_per_s=round(1.5e11 * busy * nvlink_on, -3),
            nvlink_rx_bytes_per_s=round(1.5e11 * busy * nvlink_on, -3),
        )


# ---------------------------------------------------------------- fault effects


def _ecc_storm(f: Any, t: float, v: _Vals, b: Baseline) -> None:
    v.ecc_corr += int(_grown(t, f, f.start_rate_per_s, f.peak_rate_per_s))
    if f.end_with_dbe and t >= f.end_s:
        # A DBE on Ampere+ is contained by an uncorrectable row remap pending reset.
        v.dbe += 1
        v.remap_uncorr += 1
        v.remap_pending = True


def _remap_growth(f: Any, t: float, v: _Vals, b: Baseline) -> None:
    rows = min(f.rows, int(f.progress(t) * f.rows + 1e-9))
    v.remap_corr += rows
    v.ecc_corr += int(f.correctable_ecc_per_row * f.rows * f.progress(t))
    if rows:
        v.remap_pending = True  # remaps take effect at the next GPU reset
    if f.end_with_failure and t >= f.end_s:
        v.remap_failure = True


def _retired_pages(f: Any, t: float, v: _Vals, b: Baseline) -> None:
    pages = min(f.pages, int(f.progress(t) * f.pages + 1e-9))
    v.retired_sbe += pages
    if pages:
        v.retired_pending = True
    if f.end_with_dbe and t >= f.end_s:
        v.dbe += 1
        v.retired_dbe += 1


def _thermal(f: Any, t: float, v: _Vals, b: Baseline) -> None:
    if f.recover and t >= f.end_s:
        return
    ramp = f.duration_s * f.ramp_fraction
    share = 1.0 if ramp <= 0 else min(1.0, (t - f.start_s) / ramp)
    peak = b.slowdown_temperature_c + f.overshoot_c
    v.temp = max(v.temp, v.temp + (peak - b.temperature_c) * share)
    margin = b.slowdown_temperature_c - v.temp
    if margin < 5.0:
        v.throttle |= SW_THERMAL_SLOWDOWN
        # Clocks fall linearly over the last 5 degrees before slowdown.
        frac = 1.0 - (1.0 - f.min_clock_fraction) * min(1.0, (5.0 - margin) / 5.0)
        v.sm_clock = min(v.sm_clock, b.sm_clock_mhz * frac)
        v.power = min(v.power, v.power * (0.5 + 0.5 * frac))
    if margin <= 0.0:
        v.throttle |= HW_SLOWDOWN | HW_THERMAL_SLOWDOWN


def _power_brake(f: Any, t: float, v: _Vals, b: Baseline) -> None:
    if t >= f.end_s:
        return
    v.throttle |= HW_POWER_BRAKE_SLOWDOWN | HW_SLOWDOWN
    v.sm_clock = min(v.sm_clock, b.sm_clock_mhz * f.clock_fraction)
    v.power = min(v.power, v.power * f.clock_fraction)


def _pcie_replay(f: Any, t: float, v: _Vals, b: Baseline) -> None:
    v.pcie_replay += int(_grown(t, f, f.start_rate_per_s, f.peak_rate_per_s))
    if f.progress(t) >= f.downgrade_at:
        v.pcie_width = min(v.pcie_width, f.degraded_width)
        if f.degraded_gen is not None:
            v.pcie_gen = min(v.pcie_gen, f.degraded_gen)
    if f.end_lost and t >= f.end_s:
        v.lost = True


def _nvlink_crc(f: Any, t: float, v: _Vals, b: Baseline) -> None:
    flit = int(_grown(t, f, f.start_rate_per_s, f.peak_rate_per_s))
    c = v.nvlink.setdefault(f.link, [0, 0, 0, 0])
    c[0] += flit
    c[1] += flit // 8  # data CRC errors are a fraction of flit CRC errors
    c[2] += flit // 2  # each CRC error forces a link-level replay, most succeed
    if f.end_with_xid and t >= f.end_s:
        c[3] += 1  # the link went through recovery: XID 74


def _sudden(f: Any, t: float, v: _Vals, b: Baseline) -> None:
    if f.xid == 79:
        v.lost = True
    elif f.xid == 48:
        v.dbe += 1
        v.remap_uncorr += 1
        v.remap_pending = True
    elif f.xid == 95:
        v.dbe += 1
        v.reset_required = True


def _ecc_burst(f: Any, t: float, v: _Vals, b: Baseline) -> None:
    v.ecc_corr += int(f.errors * f.progress(t))


_APPLY: dict[type, Callable[[Any, float, _Vals, Baseline], None]] = {
    EccStorm: _ecc_storm,
    RemapGrowth: _remap_growth,
    RetiredPages: _retired_pages,
    ThermalRunaway: _thermal,
    PowerBrake: _power_brake,
    PcieReplay: _pcie_replay,
    NvlinkCrc: _nvlink_crc,
    Sudden: _sudden,
    EccBurst: _ecc_burst,
}

# HGX H100 8-GPU baseboards enumerate their GPUs on these buses.
_HGX_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)


def _bus_id(i: int) -> str:
    if i < len(_HGX_BUSES):
        return f"00000000:{_HGX_BUSES[i]:02X}:00.0"
    return f"00000001:{i:02X}:00.0"  # beyond one baseboard: a second PCI domain


def _uuid(seed: int, i: int) -> str:
    h = f"{_mix(seed * 1_000_003 + i):016x}{_mix(seed ^ (i << 32) ^ 0x5EED):016x}"
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
