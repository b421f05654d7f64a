"""IsolationForest over the feature vector: "this GPU looks unlike the fleet".

Fitted on feature rows (:data:`forewarn.models.features.FEATURE_NAMES`) of a healthy
period; a row whose anomaly score falls below the ``contamination`` quantile of the
training scores is anomalous. Unsupervised, so it needs no failure labels -- and it
cannot say *what* will happen, only that something is unusual.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from sklearn.ensemble import IsolationForest

from forewarn.models.features import FEATURE_NAMES
from forewarn.wire import Finding, Health, Subject, SuggestedAction

__all__ = ["IsolationForestDetector"]


class IsolationForestDetector:
    """IsolationForest anomaly detector over the GPU feature vector."""

    name = "models.isolation_forest"

    def __init__(self, contamination: float = 0.001, n_estimators: int = 100,
                 max_samples: int = 4096, seed: int = 0) -> None:
        self.contamination = contamination
        self.forest = IsolationForest(n_estimators=n_estimators, max_samples=max_samples,
                                      random_state=seed)
        self.cutoff = 0.0

    def fit(self, features: pd.DataFrame) -> IsolationForestDetector:
        """Fit on feature rows; set the cutoff at the ``contamination`` quantile."""
        x = features[list(FEATURE_NAMES)].to_numpy(dtype=np.float64)
        self.forest.fit(x)
        self.cutoff = float(np.quantile(self.forest.score_samples(x), self.contamination))
        return self

    def scores(self, features: pd.DataFrame) -> np.ndarray:
        """Anomaly scores (lower = more anomalous), as sklearn's ``score_samples``."""
        x = features[list(FEATURE_NAMES)].to_numpy(dtype=np.float64)
        s: np.ndarray = self.forest.score_samples(x)
        return s

    def findings(self, features: pd.DataFrame, now: float) -> list[Finding]:
        """Findings for rows scoring below the cutoff (latest row per GPU)."""
        last = features.groupby(["node", "gpu"], sort=False).tail(1)
        s = self.scores(last)
        out = []
        for (node, gpu), score in zip(last[["node", "gpu"]].itertuples(index=False, name=None),
                                      s, strict=True):
            if score >= self.cutoff:
                continue
            out.append(Finding(
                check=self.name, health=Health.DEGRADED,
                subject=Subject(kind="gpu", node=str(node), gpu=int(gpu)),
                reason=f"feature vector is unusual for the fleet (isolation score {score:.3f}"
                       f" < cutoff {self.cutoff:.3f})",
                action=SuggestedAction.WATCH,
                evidence={"score": round(float(score), 4), "cutoff": round(self.cutoff, 4)},
                time=now,
            ))
        return out
