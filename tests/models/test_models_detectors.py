"""Peer comparison (Minder-style), robust z-score, IsolationForest, lemon ranking."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from forewarn.cli import main
from forewarn.models.features import gpu_features
from forewarn.models.fleetsim import load_params, simulate_fleet
from forewarn.models.iforest import IsolationForestDetector
from forewarn.models.jobsim import FAULTS, simulate_job
from forewarn.models.lemon import DAY, FleetHistory, LemonRanker, read_events, stints
from forewarn.models.lemon_backtest import METHODS, SHIPPED, backtest, markdown
from forewarn.models.lifesim import LifeParams, simulate_life
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
    odd["remap_c_d60"], odd["pending_frac60"], odd["xid_memory_60"] = 1.0, 0.5, 4.0
    odd["temp_vs_own"], odd["temp_vs_peers"], odd["margin_vs_own"] = 20.0, 15.0, -20.0
    odd["thr_thermal_vs_own"], odd["thr_thermal_vs_peers"], odd["width_ratio"] = 1.0, 1.0, 0.5
    odd["ecc_vs_peers"], odd["pcie_vs_peers"], odd["baseline_hours"] = 6.0, 6.0, 24.0
    assert det.scores(odd)[0] < det.cutoff
    f = det.findings(odd, now=1.0)
    assert len(f) == 1 and f[0].check == "models.isolation_forest"


@pytest.fixture(scope="module")
def life() -> pd.DataFrame:
    return read_events(simulate_life(LifeParams(gpus=3000, years=3.0, seed=5)))


def test_lemon_ranking_finds_the_gpus_that_fail_next(life: pd.DataFrame) -> None:
    cut = float(life["event_time"].min() + 2.2 * 365 * DAY)
    ranker = LemonRanker(horizon_days=90).fit(life, as_of=cut)
    ranked = ranker.rank()
    assert ranked["method"].iloc[0].startswith("discrete-time hazard")
    future = life[life["hard"] & (life["event_time"] > cut)
                  & (life["event_time"] <= cut + 90 * DAY)]
    base_rate = ranked["gpu_id"].isin(future["gpu_id"]).mean()
    top = ranked.head(60)["gpu_id"].isin(future["gpu_id"]).mean()
    assert top >= 3 * base_rate, (top, base_rate)
    nodes = ranker.node_risk(ranked)
    assert nodes["risk"].between(0, 1).all()
    assert not nodes["node"].str.endswith(tuple(f"slot{i}" for i in range(8))).any()


def test_ranking_as_of_t_reads_nothing_after_t(life: pd.DataFrame, tmp_path: Path) -> None:
    """Appending later events (failures, moves, removals, new GPUs) leaves the ranking as of
    T unchanged, through the CLI as an operator runs it."""
    cut = float(life["event_time"].min() + 2.0 * 365 * DAY)
    raw = simulate_life(LifeParams(gpus=3000, years=3.0, seed=5))
    before, after = tmp_path / "before.csv", tmp_path / "after.csv"
    raw[raw["event_time"] <= cut].to_csv(before, index=False)
    later = raw[raw["event_time"] > cut]
    assert len(later) > 1000 and later["event_type"].isin(["install", "remove"]).any()
    raw.to_csv(after, index=False)
    for src, out in ((before, "r1.csv"), (after, "r2.csv")):
        assert main(["models", "rank", "--events", str(src), "--as-of", str(cut),
                     "--out", str(tmp_path / out)]) == 0
    r1, r2 = pd.read_csv(tmp_path / "r1.csv"), pd.read_csv(tmp_path / "r2.csv")
    assert len(r1) > 1000
    pd.testing.assert_frame_equal(r1, r2)


def test_shipped_ranking_beats_every_baseline_on_a_generated_fleet() -> None:
    ev = read_events(simulate_life(LifeParams(gpus=4000, years=3.5, seed=11)))
    res = backtest(ev, warmup_days=365.0, every_days=182.5)
    auc = res.pivot(index="cut", columns="method", values="auc")
    assert len(auc) >= 4
    for name in METHODS[1:]:
        assert auc[SHIPPED].mean() > auc[name].mean(), (name, auc.mean())
        assert (auc[SHIPPED] > auc[name]).mean() > 0.5, (name, auc)
    table = markdown(res)
    assert table.count("\n|") >= len(auc) + 2 and "**mean**" in table


def test_lemon_events_errors_name_the_column() -> None:
    with pytest.raises(DataError, match=r"missing column.*event_type"):
        read_events(pd.DataFrame({"gpu_id": ["a"], "event_time": [1]}))
    with pytest.raises(DataError, match=r"row 1: column location is empty for install"):
        read_events(pd.DataFrame({"gpu_id": ["a", "b"], "event_time": [1, 2],
                                  "event_type": ["install", "install"],
                                  "location": ["r1/n1/0", ""]}))
    bad = simulate_life(LifeParams(gpus=64, years=0.3, seed=0))
    bad["event_time"] = bad["event_time"] * 1000
    with pytest.raises(DataError, match=r"event_time.*milliseconds"):
        read_events(bad)
    iso = simulate_life(LifeParams(gpus=64, years=0.3, seed=0))
    iso["event_time"] = pd.to_datetime(iso["event_time"], unit="s", utc=True).astype(str)
    assert read_events(iso)["event_time"].dtype == np.float64


def test_life_history_keeps_gpus_in_service_between_install_and_remove() -> None:
    ev = read_events(pd.DataFrame({
        "gpu_id": ["a", "a", "a", "a", "a", "b", "b"],
        "event_time": [0, 10, 20, 30, 40, 0, 5],
        "event_type": ["install", "dbe", "remove", "install", "move", "install", "retire"],
        "location": ["r/n1/0", "", "", "r/n2/3", "r/n3/1/x", "r/n1/1", ""],
        "cohort": ["B1", "", "", "", "", "", ""]}))
    st = stints(ev)
    assert st[["gpu_id", "start", "end", "location", "cohort"]].values.tolist() == [
        ["a", 0.0, 20.0, "r/n1/0", "B1"], ["a", 30.0, 40.0, "r/n2/3", "B1"],
        ["a", 40.0, np.inf, "r/n3/1/x", "B1"], ["b", 0.0, 5.0, "r/n1/1", ""]]
    h = FleetHistory(ev)
    assert h.depth == 4
    f = h.covariates(45.0)
    assert f.index.tolist() == ["a"]  # b retired
    assert f.loc["a", "hard_all"] == 1 and f.loc["a", "age_days"] == pytest.approx(35 / DAY)
    assert h.covariates(25.0).empty  # a removed for repair, b retired
