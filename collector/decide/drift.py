"""Feature drift of the running model, measured on the features it scores live.

The collector's model, when retrained (``forewarn models retrain``), carries its training
distribution (:func:`forewarn.models.drift.reference`). :class:`LiveDrift` takes a sample
of the feature rows of every feature matrix the model scores (once a minute: the live
scorer reuses a minute's scores for the scorings after it; at most ``rows_per_scoring``,
drawn at random, so it costs microseconds at any fleet size), counts them into the
reference's bins with a decay (half-life ``half_life_s``: the drift of the last day or
so, not of all time; only rows of GPUs whose own baseline is learned, as in the
reference), and renders ``forewarn_collector_model_feature_drift{feature}`` (PSI) and
``forewarn_collector_model_drifted_features`` (how many are above
:data:`~forewarn.models.drift.DRIFTED`) at scrape time. The shipped model carries no
training distribution: no drift metric until a retrained version runs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from prometheus_client.core import GaugeMetricFamily, Metric

from forewarn.models.drift import DRIFTED, bin_counts, psi_of_counts

__all__ = ["LiveDrift"]


class LiveDrift:
    """Decayed bin counts of the live features against a model's reference."""

    def __init__(self, reference: Mapping[str, Any], feature_names: Sequence[str], *,
                 rows_per_scoring: int = 256, half_life_s: float = 86400.0,
                 seed: int = 0) -> None:
        ref = reference["features"]
        # (column of the feature matrix, name, edges, expected shares)
        self._features = [(i, n, np.asarray(ref[n]["edges"], dtype=np.float64),
                           np.asarray(ref[n]["shares"], dtype=np.float64))
                          for i, n in enumerate(feature_names) if n in ref]
        self._counts = [np.zeros(len(e) + 1) for _i, _n, e, _s in self._features]
        # Rows of GPUs whose own baseline is learned, as in the reference (drift.steady_rows).
        names = list(feature_names)
        self._steady = names.index("baseline_hours") if "baseline_hours" in names else None
        self.rows_per_scoring = rows_per_scoring
        self.half_life_s = half_life_s
        self._rng = np.random.default_rng(seed)
        self._last: float | None = None
        self._lock = threading.Lock()

    def update(self, x: np.ndarray, now: float) -> None:
        """Count a sample of the rows of feature matrix ``x`` (columns in the model's
        feature order), decaying the counts so far by the time since the last update."""
        if self._steady is not None:
            x = x[x[:, self._steady] > 0]
        if len(x) > self.rows_per_scoring:
            x = x[self._rng.choice(len(x), self.rows_per_scoring, replace=False)]
        decay = 1.0 if self._last is None else 0.5 ** (max(0.0, now - self._last)
                                                       / self.half_life_s)
        self._last = now
        with self._lock:
            for k, (i, _n, edges, _s) in enumerate(self._features):
                self._counts[k] = self._counts[k] * decay + bin_counts(edges, x[:, i])

    def psi(self) -> dict[str, float]:
        """PSI per feature of the counted rows (empty before the first update)."""
        with self._lock:
            if self._last is None:
                return {}
            return {n: psi_of_counts(s, c)
                    for (_i, n, _e, s), c in zip(self._features, self._counts, strict=True)}

    def collect(self) -> Iterator[Metric]:
        """The drift gauges (none before the first update)."""
        drift = self.psi()
        if not drift:
            return
        g = GaugeMetricFamily("forewarn_collector_model_feature_drift",
                              "Population stability index of each feature the model scores "
                              "live against its training distribution (> 0.25: drifted).",
                              labels=["feature"])
        for name, v in drift.items():
            g.add_metric([name], v)
        yield g
        yield GaugeMetricFamily("forewarn_collector_model_drifted_features",
                                f"Features whose drift (PSI) is above {DRIFTED:g}.",
                                value=sum(v > DRIFTED for v in drift.values()))
