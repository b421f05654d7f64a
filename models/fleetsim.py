"""Fleet simulator: labelled GPU telemetry in the agent's replay format.

Simulates ``nodes x gpus_per_node`` GPUs for ``days`` at ``sample_interval_s`` and writes
what the agent would have recorded (see :mod:`forewarn.models.schema`), the XID events,
and the ground truth: one label row per failure (``node, gpu, time, cause,
had_precursor``). Parameters live in ``models/data/fleet_params.toml`` (documented in
``docs/models.md``); every number there is an assumption, several of them stated as such.

Model of a GPU (all vectorised with numpy over GPUs x time, one node at a time):

* workload: busy/idle phases shared by the GPUs of a node; temperature follows the load
  through an AR(1) lag, with benign hot spells; power follows the load, capped on
  power-capped nodes (``SW_POWER_CAP`` throttle bit) -- benign look-alikes of thermal and
  power precursors;
* counters: background correctable ECC / PCIe replay / NVLink CRC, isolated benign bursts
  (some raising XID 92 or a single XID 63 remap) that lead nowhere;
* failures: a Poisson draw per GPU at an (inflated) rate; cause from the Llama 3 mix
  (docs/reference.md, table 5); with probability ``precursor_share`` (per cause, an assumption)
  a precursor of lognormal duration and amplitude precedes it, shaped by the cause:
  ``hbm3`` correctable ECC accelerating + row remaps (XID 63) ending in a DBE (XID 48);
  ``sram`` SRAM ECC bursts + contained errors (XID 94) ending in XID 95; ``faulty_gpu``
  PCIe replays accelerating + link width drop ending off the bus (XID 79); ``network``
  NVLink CRC growth ending in XID 74; ``thermal`` temperature creep and throttling ending
  in XID 79; ``gsp`` power hiccups ending in XID 119. After its failure a GPU writes one
  last sample and then nothing (it is out for repair).
"""

from __future__ import annotations

import dataclasses
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy.signal import lfilter  # type: ignore[import-untyped]

from forewarn.gpu import (
    GPU_IDLE,
    HW_SLOWDOWN,
    HW_THERMAL_SLOWDOWN,
    SW_POWER_CAP,
    SW_THERMAL_SLOWDOWN,
)

__all__ = [
    "CauseParams",
    "FleetData",
    "FleetParams",
    "load_params",
    "simulate_fleet",
    "write_fleet",
]

IDLE = GPU_IDLE
SW_THERMAL = SW_THERMAL_SLOWDOWN
HW_THERMAL = HW_THERMAL_SLOWDOWN
N_LINKS = 4


@dataclasses.dataclass(frozen=True)
class CauseParams:
    """One failure cause: its weight in the mix and its precursor."""

    name: str
    weight: float
    precursor_share: float
    precursor_median_min: float = 30.0
    precursor_sigma: float = 0.5
    final_xid: int = 0


@dataclasses.dataclass(frozen=True)
class FleetParams:
    """All simulator parameters (see ``models/data/fleet_params.toml``)."""

    nodes: int
    gpus_per_node: int
    days: float
    sample_interval_s: float
    start_time: float
    seed: int
    rate_per_1000_gpu_days: float
    causes: tuple[CauseParams, ...]
    precursor_scale: float
    strength_sigma: float
    min_minutes: float
    noise_scale: float
    temperature_ar_sd_c: float
    power_sd_frac: float
    background_ecc_per_hour: float
    background_pcie_per_hour: float
    background_nvlink_per_hour: float
    benign: dict[str, float]

    def replace(self, **changes: Any) -> FleetParams:
        """A copy with some fields changed (e.g. ``seed``, ``precursor_scale``)."""
        return dataclasses.replace(self, **changes)

    @property
    def gpu_days(self) -> float:
        return self.nodes * self.gpus_per_node * self.days


