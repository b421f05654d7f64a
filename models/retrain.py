"""Learning from the operator's own fleet: train a candidate on the fleet's history, judge
it against the running model in shadow, promote it only when it is better.

:func:`retrain` takes the fleet's telemetry, XIDs and other outcomes (the collector's store:
:mod:`forewarn.collector.storage.history`; or an export in the replay format) and:

1. computes the live predictor's features (:func:`~.features.gpu_features`) and the
   failure labels (:func:`~.labels.labels_from_telemetry`: fatal XIDs, GPUs lost, new
   uncorrectable ECC errors and row remaps, remap failures, drains);
2. splits time at ``end - shadow_days``: the candidate is fitted on what came before
   (feature rows up to one horizon before the cut, so no row's label looks into the
   window) and never sees the shadow window. It is of the kind that ships
   (``rules_forest``: its isolation forest refitted on the fleet's own rows, its cutoff
   tuned on the fleet's GPUs held out of the fit at the false-alarm target), or the
   gradient-boosted ``model`` when asked (:func:`~.train.train_detector`);
3. scores the candidate and the running model on the shadow window and applies the gate
   (:mod:`~.gate`: better = at least the recall on failures with a precursor at no more
   false alarms per 1,000 GPU-days, one strictly better, over enough failures);
4. stores the candidate with its training distribution (for drift, :mod:`~.drift`) as the
   registry's next version, promoted or refused, with the reason and both scores
   (:mod:`~.registry`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pandas as pd

from forewarn.errors import InputError
from forewarn.models.drift import psi, reference
from forewarn.models.features import gpu_features
from forewarn.models.gate import MIN_FAILURES, Verdict, judge, shadow_score
from forewarn.models.labels import labels_from_telemetry
from forewarn.models.registry import ModelRegistry
from forewarn.models.train import DETECTORS, SHIPPED_DETECTOR, train_detector

__all__ = ["RetrainError", "RetrainResult", "retrain"]


class RetrainError(InputError, ValueError):
    """No candidate could be trained (too little history or too few failures before the
    shadow window); the message says what is missing."""


@dataclasses.dataclass(frozen=True)
class RetrainResult:
    """What :func:`retrain` did."""

    version: int
    running_version: int
    verdict: Verdict
    drift: dict[str, float]
    """PSI per feature of the shadow window against the running model's training
    distribution (the candidate's when the running model carries none)."""
    window: dict[str, Any]


def _split(features: pd.DataFrame, labels: pd.DataFrame, shadow_days: float,
           horizon_s: float) -> tuple[tuple[pd.DataFrame, pd.DataFrame],
                                      tuple[pd.DataFrame, pd.DataFrame], float, float]:
    end = float(features["time"].max()) + 60.0
    cut = end - shadow_days * 86400.0
    t = features["time"].to_numpy()
    lt = labels["time"].to_numpy(dtype=np.float64)
    train = (features.loc[t < cut - horizon_s], labels.loc[lt < cut])
    shadow = (features.loc[t >= cut], labels.loc[lt >= cut])
    return train, shadow, cut, end


def retrain(samples: pd.DataFrame, xids: pd.DataFrame | None, outcomes: pd.DataFrame | None,
            registry: ModelRegistry, *, shadow_days: float = 7.0,
            min_failures: int = MIN_FAILURES, detector: str = SHIPPED_DETECTOR,
            threshold: float | None = None, target_false_alarms: float = 0.5, seed: int = 0,
            max_iter: int = 150, now: float | None = None) -> RetrainResult:
    """See the module docstring; ``detector``, ``threshold``, ``target_false_alarms``,
    ``seed`` and ``max_iter`` as :func:`~.train.train_detector` takes them. Raises
    :class:`RetrainError` when no candidate can be trained, and
    :class:`~.schema.DataError` for unusable data."""
    if detector not in DETECTORS:
        raise RetrainError(f"detector: {detector!r} is none of {', '.join(DETECTORS)}")
    if samples.empty:
        raise RetrainError("the store holds no telemetry")
    features = gpu_features(samples, xids)
    labels = labels_from_telemetry(samples, xids, outcomes=outcomes)
    running_version = registry.current()
    running = registry.load(running_version)
    horizon = running.horizon_s
    (tf, tl), (sf, sl), cut, end = _split(features, labels, shadow_days, horizon)
    if tf.empty or sf.empty:
        raise RetrainError(f"the store spans {(end - float(features['time'].min())) / 86400:.1f}"
                           f" days: too short for a {shadow_days:g}-day shadow window and "
                           "history before it to train on")
    try:
        candidate = train_detector(detector, [(tf, tl)], horizon_s=horizon,
                                   threshold=threshold, seed=seed, max_iter=max_iter,
                                   target_false_alarms=target_false_alarms)
    except ValueError as exc:
        raise RetrainError(f"no candidate trained on the {len(tl)} failure(s) before the "
                           f"shadow window: {exc}") from None
    window = {"train_until": cut, "shadow_from": cut, "shadow_until": end,
              "shadow_days": shadow_days, "train_failures": len(tl),
              "shadow_failures": len(sl)}
    candidate.metadata.update(reference=reference(tf, candidate.feature_names, seed=seed),
                              retrain=window)
    verdict = judge(shadow_score(candidate, sf, sl, horizon),
                    shadow_score(running, sf, sl, horizon), min_failures=min_failures)
    version = registry.add(candidate, promote=verdict.promote, reason=verdict.reason,
                           scores={**verdict.scores(), "window": window}, now=now)
    ref = running.metadata.get("reference") or candidate.metadata["reference"]
    return RetrainResult(version=version, running_version=running_version, verdict=verdict,
                         drift=psi(ref, sf), window=window)
