"""Failure predictor: P(this GPU fails within horizon H) from windowed features.

A scikit-learn :class:`~sklearn.ensemble.HistGradientBoostingClassifier` calibrated with
isotonic regression (:class:`~sklearn.calibration.CalibratedClassifierCV`), trained on
per-minute feature rows (:mod:`forewarn.models.features`) labelled 1 when the GPU fails
within ``horizon_s`` after the row. Rows after a failure are dropped; negatives are
subsampled every ``neg_stride`` minutes and weighted back so that the calibrated
probability keeps the data's own failure rate: that is the alarm score (the threshold is on
it). Simulated fleets fail far more often than real ones, so given a base rate the findings'
P is measured as ``rules_forest``'s is (:mod:`~forewarn.models.calibration`): on every kept
row of the tuning sets (the GPUs held out of the fit; the training sets when there are
none), the share a failure followed within the horizon at each score, failing rows
weighted down to the base rate; the knots are stored in ``metadata["calibration"]``.
Negatives in the hours just before a failure (``precursor_window_s``) are not fitted on: a
precursor often starts earlier than the horizon, and its early minutes, labelled 0, would
teach the model that its signal is normal (the evaluation counts an alarm raised there as
true when it lasts to the failure). The operating threshold is tuned on GPUs held out of the
fit (by default: the most recall whose false alarms stay under ``target_false_alarms`` per
1,000 GPU-days), and is configurable afterwards.

Gradient boosting for GPU failure prediction follows Liu et al. (SYSTOR 2023,
docs/reference.md), who found single GBDTs imprecise on real fleets; here the model is judged
on simulated data it never saw (docs/models.md).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
from sklearn.calibration import CalibratedClassifierCV
from sklearn.ensemble import HistGradientBoostingClassifier

from forewarn.models import calibration
from forewarn.models.evaluate import evaluate_scores
from forewarn.models.features import FEATURE_NAMES
from forewarn.wire import Finding, Health, Subject, SuggestedAction

__all__ = ["PRECURSOR_WINDOW_S", "FailurePredictor", "alarm_health", "fit_table", "label_rows",
           "measure_calibration", "split_gpus", "train_predictor"]

UNHEALTHY_SCORE = 0.8
"""An alarm at or above this score is unhealthy, below it degraded."""


def alarm_health(score: float) -> Health:
    """The health of an alarm at ``score`` (a finding's, the status page's)."""
    return Health.DEGRADED if score < UNHEALTHY_SCORE else Health.UNHEALTHY


@dataclasses.dataclass
class FailurePredictor:
    """A calibrated failure-probability model and its operating point."""

    classifier: Any
    feature_names: tuple[str, ...] = FEATURE_NAMES
    horizon_s: float = 3600.0
    threshold: float = 0.5
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    check_name: str = "models.failure_predictor"

    def predict_proba(self, features: pd.DataFrame | np.ndarray) -> np.ndarray:
        """P(failure within ``horizon_s``) for each row."""
        if isinstance(features, pd.DataFrame):
            x = features.loc[:, list(self.feature_names)].to_numpy(dtype=np.float64)
        else:
            x = np.asarray(features, dtype=np.float64)
        if len(x) == 0:
            return np.zeros(0)
        p: np.ndarray = self.classifier.predict_proba(x)[:, 1]
        return p

    def failure_probability(self, scores: np.ndarray) -> np.ndarray | None:
        """P(failure within ``horizon_s``) at the scores :meth:`predict_proba` gave: the
        classifier's own calibration of its alarm score when it has one (``rules_forest``);
        from a calibrated classifier (the gradient-boosted model) the scores, shifted to the
        base rate it was trained for when there is one; None for an alarm score without a
        calibration (a model saved before it had one)."""
        calibrated = getattr(self.classifier, "probability", None)
        if calibrated is None:
            knots = self.metadata.get("calibration", {}).get("knots")
            return scores if knots is None else calibration.apply(np.asarray(knots), scores)
        p: np.ndarray | None = calibrated(scores)
        return p

    def _reason(self, score: float, p: float | None) -> str:
        """What a finding's numbers are (:meth:`findings`)."""
        horizon = f"P(GPU fails within {self.horizon_s / 60:.0f} min)"
        if p is None:
            return (f"alarm score {score:.2f} (threshold {self.threshold:.2f}; a score, "
                    f"not a probability: this model carries no calibration)")
        cal = self.metadata.get("calibration", {})
        if getattr(self.classifier, "probability", None) is None and "knots" not in cal:
            return f"{horizon} = {p:.2f} (threshold {self.threshold:.2f})"  # score is P
        rate = cal.get("base_rate_per_1000_gpu_days")
        at = f" at {rate:g} failures per 1,000 GPU-days" if rate is not None else ""
        return (f"alarm score {score:.2f} (threshold {self.threshold:.2f}); {horizon} = "
                f"{p:.4f} (calibrated{at})")

    def score(self, features: pd.DataFrame) -> pd.DataFrame:
        """``node, gpu, time, p`` for each feature row."""
        out = features[["node", "gpu", "time"]].copy()
        out["p"] = self.predict_proba(features)
        return out

    def findings(self, nodes: np.ndarray, gpus: np.ndarray, probs: np.ndarray, now: float,
                 evidence: dict[str, np.ndarray] | None = None,
                 alarm: np.ndarray | None = None) -> list[Finding]:
        """Findings for the GPUs whose score (``probs``, from :meth:`predict_proba`) is at
        or above the threshold (or, given ``alarm``, those it marks), with their
        ``evidence`` values (numbers rounded, strings as they are). A finding's
        ``probability`` is :meth:`failure_probability` (what the cost-aware policy reads;
        None without one), its evidence has the ``score`` and that ``probability``."""
        out = []
        failing = self.failure_probability(probs)
        for i in np.nonzero(probs >= self.threshold if alarm is None else alarm)[0]:
            p = float(probs[i])
            pf = None if failing is None else min(1.0, max(0.0, float(failing[i])))
            ev: dict[str, float | int | str | bool | None] = {
                "score": round(p, 4), "probability": None if pf is None else round(pf, 6)}
            if evidence:
                ev.update({k: v[i] if isinstance(v[i], str) else round(float(v[i]), 4)
                           for k, v in evidence.items()})
            out.append(Finding(
                check=self.check_name,
                health=alarm_health(p),
                subject=Subject(kind="gpu", node=str(nodes[i]), gpu=int(gpus[i])),
                reason=self._reason(p, pf), action=SuggestedAction.CHECKPOINT,
                evidence=ev, time=now, probability=pf,
                horizon_s=self.horizon_s,
            ))
        return out


