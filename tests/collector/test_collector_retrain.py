"""``forewarn models retrain`` on a collector's own store: the candidate is of the kind that
ships (``rules_forest``) unless ``--detector model`` asks for the gradient-boosted one, a
better candidate is promoted, a worse one refused, rollback restores a version, and the
collector runs the current one."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from forewarn.cli import main
from forewarn.collector.config import CollectorConfig
from forewarn.collector.decide.policy_service import PolicyService
from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.store import Store
from forewarn.collector.storage.telemetry import TelemetryWriter
from forewarn.models.fleetsim import load_params, simulate_fleet
from forewarn.models.persist import load_default_model
from forewarn.models.registry import ModelRegistry
from forewarn.models.rules_forest import RulesForest
from forewarn.models.suites import classic

from support.history import fleet_batches, store_fleet
from support.polling import poll

FAST = ["--shadow-days", "1", "--min-failures", "1", "--max-iter", "20"]


def _service(data_dir: Path) -> PolicyService:
    """The collector's policy with its model loaded (it loads in the background)."""
    svc = PolicyService.from_config(CollectorConfig(data_dir=data_dir))
    predictor = svc.advisors.predictor
    assert predictor is not None
    assert poll(lambda: predictor.readiness()["ready"], 240, 0.1), predictor.readiness()
    return svc


def test_retrain_promotes_a_better_candidate_refuses_a_worse_one_and_rolls_back(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Two nodes of 8 GPUs for 3 days, failures inflated; the last day holds 5 of them.
    fleet = simulate_fleet(classic(load_params()).replace(
        nodes=2, gpus_per_node=8, days=3.0, rate_per_1000_gpu_days=300.0, seed=3))
    xids = fleet.xids.rename(columns={"xid": "code"})
    store = Store(tmp_path / "collector.db")
    store_fleet(store, TelemetryWriter(store, tmp_path / "telemetry", CollectorMetrics(),
                                       retention_days=3650), fleet.samples, xids)
    store.close()
    # The running model misses everything (a threshold no probability reaches).
    registry = ModelRegistry(tmp_path / "models")
    blind = load_default_model()
    blind.threshold = 1.01
    assert registry.add(blind, promote=True, reason="test: a model that misses all") == 1
    store_args = ["--data-dir", str(tmp_path)]

    assert main(["models", "retrain", *store_args, *FAST]) == 0
    out = capsys.readouterr().out
    assert "candidate version 2 (rules_forest): PROMOTED against version 1: better: recall" in out
    assert "feature drift (PSI" in out
    assert registry.current() == 2

    # A candidate that alarms on nothing is worse than version 2: refused, 2 keeps running.
    assert main(["models", "retrain", *store_args, *FAST, "--threshold", "1.01"]) == 0
    out = capsys.readouterr().out
    assert "candidate version 3 (rules_forest): REFUSED against version 2: worse recall" in out
    assert registry.current() == 2
    promoted = registry.load(2)
    assert isinstance(promoted.classifier, RulesForest)  # the kind that ships
    assert isinstance(registry.load(3).classifier, RulesForest)
    assert promoted.metadata["reference"]["features"]  # its training distribution

    predictor = _service(tmp_path).advisors.predictor
    assert predictor is not None and predictor.source == "registry v2"
    assert predictor.model is not None
    assert predictor.model.threshold == promoted.threshold
    # Drift counts GPUs whose own baseline is learned: 12 hours of telemetry.
    last = fleet.samples[fleet.samples["time"] >= fleet.samples["time"].max() - 12 * 3600]
    predictor.observe(list(fleet_batches(last, xids.iloc[:0], 1.0)))
    predictor.score(float(last["time"].max()))
    metrics = CollectorRegistry()
    predictor.register(metrics)
    text = generate_latest(metrics).decode()
    assert 'forewarn_collector_model_feature_drift{feature="ecc_d15"}' in text
    assert "forewarn_collector_model_drifted_features " in text

    assert main(["models", "drift", *store_args, "--days", "100000"]) == 0
    assert "feature drift (PSI" in capsys.readouterr().out

    assert main(["models", "rollback", "1", *store_args, "--reason", "test"]) == 0
    assert "running version 1" in capsys.readouterr().out
    assert registry.current() == 1
    predictor = _service(tmp_path).advisors.predictor
    assert predictor is not None and predictor.source == "registry v1"
    assert predictor.model is not None and predictor.model.threshold == 1.01
    assert predictor.drift is None  # the shipped model carries no training distribution
    assert main(["models", "versions", *store_args]) == 0
    out = capsys.readouterr().out
    assert "running version 1; versions 0, 1, 2, 3" in out
    assert [line.split()[3] for line in out.splitlines()[1:]] == [
        "promoted", "promoted", "refused", "rolled_back"]
    assert main(["models", "rollback", "9", *store_args]) == 2
    assert "no model version 9" in capsys.readouterr().err

    # The gradient-boosted kind only when asked for.
    assert main(["models", "retrain", *store_args, *FAST, "--detector", "model"]) == 0
    assert "candidate version 4 (model): " in capsys.readouterr().out
    boosted = registry.load(4)
    assert not isinstance(boosted.classifier, RulesForest)
    assert boosted.metadata["detector"] == "model"


def test_retrain_says_what_is_missing_on_a_short_store(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = Store(tmp_path / "collector.db")
    samples = pd.DataFrame({"node": ["n1"] * 30, "gpu": [0] * 30,
                            "time": [1_767_225_600.0 + 60 * i for i in range(30)],
                            "temperature_c": [50.0] * 30})
    store_fleet(store, TelemetryWriter(store, tmp_path / "telemetry", CollectorMetrics(),
                                       retention_days=3650), samples, samples.iloc[:0])
    store.close()
    assert main(["models", "retrain", "--data-dir", str(tmp_path)]) == 2
    assert "too short for a 7-day shadow window" in capsys.readouterr().err
    assert ModelRegistry(tmp_path / "models").versions() == [0]
    # The same from an export in the replay format, with a registry of its own.
    export = tmp_path / "export"
    export.mkdir()
    samples.to_parquet(export / "samples.parquet", index=False)
    assert main(["models", "retrain", "--data", str(export), "--registry",
                 str(tmp_path / "reg")]) == 2
    assert "too short for a 7-day shadow window" in capsys.readouterr().err
    assert main(["models", "drift", "--data", str(export), "--registry",
                 str(tmp_path / "reg")]) == 1
    assert "carries no training distribution" in capsys.readouterr().err


def test_live_drift_shows_a_shifted_feature_and_forgets_old_rows() -> None:
    import numpy as np

    from forewarn.collector.decide.drift import LiveDrift
    from forewarn.models.drift import DRIFTED, reference

    rng = np.random.default_rng(1)
    train = pd.DataFrame({"steady": rng.normal(0, 1, 10_000),
                          "shifted": rng.normal(0, 1, 10_000)})
    live = LiveDrift(reference(train, ["steady", "shifted"]), ["steady", "shifted"],
                     half_life_s=3600.0)
    assert live.psi() == {} and list(live.collect()) == []
    for k in range(20):  # 20 scorings of 256 sampled rows, the second feature 1 SD off
        live.update(np.column_stack([rng.normal(0, 1, 5000), rng.normal(1, 1, 5000)]),
                    10.0 * k)
    d = live.psi()
    assert d["steady"] < 0.1 < DRIFTED < d["shifted"]
    for k in range(20):  # a day later the fleet is back to normal: the old rows fade
        live.update(rng.normal(0, 1, (5000, 2)), 86400.0 + 10.0 * k)
    assert live.psi()["shifted"] < 0.1
