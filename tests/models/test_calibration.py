"""The probability on the shipped model's findings is a probability, not its alarm score
(``models/calibration.py``): the cost-aware policy multiplies it by the work at risk."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from forewarn.models.calibration import apply, fit, positive_weight
from forewarn.models.fleetsim import load_params
from forewarn.models.persist import load_default_model
from forewarn.models.predictor import label_rows
from forewarn.models.suites import heldout_suite, simulate_features

pytestmark = pytest.mark.timeout(600)

_FLEETS = ("same_params_new_seed", "short_precursors_x0.5", "long_precursors_x2",
           "noise_x1.6")


@pytest.fixture(scope="module")
def heldout() -> tuple[pd.DataFrame, np.ndarray, float]:
    """Feature rows of four held-out fleets (seeds training never uses, 896 GPU-days),
    whether the GPU failed within the hour after each, and the weight of a failing row
    that brings the simulated failure rate down to a real fleet's."""
    suite = heldout_suite(scale=0.25)
    feats, ys, failures = [], [], 0
    for k, name in enumerate(_FLEETS):
        f, lab = simulate_features(suite[name])
        y, keep = label_rows(f, lab, 3600.0)
        feats.append(f.loc[keep].assign(node=f"{k}:" + f.loc[keep, "node"].astype(str)))
        ys.append(y[keep])
        failures += len(lab)
    rows = pd.concat(feats, ignore_index=True)
    w = positive_weight(failures, len(rows) / 1440.0, load_params().real_per_1000_gpu_days)
    return rows, np.concatenate(ys), w


def _observed(y: np.ndarray, w: float) -> float:
    """The share of rows a failure followed, failing rows weighted by ``w``."""
    return float(w * y.sum() / (w * y.sum() + (1 - y).sum()))


def test_findings_carry_the_failure_rate_observed_at_their_score(
        heldout: tuple[pd.DataFrame, np.ndarray, float]) -> None:
    """On held-out fleets, the mean probability on the shipped model's findings (its
    alarms) is within a factor of 3 of the share of those GPU-minutes that a failure
    followed within the hour, at a real fleet's failure rate (0.81 per 1,000 GPU-days;
    failing rows weighted down from the simulator's 40); so is the mean P of the minutes
    below the threshold. A factor of 3: the alarms hold 5 failing GPUs, and the
    calibration was measured on other fleets (the training and tuning seeds). Measured
    (2026-11-24): alarms 0.0059 against 0.0051, below the threshold 2.5e-5 against
    3.1e-5."""
    rows, y, w = heldout
    model = load_default_model()
    scores = model.predict_proba(rows)
    alarm = scores >= model.threshold
    found = model.findings(rows["node"].to_numpy()[alarm], rows["gpu"].to_numpy()[alarm],
                           scores[alarm], 0.0)
    assert len(found) == alarm.sum()
    failing_gpus = rows.loc[alarm & (y == 1), ["node", "gpu"]].drop_duplicates()
    assert len(failing_gpus) >= 5  # enough failures to measure a rate on
    on_findings = np.array([f.probability for f in found], dtype=np.float64).mean()
    below = model.failure_probability(scores[~alarm])
    assert below is not None
    for what, mean_p, observed in (("findings", on_findings, _observed(y[alarm], w)),
                                   ("below threshold", below.mean(), _observed(y[~alarm], w))):
        assert observed / 3 <= mean_p <= observed * 3, (
            f"{what}: mean P {mean_p:.4g}, observed {observed:.4g}")


def test_a_calibration_is_monotone_and_weighs_failures_down_to_the_base_rate() -> None:
    """Rows at score 0.9 fail half the time, at 0.1 never: P is 0.5 at 0.9 with the
    data's own rate and, at a base rate 100 times lower, about 0.01."""
    scores = np.repeat([0.1, 0.9], 100)
    fails = np.r_[np.zeros(100), np.tile([0, 1], 50)]
    assert apply(fit(scores, fails), np.array([0.1, 0.9])).tolist() == [0.0, 0.5]
    w = positive_weight(failures=10, gpu_days=100.0, base_rate_per_1000_gpu_days=1.0)
    assert w == pytest.approx(0.01)
    p = apply(fit(scores, fails, w), np.array([0.05, 0.5, 0.9, 1.0]))
    assert p[2] == pytest.approx(0.01 / 1.01) and p[3] == p[2] and p[0] == 0.0
    assert np.all(np.diff(p) >= 0)


