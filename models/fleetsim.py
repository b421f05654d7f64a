"""Fleet simulator: labelled GPU telemetry in the agent's replay format.

Simulates ``nodes x gpus_per_node`` GPUs for ``days`` at ``sample_interval_s`` and writes
what the agent would have recorded (see :mod:`forewarn.models.schema`), the XID events,
the ground truth -- one label row per failure (``node, gpu, time, cause, had_precursor,
family``) -- and which benign behaviour families each GPU shows. Parameters live in
``models/data/fleet_params.toml`` (documented in ``docs/models.md``); every number there
is an assumption, several of them stated as such.

Model of a GPU (all vectorised with numpy over GPUs x time, one node at a time):

* workload: busy/idle phases shared by the GPUs of a node; temperature follows the load
  through an AR(1) lag; power follows the load, capped on power-capped nodes
  (``SW_POWER_CAP`` throttle bit);
* benign behaviour families (:data:`forewarn.models.families.BENIGN`) at a prevalence
  drawn per fleet: chronic correctable-ECC trickles, PCIe replays creeping up, GPUs that
  always run hot, telemetry gaps, node-wide events, one-off bursts, hot spells;
* failures: a Poisson draw per GPU at an (inflated) rate -- precision is judged at the real
  rate, ``real_per_1000_node_days`` -- with the cause from the Llama 3 mix
  (docs/reference.md, table 5); with probability ``precursor_share`` (per cause, an
  assumption) one of the cause's precursor families
  (:data:`forewarn.models.families.PRECURSORS`, the one table of failure kinds: cause,
  final XID, duration, shape) precedes it, with a lognormal duration (minutes to days),
  amplitude and a randomly drawn growth shape. After its failure a GPU writes one last
  sample and then nothing (it is out for repair); a fatal bus or GSP XID leaves it lost, a
  fatal memory XID with an uncorrectable ECC error (classes from :mod:`forewarn.gpu`).
"""

from __future__ import annotations

import dataclasses
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, Final

import numpy as np
import pandas as pd
from scipy.signal import lfilter  # type: ignore[import-untyped]

from forewarn.gpu import (
    GPU_IDLE,
    HW_SLOWDOWN,
    HW_THERMAL_SLOWDOWN,
    SW_POWER_CAP,
    SW_THERMAL_SLOWDOWN,
    classify_xid,
)
from forewarn.models.families import BENIGN, N_LINKS, PRECURSORS, NodeArrays

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


@dataclasses.dataclass(frozen=True)
class CauseParams:
    """One failure cause: its weight in the mix, the share of its failures with a
    precursor, the precursor families it draws from (those of
    :data:`~forewarn.models.families.PRECURSORS` with this cause, in table order), and its
    XID without one."""

    name: str
    weight: float
    precursor_share: float
    final_xid: int = 0
    families: tuple[str, ...] = ()


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
    real_per_1000_node_days: float
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
    balanced_families: bool = False
    """Every failure gets a precursor with probability 0.8, its family drawn uniformly
    over all families (the leave-one-family-out pool: enough failures of each family;
    per-family figures do not depend on the mix)."""

    def replace(self, **changes: Any) -> FleetParams:
        """A copy with some fields changed (e.g. ``seed``, ``precursor_scale``)."""
        return dataclasses.replace(self, **changes)

    @property
    def gpu_days(self) -> float:
        return self.nodes * self.gpus_per_node * self.days

    @property
    def real_per_1000_gpu_days(self) -> float:
        """The real fleet's failure rate per GPU: precision is judged at this base rate."""
        return self.real_per_1000_node_days / self.gpus_per_node