def load_params(path: str | Path | None = None) -> FleetParams:
    """Read simulator parameters from a TOML file (default: the shipped one)."""
    if path is None:
        text = resources.files("forewarn.models").joinpath("data/fleet_params.toml").read_text()
    else:
        text = Path(path).read_text()
    raw = tomllib.loads(text)
    try:
        fleet, fail, pre, noise = raw["fleet"], raw["failures"], raw["precursor"], raw["noise"]
        causes = tuple(
            CauseParams(name=name, **{k: v for k, v in c.items()})
            for name, c in raw["causes"].items()
        )
        return FleetParams(
            nodes=int(fleet["nodes"]),
            gpus_per_node=int(fleet["gpus_per_node"]),
            days=float(fleet["days"]),
            sample_interval_s=float(fleet["sample_interval_s"]),
            start_time=float(fleet["start_time"]),
            seed=int(fleet["seed"]),
            rate_per_1000_gpu_days=float(fail["rate_per_1000_gpu_days"]),
            causes=causes,
            precursor_scale=float(pre["scale"]),
            strength_sigma=float(pre["strength_sigma"]),
            min_minutes=float(pre["min_minutes"]),
            noise_scale=float(noise["scale"]),
            temperature_ar_sd_c=float(noise["temperature_ar_sd_c"]),
            power_sd_frac=float(noise["power_sd_frac"]),
            background_ecc_per_hour=float(noise["background_ecc_per_hour"]),
            background_pcie_per_hour=float(noise["background_pcie_per_hour"]),
            background_nvlink_per_hour=float(noise["background_nvlink_per_hour"]),
            benign={k: float(v) for k, v in raw["benign"].items()},
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"fleet parameters: missing or bad key {exc}") from None


@dataclasses.dataclass
class FleetData:
    """What :func:`simulate_fleet` returns: samples, XID events and failure labels."""

    samples: pd.DataFrame
    xids: pd.DataFrame
    labels: pd.DataFrame
    params: FleetParams


@dataclasses.dataclass
class _Node:
    """Per-node arrays under construction, shape (G, T)."""

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
    xids: list[tuple[int, float, int]]


def _poisson_rate(rng: np.random.Generator, rate_per_step: np.ndarray) -> np.ndarray:
    out: np.ndarray = rng.poisson(np.clip(rate_per_step, 0.0, None)).astype(np.int64)
    return out


def _bursts(
    rng: np.random.Generator, arr: np.ndarray, per_gpu_day: float, days: float,
    size: float, len_steps: tuple[int, int],
) -> list[tuple[int, int]]:
    """Add isolated bursts of counts to ``arr``; return (gpu, start step) of each."""
    g_count, t_count = arr.shape
    n = rng.poisson(per_gpu_day * days * g_count)
    out = []
    for _ in range(n):
        g = int(rng.integers(g_count))
        s = int(rng.integers(t_count))
        length = int(rng.integers(len_steps[0], len_steps[1] + 1))
        total = rng.poisson(size)
        e = min(t_count, s + length)
        arr[g, s:e] += rng.multinomial(total, np.full(e - s, 1.0 / (e - s)))
        out.append((g, s))
    return out