def test_a_finding_says_which_number_is_the_score_and_which_the_probability() -> None:
    """The shipped model's finding carries the calibrated P as its probability and says
    so; a rules_forest file without a calibration gives no probability (the cost model then
    uses its per-check prior) rather than pass its score off as one."""
    import copy

    from forewarn.collector.decide.costmodel import failure_probability

    model = load_default_model()
    score = np.array([0.6])
    (found,) = model.findings(np.array(["n1"]), np.array([3]), score, 0.0)
    assert found.probability is not None and 0 < found.probability < 0.1
    assert found.evidence["score"] == 0.6 and found.evidence["probability"] == round(
        found.probability, 6)
    assert found.reason.startswith("alarm score 0.60 (threshold 0.50); P(GPU fails within "
                                   "60 min) = ") and "calibrated at 0.8125" in found.reason
    assert failure_probability(found) == (found.probability, "finding")
    bare = copy.deepcopy(model)
    bare.classifier.calibration = np.zeros((2, 0))
    (found,) = bare.findings(np.array(["n1"]), np.array([3]), score, 0.0)
    assert found.probability is None and "not a probability" in found.reason
    assert failure_probability(found)[1] != "finding"


def test_the_gradient_boosted_models_p_is_at_the_base_rate_given() -> None:
    """``--detector model`` trained on simulated fleets (which fail ~300x more often than
    real ones) gives findings P at the real rate, as rules_forest does: its calibrated
    output at the data's own rate stays the alarm score (the threshold is on it), and P is
    measured on the training rows with failing rows weighted down to the base rate (a prior
    shift). Its mean over those rows (weighted alike) is the share of GPU-minutes a failure
    followed at the base rate; without a base rate P is the score."""
    from forewarn.models.features import gpu_features
    from forewarn.models.fleetsim import simulate_fleet
    from forewarn.models.suites import classic
    from forewarn.models.train import train_detector

    d = simulate_fleet(classic(load_params()).replace(nodes=2, gpus_per_node=8, days=2.0,
                                                      seed=11, rate_per_1000_gpu_days=1500.0))
    f = gpu_features(d.samples, d.xids)
    real = load_params().real_per_1000_gpu_days
    model = train_detector("model", [(f, d.labels)], threshold=0.5, max_iter=30,
                           base_rate_per_1000_gpu_days=real)
    cal = model.metadata["calibration"]
    assert cal["base_rate_per_1000_gpu_days"] == real
    assert cal["failures_per_1000_gpu_days"] > 100 * real
    y, keep = label_rows(f, d.labels, 3600.0)
    scores = model.predict_proba(f.loc[keep])
    p = model.failure_probability(scores)
    assert p is not None and np.all(p <= scores) and p.mean() < scores.mean() / 20
    w = positive_weight(len(d.labels), keep.sum() / 1440.0, real)
    observed = _observed(y[keep], w)
    mean_p = float(np.average(p, weights=np.where(y[keep] > 0, w, 1.0)))
    assert observed / 2 <= mean_p <= observed * 2, (mean_p, observed)
    i = int(np.argmax(scores))
    (found,) = model.findings(np.array(["n"]), np.array([0]), scores[i:i + 1], 0.0)
    assert found.probability == pytest.approx(float(p[i]), rel=1e-6)
    assert found.reason.startswith("alarm score ") and "calibrated at 0.8125" in found.reason
    own = train_detector("model", [(f, d.labels)], threshold=0.5, max_iter=30)
    s = own.predict_proba(f.loc[keep])
    own_p = own.failure_probability(s)
    assert own_p is not None and np.array_equal(own_p, s)


def test_a_score_where_every_row_failed_is_no_certainty_at_a_lower_base_rate() -> None:
    """A model that separates some failing rows of its own training data perfectly (a
    top score level where all 10 rows failed) does not make a failure certain there: at a
    base rate 100 times lower, P at that score is about 10 x 0.01 / (10 x 0.01 + 1), not
    1.0 (one row that did not fail is assumed at the highest score). Before, P was 1.0 and
    above the score itself."""
    scores = np.r_[np.full(100, 0.1), np.full(10, 0.9)]
    fails = np.r_[np.zeros(100), np.ones(10)]
    p = apply(fit(scores, fails, 0.01), np.array([0.9]))
    assert p[0] == pytest.approx(0.1 / 1.1)