def load_params(path: str | Path | None = None) -> FleetParams:
    """Read simulator parameters from a TOML file (default: the shipped one)."""
    if path is None:
        text = resources.files("forewarn.models").joinpath("data/fleet_params.toml").read_text()
    else:
        text = Path(path).read_text()
    raw = tomllib.loads(text)
    try:
        fleet, fail, pre, noise = raw["fleet"], raw["failures"], raw["precursor"], raw["noise"]
        causes = tuple(_cause(name, c) for name, c in raw["causes"].items())
        if "families" in raw:
            raise ValueError(f"fleet parameters: families: {_FAMILIES_MOVED}")
        return FleetParams(
            nodes=int(fleet["nodes"]),
            gpus_per_node=int(fleet["gpus_per_node"]),
            days=float(fleet["days"]),
            sample_interval_s=float(fleet["sample_interval_s"]),
            start_time=float(fleet["start_time"]),
            seed=int(fleet["seed"]),
            rate_per_1000_gpu_days=float(fail["rate_per_1000_gpu_days"]),
            real_per_1000_node_days=float(fail["real_per_1000_node_days"]),
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


_FAMILIES_MOVED: Final = ("precursor families, their causes and durations are "
                          "forewarn.models.families.PRECURSORS, not parameters")


def _cause(name: str, raw: dict[str, Any]) -> CauseParams:
    if "families" in raw:
        raise ValueError(f"fleet parameters: causes.{name}.families: {_FAMILIES_MOVED}")
    return CauseParams(name=name, weight=float(raw["weight"]),
                       precursor_share=float(raw["precursor_share"]),
                       final_xid=int(raw.get("final_xid", 0)),
                       families=tuple(f for f, fam in PRECURSORS.items() if fam.cause == name))


@dataclasses.dataclass
class FleetData:
    """What :func:`simulate_fleet` returns: samples, XID events, failure labels (with
    each failure's precursor ``family``, ``none`` without one) and the benign behaviour
    families each GPU shows (``node, gpu, behaviour``)."""

    samples: pd.DataFrame
    xids: pd.DataFrame
    labels: pd.DataFrame
    params: FleetParams
    behaviours: pd.DataFrame = dataclasses.field(default_factory=lambda: pd.DataFrame(
        columns=["node", "gpu", "behaviour"]))


def _arrays(p: FleetParams, rng: np.random.Generator, t_count: int) -> NodeArrays:
    """Workload (busy/idle phases shared by the node's GPUs: one job per node at a time),
    the temperature target it drives, and background counters."""
    g_count = p.gpus_per_node
    dt = p.sample_interval_s
    ns = p.noise_scale
    changes = rng.random(t_count) < p.benign["job_change_per_gpu_day"] * dt / 86400
    phase = np.cumsum(changes)
    levels = np.where(rng.random(phase.max() + 1) < 0.8,
                      rng.uniform(0.75, 1.0, phase.max() + 1), 0.05)
    load = np.clip(np.broadcast_to(levels[phase], (g_count, t_count))
                   + rng.normal(0, 0.03, (g_count, t_count)), 0.0, 1.0)
    a = NodeArrays(
        rng=rng, dt=dt, times=p.start_time + np.arange(t_count) * dt, load=load,
        temp_target=32.0 + rng.normal(0, 2, (g_count, 1)) + 45.0 * load,
        power_extra_sd=np.zeros((g_count, t_count)),
        ecc=np.zeros((g_count, t_count), np.int64),
        remap=np.zeros((g_count, t_count), np.int64),
        remap_pending=np.zeros((g_count, t_count), bool),
        pcie=np.zeros((g_count, t_count), np.int64),
        width_drop=np.zeros((g_count, t_count), bool),
        nvl_crc=np.zeros((g_count, N_LINKS, t_count), np.int64),
        nvl_replay=np.zeros((g_count, N_LINKS, t_count), np.int64),
        keep=np.ones((g_count, t_count), bool), xids=[], tags=[set() for _ in range(g_count)],
    )
    some = rng.random((g_count, 1)) < 0.2  # most healthy GPUs see no background errors
    a.ecc += a.poisson(p.background_ecc_per_hour * ns * some, (g_count, t_count))
    a.pcie += a.poisson(p.background_pcie_per_hour * ns * some, (g_count, t_count))
    a.nvl_crc[:, 0] += a.poisson(p.background_nvlink_per_hour * ns, (g_count, t_count))
    return a


def _benign(p: FleetParams, a: NodeArrays, fleet_rng: np.random.Generator) -> None:
    """Every benign family at this fleet's prevalence (drawn once per fleet around the
    parameter file's, lognormal with ``prevalence_sigma``) times ``noise_scale``."""
    b = p.benign
    spread = b.get("prevalence_sigma", 0.0)
    for name, fn in BENIGN.items():
        level = b[name] * p.noise_scale * float(fleet_rng.lognormal(0.0, spread))
        fn(a, min(level, 1.0) if name in _SHARES else level)
    for g, s in _positions(a, b["app_xid_per_gpu_day"]):
        a.xid(g, s, int(a.rng.choice([13, 31, 43])))


_SHARES: Final = frozenset({"ecc_trickle", "pcie_creep", "hot_gpu", "telemetry_gaps"})
"""Benign families whose value is a share of GPUs (the others are rates)."""


def _positions(a: NodeArrays, per_gpu_day: float) -> list[tuple[int, int]]:
    g_count, t_count = a.keep.shape
    n = a.rng.poisson(per_gpu_day * t_count * a.dt / 86400 * g_count)
    return [(int(a.rng.integers(g_count)), int(a.rng.integers(t_count))) for _ in range(n)]


def _failures(p: FleetParams, a: NodeArrays, node: str, node_idx: int
              ) -> tuple[list[dict[str, Any]], np.ndarray, np.ndarray, np.ndarray]:
    """Draw failures and write their precursors; (labels, end step, state lost, DBE)."""
    rng, dt = a.rng, a.dt
    g_count, t_count = a.keep.shape
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
        family, minutes, xid = "none", 0.0, cause.final_xid
        share, choices = cause.precursor_share, cause.families
        if p.balanced_families:
            share, choices = 0.8, tuple(PRECURSORS)
        if choices and rng.random() < share:
            family = str(rng.choice(choices))
            kind = PRECURSORS[family]
            minutes = max(p.min_minutes,
                          float(rng.lognormal(np.log(kind.median_min), kind.sigma))
                          ) * p.precursor_scale
            strength = float(rng.lognormal(0.0, p.strength_sigma))
            s = max(0, f_step - max(1, round(minutes * 60 / dt)))
            kind.write(a, g, s, f_step, strength)
            xid = kind.xid
        end_step[g] = f_step + 1
        a.keep[g, f_step] = True  # the failure itself is recorded
        if xid:
            a.xid(g, f_step, xid)
        state_lost[g], dbe[g] = _failure_effect(xid)
        labels.append({
            "node": node, "gpu": g, "uuid": f"GPU-{node_idx:04d}-{g}",
            "time": float(a.times[f_step]), "cause": cause.name, "had_precursor": minutes > 0,
            "precursor_minutes": minutes, "family": family,
        })
    return labels, end_step, state_lost, dbe


def _failure_effect(xid: int) -> tuple[bool, bool]:
    """(the GPU is lost, it has a double-bit error) after a failure raising ``xid``: a
    fatal bus or GSP XID leaves a GPU that no longer answers (``state = lost``), a fatal
    memory XID an uncorrectable ECC error; others (NVLink, none) neither."""
    c = classify_xid(xid)
    return c.fatal and c.cls in ("bus", "gsp"), c.fatal and c.cls == "memory"


def _simulate_node(p: FleetParams, node_idx: int) -> tuple[
        pd.DataFrame, list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    rng = np.random.default_rng([p.seed, node_idx])
    g_count = p.gpus_per_node
    dt = p.sample_interval_s
    t_count = round(p.days * 86400 / dt)
    node = f"node{node_idx:04d}"
    a = _arrays(p, rng, t_count)
    _benign(p, a, np.random.default_rng([p.seed, 10**6]))  # same draws on every node
    capped = rng.random() < p.benign["power_capped_node_share"]
    if capped:
        for tags in a.tags:
            tags.add("power_cap")
    labels, end_step, state_lost, dbe = _failures(p, a, node, node_idx)
    times = a.times

    # Temperature: AR(1) lag toward the target, plus noise.
    lag = np.exp(-dt / 120.0)
    noise = rng.normal(0, p.temperature_ar_sd_c * p.noise_scale, (g_count, t_count))
    temp = lfilter([1 - lag], [1, -lag], a.temp_target + noise / (1 - lag), axis=1,
                   zi=(a.temp_target[:, :1] * lag))[0]
    slowdown = 87.0 + rng.normal(0, 1.5, (g_count, 1))
    margin = slowdown - temp
    limit = 500.0 if capped else 700.0
    demand = 700.0 * (0.1 + 0.85 * a.load) \
        + rng.normal(0, 1, (g_count, t_count)) * 700.0 * (p.power_sd_frac * p.noise_scale
                                                           + a.power_extra_sd)
    power = np.clip(np.minimum(demand, limit), 30.0, None)
    throttle = np.where(a.load < 0.2, IDLE, 0) | np.where(demand > limit, SW_POWER_CAP, 0) \
        | np.where(margin < 3.0, SW_THERMAL, 0) \
        | np.where(margin < 0.0, HW_THERMAL | HW_SLOWDOWN, 0)

    ecc = np.cumsum(a.ecc, axis=1)
    uncorr = np.zeros((g_count, t_count), np.int64)
    uncorr[dbe, :] = (np.arange(t_count)[None, :] >= (end_step[dbe] - 1)[:, None])
    remap_c = np.cumsum(a.remap, axis=1)
    pcie = np.cumsum(a.pcie, axis=1)
    width = np.where(a.width_drop, 8, 16)
    crc = np.cumsum(a.nvl_crc, axis=2)
    rep = np.cumsum(a.nvl_replay, axis=2)

    keep = (np.arange(t_count)[None, :] < end_step[:, None]) & a.keep
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
        "remap_pending": a.remap_pending[gi, ti],
        "remap_failure": False,
        "retired_pages_sbe": 0,
        "retired_pages_dbe": 0,
        "retired_pages_pending": False,
        "pcie_replay_total": pcie[gi, ti],
        "pcie_link_width": width[gi, ti].astype(np.int64),
        "pcie_link_width_max": 16,
    })
    for link in range(N_LINKS):
        df[f"nvlink{link}_crc_flit"] = crc[gi, link, ti]
        df[f"nvlink{link}_replay"] = rep[gi, link, ti]
    xids = [
        {"node": node, "gpu": g, "time": t, "code": c, "text": ""}
        for g, t, c in a.xids if t <= times[end_step[g] - 1]
    ]
    behaviours = [{"node": node, "gpu": g, "behaviour": b}
                  for g in range(g_count) for b in sorted(a.tags[g])]
    return df, xids, labels, behaviours


