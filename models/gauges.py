"""Gauge levels now, over the GPU's own long run, and against its node peers.

Helpers of :func:`forewarn.models.features.derive`: every gauge (:data:`GAUGES` there) is
a mean between two cumulative grid rows, so the same arithmetic serves the current window,
the GPU's own baseline (first grid row to the baseline's end) and the comparison with the
node's other GPUs at the same minute.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import numpy as np
import pandas as pd

__all__ = ["MIN_ROBUST_PEERS", "RECENT_GAUGES", "ROUNDING", "gauge_levels", "own_levels",
           "peer_deviation", "peer_robust_z", "recent_vs_own", "window_mean", "window_std"]


def window_mean(sum_a: np.ndarray, sum_b: np.ndarray, n_a: np.ndarray, n_b: np.ndarray,
                fallback: np.ndarray) -> np.ndarray:
    """Mean of a gauge between two cumulative rows (sums ``sum_a - sum_b`` over sample
    counts ``n_a - n_b``); ``fallback`` where no sample came in between."""
    n = n_a - n_b
    with np.errstate(invalid="ignore", divide="ignore"):
        m = (sum_a - sum_b) / n
    return np.where(n > 0, m, fallback)


ROUNDING: Final = 1e-9
"""Variances below this share of the mean square are rounding, not spread: a gauge
constant over a window (a GPU at its power cap) reads a variance of exactly zero in
exact arithmetic, but the difference of two long cumulative sums leaves a residue of a
few ulps whose size depends on the order the sums were taken in (per sample live, per
minute in batch). Left in, a tree's split at zero would turn on that residue. 1e-9 of
the mean square is a standard deviation of 3e-5 of the mean (0.02 W at 600 W), far below
what the models tell apart."""


def window_std(mean_sq: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """Standard deviation from the mean of squares and the mean (of one window), zero
    where the variance is within :data:`ROUNDING` of the mean square."""
    var = mean_sq - mean * mean
    out: np.ndarray = np.sqrt(np.where(var > ROUNDING * np.abs(mean_sq), var, 0.0))
    return out


def gauge_levels(now: Mapping[str, np.ndarray], l5: Mapping[str, np.ndarray],
                  l15: Mapping[str, np.ndarray], limit: np.ndarray, t5: np.ndarray
                  ) -> dict[str, np.ndarray]:
    """The current level of each of :data:`GAUGES` (5- or 15-minute means)."""
    zero = np.zeros_like(t5)
    n = now["n"]
    t15 = window_mean(now["temp"], l15["temp"], n, l15["n"], t5)
    t2_15 = window_mean(now["temp2"], l15["temp2"], n, l15["n"], t15 * t15)
    p15 = window_mean(now["power"], l15["power"], n, l15["n"], zero)
    p2_15 = window_mean(now["power2"], l15["power2"], n, l15["n"], zero)
    return {
        "temp": t5,
        "temp_std": window_std(t2_15, t15),
        "margin": window_mean(now["margin"], l5["margin"], n, l5["n"], now["margin_last"]),
        "power": p15 / limit,
        "power_std": window_std(p2_15, p15) / limit,
        "thr_thermal": window_mean(now["thr_thermal"], l15["thr_thermal"], n, l15["n"], zero),
        "thr_power": window_mean(now["thr_power"], l15["thr_power"], n, l15["n"], zero),
        "pending": window_mean(now["pending"], l15["pending"], n, l15["n"], zero),
        "samples": np.maximum(n - l5["n"], 0.0) / 5.0,
    }


def own_levels(first: Mapping[str, np.ndarray], end: Mapping[str, np.ndarray],
               minutes: np.ndarray, limit: np.ndarray, min_minutes: float
               ) -> dict[str, np.ndarray]:
    """The GPU's own long-run level of each of :data:`GAUGES`, from its first grid row to
    the baseline's end row; ``_has`` is 1 where that spans ``min_minutes``
    and holds samples. Standard deviations here are over the whole baseline (workload
    changes included), so a 15-minute one is usually below it."""
    n = end["n"] - first["n"]
    has = (minutes >= min_minutes) & (n > 0)
    zero = np.zeros_like(minutes)

    def mean(col: str) -> np.ndarray:
        return window_mean(end[col], first[col], end["n"], first["n"], zero)

    t, p = mean("temp"), mean("power")
    with np.errstate(invalid="ignore", divide="ignore"):
        samples = np.where(minutes > 0, n / minutes, 0.0)
    return {
        "_has": has.astype(np.float64), "temp": t,
        "temp_std": window_std(mean("temp2"), t),
        "margin": mean("margin"), "power": p / limit,
        "power_std": window_std(mean("power2"), p) / limit,
        "thr_thermal": mean("thr_thermal"), "thr_power": mean("thr_power"),
        "pending": mean("pending"), "samples": samples,
    }


RECENT_GAUGES: Final = ("temp", "temp_std", "margin", "power", "power_std", "thr_thermal",
                         "thr_power", "pending")
"""Gauges compared over the GPU's recent hours with its own baseline (every gauge but the
sample rate, whose window's span the cumulative rows do not hold)."""