def _simulate_node(p: FleetParams, node_idx: int) -> tuple[pd.DataFrame, list[dict[str, Any]],
                                                            list[dict[str, Any]]]:
    rng = np.random.default_rng([p.seed, node_idx])
    g_count = p.gpus_per_node
    dt = p.sample_interval_s
    t_count = round(p.days * 86400 / dt)
    times = p.start_time + np.arange(t_count) * dt
    hours = dt / 3600.0
    ns = p.noise_scale
    b = p.benign
    node = f"node{node_idx:04d}"

    # Workload: busy/idle phases shared by the node's GPUs (one job per node at a time).
    changes = rng.random(t_count) < b["job_change_per_gpu_day"] * dt / 86400
    phase = np.cumsum(changes)
    levels = np.where(rng.random(phase.max() + 1) < 0.8,
                      rng.uniform(0.75, 1.0, phase.max() + 1), 0.05)
    load = np.broadcast_to(levels[phase], (g_count, t_count)) \
        + rng.normal(0, 0.03, (g_count, t_count))
    load = np.clip(load, 0.0, 1.0)
    temp_target = 32.0 + rng.normal(0, 2, (g_count, 1)) + 45.0 * load
    # Benign hot spells: workload-driven swings of +5..15 C for about an hour.
    for g, s in _bursts_positions(rng, g_count, t_count, b["hot_spell_per_gpu_day"] * ns, p.days):
        length = int(rng.uniform(0.5, 1.5) * 3600 / dt) + 1
        e = min(t_count, s + length)
        temp_target[g, s:e] += rng.uniform(5, 15) * np.sin(np.linspace(0, np.pi, e - s))

    st = _Node(
        load=load, temp_target=temp_target,
        power_extra_sd=np.zeros((g_count, t_count)),
        ecc=_poisson_rate(rng, np.full((g_count, t_count), p.background_ecc_per_hour * hours * ns)
                          * (rng.random((g_count, 1)) < 0.2)),
        remap=np.zeros((g_count, t_count), np.int64),
        remap_pending=np.zeros((g_count, t_count), bool),
        pcie=_poisson_rate(rng, np.full((g_count, t_count), p.background_pcie_per_hour * hours * ns)
                           * (rng.random((g_count, 1)) < 0.2)),
        width_drop=np.zeros((g_count, t_count), bool),
        nvl_crc=_poisson_rate(rng, np.full((g_count, t_count),
                                           p.background_nvlink_per_hour * hours * ns)),
        nvl_replay=np.zeros((g_count, t_count), np.int64),
        xids=[],
    )
    minute = max(1, round(60 / dt))
    for g, s in _bursts(rng, st.ecc, b["ecc_burst_per_gpu_day"] * ns, p.days,
                        b["ecc_burst_size"], (2 * minute, 10 * minute)):
        if rng.random() < b["ecc_burst_xid92_share"]:
            st.xids.append((g, float(times[s]), 92))
    _bursts(rng, st.pcie, b["pcie_burst_per_gpu_day"] * ns, p.days, 60.0, (minute, 5 * minute))
    _bursts(rng, st.nvl_crc, b["nvlink_burst_per_gpu_day"] * ns, p.days, 30.0,
            (minute, 3 * minute))
    for g, s in _bursts_positions(rng, g_count, t_count, b["remap_event_per_gpu_day"] * ns,
                                  p.days):
        st.remap[g, s] += 1
        st.remap_pending[g, s:s + 5 * minute] = True
        st.xids.append((g, float(times[s]), 63))
    for g, s in _bursts_positions(rng, g_count, t_count, b["app_xid_per_gpu_day"], p.days):
        st.xids.append((g, float(times[s]), int(rng.choice([13, 31, 43]))))

    # Failures.
    weights = np.array([c.weight for c in p.causes])
    prob_fail = 1.0 - np.exp(-p.rate_per_1000_gpu_days / 1000.0 * p.days)
    end_step = np.full(g_count, t_count)
    state_lost = np.zeros(g_count, bool)
    dbe = np.zeros(g_count, bool)
    labels: list[dict[str, Any]] = []
    for g in range(g_count):
        if rng.random() >= prob_fail:
            continue
        f_step = int(rng.integers(1, t_count))
        cause = p.causes[int(rng.choice(len(p.causes), p=weights / weights.sum()))]
        has_pre = bool(rng.random() < cause.precursor_share)
        minutes = 0.0
        if has_pre:
            minutes = max(p.min_minutes, float(rng.lognormal(
                np.log(cause.precursor_median_min), cause.precursor_sigma))) * p.precursor_scale
            strength = float(rng.lognormal(0.0, p.strength_sigma))
            _precursor(rng, st, g, cause.name, f_step, max(1, round(minutes * 60 / dt)),
                       strength, times, dt)
        end_step[g] = f_step + 1
        if cause.final_xid:
            st.xids.append((g, float(times[f_step]), cause.final_xid))
        state_lost[g] = cause.final_xid in (79, 119)
        dbe[g] = cause.final_xid in (48, 95)
        labels.append({
            "node": node, "gpu": g, "uuid": f"GPU-{node_idx:04d}-{g}",
            "time": float(times[f_step]), "cause": cause.name, "had_precursor": has_pre,
            "precursor_minutes": minutes,
        })

    # Temperature: AR(1) lag toward the target, plus noise.
    a = np.exp(-dt / 120.0)
    noise = rng.normal(0, p.temperature_ar_sd_c * ns, (g_count, t_count))
    temp = lfilter([1 - a], [1, -a], st.temp_target + noise / (1 - a), axis=1,
                   zi=(st.temp_target[:, :1] * a))[0]
    slowdown = 87.0 + rng.normal(0, 1.5, (g_count, 1))
    margin = slowdown - temp
    capped = rng.random() < b["power_capped_node_share"]
    limit = 500.0 if capped else 700.0
    demand = 700.0 * (0.1 + 0.85 * st.load) \
        + rng.normal(0, 1, (g_count, t_count)) * 700.0 * (p.power_sd_frac * ns
                                                           + st.power_extra_sd)
    power = np.clip(np.minimum(demand, limit), 30.0, None)
    throttle = np.where(st.load < 0.2, IDLE, 0) | np.where(demand > limit, SW_POWER_CAP, 0) \
        | np.where(margin < 3.0, SW_THERMAL, 0) \
        | np.where(margin < 0.0, HW_THERMAL | HW_SLOWDOWN, 0)

    ecc = np.cumsum(st.ecc, axis=1)
    uncorr = np.zeros((g_count, t_count), np.int64)
    uncorr[dbe, :] = (np.arange(t_count)[None, :] >= (end_step[dbe] - 1)[:, None])
    remap_c = np.cumsum(st.remap, axis=1)
    pcie = np.cumsum(st.pcie, axis=1)
    width = np.where(st.width_drop, 8, 16)
    crc = np.cumsum(st.nvl_crc, axis=1)
    rep = np.cumsum(st.nvl_replay, axis=1)

    keep = np.arange(t_count)[None, :] < end_step[:, None]
    gi, ti = np.nonzero(keep)
    state = np.full((g_count, t_count), "ok", dtype=object)
    last = end_step - 1
    for lost_g in np.nonzero(state_lost)[0]:
        state[lost_g, last[lost_g]] = "lost"
    df = pd.DataFrame({
        "node": node,
        "gpu": gi.astype(np.int64),
        "uuid": np.array([f"GPU-{node_idx:04d}-{g}" for g in range(g_count)])[gi],
        "time": times[ti],
        "state": state[gi, ti],
        "temperature_c": np.round(temp[gi, ti], 1).astype(np.float32),
        "slowdown_margin_c": np.round(margin[gi, ti], 1).astype(np.float32),
        "power_w": np.round(power[gi, ti], 1).astype(np.float32),
        "power_limit_w": np.float32(limit),
        "throttle_reasons": throttle[gi, ti].astype(np.int64),
        "ecc_corrected_volatile": ecc[gi, ti],
        "ecc_uncorrected_volatile": uncorr[gi, ti],
        "remapped_rows_correctable": remap_c[gi, ti],
        "remapped_rows_uncorrectable": uncorr[gi, ti],
        "remap_pending": st.remap_pending[gi, ti],
        "remap_failure": False,
        "retired_pages_sbe": 0,
        "retired_pages_dbe": 0,
        "retired_pages_pending": False,
        "pcie_replay_total": pcie[gi, ti],
        "pcie_link_width": width[gi, ti].astype(np.int64),
        "pcie_link_width_max": 16,
    })
    # The failing NVLink sits on link 0; links 1..3 carry background only.
    for link in range(N_LINKS):
        if link == 0:
            df["nvlink0_crc_flit"] = crc[gi, ti]
            df["nvlink0_replay"] = rep[gi, ti]
        else:
            df[f"nvlink{link}_crc_flit"] = 0
            df[f"nvlink{link}_replay"] = 0
    xids = [
        {"node": node, "gpu": g, "time": t, "code": c, "text": ""}
        for g, t, c in st.xids if t <= times[end_step[g] - 1]
    ]
    return df, xids, labels


