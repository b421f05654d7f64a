"""Outcome labels from a fleet's own records: what ``forewarn models retrain`` learns from."""

from __future__ import annotations

import pandas as pd

from forewarn.models.labels import labels_from_telemetry

T0 = 1_767_225_600.0


def _samples(**columns: list[object]) -> pd.DataFrame:
    n = len(next(iter(columns.values())))
    return pd.DataFrame({"node": ["n1"] * n, "gpu": [0] * n,
                         "time": [T0 + 60.0 * i for i in range(n)], **columns})


def test_a_remap_failure_in_the_telemetry_is_a_failure() -> None:
    # NVML reports a failed row remap as a flag, with no uncorrectable remap counted.
    found = labels_from_telemetry(_samples(remap_failure=[False, False, True, True]))
    assert found[["node", "gpu", "time", "cause"]].to_dict("records") == [
        {"node": "n1", "gpu": 0, "time": T0 + 120.0, "cause": "remap_failure"}]


def test_other_outcomes_join_the_labels_and_the_same_failure_counts_once() -> None:
    samples = _samples(ecc_uncorrected_volatile=[0, 0, 1, 1])
    drains = pd.DataFrame({"node": ["n1", "n2"], "gpu": [0, 3],
                           "time": [T0 + 600.0, T0 + 60.0], "cause": ["drain", "drain"]})
    found = labels_from_telemetry(samples, outcomes=drains)
    assert found[["node", "gpu", "time", "cause"]].to_dict("records") == [
        {"node": "n1", "gpu": 0, "time": T0 + 120.0, "cause": "dbe"},
        {"node": "n2", "gpu": 3, "time": T0 + 60.0, "cause": "drain"}]
    assert found["had_precursor"].all()