def recent_vs_own(now: Mapping[str, np.ndarray], end: Mapping[str, np.ndarray],
                  own: Mapping[str, np.ndarray], limit: np.ndarray) -> dict[str, np.ndarray]:
    """Each of :data:`RECENT_GAUGES` since the own baseline's end (4 to 8 hours back) less
    the GPU's own long-run level (:func:`own_levels`); zero without a baseline. A change that
    lasts (a drift over hours or days, a failing fan) fills the window; a benign hot spell
    of an hour is a small part of it."""
    recent = own_levels(end, now, np.ones_like(own["_has"]), limit, 0.0)
    has = (own["_has"] > 0) & (recent["_has"] > 0)
    return {f"{g}_recent_vs_own": np.where(has, recent[g] - own[g], 0.0)
            for g in RECENT_GAUGES}


def peer_deviation(values: Mapping[str, np.ndarray], group: np.ndarray | None,
                   counters: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Each value minus the median of its ``group`` (the GPUs of one node at one time;
    -1: not a peer, deviation zero); ``samples_vs_peers`` as a ratio to the median, minus
    one. No group: zeros."""
    if group is None or len(group) == 0:
        return {k: np.zeros(len(v)) for k, v in values.items()}
    df = pd.DataFrame(dict(values))
    grouped = df.groupby(group, sort=False)
    med = grouped.transform("median")
    # A GPU without peers (alone on its node, or the others quiet) is compared with what
    # a healthy peer's counters read, zero; its gauges have nothing to compare with.
    alone = (grouped[df.columns[0]].transform("size").to_numpy() == 1) & (group >= 0)
    out: dict[str, np.ndarray] = {}
    for k in values:
        v, m = df[k].to_numpy(), med[k].to_numpy()
        lone = 0.0 if k.removesuffix("_vs_peers") in counters else v
        m = np.where(group >= 0, np.where(alone, lone, m), v)
        if k == "samples_vs_peers":
            with np.errstate(invalid="ignore", divide="ignore"):
                out[k] = np.where(m > 0, v / m - 1.0, 0.0)
        else:
            out[k] = v - m
    return out


MIN_ROBUST_PEERS: Final = 3
"""Members a group needs for a robust z-score: with two, the median is their midpoint and
the MAD half their gap, so each reads |z| <= 0.67 whichever of them moved -- a comparison of
two says that they differ, never which."""


def peer_robust_z(values: Mapping[str, np.ndarray], group: np.ndarray,
                  floors: Mapping[str, float]) -> tuple[dict[str, np.ndarray],
                                                        dict[str, np.ndarray]]:
    """Each value's robust z-score within its ``group`` (e.g. the GPUs of one job at one
    minute), (x - median) / max(1.4826 MAD, floor), and the group's median: ``(z,
    median)``. Rows of group -1, or of a group of fewer than :data:`MIN_ROBUST_PEERS`,
    read z zero. The same grouping as :func:`peer_deviation`, scaled."""
    df = pd.DataFrame(dict(values))
    grouped = df.groupby(group, sort=False)
    med = grouped.transform("median")
    mad = (df - med).abs().groupby(group, sort=False).transform("median")
    size = grouped[df.columns[0]].transform("size").to_numpy()
    ok = (group >= 0) & (size >= MIN_ROBUST_PEERS)
    z: dict[str, np.ndarray] = {}
    for k in values:
        scale = np.maximum(1.4826 * mad[k].to_numpy(), floors[k])
        z[k] = np.where(ok, (df[k].to_numpy() - med[k].to_numpy()) / scale, 0.0)
    return z, {k: med[k].to_numpy() for k in values}