def _bursts_positions(rng: np.random.Generator, g_count: int, t_count: int,
                      per_gpu_day: float, days: float) -> list[tuple[int, int]]:
    n = rng.poisson(per_gpu_day * days * g_count)
    return [(int(rng.integers(g_count)), int(rng.integers(t_count))) for _ in range(n)]


def _precursor(rng: np.random.Generator, st: _Node, g: int, cause: str, f_step: int,
               d_steps: int, strength: float, times: np.ndarray, dt: float) -> None:
    """Write the cause's precursor into the node arrays over [f_step - d_steps, f_step)."""
    s = max(0, f_step - d_steps)
    prog = (np.arange(s, f_step) - (f_step - d_steps)) / d_steps  # 0..1
    hours = dt / 3600.0
    n = f_step - s
    if n <= 0:
        return
    minute = max(1, round(60 / dt))

    def some_steps(k: int, after: float) -> np.ndarray:
        lo = s + int(after * n)
        return np.sort(rng.integers(lo, f_step, size=k)) if f_step > lo else np.array([], int)

    if cause == "hbm3":
        # Correctable ECC accelerating from ~30/h to ~1,000/h; rows remapped on the way.
        st.ecc[g, s:f_step] += rng.poisson(strength * 30.0 * np.exp(3.5 * prog) * hours)
        for k in some_steps(1 + rng.poisson(2 * strength), 0.3):
            st.remap[g, k] += 1
            st.remap_pending[g, k:k + 5 * minute] = True
            st.xids.append((g, float(times[k]), 63))
        for k in some_steps(1, 0.6):
            st.xids.append((g, float(times[k]), 92))
    elif cause == "sram":
        st.ecc[g, s:f_step] += rng.poisson(strength * 40.0 * (1 + 10 * prog**2) * hours)
        for k in some_steps(1 + rng.poisson(1), 0.5):
            st.xids.append((g, float(times[k]), 94))
    elif cause == "faulty_gpu":
        st.pcie[g, s:f_step] += rng.poisson(strength * 60.0 * np.exp(3.0 * prog) * hours)
        if rng.random() < 0.5:
            st.width_drop[g, s + int(0.7 * n):f_step + 1] = True
    elif cause == "network":
        crc = rng.poisson(strength * 50.0 * np.exp(3.0 * prog) * hours)
        st.nvl_crc[g, s:f_step] += crc
        st.nvl_replay[g, s:f_step] += rng.binomial(crc, 0.1)
    elif cause == "thermal":
        st.temp_target[g, s:f_step] += strength * 18.0 * prog**1.3
    elif cause == "gsp":
        st.power_extra_sd[g, s:f_step] += 0.08 * strength * (0.3 + prog)