def label_rows(features: pd.DataFrame, labels: pd.DataFrame, horizon_s: float,
               settle_s: float = 3600.0) -> tuple[np.ndarray, np.ndarray]:
    """``(y, keep)``: y = 1 when the GPU's next failure is within ``horizon_s`` after the
    row. Rows at a failure and for ``settle_s`` after it are not kept (the failure itself
    is no prediction, and a repaired GPU starts afresh); a GPU may fail more than once."""
    n = len(features)
    if n == 0:
        return np.zeros(0, np.int8), np.zeros(0, bool)
    key = features["node"].astype(str) + "/" + features["gpu"].astype(str)
    rows = pd.DataFrame({"key": key.to_numpy(dtype=object), "time": features["time"].to_numpy(
        dtype=np.float64), "i": np.arange(n)}).sort_values("time", kind="stable")
    lab = pd.DataFrame({"key": (labels["node"].astype(str) + "/"
                                + labels["gpu"].astype(str)).to_numpy(dtype=object),
                        "fail": labels["time"].to_numpy(dtype=np.float64)})
    # One key dtype on both sides (pandas may infer a string dtype for one and leave an
    # empty table's keys as objects: merge_asof refuses that).
    rows["key"] = rows["key"].astype(str)
    lab["key"] = lab["key"].astype(str)
    lab = lab.sort_values("fail", kind="stable")
    nxt = pd.merge_asof(rows, lab.rename(columns={"fail": "time_f"}).assign(
        nxt=lambda d: d["time_f"]), left_on="time", right_on="time_f", by="key",
        direction="forward", allow_exact_matches=False)
    prv = pd.merge_asof(rows, lab.rename(columns={"fail": "time_f"}).assign(
        prv=lambda d: d["time_f"]), left_on="time", right_on="time_f", by="key",
        direction="backward", allow_exact_matches=True)
    t = rows["time"].to_numpy()
    nx = nxt["nxt"].to_numpy(dtype=np.float64)
    pv = prv["prv"].to_numpy(dtype=np.float64)
    y_sorted = ~np.isnan(nx) & (nx - t <= horizon_s)
    keep_sorted = np.isnan(pv) | (t - pv > settle_s)
    y = np.zeros(n, np.int8)
    keep = np.zeros(n, bool)
    y[rows["i"].to_numpy()] = y_sorted
    keep[rows["i"].to_numpy()] = keep_sorted
    return y, keep


