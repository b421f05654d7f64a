"""A GPU's own history is its baseline: a steady trickle of correctable ECC errors is
normal for that GPU (common on healthy GPUs in real fleets, issue 17), while the same
GPU's rate accelerating is a warning."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from forewarn.models.features import FEATURE_NAMES, GRID_S, gpu_features
from forewarn.models.persist import load_default_model
from forewarn.models.predictor import FailurePredictor

_STEP_S = 10.0
_T0 = 1.75e9


def _trickle(per_hour: float, hours: float, *, accel_hours: float = 0.0,
             accel: float = 30.0, seed: int = 0) -> pd.DataFrame:
    """Telemetry of one healthy GPU with a steady correctable-ECC trickle for ``hours``,
    then (optionally) the rate growing to ``accel`` times over ``accel_hours``."""
    rng = np.random.default_rng(seed)
    t = np.arange(0.0, (hours + accel_hours) * 3600, _STEP_S)
    rate = np.full(len(t), per_hour / 3600 * _STEP_S)
    if accel_hours:
        prog = np.clip((t - hours * 3600) / (accel_hours * 3600), 0, 1)
        rate *= 1 + (accel - 1) * prog**2
    n = len(t)
    return pd.DataFrame({
        "node": "n1", "gpu": 0, "time": _T0 + t,
        "temperature_c": 60 + rng.normal(0, 1, n), "slowdown_margin_c": 25.0,
        "power_w": 500 + rng.normal(0, 10, n), "power_limit_w": 700.0, "throttle_reasons": 0,
        "ecc_corrected_volatile": np.cumsum(rng.poisson(rate)),
        "ecc_uncorrected_volatile": 0, "remapped_rows_correctable": 0,
        "remapped_rows_uncorrectable": 0, "remap_pending": 0, "pcie_replay_total": 0,
        "pcie_link_width": 16, "pcie_link_width_max": 16,
    })


@pytest.fixture(scope="module")
def model() -> FailurePredictor:
    return load_default_model()


_BASELINE_H = 10.0


@pytest.mark.parametrize("per_hour", [6.0, 30.0, 120.0])
def test_chronic_trickle_does_not_alarm_after_its_baseline_is_learned(
        model: FailurePredictor, per_hour: float) -> None:
    f = gpu_features(_trickle(per_hour, 48.0))
    learned = f[f["time"] >= _T0 + _BASELINE_H * 3600]
    p = model.predict_proba(learned)
    assert (p < model.threshold).all(), (
        f"{int((p >= model.threshold).sum())} of {len(p)} minutes alarm on a steady "
        f"{per_hour:g}/h trickle (max p {p.max():.2f})")


@pytest.mark.parametrize("per_hour", [6.0, 30.0, 120.0])
def test_the_same_gpu_alarms_when_its_rate_accelerates(
        model: FailurePredictor, per_hour: float) -> None:
    hours = 48.0
    f = gpu_features(_trickle(per_hour, hours, accel_hours=2.0))
    grows = f[f["time"] > _T0 + hours * 3600 + GRID_S]
    p = model.predict_proba(grows)
    assert (p >= model.threshold).any(), f"no alarm as the rate grows (max p {p.max():.2f})"


def test_live_scorer_learns_the_baseline_too(model: FailurePredictor) -> None:
    """The collector's path: quiet through the trickle once learned, alarms as it grows;
    its features (baseline included) equal the batch features."""
    from forewarn.models.live import LiveScorer
    from forewarn.wire import GpuSample

    hours = 14.0
    df = _trickle(30.0, hours, accel_hours=2.0, seed=3)
    batch = gpu_features(df).set_index("time")
    scorer = LiveScorer(model)
    quiet: list[int] = []
    grows: list[int] = []
    next_score = _T0 + _BASELINE_H * 3600
    cols = [c for c in df.columns if c not in ("node", "gpu", "time")]
    for row in df.itertuples(index=False):
        if row.time >= next_score:
            _slots, feats, ft = scorer.features(next_score)
            for c in FEATURE_NAMES:
                np.testing.assert_allclose(feats[c], [batch.loc[ft, c]], atol=1e-6, err_msg=c)
            found = scorer.score(next_score)
            (grows if next_score > _T0 + hours * 3600 else quiet).append(len(found))
            next_score += 10 * GRID_S
        kw = {c: getattr(row, c) for c in cols}
        kw = {k: (int(v) if k in ("throttle_reasons", "pcie_link_width", "pcie_link_width_max")
                  or k.startswith(("ecc", "remap", "pcie_replay")) else float(v))
              for k, v in kw.items()}
        scorer.observe(GpuSample(node="n1", gpu=0, time=float(row.time), source="replay",
                                 **kw))
    assert len(quiet) >= 20 and sum(quiet) == 0
    assert sum(grows) > 0