def simulate_fleet(params: FleetParams) -> FleetData:
    """Simulate the fleet described by ``params`` (deterministic for a given seed)."""
    frames, xids, labels = [], [], []
    for node_idx in range(params.nodes):
        df, x, lab = _simulate_node(params, node_idx)
        frames.append(df)
        xids.extend(x)
        labels.extend(lab)
    samples = pd.concat(frames, ignore_index=True)
    xid_df = pd.DataFrame(xids, columns=["node", "gpu", "time", "code", "text"]).rename(
        columns={"code": "xid", "text": "xid_text"})  # the agent's replay events columns
    xid_df = xid_df.sort_values(["time", "node", "gpu"], ignore_index=True)
    label_df = pd.DataFrame(labels, columns=["node", "gpu", "uuid", "time", "cause",
                                             "had_precursor", "precursor_minutes"])
    return FleetData(samples=samples, xids=xid_df, labels=label_df, params=params)


def write_fleet(data: FleetData, out_dir: str | Path) -> dict[str, Path]:
    """Write ``samples.parquet``, ``xids.parquet`` and ``labels.csv`` under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"samples": out / "samples.parquet", "xids": out / "xids.parquet",
             "labels": out / "labels.csv"}
    data.samples.to_parquet(paths["samples"], index=False)
    data.xids.to_parquet(paths["xids"], index=False)
    data.labels.to_csv(paths["labels"], index=False)
    return paths
