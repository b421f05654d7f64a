"""Robust rolling z-score per series: the baseline anomaly detector.

For each subject and series, z = (x - rolling median) / (1.4826 x rolling MAD) over the
previous ``window`` points (the current point excluded, so a spike cannot hide itself).
A point with ``|z| >= threshold`` is anomalous; the median/MAD pair is robust to the very
outliers it is looking for. Vectorised with pandas rolling windows per subject.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from forewarn.wire import Finding, Health, Subject, SuggestedAction

__all__ = ["RobustZScore"]


class RobustZScore:
    """Rolling robust z-scores per (node, gpu) series of a feature or sample table.

    Args:
        columns: the series to watch (e.g. ``temperature_c``, ``ecc_d5``).
        window: points in the rolling baseline.
        threshold: ``|z|`` at or above which a point is anomalous.
        min_mad: floor of the MAD, in the series' units, so a flat series does not turn
            the smallest wiggle into an anomaly.
    """

    name = "models.robust_zscore"

    def __init__(self, columns: Sequence[str], window: int = 60, threshold: float = 6.0,
                 min_mad: float | dict[str, float] = 0.5) -> None:
        self.columns = tuple(columns)
        self.window = window
        self.threshold = threshold
        self.min_mad = min_mad

    def zscores(self, table: pd.DataFrame) -> pd.DataFrame:
        """``node, gpu, time`` and one ``<column>_z`` per watched column."""
        t = table.sort_values(["node", "gpu", "time"], kind="stable")
        keys = [t["node"], t["gpu"]]
        out = t[["node", "gpu", "time"]].copy()
        for c in self.columns:
            prev = t[c].astype(np.float64).groupby(keys).shift(1)
            roll = prev.groupby(keys).rolling(self.window, min_periods=max(5, self.window // 4))
            med = roll.median().reset_index(level=[0, 1], drop=True)
            dev = (prev - med).abs()
            mad = dev.groupby(keys).rolling(self.window, min_periods=max(5, self.window // 4)) \
                .median().reset_index(level=[0, 1], drop=True)
            floor = self.min_mad[c] if isinstance(self.min_mad, dict) else self.min_mad
            scale = 1.4826 * np.maximum(mad, floor)
            out[f"{c}_z"] = ((t[c] - med) / scale).fillna(0.0)
        return out

    def findings(self, table: pd.DataFrame, now: float | None = None) -> list[Finding]:
        """One finding per subject whose latest point is anomalous on any series."""
        z = self.zscores(table)
        last = z.groupby(["node", "gpu"], sort=False).tail(1)
        out = []
        zc = [f"{c}_z" for c in self.columns]
        for row in last.itertuples(index=False):
            vals = {c: float(getattr(row, c)) for c in zc}
            worst = max(vals, key=lambda c: abs(vals[c]))
            if abs(vals[worst]) < self.threshold:
                continue
            out.append(Finding(
                check=self.name, health=Health.DEGRADED,
                subject=Subject(kind="gpu", node=str(row.node), gpu=int(row.gpu)),
                reason=f"{worst[:-2]} is {vals[worst]:+.1f} robust SDs from its recent median",
                action=SuggestedAction.WATCH,
                evidence={k[:64]: round(v, 2) for k, v in vals.items()},
                time=float(now if now is not None else row.time),
            ))
        return out
