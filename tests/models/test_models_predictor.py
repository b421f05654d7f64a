"""Failure predictor trained on small simulated fleets and judged on unseen ones;
persistence with the skops allow-list; live scoring with shadow scores; CLI and report."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import skops.io as sio

from forewarn.cli import main
from forewarn.models.evaluate import baseline_scores, evaluate_scores
from forewarn.models.features import FEATURE_NAMES, gpu_features
from forewarn.models.fleetsim import FleetParams, load_params, simulate_fleet, write_fleet
from forewarn.models.live import LiveScorer
from forewarn.models.persist import (
    ModelError,
    UntrustedModelError,
    load_default_model,
    load_model,
    save_model,
)
from forewarn.models.predictor import FailurePredictor, fit_table, label_rows, train_predictor
from forewarn.models.suites import classic
from forewarn.wire import GpuSample, NvlinkCounters

from support.images import check_png

pytestmark = pytest.mark.timeout(600)


def _params(**kw: object) -> FleetParams:
    # Small fleets with failures inflated further (200 per 1,000 GPU-days) for positives.
    base: dict[str, object] = {"nodes": 5, "days": 2.0, "rate_per_1000_gpu_days": 200.0}
    return classic(load_params()).replace(**(base | kw))


@pytest.fixture(scope="module")
def model() -> FailurePredictor:
    sets = []
    for seed, scale in ((11, 1.0), (12, 1.3)):
        d = simulate_fleet(_params(seed=seed, precursor_scale=scale))
        sets.append((gpu_features(d.samples, d.xids), d.labels))
    d = simulate_fleet(_params(seed=21))
    return train_predictor(sets, tune=(gpu_features(d.samples, d.xids), d.labels),
                           max_iter=60, neg_stride=10, target_false_alarms=2.0)


def test_predictor_beats_the_rules_baseline_on_unseen_fleets(model: FailurePredictor) -> None:
    # Seeds and parameter values training never saw: shorter precursors, more noise.
    d = simulate_fleet(_params(seed=31, nodes=8, precursor_scale=0.6, noise_scale=1.4))
    f = gpu_features(d.samples, d.xids)
    _y, keep = label_rows(f, d.labels, model.horizon_s)
    scored = model.score(f.loc[keep])
    assert scored["p"].between(0, 1).all()
    r = evaluate_scores(scored, d.labels, model.threshold, horizon_s=model.horizon_s)
    base = evaluate_scores(scored.assign(p=baseline_scores(f.loc[keep])), d.labels, 0.5,
                           horizon_s=model.horizon_s)
    assert r.failures_with_precursor >= 5
    assert r.recall_precursor >= 0.6, r
    assert r.precision >= 0.6, r
    assert r.median_lead_precursor_min >= 10.0, r
    assert r.false_alarms_per_1000_gpu_days < base.false_alarms_per_1000_gpu_days
    assert r.recall_precursor > base.recall_precursor


def test_fit_leaves_out_negatives_just_before_a_failure() -> None:
    # One GPU, a row a minute for 10 hours, failing at hour 9: the last hour is positive;
    # the hours before it may hold the precursor's start, so they are not fitted as normal.
    t = np.arange(0.0, 10 * 3600.0, 60.0)
    f = pd.DataFrame({"node": "n0", "gpu": 0, "time": t} | dict.fromkeys(FEATURE_NAMES, 0.0))
    labels = pd.DataFrame({"node": ["n0"], "gpu": [0], "time": [9 * 3600.0]})
    fit = fit_table(f, labels, 3600.0, neg_stride=1, precursor_window_s=4 * 3600.0)
    before = 9 * 3600.0 - f.loc[fit.index, "time"]
    assert (fit["y"] == 1).sum() == 60 and (before[fit["y"] == 1] <= 3600.0).all()
    negatives = before[fit["y"] == 0]
    assert len(negatives) > 0 and (negatives >= 4 * 3600.0).all()
    assert not ((before > 3600.0) & (before < 4 * 3600.0)).any()


def test_model_round_trips_through_skops(model: FailurePredictor, tmp_path: Path) -> None:
    path = save_model(model, tmp_path / "m.skops")
    again = load_model(path)
    x = np.random.default_rng(0).random((50, len(model.feature_names)))
    np.testing.assert_allclose(again.predict_proba(x), model.predict_proba(x))
    assert again.threshold == model.threshold and again.horizon_s == model.horizon_s


class Gadget:
    """A type no forewarn model contains."""

    def __init__(self) -> None:
        self.payload = "anything"


def test_untrusted_types_are_refused_with_their_names(tmp_path: Path) -> None:
    path = tmp_path / "evil.skops"
    sio.dump({"format": "forewarn.models/failure-predictor", "classifier": Gadget()}, path)
    with pytest.raises(UntrustedModelError, match=r"allow-list.*Gadget"):
        load_model(path)
    (tmp_path / "junk.skops").write_bytes(b"not a zip")
    with pytest.raises(ModelError, match="not a readable skops model"):
        load_model(tmp_path / "junk.skops")
    sio.dump({"format": "something-else"}, tmp_path / "other.skops")
    with pytest.raises(ModelError, match="not a forewarn failure-predictor"):
        load_model(tmp_path / "other.skops")


def test_default_model_ships_and_loads() -> None:
    m = load_default_model()
    assert 0 < m.threshold < 1 and m.horizon_s > 0
    assert m.predict_proba(np.zeros((3, len(m.feature_names)))).max() < m.threshold


def _sample(row: dict[str, object], state: str = "ok") -> GpuSample:
    keys = ("temperature_c", "slowdown_margin_c", "power_w", "power_limit_w",
            "throttle_reasons", "ecc_corrected_volatile", "ecc_uncorrected_volatile",
            "remapped_rows_correctable", "remapped_rows_uncorrectable", "remap_pending",
            "pcie_replay_total", "pcie_link_width", "pcie_link_width_max")
    kw = {k: getattr(row[k], "item", lambda v=row[k]: v)() for k in keys}
    return GpuSample(node=str(row["node"]), gpu=int(str(row["gpu"])),
                     time=float(str(row["time"])), source="replay", state=state,  # type: ignore[arg-type]
                     nvlink=(NvlinkCounters(link=0, crc_flit=int(str(row["nvlink0_crc_flit"])),
                                            replay=int(str(row["nvlink0_replay"]))),),
                     **kw)


def test_live_scorer_warns_before_failure_and_scores_itself(model: FailurePredictor) -> None:
    p = classic(load_params()).replace(nodes=4, days=1.0, seed=41,
                                        rate_per_1000_gpu_days=400.0)
    d = simulate_fleet(p)
    pre = d.labels[d.labels["had_precursor"] & d.labels["cause"].isin(["hbm3", "faulty_gpu"])]
    assert len(pre) > 0
    scorer = LiveScorer(model)
    findings = []
    rows = d.samples.sort_values("time", kind="stable").to_dict("records")
    next_score = rows[0]["time"] + 600
    for r in rows:
        if r["time"] >= next_score:
            findings += scorer.score(float(next_score))
            next_score += 60
        scorer.observe(_sample(r, state=str(r["state"])))
    target = pre.iloc[0]
    early = [f for f in findings if f.subject.node == target.node
             and f.subject.gpu == target.gpu and f.time <= target.time - 60]
    assert early, "no warning before the failure"
    assert all(f.probability is not None and f.probability >= model.threshold for f in early)
    assert early[0].horizon_s == model.horizon_s
    stats = scorer.shadow()
    assert stats.failures >= len(pre) and stats.caught >= 1
    assert stats.recall is not None and stats.lead_time_median_s is not None
    assert stats.lead_time_median_s > 60
    metrics = stats.as_metrics()
    assert metrics["forewarn_model_shadow_failures_total"] == stats.failures
    assert 0 <= metrics["forewarn_model_shadow_recall"] <= 1


def test_cli_simulate_train_eval_backtest(tmp_path: Path) -> None:
    train_dir, test_dir = tmp_path / "train", tmp_path / "test"
    for out, seed in ((train_dir, "51"), (test_dir, "52")):
        assert main(["models", "simulate-fleet", "--out", str(out), "--nodes", "4",
                     "--days", "2", "--rate", "200", "--seed", seed]) == 0
    model_path = tmp_path / "m.skops"
    assert main(["models", "train", "--data", str(train_dir), "--out", str(model_path),
                 "--threshold", "0.3"]) == 0
    report = tmp_path / "report"
    assert main(["models", "eval", "--model", str(model_path), "--data", str(test_dir),
                 "--report", str(report)]) == 0
    for name in ("pr_curve.png", "lead_times.png"):
        check_png(report / name)
    assert "baseline" in (report / "report.md").read_text()
    alarms = tmp_path / "alarms.csv"
    assert main(["models", "backtest", "--model", str(model_path), "--samples",
                 str(test_dir / "samples.parquet"), "--xids", str(test_dir / "xids.parquet"),
                 "--labels", str(test_dir / "labels.csv"), "--out", str(alarms)]) == 0
    assert alarms.exists()


def test_cli_errors_name_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                     ) -> None:
    d = tmp_path / "bad"
    data = simulate_fleet(load_params().replace(nodes=1, days=0.1))
    data.samples["temperature_c"] += 273.15
    write_fleet(data, d)
    assert main(["models", "train", "--data", str(d), "--out", str(tmp_path / "m")]) == 2
    assert "temperature_c" in capsys.readouterr().err
    data.labels.drop(columns="cause").to_csv(d / "labels.csv", index=False)
    assert main(["models", "eval", "--data", str(d), "--report", str(tmp_path / "r")]) == 2
    assert "cause" in capsys.readouterr().err


def test_cli_retrains_on_a_collector_style_store_and_ranks_events(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from forewarn.models.lifesim import LifeParams, simulate_life

    data = simulate_fleet(_params(seed=61, nodes=3))
    day = tmp_path / "store" / "telemetry" / "date=2026-01-01"
    day.mkdir(parents=True)
    data.samples.to_parquet(day / "part-0.parquet", index=False)
    data.xids.to_parquet(tmp_path / "store" / "xids.parquet", index=False)
    assert main(["models", "train", "--data", str(tmp_path / "store"), "--out",
                 str(tmp_path / "own.skops"), "--threshold", "0.5"]) == 0
    assert "found in the telemetry" in capsys.readouterr().err
    assert load_model(tmp_path / "own.skops").threshold == 0.5
    events = tmp_path / "events.csv"
    simulate_life(LifeParams(gpus=512, years=1.5, seed=1)).to_csv(events, index=False)
    assert main(["models", "rank", "--events", str(events), "--days", "14", "--top", "5",
                 "--out", str(tmp_path / "ranked.csv")]) == 0
    out = capsys.readouterr().out
    assert "risk of a hard failure in 14 days" in out and "nodes:" in out
