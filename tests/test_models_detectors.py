"""Peer comparison (Minder-style), robust z-score, IsolationForest, lemon ranking."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from forewarn.models.features import gpu_features
from forewarn.models.fleetsim import load_params, simulate_fleet
from forewarn.models.iforest import IsolationForestDetector
from forewarn.models.jobsim import FAULTS, simulate_job
from forewarn.models.lemon import DAY, LemonRanker, read_events, simulate_events
from forewarn.models.peers import PeerComparison
from forewarn.models.schema import DataError
from forewarn.models.zscore import RobustZScore
from forewarn.wire import Health

METRICS = ("compute_s", "gpu_util_pct", "temperature_c", "power_w", "sm_clock_mhz",
           "ecc_per_interval")


def _peers() -> PeerComparison:
    return PeerComparison(METRICS, bucket_s=5.0, z_min=4.0, continuity=3, rel_floor=0.005,
                          abs_floor={"ecc_per_interval": 3.0})


def test_peer_comparison_names_the_degraded_gpu_within_60s() -> None:
    """Over many simulated 32-GPU jobs (slow, hot or erroring GPU, and healthy jobs), the
    suspect is named within 60 s of onset with precision >= 0.95."""
    pc = _peers()
    named = correct = faulty_runs = detected = 0
    for seed in range(50):
        fault = None if seed % 5 == 4 else FAULTS[seed % 3]
        df, victim = simulate_job(fault=fault, seed=seed, duration_s=400, onset_s=300)
        onset = df["time"].min() + 300
        s = pc.suspects(df)
        named += len(s)
        correct += int(((s["member"] == victim) & (s["time"] >= onset)).sum())
        if fault is not None:
            faulty_runs += 1
            hit = s[(s["member"] == victim) & (s["time"] >= onset) & (s["time"] <= onset + 60)]
            detected += int(len(hit) > 0)
    assert named > 0
    precision = correct / named
    assert precision >= 0.95, (precision, named)
    assert detected / faulty_runs >= 0.9, (detected, faulty_runs)


def test_peer_comparison_ignores_job_wide_changes_and_reports_findings() -> None:
    df, _ = simulate_job(fault=None, seed=11, duration_s=300)
    df.loc[df["time"] > df["time"].min() + 150, "compute_s"] *= 1.5  # everyone slows
    assert _peers().suspects(df).empty
    df, victim = simulate_job(fault="hot", seed=12, duration_s=420, onset_s=300)
    found = _peers().findings(df, now=float(df["time"].max()))
    assert found and found[0].subject.rank == victim and found[0].subject.kind == "rank"
    assert found[0].health == Health.DEGRADED


def test_robust_zscore_flags_a_spike_not_the_baseline() -> None:
    t = 1.7e9 + np.arange(200) * 60.0
    rng = np.random.default_rng(0)
    df = pd.DataFrame({"node": "n", "gpu": np.repeat([0, 1], 200), "time": np.tile(t, 2),
                       "temperature_c": 60 + rng.normal(0, 1, 400)})
    det = RobustZScore(["temperature_c"], window=60, threshold=6.0)
    assert det.findings(df) == []
    df.loc[399, "temperature_c"] = 85.0
    f = det.findings(df)
    assert len(f) == 1 and f[0].subject.gpu == 1 and "temperature_c" in f[0].reason


def test_isolation_forest_finds_the_failing_gpu() -> None:
    p = load_params().replace(nodes=2, days=1.0, seed=4, rate_per_1000_gpu_days=0.0)
    feats = gpu_features(simulate_fleet(p).samples)
    det = IsolationForestDetector(contamination=0.001, n_estimators=50).fit(feats)
    odd = feats.tail(1).copy()
    # A GPU in the last minutes of an HBM failure: ECC at ~1,000/h for an hour, rows
    # remapped, hot and throttling, PCIe link degraded.
    for col in ("ecc_d5", "ecc_d15", "ecc_d60", "ecc_conc15", "pcie_d15", "pcie_d60"):
        odd[col] = 6.0
    odd["ecc_active15"], odd["ecc_active60"], odd["pcie_active60"] = 15.0, 60.0, 60.0
    odd["remap_c_total"], odd["pending_frac60"], odd["xid_memory_60"] = 2.0, 0.5, 4.0
    odd["temp_mean5"], odd["margin_mean5"], odd["margin_last"] = 95.0, -5.0, -5.0
    odd["thr_thermal_frac15"], odd["thr_thermal_frac60"], odd["width_ratio"] = 1.0, 1.0, 0.5
    assert det.scores(odd)[0] < det.cutoff
    f = det.findings(odd, now=1.0)
    assert len(f) == 1 and f[0].check == "models.isolation_forest"


def test_lemon_ranking_finds_the_gpus_that_fail_next() -> None:
    ev = read_events(simulate_events(nodes=48, days=200, seed=3))
    cut = float(ev["event_time"].min() + 170 * DAY)
    past = ev[ev["event_time"] <= cut]
    ranker = LemonRanker(horizon_days=30).fit(past)
    ranked = ranker.rank(past, as_of=cut)
    assert ranked["method"].iloc[0].startswith("logistic")
    future = ev[ev["hard"] & (ev["event_time"] > cut) & (ev["event_time"] <= cut + 30 * DAY)]
    base_rate = future["gpu_id"].nunique() / len(ranked)
    top = ranked.head(20)["gpu_id"].isin(future["gpu_id"]).mean()
    assert top >= 3 * base_rate, (top, base_rate)
    nodes = ranker.node_risk(ranked)
    assert nodes["risk"].between(0, 1).all()


def test_lemon_events_errors_name_the_column() -> None:
    with pytest.raises(DataError, match=r"missing column.*slot"):
        read_events(pd.DataFrame({"gpu_id": ["a"], "node": ["n"], "first_seen": [0],
                                  "event_time": [1], "event_type": ["dbe"]}))
    bad = simulate_events(nodes=1, days=10, seed=0)
    bad["event_time"] = bad["event_time"] * 1000
    with pytest.raises(DataError, match=r"event_time.*milliseconds"):
        read_events(bad)
    iso = simulate_events(nodes=1, days=10, seed=0)
    iso["event_time"] = pd.to_datetime(iso["event_time"], unit="s", utc=True).astype(str)
    assert read_events(iso)["event_time"].dtype == np.float64