def _tune_threshold(scored: pd.DataFrame, labels: pd.DataFrame, horizon_s: float,
                    target_false_alarms: float) -> float:
    """Among thresholds 0.05..0.95 (step 0.05) whose false alarms stay under the target,
    the one with the most recall (ties: the higher threshold). When none catches anything
    there, the one with the fewest false alarms among those that catch something: a
    threshold nothing reaches is no operating point. (Precision is not asked for here:
    simulated fleets fail far more often than real ones, so their precision says little;
    docs/models.md judges it at the real base rate.)"""
    rows = []
    for thr in np.round(np.arange(0.05, 0.96, 0.05), 2):
        r = evaluate_scores(scored, labels, float(thr), horizon_s=horizon_s)
        rows.append((float(thr), r.false_alarms_per_1000_gpu_days, r.precision,
                     r.recall_precursor))
    good = [r for r in rows if r[1] <= target_false_alarms and r[3] > 0]
    if good:
        return max(good, key=lambda r: (r[3], r[0]))[0]
    catching = [r for r in rows if r[3] > 0] or rows
    return min(catching, key=lambda r: (r[1], -r[3], -r[0]))[0]


PRECURSOR_WINDOW_S = 4 * 3600.0
"""Negatives less than this before a failure are left out of the fit (precursors last up
to a few hours; the features' own baseline ends 4 to 8 hours back for the same reason)."""


