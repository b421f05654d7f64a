"""Windowed features per GPU (and per rank), computed the same way in batch and live.

Samples are folded onto a 60 s grid per GPU (:data:`GRID_S`). Each grid row holds
*cumulative* state: counters as NVML reports them (correctable ECC, remapped rows, retired
pages, PCIe replays, NVLink CRC/replay/recovery summed over links) and running sums of
gauges (temperature, slowdown margin, power, power squared, throttle-reason and
remap-pending sample counts, XIDs by class). Every feature is then a difference between
the current row and the row :data:`LAGS` grid steps earlier -- a rate, a mean, a variance,
a fraction -- so :func:`derive` computes the same numbers from a pandas table (training)
and from a ring buffer of the last hour (:mod:`forewarn.models.live`), vectorised over all
GPUs in both cases.

Windows: 5, 15 and 60 minutes. Rates are counts per window (``log1p``) *beyond the GPU's
own long-run baseline*: the GPU's rate from its first grid row to the last
:data:`BASELINE_BLOCK` boundary but one (4 to 8 hours back, so that a precursor of a few
hours does not leak into it), once that spans :data:`BASELINE_MIN_MINUTES` and is at least
:data:`CHRONIC_PER_HOUR`, is
subtracted from each window with a generous Poisson allowance (a steady trickle of
correctable ECC is common on healthy GPUs in real fleets and normal for that GPU: issue
17); active minutes likewise. Acceleration is the last 5 minutes' excess rate against the
hour's; temperature level, 5-vs-15 minute slope and
excursion from the hour's mean; slowdown margin; throttle fractions (thermal:
``SW_THERMAL``/``HW_THERMAL``/``HW_SLOWDOWN``, power: ``SW_POWER_CAP``/``HW_POWER_BRAKE``,
nvmlClocksEventReasons bits); power standard deviation over 15 minutes as a share of the
limit; XID counts by class over the hour (classes as in the agent's XID check, after
NVIDIA's catalog, docs/reference.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import numpy as np
import pandas as pd

from forewarn.gpu import POWER_BITS, THERMAL_BITS, XID_CATALOG
from forewarn.models.gauges import (
    RECENT_GAUGES,
    gauge_levels,
    own_levels,
    peer_deviation,
    recent_vs_own,
    window_mean,
)
from forewarn.models.oscillation import HISTORY_COLUMNS, History, oscillation_vs_peers
from forewarn.models.schema import nvlink_sums, validate_samples, validate_xids

__all__ = [
    "BASELINE_BLOCK",
    "BASELINE_MIN_MINUTES",
    "CHRONIC_PER_HOUR",
    "CUM_COLUMNS",
    "FEATURE_NAMES",
    "GAUGES",
    "GRID_S",
    "LAGS",
    "LAST_COLUMNS",
    "LEGACY_NAMES",
    "PEER_MINUTES",
    "XID_CLASSES",
    "derive",
    "gpu_features",
    "grid_state",
    "peer_deviation",
    "rank_features",
    "xid_class",
]

GRID_S: Final = 60.0
"""Feature grid step in seconds."""
LAGS: Final = (5, 15, 60)
"""Window lengths in grid steps (minutes)."""
BASELINE_BLOCK: Final = 240
"""The baseline ends at the start of the previous block of this many minutes (absolute
minute numbers), i.e. 4 to 8 hours back: precursors of up to a few hours stay out of it."""
BASELINE_MIN_MINUTES: Final = 120
"""History (up to the baseline's end) a GPU needs before its own baseline rate is used."""
CHRONIC_PER_HOUR: Final = 1.0
"""A baseline is used only when errors came in at least this many distinct minutes per
hour: a stray error now and then, or a one-off burst, is not a chronic behaviour, and a
clean GPU's features stay as they were."""

COUNTERS: Final = (
    "ecc", "ecc_unc", "remap_c", "remap_u", "ret_sbe", "ret_dbe", "pcie",
    "nvl_crc", "nvl_replay", "nvl_recovery",
)
SUMS: Final = ("n", "temp", "temp2", "margin", "power", "power2", "thr_thermal", "thr_power",
               "pending")
_RATE_COUNTERS: Final = ("ecc", "remap_c", "ret_sbe", "pcie", "nvl_crc", "nvl_replay",
                         "nvl_recovery")
ACTIVE: Final = _RATE_COUNTERS
"""Counters whose *active minutes* (minutes with any increment) are counted -- every
counter the features rate: a burst that leads nowhere is short, a precursor persists, and
the active minutes tell a chronic trickle (its own baseline) from a one-off burst."""
XID_CLASSES: Final = ("application", "memory", "interconnect", "bus", "gsp", "other")
CUM_COLUMNS: Final = COUNTERS + SUMS + tuple(f"xid_{c}" for c in XID_CLASSES) \
    + tuple(f"{c}_active" for c in ACTIVE)
"""Cumulative grid columns: features are differences of these between lags."""
LAST_COLUMNS: Final = ("temp_last", "margin_last", "limit_last", "width_ratio")
"""Latest-value grid columns."""


_XID_CLASS: Final = {code: c.cls for code, c in XID_CATALOG.items()}

GAUGES: Final = ("temp", "temp_std", "margin", "power", "power_std", "thr_thermal",
                  "thr_power", "pending", "samples")
"""Gauge signals compared with the GPU's own long-run level and with its node peers."""
PEER_COUNTERS: Final = _RATE_COUNTERS
"""Counter rates compared with the node peers' (a node-wide event moves them all)."""
PEER_MINUTES: Final = 15
"""A GPU counts as a peer at a grid row when it sent a sample in the last this many
minutes (from the grid itself, so batch and live agree); a quiet GPU's own peer
deviation is zero."""


def xid_class(code: int) -> str:
    """The class of an XID code (same classes as the agent's XID check)."""
    return _XID_CLASS.get(int(code), "other")


def _feature_names() -> tuple[str, ...]:
    names: list[str] = []
    for c in _RATE_COUNTERS:
        names += [f"{c}_d5", f"{c}_d15", f"{c}_d60", f"{c}_accel"]
    names += [f"{c}_{k}" for c in ACTIVE for k in ("active15", "active60", "conc15")]
    names += ["baseline_hours", "remap_u_total", "pending_frac60", "temp_slope",
              "temp_excursion",
              "power_std15", "width_ratio", "samples_missing5", "samples_missing15"]
    names += [f"{g}_vs_own" for g in GAUGES]
    names += [f"{g}_vs_peers" for g in GAUGES] + ["samples_missing15_vs_peers"]
    names += [f"{g}_vs_own_vs_peers" for g in GAUGES]
    names += [f"{g}_recent_vs_own_vs_peers" for g in RECENT_GAUGES] + ["temp_osc_vs_peers"]
    names += [f"{c}_vs_peers" for c in PEER_COUNTERS]
    names += [f"xid_{c}_60" for c in XID_CLASSES]
    return tuple(names)


FEATURE_NAMES: Final = _feature_names()
"""Order of the feature vector the models see."""
LEGACY_NAMES: Final = ("remap_c_total", "ret_sbe_total", "temp_mean5", "margin_mean5",
                       "margin_last", "thr_thermal_frac15", "thr_thermal_frac60",
                       "thr_power_frac15")
"""Level features of models trained before every feature became a change against the
GPU's own baseline or its peers (issue 17): still computed, so such a model (the shipped
one) keeps working; new models are not trained on them."""


def baseline_end(minute: np.ndarray) -> np.ndarray:
    """The absolute minute the own baseline of a row at ``minute`` ends at."""
    out: np.ndarray = (minute // BASELINE_BLOCK - 1) * BASELINE_BLOCK
    return out


def _baseline_rate(first: Mapping[str, np.ndarray], end: Mapping[str, np.ndarray],
                   minutes: np.ndarray, col: str) -> np.ndarray:
    """The GPU's own per-minute rate of ``col`` from its first row to the baseline's end
    row; zero until that spans :data:`BASELINE_MIN_MINUTES`, for counters without active
    minutes, and unless errors came in at least :data:`CHRONIC_PER_HOUR` distinct minutes
    an hour: a one-off burst is not a chronic behaviour."""
    if col not in ACTIVE:
        return np.zeros_like(minutes)
    a = f"{col}_active"
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.maximum(end[col] - first[col], 0.0) / minutes
        active = np.maximum(end[a] - first[a], 0.0) / minutes
    chronic = (minutes >= BASELINE_MIN_MINUTES) & (active * 60.0 >= CHRONIC_PER_HOUR)
    out: np.ndarray = np.where(chronic, r, 0.0)
    return out


def _excess(d: np.ndarray, rate: np.ndarray, window: float) -> np.ndarray:
    """Count ``d`` in a ``window``-minute window beyond what the baseline ``rate``
    explains: beyond the Poisson upper bound (sqrt(mu) + 2.5)^2, about five standard
    deviations on the square-root (variance-stabilised) scale, so that even at a few
    errors per hour a fleet of 100,000 GPUs rarely sees a chance excess. No baseline
    (rate 0): the count as it is."""
    mu = rate * window
    out: np.ndarray = np.where(mu > 0, np.maximum(d - (np.sqrt(mu) + 2.5) ** 2, 0.0), d)
    return out


def _active(c: str, now: Mapping[str, np.ndarray], l15: Mapping[str, np.ndarray],
            l60: Mapping[str, np.ndarray], d15: np.ndarray, d60: np.ndarray
            ) -> dict[str, np.ndarray]:
    """Active-minute features of counter ``c`` given its excess counts over 15 and 60
    minutes. Active minutes count only as far as there are errors beyond the baseline: a
    trickle is active every minute and that is its normal."""
    a = f"{c}_active"
    active15 = np.minimum(np.maximum(now[a] - l15[a], 0.0), d15)
    return {
        f"{c}_active15": active15,
        f"{c}_active60": np.minimum(np.maximum(now[a] - l60[a], 0.0), d60),
        # Concentration: errors per active minute. A burst packs many errors into a few
        # minutes; a precursor spreads a growing rate over many.
        f"{c}_conc15": np.log1p(d15 / np.maximum(active15, 1.0)),
    }


def _finite(x: np.ndarray) -> np.ndarray:
    """A float64 copy of ``x`` with NaN as 0 and infinities as the largest floats
    (:func:`numpy.nan_to_num`, whose passes are skipped when all is finite: the usual
    case)."""
    x = np.asarray(x, dtype=np.float64)
    out: np.ndarray = x.copy() if np.isfinite(x).all() else np.nan_to_num(x)
    return out


def derive(now: Mapping[str, np.ndarray], lag: Mapping[int, Mapping[str, np.ndarray]],
           first: Mapping[str, np.ndarray] | None = None,
           end: Mapping[str, np.ndarray] | None = None,
           minutes: np.ndarray | None = None,
           group: np.ndarray | None = None,
           history: History | None = None) -> dict[str, np.ndarray]:
    """Features from the current grid row (cumulative and latest columns), the rows
    :data:`LAGS` steps back and, for the GPU's own baseline, its first grid row, the row
    at :func:`baseline_end` and the ``minutes`` between them (without them: no
    baseline), and the peer ``group`` of each row (integer codes: the rows of one node at
    one time; without it: no peer deviation) and ``history`` (:mod:`.oscillation`; without
    it: none). Arrays are aligned (one element per GPU or per grid row)."""
    out: dict[str, np.ndarray] = {}
    l5, l15, l60 = lag[5], lag[15], lag[60]
    zero = np.zeros_like(np.asarray(now["n"], dtype=np.float64))
    for c in _RATE_COUNTERS:
        r = zero if first is None or end is None or minutes is None \
            else _baseline_rate(first, end, minutes, c)
        d5 = _excess(np.maximum(now[c] - l5[c], 0.0), r, 5.0)
        d15 = _excess(np.maximum(now[c] - l15[c], 0.0), r, 15.0)
        d60 = _excess(np.maximum(now[c] - l60[c], 0.0), r, 60.0)
        out[f"{c}_d5"] = np.log1p(d5)
        out[f"{c}_d15"] = np.log1p(d15)
        out[f"{c}_d60"] = np.log1p(d60)
        # Acceleration: per-minute rate in the last 5 minutes vs the 55 before.
        out[f"{c}_accel"] = np.log1p(d5 / 5.0) - np.log1p(np.maximum(d60 - d5, 0.0) / 55.0)
        if c in ACTIVE:
            out |= _active(c, now, l15, l60, d15, d60)
    # How much own history the baseline rests on (0: none yet, raw counts above): a
    # model must tell "many errors on a GPU it knows" from "on a GPU it just met".
    out["baseline_hours"] = zero if minutes is None else np.where(
        minutes >= BASELINE_MIN_MINUTES, np.minimum(minutes, 48 * 60.0) / 60.0, 0.0)
    out["remap_u_total"] = np.log1p(np.maximum(now["remap_u"], 0.0))
    n60 = np.maximum(now["n"] - l60["n"], 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        out["pending_frac60"] = np.where(n60 > 0, (now["pending"] - l60["pending"]) / n60, 0.0)
    t_last = now["temp_last"]
    t5 = window_mean(now["temp"], l5["temp"], now["n"], l5["n"], t_last)
    t5_15 = window_mean(l5["temp"], l15["temp"], l5["n"], l15["n"], t5)
    t60 = window_mean(now["temp"], l60["temp"], now["n"], l60["n"], t5)
    out["temp_slope"] = t5 - t5_15
    out["temp_excursion"] = t5 - t60
    limit = np.where(now["limit_last"] > 0, now["limit_last"], 1.0)
    level = gauge_levels(now, l5, l15, limit, t5)
    out["power_std15"] = level["power_std"]
    out["width_ratio"] = now["width_ratio"]
    # Missing telemetry: the sample rate of the last 5 / 15 minutes against the GPU's own
    # long-run rate (or, before it has one, the hour's): a GPU about to fall off the bus
    # often goes quiet first (NVML calls time out), so samples thin out.
    own = None if first is None or end is None or minutes is None \
        else own_levels(first, end, minutes, limit, BASELINE_MIN_MINUTES)
    ref = np.maximum(now["n"] - l60["n"], 0.0) / 60.0
    if own is not None:
        ref = np.where(own["_has"] > 0, own["samples"], ref)
    with np.errstate(invalid="ignore", divide="ignore"):
        for k, lag_k in ((5, l5), (15, l15)):
            rate = np.maximum(now["n"] - lag_k["n"], 0.0) / k
            out[f"samples_missing{k}"] = np.where(ref > 0, np.clip(1.0 - rate / ref, 0, 1), 0.0)
    # Against its own long-run level: a GPU that always runs hot, throttles or draws much
    # power is normal for that GPU; what changed is what counts.
    for g in GAUGES:
        if own is None:
            out[f"{g}_vs_own"] = zero
        elif g == "samples":
            with np.errstate(invalid="ignore", divide="ignore"):
                out[f"{g}_vs_own"] = np.where((own["_has"] > 0) & (own[g] > 0),
                                              level[g] / own[g] - 1.0, 0.0)
        else:
            out[f"{g}_vs_own"] = np.where(own["_has"] > 0, level[g] - own[g], 0.0)
    # Against the node's other GPUs at the same time (Minder, docs/reference.md): a
    # node-wide event (cooling, power capping, the host's PCIe, an agent restart) moves
    # every GPU of the node and is no precursor of one GPU's failure.
    peer_in = {f"{g}_vs_peers": level[g] for g in GAUGES}
    # The share of its own usual samples a GPU missed over 15 minutes beyond the share its
    # peers missed of theirs: a GPU going quiet before it falls off the bus, while a
    # node-wide gap (agent restart, congested network) reads zero.
    peer_in["samples_missing15_vs_peers"] = out["samples_missing15"]
    # Its change against its own level beyond its peers' change against theirs: a node's
    # workload moves every GPU's gauges together and reads zero, and so does what is
    # chronic for the GPU (one that always runs hot or noisy); what changed for this GPU
    # alone stands out (a thermal interface failing, a fan hunting, power hiccups).
    peer_in |= {f"{g}_vs_own_vs_peers": out[f"{g}_vs_own"] for g in GAUGES}
    # The same over the hours since the baseline's end: what lasts (a drift over days).
    if own is not None and end is not None:
        peer_in |= {f"{k}_vs_peers": v for k, v in recent_vs_own(now, end, own, limit).items()}
    peer_in |= {f"{c}_vs_peers": out[f"{c}_d15"] for c in PEER_COUNTERS}
    member = (now["n"] - lag[PEER_MINUTES]["n"]) > 0
    out |= peer_deviation(peer_in, None if group is None else np.where(member, group, -1),
                          PEER_COUNTERS)
    # A GPU without its own baseline changed against nothing: beside peers below theirs
    # (an idle node, 15-minute swings under the long-run ones) zero minus their median
    # would read as its own rise, and a GPU swapped in would alarm for hours.
    has_own = zero if own is None else own["_has"] > 0
    for name in [f"{g}_vs_own_vs_peers" for g in GAUGES] \
            + [f"{g}_recent_vs_own_vs_peers" for g in RECENT_GAUGES]:
        out[name] = np.where(has_own, out.get(name, zero), 0.0)
    out["temp_osc_vs_peers"] = zero if history is None else oscillation_vs_peers(
        history, None if group is None else np.where(member, group, -1))
    for c in XID_CLASSES:
        out[f"xid_{c}_60"] = np.maximum(now[f"xid_{c}"] - l60[f"xid_{c}"], 0.0)
    out["remap_c_total"] = np.log1p(np.maximum(now["remap_c"], 0.0))
    out["ret_sbe_total"] = np.log1p(np.maximum(now["ret_sbe"], 0.0))
    out["temp_mean5"] = t5
    out["margin_mean5"] = level["margin"]
    out["margin_last"] = now["margin_last"]
    out["thr_thermal_frac15"] = level["thr_thermal"]
    out["thr_thermal_frac60"] = window_mean(now["thr_thermal"], l60["thr_thermal"], now["n"],
                                      l60["n"], zero)
    out["thr_power_frac15"] = level["thr_power"]
    return {k: _finite(out[k]) for k in FEATURE_NAMES + LEGACY_NAMES}


def _num(df: pd.DataFrame, col: str, default: float = 0.0) -> pd.Series:
    if col not in df.columns:
        return pd.Series(default, index=df.index, dtype=np.float64)
    return pd.to_numeric(df[col], errors="coerce").astype(np.float64)


def _row_values(samples: pd.DataFrame) -> pd.DataFrame:
    """Per-sample values that fold onto the grid (one column per grid quantity)."""
    s = samples
    thr = _num(s, "throttle_reasons").fillna(0).astype(np.int64)
    temp, margin = _num(s, "temperature_c"), _num(s, "slowdown_margin_c")
    power = _num(s, "power_w")
    n = (temp.notna() | power.notna()).astype(np.float64)
    # A counted sample without a temperature (or margin) counts at the GPU's last one: a
    # read that failed is no 0 C minute (it would read as a swing); margins without one add.
    gpu = [s["node"], s["gpu"]]
    held_t = temp.groupby(gpu).ffill().fillna(0) * n
    held_m = margin.fillna(margin.groupby(gpu).ffill().fillna(0) * n)
    width, width_max = _num(s, "pcie_link_width"), _num(s, "pcie_link_width_max")
    v = pd.DataFrame({
        "node": s["node"], "gpu": s["gpu"],
        "minute": np.floor(s["time"].to_numpy() / GRID_S).astype(np.int64),
        "ecc": _num(s, "ecc_corrected_volatile"),
        "ecc_unc": _num(s, "ecc_uncorrected_volatile"),
        "remap_c": _num(s, "remapped_rows_correctable"),
        "remap_u": _num(s, "remapped_rows_uncorrectable"),
        "ret_sbe": _num(s, "retired_pages_sbe"),
        "ret_dbe": _num(s, "retired_pages_dbe"),
        "pcie": _num(s, "pcie_replay_total"),
        **nvlink_sums(s),
        "n": n, "temp": held_t, "temp2": held_t ** 2, "margin": held_m,
        "power": power.fillna(0), "power2": power.fillna(0) ** 2,
        "thr_thermal": ((thr & THERMAL_BITS) != 0).astype(np.float64),
        "thr_power": ((thr & POWER_BITS) != 0).astype(np.float64),
        "pending": _num(s, "remap_pending").fillna(0).clip(0, 1),
        "temp_last": temp, "margin_last": margin,
        "limit_last": _num(s, "power_limit_w"),
        "width_ratio": (width / width_max.where(width_max > 0)).where(width.notna()),
    })
    return v


def _inline_xids(samples: pd.DataFrame) -> pd.DataFrame | None:
    """XIDs carried in the samples file's ``xid`` column (the replay format)."""
    if "xid" not in samples.columns:
        return None
    code = pd.to_numeric(samples["xid"], errors="coerce")
    sel = code.notna()
    if not sel.any():
        return None
    return pd.DataFrame({"node": samples.loc[sel, "node"], "gpu": samples.loc[sel, "gpu"],
                         "time": samples.loc[sel, "time"],
                         "code": code[sel].astype(np.int64)})


def grid_state(samples: pd.DataFrame, xids: pd.DataFrame | None = None,
               tail: int = 0) -> pd.DataFrame:
    """Samples (and XIDs) on the per-GPU 60 s grid of cumulative state: a row per GPU per
    minute from its first sample to ``tail`` minutes after its last (``_tail`` True there),
    columns ``node, gpu, minute`` + :data:`CUM_COLUMNS` + :data:`LAST_COLUMNS`, sorted by
    GPU then minute. Raises :class:`~forewarn.models.schema.DataError` on bad input."""
    samples = validate_samples(samples)
    v = _row_values(samples.sort_values(["node", "gpu", "time"], kind="stable"))
    keys = ["node", "gpu", "minute"]
    agg = {c: "last" for c in COUNTERS} | {c: "sum" for c in SUMS} \
        | {c: "last" for c in LAST_COLUMNS}
    g = v.groupby(keys, sort=True).agg(agg)
    # Regular grid per GPU: every minute from first to last.
    span = g.reset_index().groupby(["node", "gpu"])["minute"].agg(["min", "max"])
    lengths = (span["max"] + tail - span["min"] + 1).to_numpy()
    idx = pd.MultiIndex.from_arrays([
        np.repeat(span.index.get_level_values(0).to_numpy(), lengths),
        np.repeat(span.index.get_level_values(1).to_numpy(), lengths),
        np.concatenate([np.arange(a, b + tail + 1) for a, b in zip(span["min"], span["max"],
                                                                    strict=True)])
        if len(span) else np.array([], np.int64),
    ], names=keys)
    g = g.reindex(idx)
    gid = np.repeat(np.arange(len(span)), lengths)
    by = pd.Series(gid, index=g.index)
    for c in COUNTERS:
        g[c] = g[c].groupby(by).ffill().fillna(0.0)
    for c in SUMS:
        g[c] = g[c].fillna(0.0).groupby(by).cumsum()
    for c in LAST_COLUMNS:
        g[c] = g[c].groupby(by).ffill()
    for c in ACTIVE:
        g[f"{c}_active"] = (g[c].groupby(by).diff() > 0).astype(np.float64).groupby(by).cumsum()
    g["temp_last"] = g["temp_last"].fillna(0.0)
    g["margin_last"] = g["margin_last"].fillna(0.0)
    g["limit_last"] = g["limit_last"].fillna(0.0)
    g["width_ratio"] = g["width_ratio"].fillna(1.0)
    out = g.reset_index()
    for c in XID_CLASSES:
        out[f"xid_{c}"] = 0.0
    inline = _inline_xids(samples)
    if inline is not None:
        xids = inline if xids is None else pd.concat(
            [validate_xids(xids), inline], ignore_index=True)
    if xids is not None and len(xids):
        x = validate_xids(xids)
        x = x.assign(minute=np.floor(x["time"].to_numpy() / GRID_S).astype(np.int64),
                     cls="xid_" + x["code"].map(xid_class))
        counts = x.groupby(["node", "gpu", "minute", "cls"]).size().unstack(fill_value=0)
        counts = counts.reindex(pd.MultiIndex.from_frame(out[keys])).fillna(0.0)
        for col in counts.columns:
            out[col] = counts[col].to_numpy(dtype=np.float64)
        for c in XID_CLASSES:
            out[f"xid_{c}"] = out[f"xid_{c}"].groupby(gid).cumsum()
    out["_gid"] = gid
    out["_tail"] = out["minute"].to_numpy() > np.repeat(span["max"].to_numpy(), lengths)
    return out


def gpu_features(samples: pd.DataFrame, xids: pd.DataFrame | None = None) -> pd.DataFrame:
    """Feature table: one row per GPU per minute, columns ``node, gpu, time`` (end of the
    minute, seconds), :data:`FEATURE_NAMES` and :data:`LEGACY_NAMES`; a GPU's rows end at its
    last sample, but it stays a peer :data:`PEER_MINUTES` longer, as live (and after a gap)."""
    g = grid_state(samples, xids, tail=PEER_MINUTES)
    gid = g["_gid"]
    cols = list(CUM_COLUMNS)
    first = g.groupby(gid)[cols].transform("first")
    lag: dict[int, dict[str, np.ndarray]] = {}
    for k in LAGS:
        shifted = g.groupby(gid)[cols].shift(k).fillna(first)
        lag[k] = {c: shifted[c].to_numpy() for c in cols}
    now = {c: g[c].to_numpy(dtype=np.float64) for c in (*cols, *LAST_COLUMNS)}
    # Own baseline: the row at baseline_end(minute) of the same GPU (the grid is regular).
    minute = g["minute"].to_numpy()
    pos = g.groupby(gid).cumcount().to_numpy()
    first_minute = minute - pos
    span = np.maximum(baseline_end(minute) - first_minute, 0)
    at = np.arange(len(g)) - pos + span
    base = {c: first[c].to_numpy() for c in cols}
    end = {c: g[c].to_numpy(dtype=np.float64)[at] for c in cols}
    group = pd.MultiIndex.from_arrays([g["node"], minute]).factorize()[0]
    cum = {c: g[c].to_numpy(dtype=np.float64) for c in HISTORY_COLUMNS}

    def history(k: int) -> dict[str, np.ndarray]:  # the grid k minutes back, as lag does
        return {c: v[np.arange(len(g)) - np.minimum(pos, k)] for c, v in cum.items()}

    feats = derive(now, lag, base, end, span.astype(np.float64), group, history)
    out = pd.DataFrame(feats)
    out.insert(0, "time", (g["minute"].to_numpy() + 1) * GRID_S)
    out.insert(0, "gpu", g["gpu"].to_numpy())
    out.insert(0, "node", g["node"].to_numpy())
    return out[~g["_tail"].to_numpy()].reset_index(drop=True)


def rank_features(steps: pd.DataFrame, bucket_s: float = 10.0) -> pd.DataFrame:
    """Per-rank features against the job's peers, one row per rank per ``bucket_s``.

    Input columns: ``job, rank, time, step_seconds, loss, grad_norm`` (hook step records).
    Output: ``step_ratio`` (rank's median step time / median over the job's ranks),
    ``loss_z`` and ``grad_norm_z`` (robust z-scores across the job's ranks: (x - median)
    / (1.4826 * MAD)).
    """
    need = ("job", "rank", "time", "step_seconds", "loss", "grad_norm")
    missing = [c for c in need if c not in steps.columns]
    if missing:
        from forewarn.models.schema import DataError

        raise DataError(f"steps: missing column(s) {', '.join(missing)}")
    s = steps.assign(bucket=np.floor(steps["time"] / bucket_s).astype(np.int64))
    per = s.groupby(["job", "bucket", "rank"])[["step_seconds", "loss", "grad_norm"]].median()
    per = per.reset_index()
    grp = per.groupby(["job", "bucket"])
    out = per[["job", "bucket", "rank"]].copy()
    out["time"] = (out["bucket"] + 1) * bucket_s
    med_step = grp["step_seconds"].transform("median")
    out["step_ratio"] = per["step_seconds"] / med_step.where(med_step > 0)
    for col in ("loss", "grad_norm"):
        med = grp[col].transform("median")
        mad = (per[col] - med).abs().groupby([per["job"], per["bucket"]]).transform("median")
        scale = 1.4826 * mad
        out[f"{col}_z"] = ((per[col] - med) / scale.where(scale > 0)).fillna(0.0)
    return out.drop(columns="bucket")
