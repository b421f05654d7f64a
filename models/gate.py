"""The shadow promotion gate: is a retrained candidate better than the running model?

Both models score the same rows -- every GPU-minute of the shadow window (the last N days
of the fleet's own store), with the features the live predictor computes -- and each is
judged at its own operating threshold against the same outcomes, by the event-level
definitions of :mod:`~.evaluate` (alarm episodes; a failure is caught when an episode
started at least a minute before it; false alarms per 1,000 GPU-days).

**Better** means: the window holds at least ``min_failures`` failures, and the candidate's
recall on failures with a precursor is at least the running model's while its false alarms
per 1,000 GPU-days are at most the running model's, one of the two strictly better. Anything
else is refused with the figure that decided it: fewer failures caught, more false alarms,
no difference, or too few failures to tell.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pandas as pd

from forewarn.models.evaluate import EvalResult, evaluate_scores
from forewarn.models.predictor import FailurePredictor, label_rows

__all__ = ["MIN_FAILURES", "Verdict", "judge", "shadow_score"]

MIN_FAILURES = 3
"""Failures the shadow window must hold before a candidate can be judged better."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The gate's decision, its reason and both models' figures."""

    promote: bool
    reason: str
    candidate: dict[str, Any]
    running: dict[str, Any]

    def scores(self) -> dict[str, Any]:
        """What the registry records with the decision."""
        return {"candidate": self.candidate, "running": self.running}


def _figures(r: EvalResult) -> dict[str, Any]:
    return {"threshold": r.threshold, "failures": r.failures,
            "failures_with_precursor": r.failures_with_precursor,
            "caught_with_precursor": r.caught_with_precursor,
            "recall_precursor": round(r.recall_precursor, 4),
            "false_alarms_per_1000_gpu_days": round(r.false_alarms_per_1000_gpu_days, 4),
            "episodes": r.episodes, "precision": round(r.precision, 4),
            "median_lead_min": round(r.median_lead_precursor_min, 1),
            "gpu_days": round(r.gpu_days, 2)}


def shadow_score(model: FailurePredictor, features: pd.DataFrame, labels: pd.DataFrame,
                 horizon_s: float) -> EvalResult:
    """``model`` judged on ``features`` (rows after a failure's settling time left out)."""
    _y, keep = label_rows(features, labels, horizon_s)
    scored = model.score(features.loc[keep])
    return evaluate_scores(scored, labels, model.threshold, horizon_s=horizon_s)


def judge(candidate: EvalResult, running: EvalResult, *, min_failures: int = MIN_FAILURES
          ) -> Verdict:
    """The rule in the module docstring."""
    c, r = _figures(candidate), _figures(running)
    n = candidate.failures_with_precursor
    rc, rr = candidate.recall_precursor, running.recall_precursor
    fc, fr = candidate.false_alarms_per_1000_gpu_days, running.false_alarms_per_1000_gpu_days
    if n < min_failures:
        why = (f"too few failures to judge: the shadow window holds {n}, at least "
               f"{min_failures} needed")
        return Verdict(False, why, c, r)
    if rc < rr:
        return Verdict(False, f"worse recall on failures with a precursor: {rc:.2f} < "
                              f"{rr:.2f} of the running model", c, r)
    if fc > fr:
        return Verdict(False, f"more false alarms per 1,000 GPU-days: {fc:.2f} > {fr:.2f} "
                              "of the running model", c, r)
    if rc == rr and fc == fr:
        return Verdict(False, f"no better than the running model (recall {rc:.2f}, "
                              f"{fc:.2f} false alarms per 1,000 GPU-days)", c, r)
    return Verdict(True, f"better: recall {rc:.2f} >= {rr:.2f} at {fc:.2f} <= {fr:.2f} false "
                         f"alarms per 1,000 GPU-days, over {n} failures", c, r)