def fit_table(features: pd.DataFrame, labels: pd.DataFrame, horizon_s: float,
              neg_stride: int = 5, precursor_window_s: float = PRECURSOR_WINDOW_S
              ) -> pd.DataFrame:
    """Rows to fit on: every positive row and every ``neg_stride``-th minute of the
    negatives, with ``y`` and a weight ``w`` that restores the negatives' share. Negatives
    whose next failure is less than ``precursor_window_s`` away are left out: they may be
    a precursor's early minutes, neither normal nor yet within the horizon."""
    y, keep = label_rows(features, labels, horizon_s)
    near, _keep = label_rows(features, labels, max(horizon_s, precursor_window_s))
    minute = (features["time"].to_numpy() // 60).astype(np.int64)
    rows = keep & ((y == 1) | ((minute % neg_stride == 0) & (near == 0)))
    out = features.loc[rows, list(FEATURE_NAMES)].copy()
    out["y"] = y[rows]
    out["w"] = np.where(out["y"] == 1, 1.0, float(neg_stride))
    return out


def split_gpus(features: pd.DataFrame, labels: pd.DataFrame, share: float, seed: int
               ) -> tuple[tuple[pd.DataFrame, pd.DataFrame], tuple[pd.DataFrame, pd.DataFrame]]:
    """Split a fleet by GPU into (fit, held-out) feature/label pairs."""
    key = features["node"].astype(str) + "/" + features["gpu"].astype(str)
    gpus = key.unique()
    rng = np.random.default_rng(seed)
    held = set(rng.choice(gpus, size=int(len(gpus) * share), replace=False))
    is_held = key.isin(held).to_numpy()
    lkey = (labels["node"].astype(str) + "/" + labels["gpu"].astype(str)).isin(held).to_numpy()
    return ((features.loc[~is_held], labels.loc[~lkey]),
            (features.loc[is_held], labels.loc[lkey]))


def train_predictor(sets: list[tuple[pd.DataFrame, pd.DataFrame]], *,
                    tune: tuple[pd.DataFrame, pd.DataFrame] | None = None,
                    horizon_s: float = 3600.0, neg_stride: int = 5,
                    tune_share: float = 0.25, target_false_alarms: float = 0.5,
                    threshold: float | None = None, seed: int = 0,
                    max_iter: int = 150,
                    base_rate_per_1000_gpu_days: float | None = None) -> FailurePredictor:
    """Fit the calibrated predictor on ``(features, labels)`` pairs (features from
    :func:`~forewarn.models.features.gpu_features`). The operating threshold is given, or
    tuned on ``tune`` (or, without one, on ``tune_share`` of the GPUs held out of the fit).
    With ``base_rate_per_1000_gpu_days`` the findings' P is at that failure rate (module
    docstring), else at the data's own."""
    start = time.perf_counter()
    tunes: list[tuple[pd.DataFrame, pd.DataFrame]] = []
    fits = []
    for features, labels in sets:
        if threshold is None and tune is None and tune_share > 0:
            (ff, fl), held = split_gpus(features, labels, tune_share, seed)
            tunes.append(held)
        else:
            ff, fl = features, labels
        fits.append(fit_table(ff, fl, horizon_s, neg_stride))
    if tune is not None:
        tunes = [tune]
    fit = pd.concat(fits, ignore_index=True)
    yf = fit["y"].to_numpy()
    if yf.sum() < 6:
        raise ValueError(f"too few positive rows to train on ({int(yf.sum())}); "
                         "use more data or a longer horizon")
    x = fit[list(FEATURE_NAMES)].to_numpy(dtype=np.float64)
    base = HistGradientBoostingClassifier(max_iter=max_iter, learning_rate=0.08,
                                          max_leaf_nodes=31, l2_regularization=1.0,
                                          random_state=seed)
    clf = CalibratedClassifierCV(base, method="isotonic", cv=3, ensemble=False)
    clf.fit(x, yf, sample_weight=fit["w"].to_numpy())
    pred = FailurePredictor(classifier=clf, horizon_s=horizon_s)
    if threshold is None:
        scored = []
        tune_labels = []
        for k, (tf, tl) in enumerate(tunes):
            _y, keep = label_rows(tf, tl, horizon_s)
            sc = pred.score(tf.loc[keep])
            sc["node"] = f"{k}:" + sc["node"].astype(str)
            scored.append(sc)
            tune_labels.append(tl.assign(node=f"{k}:" + tl["node"].astype(str)))
        threshold = _tune_threshold(pd.concat(scored, ignore_index=True),
                                    pd.concat(tune_labels, ignore_index=True),
                                    horizon_s, target_false_alarms)
    pred.threshold = float(threshold)
    pred.metadata = {
        "trained_at": time.time(), "train_seconds": round(time.perf_counter() - start, 2),
        "train_rows": len(fit), "positive_rows": int(yf.sum()),
        "failures": int(sum(len(lab) for _, lab in sets)), "horizon_s": horizon_s,
        "neg_stride": neg_stride, "target_false_alarms_per_1000": target_false_alarms,
    }
    if base_rate_per_1000_gpu_days is not None:
        # on GPUs held out of the fit when there are some: on its own fit rows a boosted
        # model is surer than it is on new GPUs
        knots, cal = measure_calibration(pred.predict_proba, tunes or sets,
                                         horizon_s=horizon_s, base_rate_per_1000_gpu_days=(
                                             base_rate_per_1000_gpu_days))
        pred.metadata["calibration"] = {**cal, "knots": knots.tolist()}
    return pred


def measure_calibration(score: Callable[[pd.DataFrame], np.ndarray],
                        sets: list[tuple[pd.DataFrame, pd.DataFrame]], *, horizon_s: float,
                        base_rate_per_1000_gpu_days: float | None
                        ) -> tuple[np.ndarray, dict[str, float]]:
    """Knots of P(failure within ``horizon_s``) at the alarm scores ``score`` gives every
    kept row of ``sets`` (:mod:`~forewarn.models.calibration`), each set's failing rows
    weighted by ``base_rate_per_1000_gpu_days`` over its own rate (None: each set's own),
    and what they rest on (for the model's metadata)."""
    scores, fails, weights = [], [], []
    failures, days = 0, 0.0
    for features, labels in sets:
        y, keep = label_rows(features, labels, horizon_s)
        d = float(keep.sum()) / 1440.0  # one feature row per GPU-minute
        w = calibration.positive_weight(len(labels), d, base_rate_per_1000_gpu_days)
        scores.append(score(features.loc[keep]))
        fails.append(y[keep])
        weights.append(np.where(y[keep] > 0, w, 1.0))
        failures, days = failures + len(labels), days + d
    knots = calibration.fit(np.concatenate(scores), np.concatenate(fails),
                            np.concatenate(weights))
    own = round(1000.0 * failures / max(days, 1e-9), 3)
    return knots, {"failures": failures, "gpu_days": round(days, 1),
                   "failures_per_1000_gpu_days": own,
                   "base_rate_per_1000_gpu_days": own if base_rate_per_1000_gpu_days is None
                   else base_rate_per_1000_gpu_days}
