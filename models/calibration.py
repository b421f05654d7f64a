"""From an alarm score to P(GPU fails within the horizon) at a fleet's failure rate.

``rules_forest``'s alarm score orders GPU-minutes by how alarming they are, and its
threshold (0.5) says where it alarms; it is not a probability. The cost-aware checkpoint
policy (``collector/decide/costmodel.py``) needs one: expected loss = P x work at risk.
:func:`fit` measures, on labelled feature rows, the share of rows at each score whose GPU
failed within the horizon after them: an isotonic regression
(a higher score never means a lower P) of the label on the score, kept as knots that
:func:`apply` interpolates linearly.

Simulated fleets fail 50-300 times more often than real ones (docs/models.md, the fleet
simulator), so a rate measured there is no real fleet's. Given a base rate, the failing
rows are weighted by the base rate over the data's own failure rate (failures per GPU-day
of the rows): a prior shift, which assumes that what a failing GPU's scores look like does
not depend on how many GPUs fail. Without one (an operator's own fleet), the rate is the
data's own. The gradient-boosted model's calibrated output, at the simulated rate, is
calibrated again the same way (``predictor.train_predictor``).
"""

from __future__ import annotations

import numpy as np
from sklearn.isotonic import IsotonicRegression

__all__ = ["apply", "fit", "positive_weight"]


def positive_weight(failures: int, gpu_days: float,
                    base_rate_per_1000_gpu_days: float | None) -> float:
    """The weight of a failing row: the base rate over the data's failure rate (1.0
    without a base rate, or with no failures to measure one)."""
    if base_rate_per_1000_gpu_days is None or failures == 0 or gpu_days <= 0:
        return 1.0
    return base_rate_per_1000_gpu_days / (1000.0 * failures / gpu_days)


def fit(scores: np.ndarray, fails: np.ndarray,
        weight_positive: float | np.ndarray = 1.0) -> np.ndarray:
    """Knots ``(2, k)``: scores and P(failure within the horizon) at them, from each row's
    ``scores`` and ``fails`` (1: the GPU failed within the horizon after the row), failing
    rows weighted by ``weight_positive`` (:func:`positive_weight`; one per row, or one for
    all)."""
    x = np.asarray(scores, dtype=np.float64)
    y = np.asarray(fails, dtype=np.float64)
    w = np.broadcast_to(np.where(y > 0, weight_positive, 1.0), y.shape)
    # No score makes a failure certain: where every row at the highest score failed (a
    # model that separated some of its own training rows), the top would read P = 1.0
    # whatever the base rate; one row that did not fail is assumed there, so it reads
    # n w / (n w + 1) at a base rate w times the data's. Elsewhere nothing changes.
    if len(x) and (y[x == x.max()] > 0).all():
        x, y, w = np.append(x, x.max()), np.append(y, 0.0), np.append(w, 1.0)
    iso = IsotonicRegression(y_min=0.0, y_max=1.0, increasing=True, out_of_bounds="clip")
    iso.fit(x, y, sample_weight=w)
    knots: np.ndarray = np.vstack([iso.X_thresholds_, iso.y_thresholds_]).astype(np.float64)
    return knots


def apply(knots: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """P(failure within the horizon) at ``scores`` (linear between the knots, the end
    values beyond them)."""
    p: np.ndarray = np.interp(np.asarray(scores, dtype=np.float64), knots[0], knots[1])
    return p
