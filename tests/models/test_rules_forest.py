"""Repeated error codes, or an isolation forest far out
(``models/rules_forest.py``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from forewarn.cli import main
from forewarn.models.evaluate import baseline_scores
from forewarn.models.features import FEATURE_NAMES
from forewarn.models.persist import TRUSTED_TYPES, load_default_model, load_model, save_model
from forewarn.models.predictor import FailurePredictor
from forewarn.models.rules_forest import THRESHOLD, RulesForest, train_rules_forest
from forewarn.models.suites import classic, simulate_features, train_suite, tune_params

pytestmark = pytest.mark.timeout(600)


_TRAIN = [classic(p) for p in train_suite(scale=0.125)]
_TUNE = classic(tune_params(scale=0.125))


@pytest.fixture(scope="module")
def detector() -> FailurePredictor:
    sets = [simulate_features(p) for p in _TRAIN]
    return train_rules_forest(sets, tune_set=simulate_features(_TUNE))


@pytest.fixture(scope="module")
def usual() -> pd.Series:
    """The median feature row of the tuning fleet: a GPU as usual."""
    features, _labels = simulate_features(_TUNE)
    return features[list(FEATURE_NAMES)].median()


def _rows(usual: pd.Series, n: int) -> pd.DataFrame:
    return pd.DataFrame([usual.to_dict()] * n)


def test_one_hardware_xid_is_no_alarm_a_second_within_the_hour_is(
        detector: FailurePredictor, usual: pd.Series) -> None:
    """A single XID 63 or 92 on a GPU otherwise as usual is routine (the rules alarm on it);
    a second hardware XID within the hour, or an uncorrectable remap on record, alarms."""
    rows = _rows(usual, 4)
    rows.loc[1, "xid_memory_60"] = 1
    rows.loc[2, ["xid_memory_60", "xid_interconnect_60"]] = 1
    rows.loc[3, "remap_u_total"] = 1
    assert baseline_scores(rows).tolist() == [0, 1, 1, 1]
    assert (detector.predict_proba(rows) >= detector.threshold).tolist() == [
        False, False, True, True]
    assert detector.threshold == THRESHOLD


def test_errors_beyond_own_rate_most_of_the_hour_alarm_a_short_burst_does_not(
        detector: FailurePredictor, usual: pd.Series) -> None:
    """A counter beyond the GPU's own rate and its node peers' in 50 minutes of the hour
    (a trickle accelerating) alarms without any error code; in 10 minutes (a one-off
    burst) not, nor in 50 minutes together with its node peers (the host's PCIe)."""
    rows = _rows(usual, 4)
    rows["baseline_hours"] = 24.0
    rows.loc[1, ["ecc_active60", "ecc_d15", "ecc_vs_peers"]] = [10, 3.0, 3.0]
    rows.loc[2, ["pcie_active60", "pcie_d15", "pcie_vs_peers"]] = [50, 3.0, 3.0]
    rows.loc[3, ["pcie_active60", "pcie_d15", "pcie_vs_peers"]] = [50, 3.0, 0.0]
    assert baseline_scores(rows).tolist() == [0, 0, 0, 0]
    assert (detector.predict_proba(rows) >= detector.threshold).tolist() == [
        False, False, True, False]


def test_forest_alarms_alone_on_a_gpu_far_from_the_fleet(detector: FailurePredictor,
                                                         usual: pd.Series) -> None:
    """No error code at all, but correctable ECC and PCIe replays far beyond the GPU's own
    rate and its peers': the forest alarms; the alarm score grows the further out it is."""
    rf = detector.classifier
    assert isinstance(rf, RulesForest) and 0 < rf.cutoff < 0.05
    rows = _rows(usual, 2)
    far = {c: 6.0 for c in FEATURE_NAMES if c.startswith(("ecc_", "pcie_d", "pcie_vs"))}
    rows.loc[1, list(far)] = list(far.values())
    assert baseline_scores(rows).tolist() == [0, 0]
    p = detector.predict_proba(rows)
    assert p[0] < detector.threshold <= p[1]


def test_a_gpu_going_quiet_alarms_its_node_going_quiet_does_not(
        detector: FailurePredictor, usual: pd.Series) -> None:
    """A GPU that missed 70 % of its usual samples over 15 minutes beyond what its node's
    peers missed, and in the last 5 minutes, alarms without any error code; the same
    losses shared by the whole node (its peers missed as many) do not, nor 40 %."""
    rows = _rows(usual, 4)
    rows.loc[1:, "samples_missing5"] = [0.8, 0.8, 0.4]
    rows.loc[1:, "samples_missing15"] = 0.7
    rows.loc[1:, "samples_missing15_vs_peers"] = [0.7, 0.0, 0.4]
    assert baseline_scores(rows).tolist() == [0, 0, 0, 0]
    assert (detector.predict_proba(rows) >= detector.threshold).tolist() == [
        False, True, False, False]


def test_detector_round_trips_through_the_allow_listed_model_file(
        detector: FailurePredictor, usual: pd.Series, tmp_path: Path) -> None:
    assert "forewarn.models.rules_forest.RulesForest" in TRUSTED_TYPES
    path = save_model(detector, tmp_path / "rf.skops")
    back = load_model(path)
    rows = _rows(usual, 3)
    rows.loc[1, "xid_bus_60"] = 2
    rows.loc[2, "ecc_d15"] = 9.0
    np.testing.assert_array_equal(back.predict_proba(rows), detector.predict_proba(rows))
    assert back.threshold == detector.threshold


def test_shipped_detector_is_the_one_train_builds(tmp_path: Path) -> None:
    """The collector's predictor runs the detector that held on behaviour it never saw
    (docs/models.md, leave-one-family-out), and `forewarn models train` builds it by
    default (`--detector model`: the gradient-boosted predictor)."""
    shipped = load_default_model()
    assert isinstance(shipped.classifier, RulesForest)
    assert shipped.metadata["detector"] == "rules_forest" and shipped.threshold == THRESHOLD
    out = tmp_path / "rf.skops"
    assert main(["models", "train", "--simulate", "--scale", "0.125", "--out", str(out)]) == 0
    assert isinstance(load_model(out).classifier, RulesForest)
