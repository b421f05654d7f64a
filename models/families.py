"""Behaviour families of the fleet simulator: precursors of failures and benign behaviour.

A *family* is one kind of behaviour with randomised shape, duration, amplitude and noise,
so that a model trained on some families can be judged on one it never saw
(``forewarn models eval-families``, leave-one-family-out; docs/models.md).

Precursor families (:data:`PRECURSORS`) write what a GPU shows before it fails, over the
steps ``[s, f)`` before the failure step ``f``; each draws its growth curve at random
(:func:`growth`: exponential, power or steps). Benign families (:data:`BENIGN`) write
behaviour that leads nowhere: chronic and steady (a correctable-ECC trickle, PCIe replays
creeping up for months, a GPU that always runs hot), one-off (bursts, single remaps, hot
spells), or node-wide (cooling, the host's PCIe, an agent restart: every GPU of the node).
Every number here is an assumption of the simulator, like those in
``models/data/fleet_params.toml``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Final

import numpy as np

__all__ = ["BENIGN", "PRECURSORS", "NodeArrays", "PrecursorFamily", "growth"]

N_LINKS: Final = 4


@dataclasses.dataclass
class NodeArrays:
    """Per-node arrays under construction, shape (G, T) (NVLink: (G, links, T)); counter
    arrays hold increments per step. ``keep`` says which samples the agent recorded."""

    rng: np.random.Generator
    dt: float
    times: np.ndarray
    load: np.ndarray
    temp_target: np.ndarray
    power_extra_sd: np.ndarray
    ecc: np.ndarray
    remap: np.ndarray
    remap_pending: np.ndarray
    pcie: np.ndarray
    width_drop: np.ndarray
    nvl_crc: np.ndarray
    nvl_replay: np.ndarray
    keep: np.ndarray
    xids: list[tuple[int, float, int]]
    tags: list[set[str]]

    @property
    def hours(self) -> float:
        """Hours per step."""
        return self.dt / 3600.0

    @property
    def minute(self) -> int:
        """Steps per minute (at least one)."""
        return max(1, round(60 / self.dt))

    def poisson(self, rate_per_hour: np.ndarray | float, shape: tuple[int, ...]
                ) -> np.ndarray:
        """Counts per step at ``rate_per_hour``."""
        lam = np.clip(np.broadcast_to(np.asarray(rate_per_hour) * self.hours, shape), 0, None)
        out: np.ndarray = self.rng.poisson(lam).astype(np.int64)
        return out

    def xid(self, g: int, step: int, code: int) -> None:
        self.xids.append((g, float(self.times[min(step, len(self.times) - 1)]), code))


def growth(rng: np.random.Generator, prog: np.ndarray, kind: str = "") -> np.ndarray:
    """A rising curve over ``prog`` (0..1) from 0 to 1, its shape drawn at random:
    exponential (rate k in 1.5..4.5), power (exponent 0.5..3) or 2-6 steps."""
    kind = kind or str(rng.choice(["exp", "power", "steps"]))
    if kind == "exp":
        k = rng.uniform(1.5, 4.5)
        out: np.ndarray = (np.exp(k * prog) - 1.0) / (np.exp(k) - 1.0)
    elif kind == "power":
        out = prog ** rng.uniform(0.5, 3.0)
    else:
        edges = np.sort(rng.uniform(0.0, 0.9, int(rng.integers(2, 7))))
        out = np.searchsorted(edges, prog, side="right") / len(edges)
    return out


def _counter_rise(a: NodeArrays, g: int, s: int, f: int, base: float, gain: float,
                  kind: str = "") -> np.ndarray:
    """Counts per step rising from ``base``/h to ``base * gain``/h over [s, f)."""
    prog = np.linspace(0.0, 1.0, f - s, endpoint=False)
    rate = base * (1.0 + (gain - 1.0) * growth(a.rng, prog, kind))
    return a.poisson(rate, (f - s,))


# -- precursors: (arrays, gpu, start step, failure step, strength) -> None -------------

def _ecc_accel(a: NodeArrays, g: int, s: int, f: int, k: float) -> None:
    """HBM: correctable ECC accelerating from ~30/h to ~1,000/h, rows remapped (XID 63)
    on the way, XID 92, ending in a double-bit error (XID 48)."""
    a.ecc[g, s:f] += _counter_rise(a, g, s, f, 30.0 * k, a.rng.uniform(10, 50))
    n = f - s
    for step in np.sort(a.rng.integers(s + int(0.3 * n), f, 1 + a.rng.poisson(2 * k))):
        a.remap[g, step] += 1
        a.remap_pending[g, step:step + 5 * a.minute] = True
        a.xid(g, int(step), 63)
    a.xid(g, int(a.rng.integers(s + int(0.6 * n), f)), 92)


def _ecc_drift_days(a: NodeArrays, g: int, s: int, f: int, k: float) -> None:
    """HBM wearing out over days: correctable ECC drifting from a few an hour to tens,
    ending in XID 48."""
    a.ecc[g, s:f] += _counter_rise(a, g, s, f, 3.0 * k, a.rng.uniform(8, 40))


def _pending_remaps(a: NodeArrays, g: int, s: int, f: int, k: float) -> None:
    """Rows remapped one after another with the remap left pending (needs a reset that
    never comes), little correctable ECC, ending in a remap failure (XID 64)."""
    n = f - s
    steps = np.sort(a.rng.integers(s, f, 2 + a.rng.poisson(2 * k)))
    for step in steps:
        a.remap[g, step] += 1
        a.xid(g, int(step), 63)
    a.remap_pending[g, steps[0]:f] = True
    a.ecc[g, s:f] += a.poisson(2.0 * k, (n,))


def _sram_bursts(a: NodeArrays, g: int, s: int, f: int, k: float) -> None:
    """SRAM: growing correctable bursts, contained errors (XID 94), ending in XID 95."""
    a.ecc[g, s:f] += _counter_rise(a, g, s, f, 40.0 * k, a.rng.uniform(5, 15), "power")
    for step in a.rng.integers(s + (f - s) // 2, f, 1 + a.rng.poisson(1)):
        a.xid(g, int(step), 94)


def _pcie_accel(a: NodeArrays, g: int, s: int, f: int, k: float) -> None:
    """PCIe replays accelerating, the link dropping to x8 in half the cases, ending off
    the bus (XID 79)."""
    a.pcie[g, s:f] += _counter_rise(a, g, s, f, 60.0 * k, a.rng.uniform(8, 30))
    if a.rng.random() < 0.5:
        a.width_drop[g, s + int(0.7 * (f - s)):f + 1] = True


def _pcie_steps(a: NodeArrays, g: int, s: int, f: int, k: float) -> None:
    """PCIe replay rate rising in steps (each a link retrain at a worse level), off the
    bus at the end."""
    a.pcie[g, s:f] += _counter_rise(a, g, s, f, 20.0 * k, a.rng.uniform(10, 60), "steps")


def _sample_thinning(a: NodeArrays, g: int, s: int, f: int, k: float) -> None:
    """The GPU goes quiet before it falls off the bus: NVML calls time out, so ever more
    samples are missing (up to 60-95 %)."""
    prog = np.linspace(0.0, 1.0, f - s, endpoint=False)
    miss = a.rng.uniform(0.6, 0.95) * growth(a.rng, prog)
    a.keep[g, s:f] &= a.rng.random(f - s) >= miss


def _nvlink(a: NodeArrays, g: int, s: int, f: int, k: float, links: int) -> None:
    for link in a.rng.choice(N_LINKS, links, replace=False):
        crc = _counter_rise(a, g, s, f, 50.0 * k / links, a.rng.uniform(8, 30))
        a.nvl_crc[g, link, s:f] += crc
        a.nvl_replay[g, link, s:f] += a.rng.binomial(crc, 0.1)


def _nvlink_one(a: NodeArrays, g: int, s: int, f: int, k: float) -> None:
    """CRC errors growing on one NVLink (with replays), ending in XID 74."""
    _nvlink(a, g, s, f, k, 1)


def _nvlink_multi(a: NodeArrays, g: int, s: int, f: int, k: float) -> None:
    """CRC errors growing across 2-4 NVLinks at once (a failing NVSwitch side or the
    GPU's own SerDes), each slower than one bad link, ending in XID 74."""
    _nvlink(a, g, s, f, k, int(a.rng.integers(2, N_LINKS + 1)))


def _thermal_creep(a: NodeArrays, g: int, s: int, f: int, k: float) -> None:
    """Thermal interface failing: temperature creeping up by ~10-25 C, off the bus."""
    prog = np.linspace(0.0, 1.0, f - s, endpoint=False)
    a.temp_target[g, s:f] += k * a.rng.uniform(10, 25) * growth(a.rng, prog, "power")


def _thermal_oscillation(a: NodeArrays, g: int, s: int, f: int, k: float) -> None:
    """A fan or its controller hunting: temperature oscillating with a period of 4-15
    minutes and a growing amplitude (up to 4-12 C), off the bus at the end."""
    prog = np.linspace(0.0, 1.0, f - s, endpoint=False)
    period = a.rng.uniform(4, 15) * 60 / a.dt
    amp = k * a.rng.uniform(4, 12) * growth(a.rng, prog, "power")
    a.temp_target[g, s:f] += amp * (1 + np.sin(2 * np.pi * np.arange(f - s) / period))


def _gsp_power(a: NodeArrays, g: int, s: int, f: int, k: float) -> None:
    """GSP firmware failing: power hiccups, ending in XID 119."""
    prog = np.linspace(0.0, 1.0, f - s, endpoint=False)
    a.power_extra_sd[g, s:f] += 0.08 * k * (0.3 + growth(a.rng, prog))


Precursor = Callable[[NodeArrays, int, int, int, float], None]


@dataclasses.dataclass(frozen=True)
class PrecursorFamily:
    """One kind of failure with a precursor: everything the simulator and the labels need
    to know about it. What the failure does to the GPU's samples (lost, double-bit error)
    follows from ``xid`` and its class in :data:`forewarn.gpu.XID_CATALOG`."""

    cause: str
    """The failure's ``cause`` label; the cause's weight in the mix and its share of
    failures with a precursor are ``[causes.<cause>]`` in the parameter file."""
    xid: int
    """The XID the failure raises."""
    median_min: float
    """Median precursor duration in minutes (lognormal)."""
    sigma: float
    """Sigma of the log of the duration."""
    write: Precursor
    """Writes the precursor over the steps ``[s, f)`` before the failure step ``f``."""


PRECURSORS: Final[dict[str, PrecursorFamily]] = {
    # Durations: ASSUMPTIONS, from minutes (GSP, SRAM) to days (HBM wearing out). A cause
    # draws among its families in this order (equally likely).
    "ecc_accel": PrecursorFamily("hbm3", 48, 70.0, 0.7, _ecc_accel),
    "ecc_drift_days": PrecursorFamily("hbm3", 48, 1800.0, 0.5, _ecc_drift_days),
    "pending_remaps": PrecursorFamily("hbm3", 64, 180.0, 0.8, _pending_remaps),
    "sram_bursts": PrecursorFamily("sram", 95, 35.0, 0.6, _sram_bursts),
    "pcie_accel": PrecursorFamily("faulty_gpu", 79, 50.0, 0.7, _pcie_accel),
    "pcie_steps": PrecursorFamily("faulty_gpu", 79, 120.0, 0.8, _pcie_steps),
    "sample_thinning": PrecursorFamily("faulty_gpu", 79, 30.0, 0.6, _sample_thinning),
    "nvlink_one": PrecursorFamily("network", 74, 45.0, 0.7, _nvlink_one),
    "nvlink_multi": PrecursorFamily("network", 74, 60.0, 0.7, _nvlink_multi),
    "thermal_creep": PrecursorFamily("thermal", 79, 45.0, 0.7, _thermal_creep),
    "thermal_oscillation": PrecursorFamily("thermal", 79, 60.0, 0.7, _thermal_oscillation),
    "gsp_power": PrecursorFamily("gsp", 119, 25.0, 0.5, _gsp_power),
}
"""Precursor families by name: the one table of the simulator's failure kinds (adding a
kind is its ``write`` function and one entry here)."""


# -- benign: (arrays, share or rate, node is capped) -> None; tags the GPUs it touches ---

def _gpus(a: NodeArrays, share: float) -> np.ndarray:
    out: np.ndarray = np.nonzero(a.rng.random(len(a.load)) < share)[0]
    return out


def _tag(a: NodeArrays, gpus: np.ndarray | range | list[int], name: str) -> None:
    for g in gpus:
        a.tags[int(g)].add(name)


def _ecc_trickle(a: NodeArrays, share: float) -> None:
    """Healthy GPUs with a steady correctable-ECC trickle for their whole life (common in
    real fleets): 0.5-300 an hour, lognormal around 8."""
    gpus = _gpus(a, share)
    t = a.ecc.shape[1]
    for g in gpus:
        rate = float(np.clip(a.rng.lognormal(np.log(8.0), 1.2), 0.5, 300.0))
        a.ecc[g] += a.poisson(rate, (t,))
    _tag(a, gpus, "ecc_trickle")


def _pcie_creep(a: NodeArrays, share: float) -> None:
    """PCIe replays creeping up over months (a marginal riser that never fails): 1-50
    an hour, growing by a few percent a day."""
    gpus = _gpus(a, share)
    t = a.pcie.shape[1]
    days = np.arange(t) * a.dt / 86400
    for g in gpus:
        rate = float(a.rng.lognormal(np.log(5.0), 0.9)) * (1 + a.rng.uniform(0.01, 0.05) * days)
        a.pcie[g] += a.poisson(rate, (t,))
    _tag(a, gpus, "pcie_creep")


def _hot_gpu(a: NodeArrays, share: float) -> None:
    """A GPU that always runs 8-18 C hotter than its peers (airflow, its slot) and may
    throttle: chronic and stable."""
    gpus = _gpus(a, share)
    for g in gpus:
        a.temp_target[g] += a.rng.uniform(8, 18)
    _tag(a, gpus, "hot_gpu")


def _telemetry_gaps(a: NodeArrays, share: float) -> None:
    """GPUs whose samples go missing now and then (1-10 %, and short gaps): a busy
    agent, a slow NVML call; it never gets worse."""
    gpus = _gpus(a, share)
    t = a.keep.shape[1]
    for g in gpus:
        a.keep[g] &= a.rng.random(t) >= a.rng.uniform(0.01, 0.1)
        for s in a.rng.integers(0, t, a.rng.poisson(t * a.dt / 86400)):
            a.keep[g, s:s + int(a.rng.integers(2, 6)) * a.minute] = False
    _tag(a, gpus, "telemetry_gaps")


def _node_events(a: NodeArrays, per_node_day: float) -> None:
    """Events that hit every GPU of the node at once: cooling trouble (+6-12 C for 1-6 h),
    the host's PCIe (a replay burst on all GPUs), an agent restart (5-30 min without
    samples) or a congested network (half the samples lost for an hour)."""
    g_count, t = a.keep.shape
    n = a.rng.poisson(per_node_day * t * a.dt / 86400)
    for _ in range(n):
        s = int(a.rng.integers(t))
        kind = a.rng.choice(["hot", "pcie", "restart", "thinning"])
        if kind == "hot":
            e = min(t, s + int(a.rng.uniform(1, 6) * 3600 / a.dt))
            prog = np.linspace(0, np.pi, e - s)
            a.temp_target[:, s:e] += a.rng.uniform(6, 12) * np.sin(prog) ** 0.3
        elif kind == "pcie":
            e = min(t, s + int(a.rng.uniform(5, 60) * 60 / a.dt) + 1)
            a.pcie[:, s:e] += a.poisson(a.rng.uniform(100, 600), (g_count, e - s))
        elif kind == "restart":
            a.keep[:, s:s + int(a.rng.uniform(5, 30) * 60 / a.dt)] = False
        else:
            e = min(t, s + int(3600 / a.dt))
            a.keep[:, s:e] &= a.rng.random((g_count, e - s)) >= 0.5
    if n:
        _tag(a, range(g_count), "node_event")


def _one_offs(a: NodeArrays, per_gpu_day: float) -> None:
    """Isolated correctable-ECC bursts (30 % with XID 92), PCIe replay and NVLink CRC
    bursts, single row remaps (XID 63) that stay single: ``per_gpu_day`` ECC bursts and
    proportionate rates of the others."""
    g_count, t = a.ecc.shape
    m = a.minute
    days = t * a.dt / 86400
    for kind, rate in (("ecc", 1.0), ("pcie", 0.6), ("nvl", 0.5), ("remap", 0.12)):
        for _ in range(a.rng.poisson(per_gpu_day * rate * days * g_count)):
            g, s = int(a.rng.integers(g_count)), int(a.rng.integers(t))
            a.tags[g].add("one_off_bursts")
            if kind == "remap":
                a.remap[g, s] += 1
                a.remap_pending[g, s:s + 5 * m] = True
                a.xid(g, s, 63)
                continue
            e = min(t, s + int(a.rng.integers(m, 10 * m + 1)))
            total = a.rng.poisson({"ecc": 40.0, "pcie": 60.0, "nvl": 30.0}[kind])
            spread = a.rng.multinomial(total, np.full(e - s, 1.0 / (e - s)))
            if kind == "ecc":
                a.ecc[g, s:e] += spread
                if a.rng.random() < 0.3:
                    a.xid(g, s, 92)
            elif kind == "pcie":
                a.pcie[g, s:e] += spread
            else:
                a.nvl_crc[g, int(a.rng.integers(N_LINKS)), s:e] += spread


def _hot_spells(a: NodeArrays, per_gpu_day: float) -> None:
    """Workload-driven temperature swings of +5-15 C for about an hour."""
    g_count, t = a.temp_target.shape
    for _ in range(a.rng.poisson(per_gpu_day * t * a.dt / 86400 * g_count)):
        g, s = int(a.rng.integers(g_count)), int(a.rng.integers(t))
        e = min(t, s + int(a.rng.uniform(0.5, 1.5) * 3600 / a.dt) + 1)
        a.temp_target[g, s:e] += a.rng.uniform(5, 15) * np.sin(np.linspace(0, np.pi, e - s))
        a.tags[g].add("hot_spells")


BENIGN: Final[dict[str, Callable[[NodeArrays, float], None]]] = {
    "ecc_trickle": _ecc_trickle, "pcie_creep": _pcie_creep, "hot_gpu": _hot_gpu,
    "telemetry_gaps": _telemetry_gaps, "node_event": _node_events,
    "one_off_bursts": _one_offs, "hot_spells": _hot_spells,
}
"""Benign families by name (power capping is drawn per node in the simulator itself);
the value each takes is its prevalence (share of GPUs) or rate (per GPU- or node-day),
from ``[benign]`` in the parameter file."""
