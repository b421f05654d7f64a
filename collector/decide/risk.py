"""What the predictor's last scoring says per GPU: its alarm score and its probability.

Two numbers, never one for the other. The **score** is what the model alarms on (at or
above ``forewarn_collector_predictor_threshold``); for the shipped ``rules_forest`` it only
orders GPU-minutes and is not a probability. The **probability** is P(the GPU fails within
the model's horizon) at a fleet's failure rate, what a finding carries
(:meth:`~forewarn.models.predictor.FailurePredictor.failure_probability`: the calibration
``models/calibration.py`` keeps in the model file; for a calibrated classifier, the
gradient-boosted model, the two are the same number). A model file without a calibration
has scores and no probability.

Exported as ``forewarn_gpu_failure_score{node,gpu}`` and
``forewarn_gpu_failure_probability{node,gpu}`` (no probability series without a
calibration), and answered by ``GET /api/v1/risk``: per GPU ``score`` and ``probability``,
per job the highest-scoring GPU's (``score``, ``risk``: its probability, ``alarm``: the
score at or above the threshold, ``health``: that alarm's, as its finding's). An unknown
probability is ``null`` in the answer and no series in the metrics, never 0.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client.core import GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from ..jobs.jobview import JobInfo
    from .seam import RiskQuery

__all__ = ["RiskScores", "empty_scores", "gpu_risk", "gpu_series", "job_risk_entry"]


@dataclasses.dataclass(frozen=True)
class RiskScores:
    """The scores and probabilities of one scoring, aligned arrays (read from any
    thread). ``probs`` is NaN where the model has no calibration."""

    time: float
    nodes: np.ndarray
    gpus: np.ndarray
    scores: np.ndarray
    probs: np.ndarray

    @functools.cached_property
    def by_gpu(self) -> dict[tuple[str, int], int]:
        """(node, gpu) -> position in the arrays."""
        return {(str(n), int(g)): i for i, (n, g) in enumerate(zip(self.nodes, self.gpus,
                                                                  strict=True))}

    def job_worst(self, job: JobInfo) -> int | None:
        """Position of the job's highest-scoring GPU (None: none of them was scored)."""
        best: int | None = None
        for r in job.ranks:
            i = self.by_gpu.get((r.node, r.gpu)) if r.gpu is not None else None
            if i is not None and (best is None or self.scores[i] >= self.scores[best]):
                best = i
        return best

    def where(self, i: int) -> str:
        """``node/gpu`` at position ``i``."""
        return f"{self.nodes[i]}/{int(self.gpus[i])}"

    def probability(self, i: int) -> float | None:
        """P at position ``i`` (None without a calibration)."""
        p = float(self.probs[i])
        return None if math.isnan(p) else p

    def job_risk(self, job: JobInfo) -> tuple[float | None, str]:
        """P of the job's highest-scoring GPU and which GPU (``node/gpu``) it is (what
        goodput advice weighs); P is None when unknown, never 0: ``(None, "")`` when none
        of the job's GPUs was scored, ``(None, "node/gpu")`` when the model has no
        calibration."""
        i = self.job_worst(job)
        if i is None:
            return None, ""
        return self.probability(i), self.where(i)


def empty_scores(now: float) -> RiskScores:
    """A scoring of no GPU."""
    return RiskScores(now, np.zeros(0, dtype=object), np.zeros(0, np.int64), np.zeros(0),
                      np.zeros(0))


def _rounded(p: float | None) -> float | None:
    return None if p is None else round(p, 6)


def gpu_risk(sc: RiskScores, query: RiskQuery) -> list[dict[str, Any]]:
    """``/api/v1/risk``'s GPUs: at or above ``query.floor`` in probability (every GPU at
    0), of ``query.node``, the highest score first, at most ``query.limit``."""
    sel = np.ones(len(sc.scores), bool) if query.floor <= 0 else sc.probs >= query.floor
    if query.node is not None:
        sel &= sc.nodes == query.node
    idx = np.nonzero(sel)[0]
    idx = idx[np.argsort(-sc.scores[idx], kind="stable")][:query.limit]
    return [{"node": str(sc.nodes[i]), "gpu": int(sc.gpus[i]),
             "score": round(float(sc.scores[i]), 6),
             "probability": _rounded(sc.probability(int(i)))} for i in idx]


def job_risk_entry(sc: RiskScores, job: JobInfo, threshold: float) -> dict[str, Any]:
    """``/api/v1/risk``'s entry for ``job``: its highest-scoring GPU's probability
    (``risk``, None when unknown: no GPU of the job scored, or a model without a
    calibration; never 0 for unknown), score, whether it alarms and the health of that
    alarm (a finding's: degraded, unhealthy from 0.8; else healthy)."""
    from forewarn.models.predictor import alarm_health

    i = sc.job_worst(job)
    score = float(sc.scores[i]) if i is not None else 0.0
    p = sc.probability(i) if i is not None else None
    alarm = i is not None and score >= threshold
    return {"job": job.job, "risk": _rounded(p), "score": round(score, 6), "alarm": alarm,
            "health": alarm_health(score).value if alarm else "healthy",
            "gpu": sc.where(i) if i is not None else "", "gpus": job.gpu_count}


def gpu_series(sc: RiskScores) -> Iterator[Metric]:
    """``forewarn_gpu_failure_score`` and ``forewarn_gpu_failure_probability`` per GPU."""
    score = GaugeMetricFamily(
        "forewarn_gpu_failure_score", "Failure model's alarm score per GPU, latest scoring: "
        "it alarms at or above forewarn_collector_predictor_threshold. Not a probability "
        "(rules_forest's orders GPU-minutes); see forewarn_gpu_failure_probability.",
        labels=["node", "gpu"])
    prob = GaugeMetricFamily(
        "forewarn_gpu_failure_probability", "P(GPU fails within the model's horizon) at the "
        "fleet failure rate the model was calibrated at, latest scoring (what findings "
        "carry and the cost-aware checkpoint policy weighs); no series from a model "
        "without a calibration.", labels=["node", "gpu"])
    for n, g, s, p in zip(sc.nodes, sc.gpus, sc.scores, sc.probs, strict=True):
        labels = [str(n), str(int(g))]
        score.add_metric(labels, float(s))
        if not math.isnan(p):
            prob.add_metric(labels, float(p))
    yield score
    yield prob
