"""Feature drift: how far the fleet's features now are from what the model was trained on.

A retrained model carries its training distribution (:func:`reference`, in the model's
``metadata["reference"]``): per feature, bin edges at the deciles of the training values
(duplicates removed, so a feature that is mostly zero gets a bin of its own for zero) and
the share of training rows in each bin, ``(-inf, e0], (e0, e1], ..., (ek, inf)``. Drift is
the population stability index of the current rows over the same bins:
``PSI = sum((a - e) * ln(a / e))`` over bins, shares floored at ``1e-4``. The current
shares ``a`` start from the reference as if :data:`PRIOR_ROWS` rows had been seen
(``a = (counts + PRIOR_ROWS * e) / (n + PRIOR_ROWS)``): a small fleet's few dozen rows
leave most bins empty by chance, and an empty bin is no evidence of a shift; with
thousands of rows the prior weighs nothing. Usual reading:
below 0.1 stable, 0.1 to 0.25 moving, above :data:`DRIFTED` drifted (the model sees data
unlike what it learned from: retrain, and judge the candidate on the shadow gate).

Only rows of GPUs whose own baseline is learned (``baseline_hours > 0``) are compared, on
both sides: in its first hours a GPU reads zero against its own level, and how many GPUs
are that young depends on when the collector started, not on the fleet. For the same
reason ``baseline_hours`` itself (the GPU's time in the store, capped at two days) is not
measured (:data:`UNMEASURED`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np
import pandas as pd

__all__ = ["DRIFTED", "PRIOR_ROWS", "UNMEASURED", "bin_counts", "psi", "psi_of_counts", "reference",
           "steady_rows"]

DRIFTED: Final = 0.25
"""PSI above which a feature counts as drifted."""

UNMEASURED: Final = frozenset({"baseline_hours"})
"""Features whose drift says nothing about the fleet (see the module docstring)."""

PRIOR_ROWS: Final = 100.0
"""Rows' worth of the reference the current shares start from (module docstring)."""

_FLOOR = 1e-4
_QUANTILES = np.linspace(0.1, 0.9, 9)


def reference(features: pd.DataFrame, names: Sequence[str], max_rows: int = 200_000,
              seed: int = 0) -> dict[str, Any]:
    """The training distribution of ``names`` in ``features`` (a plain dict, stored in the
    model file): ``{"rows": n, "features": {name: {"edges": [...], "shares": [...]}}}``."""
    rows = steady_rows(features)
    if len(rows) > max_rows:
        rows = rows.sample(max_rows, random_state=seed)
    out: dict[str, Any] = {}
    for name in (n for n in names if n not in UNMEASURED):
        v = rows[name].to_numpy(dtype=np.float64)
        v = v[np.isfinite(v)]
        edges = np.unique(np.quantile(v, _QUANTILES)) if len(v) else np.zeros(1)
        counts = bin_counts(edges, v)
        out[name] = {"edges": [float(e) for e in edges],
                     "shares": [float(s) for s in counts / max(1.0, counts.sum())]}
    return {"rows": len(rows), "features": out}


def steady_rows(features: pd.DataFrame) -> pd.DataFrame:
    """The rows of GPUs whose own baseline is learned (all rows without the column)."""
    if "baseline_hours" not in features.columns:
        return features
    return features.loc[features["baseline_hours"].to_numpy() > 0]


def bin_counts(edges: Sequence[float] | np.ndarray, values: np.ndarray) -> np.ndarray:
    """Rows of ``values`` per bin of ``edges`` (``len(edges) + 1`` bins; NaN left out)."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    idx = np.searchsorted(np.asarray(edges, dtype=np.float64), v, side="left")
    return np.bincount(idx, minlength=len(edges) + 1).astype(np.float64)


def psi_of_counts(expected_shares: Sequence[float] | np.ndarray, counts: np.ndarray) -> float:
    """PSI of observed bin ``counts`` against the reference's ``expected_shares``."""
    total = float(counts.sum())
    if total <= 0:
        return 0.0
    e = np.maximum(np.asarray(expected_shares, dtype=np.float64), _FLOOR)
    a = np.maximum((counts + PRIOR_ROWS * e) / (total + PRIOR_ROWS * e.sum()), _FLOOR)
    return float(np.sum((a - e) * np.log(a / e)))


def psi(ref: Mapping[str, Any], features: pd.DataFrame) -> dict[str, float]:
    """PSI per feature of ``features`` against ``ref`` (a :func:`reference`), for the
    reference's features that ``features`` has."""
    out = {}
    features = steady_rows(features)
    for name, r in ref["features"].items():
        if name in features.columns:
            counts = bin_counts(r["edges"], features[name].to_numpy(dtype=np.float64))
            out[name] = psi_of_counts(r["shares"], counts)
    return out
