"""Train a failure detector of either kind: the one way ``forewarn models train`` and
``forewarn models retrain`` build a model.

``rules_forest`` (:mod:`~.rules_forest`, what ships): its rules are constants, its isolation
forest is fitted on the given rows and its cutoff tuned on GPUs held out of the fit (or on
``tune``) at the false-alarm target; threshold :data:`~.rules_forest.THRESHOLD` unless one
is given. ``model`` (:mod:`~.predictor`): the gradient-boosted predictor, its threshold
given or tuned the same way. Both run wherever a
:class:`~.predictor.FailurePredictor` does, and ``metadata["detector"]`` says which.
Importing this module is cheap (the command line lists :data:`DETECTORS`); the trainers
load when one trains.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:  # the trainers import scikit-learn: only when one trains
    import pandas as pd

    from forewarn.models.predictor import FailurePredictor

__all__ = ["DETECTORS", "SHIPPED_DETECTOR", "train_detector"]

DETECTORS: Final = ("rules_forest", "model")
"""The kinds of detector forewarn trains."""

SHIPPED_DETECTOR: Final = "rules_forest"
"""The kind the shipped model is, and what a retrain builds unless asked otherwise."""


def train_detector(detector: str, sets: list[tuple[pd.DataFrame, pd.DataFrame]], *,
                   tune: tuple[pd.DataFrame, pd.DataFrame] | None = None,
                   horizon_s: float = 3600.0, threshold: float | None = None,
                   target_false_alarms: float = 0.5, seed: int = 0,
                   max_iter: int = 150,
                   base_rate_per_1000_gpu_days: float | None = None) -> FailurePredictor:
    """A ``detector`` (one of :data:`DETECTORS`) fitted on ``(features, labels)`` pairs
    (module docstring); ``max_iter`` is the boosting iterations of ``model``;
    ``base_rate_per_1000_gpu_days`` the failure rate either detector's probability is
    calibrated at (None: the data's own; :func:`~.rules_forest.calibrate`,
    :func:`~.predictor.train_predictor`). Raises
    :class:`ValueError` when it cannot be trained (an unknown kind, too few failures)."""
    from forewarn.models.predictor import train_predictor
    from forewarn.models.rules_forest import train_rules_forest

    if detector == "model":
        model = train_predictor(sets, tune=tune, horizon_s=horizon_s, threshold=threshold,
                                target_false_alarms=target_false_alarms, seed=seed,
                                max_iter=max_iter,
                                base_rate_per_1000_gpu_days=base_rate_per_1000_gpu_days)
        model.metadata["detector"] = "model"
        return model
    if detector != "rules_forest":
        raise ValueError(f"detector: {detector!r} is none of {', '.join(DETECTORS)}")
    model = train_rules_forest(sets, tune_set=tune, horizon_s=horizon_s,
                               target_false_alarms=target_false_alarms, seed=seed,
                               base_rate_per_1000_gpu_days=base_rate_per_1000_gpu_days)
    if threshold is not None:
        model.threshold = threshold
    return model
