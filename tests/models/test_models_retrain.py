"""Learning from the fleet's own history: the candidate retrain builds, the promotion gate,
the model registry, drift."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from forewarn.models.drift import DRIFTED, psi, reference
from forewarn.models.evaluate import EvalResult
from forewarn.models.fleetsim import CauseParams, load_params, simulate_fleet
from forewarn.models.gate import judge
from forewarn.models.persist import load_default_model
from forewarn.models.registry import SHIPPED, ModelRegistry, RegistryError
from forewarn.models.retrain import RetrainError, retrain
from forewarn.models.rules_forest import RulesForest
from forewarn.models.suites import classic

RESULT = EvalResult(threshold=0.5, episodes=4, true_episodes=3, false_episodes=1,
                    precision=0.75, failures=5, failures_with_precursor=4, caught=3,
                    caught_with_precursor=3, recall=0.6, recall_precursor=0.75,
                    lead_times_s=(600.0,) * 3, lead_times_precursor_s=(600.0,) * 3,
                    gpu_days=1000.0, false_alarms_per_1000_gpu_days=1.0)


def _with(**kw: float | int) -> EvalResult:
    return dataclasses.replace(RESULT, **kw)


def test_the_gate_promotes_only_a_candidate_better_at_no_more_false_alarms() -> None:
    running = RESULT
    v = judge(_with(recall_precursor=1.0, caught_with_precursor=4), running)
    assert v.promote and v.reason.startswith("better: recall 1.00 >= 0.75 at 1.00 <= 1.00")
    assert judge(_with(false_alarms_per_1000_gpu_days=0.5), running).promote
    worse = judge(_with(recall_precursor=0.5), running)
    assert not worse.promote and "worse recall" in worse.reason
    noisier = judge(_with(recall_precursor=1.0, false_alarms_per_1000_gpu_days=1.5), running)
    assert not noisier.promote and "more false alarms" in noisier.reason
    same = judge(RESULT, running)
    assert not same.promote and "no better" in same.reason
    few = judge(_with(recall_precursor=1.0), running, min_failures=5)
    assert not few.promote and "too few failures" in few.reason
    assert worse.scores()["candidate"]["recall_precursor"] == 0.5


def test_registry_records_every_decision_and_rolls_back_by_version(tmp_path: Path) -> None:
    reg = ModelRegistry(tmp_path / "models")
    assert reg.current() == SHIPPED and reg.versions() == [0] and reg.decisions() == []
    first = load_default_model()
    first.threshold = 0.61
    assert reg.add(first, promote=True, reason="better", scores={"x": 1}, now=10.0) == 1
    second = load_default_model()
    second.threshold = 0.62
    assert reg.add(second, promote=False, reason="worse", now=20.0) == 2
    assert reg.current() == 1 and reg.load().threshold == 0.61
    assert reg.load(2).threshold == 0.62 and reg.versions() == [0, 1, 2]
    reg.rollback(0, now=30.0)
    assert reg.current() == 0
    assert reg.load().threshold == load_default_model().threshold
    reg.rollback(1, reason="the shipped one alarms too often", now=40.0)
    assert reg.current() == 1
    assert [(d["version"], d["previous"], d["decision"]) for d in reg.decisions()] == [
        (1, 0, "promoted"), (2, 1, "refused"), (0, 1, "rolled_back"), (1, 0, "rolled_back")]
    assert reg.decisions()[0]["scores"] == {"x": 1}
    with pytest.raises(RegistryError, match="no model version 7"):
        reg.rollback(7)
    (tmp_path / "models" / "registry.json").write_text("{")
    with pytest.raises(RegistryError, match="not valid JSON"):
        reg.current()


def test_drift_shows_a_shifted_feature_and_not_an_unshifted_one() -> None:
    rng = np.random.default_rng(0)
    n = 20_000
    train = pd.DataFrame({"steady": rng.normal(0, 1, n), "shifted": rng.normal(0, 1, n),
                          "mostly_zero": np.where(rng.random(n) < 0.9, 0.0,
                                                  rng.exponential(1.0, n))})
    ref = reference(train, list(train.columns))
    now = pd.DataFrame({"steady": rng.normal(0, 1, 5000), "shifted": rng.normal(1.0, 1, 5000),
                        "mostly_zero": np.where(rng.random(5000) < 0.6, 0.0,
                                                rng.exponential(1.0, 5000))})
    d = psi(ref, now)
    assert d["steady"] < 0.05
    assert d["shifted"] > DRIFTED and d["mostly_zero"] > DRIFTED


def test_drift_compares_gpus_with_a_learned_baseline_and_not_their_age() -> None:
    # Training saw the store's first days: young GPUs (no baseline yet: zero against their
    # own level, baseline_hours 0) and older ones. Later every GPU is two days old.
    rng = np.random.default_rng(2)
    n = 20_000
    age = rng.uniform(0, 60, n)
    learned = age >= 2
    train = pd.DataFrame({"baseline_hours": np.where(learned, np.minimum(age, 48), 0.0),
                          "temp_vs_own": np.where(learned, rng.normal(0, 1, n), 0.0)})
    ref = reference(train, list(train.columns))
    later = pd.DataFrame({"baseline_hours": np.full(5000, 48.0),
                          "temp_vs_own": rng.normal(0, 1, 5000)})
    d = psi(ref, later)
    assert "baseline_hours" not in d and d["temp_vs_own"] < 0.1


def test_drift_of_a_small_healthy_fleet_reads_stable() -> None:
    """A small fleet (one node's 8 GPUs over a few minutes) drawn from the very distribution
    the model learned from is not drifted: with a few dozen rows most bins are empty by
    chance, and an empty bin is no evidence of a shift. A real shift still shows once
    there are rows enough to tell."""
    rng = np.random.default_rng(3)
    n = 20_000

    def rows(k: int, shift: float = 0.0) -> pd.DataFrame:
        return pd.DataFrame({"temp_vs_own": rng.normal(shift, 1, k),
                             "ecc_d15": np.where(rng.random(k) < 0.9, 0.0,
                                                 rng.exponential(1.0 + shift, k))})

    ref = reference(rows(n), ["temp_vs_own", "ecc_d15"])
    for k in (8, 24, 40):
        d = psi(ref, rows(k))
        assert max(d.values()) < DRIFTED, f"{k} healthy rows read drifted: {d}"
    assert psi(ref, rows(2000, shift=1.0))["temp_vs_own"] > DRIFTED


def _bursty_fleet() -> tuple[pd.DataFrame, pd.DataFrame]:
    """Three nodes of 8 GPUs for 3 days whose failures (a correctable-ECC rate that
    accelerates, with repeated XIDs: the rules catch them) are inflated, and whose healthy
    GPUs all show a chronic behaviour the simulator never writes: a marginal board whose
    PCIe replays, correctable ECC and NVLink CRC come in a 2-minute burst every 2 hours,
    each GPU at its own phase, for its whole life. The shipped forest calls those bursts far
    out; the fleet's own forest has seen them on every healthy GPU."""
    hbm3 = CauseParams(name="hbm3", weight=1.0, precursor_share=1.0, final_xid=48,
                       families=("ecc_accel",))
    fleet = simulate_fleet(classic(load_params()).replace(
        nodes=3, gpus_per_node=8, days=3.0, rate_per_1000_gpu_days=150.0, seed=3,
        causes=(hbm3,)))
    s = fleet.samples.copy()
    failing = set(zip(fleet.labels["node"], fleet.labels["gpu"], strict=True))
    healthy = np.array([k not in failing for k in zip(s["node"], s["gpu"], strict=True)])
    minute = (s["time"].to_numpy() // 60).astype(np.int64) + 15 * s["gpu"].to_numpy()
    burst = healthy & (minute % 120 < 2)
    rng = np.random.default_rng(0)
    for col in ("pcie_replay_total", "ecc_corrected_volatile", "nvlink0_crc_flit"):
        extra = pd.Series(rng.poisson(1000, len(s)) * burst, index=s.index)
        s[col] += extra.groupby([s["node"], s["gpu"]]).cumsum()
    return s, fleet.xids


def test_retrain_builds_a_rules_forest_that_learns_the_fleets_chronic_behaviour(
        tmp_path: Path) -> None:
    samples, xids = _bursty_fleet()
    registry = ModelRegistry(tmp_path / "models")
    res = retrain(samples, xids, None, registry, shadow_days=1.0)
    candidate = registry.load(res.version)
    assert isinstance(candidate.classifier, RulesForest)
    assert candidate.metadata["detector"] == "rules_forest"
    assert res.running_version == SHIPPED
    c, r = res.verdict.candidate, res.verdict.running
    assert r["false_alarms_per_1000_gpu_days"] > 0, r  # the shipped forest cries wolf
    assert c["false_alarms_per_1000_gpu_days"] < r["false_alarms_per_1000_gpu_days"]
    assert c["recall_precursor"] >= r["recall_precursor"] > 0
    assert res.verdict.promote, res.verdict.reason
    assert registry.current() == res.version == 1


def test_retrain_refuses_an_unknown_detector_and_stores_nothing(tmp_path: Path) -> None:
    samples = pd.DataFrame({"node": ["n1"], "gpu": [0], "time": [1.767e9],
                            "temperature_c": [50.0]})
    registry = ModelRegistry(tmp_path / "models")
    with pytest.raises(RetrainError, match="detector: 'svm' is none of rules_forest, model"):
        retrain(samples, None, None, registry, detector="svm")
    assert registry.versions() == [SHIPPED] and registry.decisions() == []