def simulate_fleet(params: FleetParams) -> FleetData:
    """Simulate the fleet described by ``params`` (deterministic for a given seed)."""
    frames, xids, labels, behaviours = [], [], [], []
    for node_idx in range(params.nodes):
        df, x, lab, beh = _simulate_node(params, node_idx)
        frames.append(df)
        xids.extend(x)
        labels.extend(lab)
        behaviours.extend(beh)
    samples = pd.concat(frames, ignore_index=True)
    xid_df = pd.DataFrame(xids, columns=["node", "gpu", "time", "code", "text"]).rename(
        columns={"code": "xid", "text": "xid_text"})  # the agent's replay events columns
    xid_df = xid_df.sort_values(["time", "node", "gpu"], ignore_index=True)
    label_df = pd.DataFrame(labels, columns=["node", "gpu", "uuid", "time", "cause",
                                             "had_precursor", "precursor_minutes", "family"])
    return FleetData(samples=samples, xids=xid_df, labels=label_df, params=params,
                     behaviours=pd.DataFrame(behaviours, columns=["node", "gpu", "behaviour"]))


def write_fleet(data: FleetData, out_dir: str | Path) -> dict[str, Path]:
    """Write ``samples.parquet``, ``xids.parquet``, ``labels.csv`` and
    ``behaviours.csv`` under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"samples": out / "samples.parquet", "xids": out / "xids.parquet",
             "labels": out / "labels.csv", "behaviours": out / "behaviours.csv"}
    data.behaviours.to_csv(paths["behaviours"], index=False)
    data.samples.to_parquet(paths["samples"], index=False)
    data.xids.to_parquet(paths["xids"], index=False)
    data.labels.to_csv(paths["labels"], index=False)
    return paths
