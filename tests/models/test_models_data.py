"""Fleet simulator, feature pipeline (batch == live), data validation."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pytest

from forewarn.models.features import (
    FEATURE_NAMES,
    LEGACY_NAMES,
    gpu_features,
    rank_features,
)
from forewarn.models.fleetsim import load_params, simulate_fleet
from forewarn.models.live import LiveScorer
from forewarn.models.predictor import FailurePredictor
from forewarn.models.schema import DataError, validate_samples
from forewarn.wire import GpuSample, NvlinkCounters, XidEvent


def _small(**kw: object) -> object:
    return load_params().replace(nodes=2, gpus_per_node=4, days=0.25, **kw)


def test_simulator_is_deterministic_and_labelled() -> None:
    p = load_params().replace(nodes=3, days=2.0, seed=5, rate_per_1000_gpu_days=200.0)
    a, b = simulate_fleet(p), simulate_fleet(p)
    pd.testing.assert_frame_equal(a.samples, b.samples)
    assert len(a.labels) > 0
    assert set(a.labels.columns) >= {"node", "gpu", "time", "cause", "had_precursor"}
    assert set(a.labels["cause"]) <= {c.name for c in p.causes}
    # A failed GPU writes nothing after its failure.
    for row in a.labels.itertuples():
        g = a.samples[(a.samples.node == row.node) & (a.samples.gpu == row.gpu)]
        assert g["time"].max() <= row.time
    # Counters are cumulative (never decrease within a GPU).
    diffs = a.samples.groupby(["node", "gpu"])["ecc_corrected_volatile"].diff().dropna()
    assert (diffs >= 0).all()
    assert 20 < a.samples["temperature_c"].median() < 90


class _Zero:
    """A classifier stand-in that scores every row 0 (the test only compares features)."""

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        return np.column_stack([np.ones(len(x)), np.zeros(len(x))])


class _One:
    """A classifier stand-in that scores every row 1 (every GPU alarms)."""

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        return np.column_stack([np.zeros(len(x)), np.ones(len(x))])


def _to_sample(r: dict[str, object]) -> GpuSample:
    keys = ("node", "gpu", "uuid", "time", "temperature_c", "slowdown_margin_c", "power_w",
            "power_limit_w", "throttle_reasons", "ecc_corrected_volatile",
            "ecc_uncorrected_volatile", "remapped_rows_correctable",
            "remapped_rows_uncorrectable", "remap_pending", "remap_failure",
            "retired_pages_sbe", "retired_pages_dbe", "pcie_replay_total", "pcie_link_width",
            "pcie_link_width_max")
    kw: dict[str, Any] = {k: getattr(r[k], "item", lambda v=r[k]: v)() for k in keys}
    links = tuple(NvlinkCounters(link=k, crc_flit=int(str(r[f"nvlink{k}_crc_flit"])),
                                 replay=int(str(r[f"nvlink{k}_replay"])))
                  for k in range(4))
    return GpuSample(source="replay", nvlink=links, state=str(r["state"]), **kw)  # type: ignore[arg-type]


def test_live_features_equal_batch_features() -> None:
    p = load_params().replace(nodes=1, gpus_per_node=3, days=0.15, seed=3,
                              rate_per_1000_gpu_days=0.0, noise_scale=4.0)
    d = simulate_fleet(p)
    batch = gpu_features(d.samples, d.xids)
    live = LiveScorer(FailurePredictor(classifier=_Zero()))
    rows = d.samples.sort_values(["time", "gpu"]).to_dict("records")
    xids = d.xids.to_dict("records")
    xi, checked = 0, 0
    for k, r in enumerate(rows):
        t = float(r["time"])
        if k and int(t // 60) != int(float(rows[k - 1]["time"]) // 60):
            slots, feats, ft = live.features(t)
            b = batch[batch.time == ft].sort_values("gpu")
            assert len(b) == len(slots)
            for c in FEATURE_NAMES + LEGACY_NAMES:
                np.testing.assert_allclose(feats[c], b[c].to_numpy(), atol=1e-6, err_msg=c)
            checked += 1
        while xi < len(xids) and xids[xi]["time"] <= t:
            x = xids[xi]
            live.observe_xid(XidEvent(node=x["node"], gpu=int(x["gpu"]), code=int(x["xid"]),
                                      time=float(x["time"]), source="replay"))
            xi += 1
        live.observe(_to_sample(r))
    assert checked > 100


def test_missing_columns_are_named() -> None:
    df = pd.DataFrame({"node": ["a"], "temperature_c": [50.0]})
    with pytest.raises(DataError, match=r"missing column.*gpu, time"):
        validate_samples(df, "h.csv")


@pytest.mark.parametrize(("col", "value", "unit"), [
    ("temperature_c", 333.15, "Kelvin"),
    ("power_w", 350_000.0, "milliwatts"),
    ("time", 1.7e12, "milliseconds"),
])
def test_wrong_units_are_named(col: str, value: float, unit: str) -> None:
    df = pd.DataFrame({"node": ["a"] * 3, "gpu": [0] * 3, "time": [1.7e9, 1.7e9 + 1, 1.7e9 + 2],
                       "temperature_c": [50.0] * 3, "power_w": [300.0] * 3})
    df[col] = value
    with pytest.raises(DataError, match=rf"{col}.*{unit}"):
        gpu_features(df)


def test_features_accept_sparse_replay_columns_and_inline_xids() -> None:
    df = pd.DataFrame({"node": "n", "gpu": 0, "time": 1.7e9 + np.arange(0, 3600, 10.0),
                       "temperature_c": 60.0, "xid": np.nan})
    df.loc[100, "xid"] = 79
    f = gpu_features(df)
    assert list(f.columns[3:]) == list(FEATURE_NAMES + LEGACY_NAMES)
    assert f["xid_bus_60"].max() == 1
    assert np.isfinite(f[list(FEATURE_NAMES)].to_numpy()).all()


def test_rank_features_flag_the_slow_and_divergent_rank() -> None:
    rng = np.random.default_rng(0)
    rows = []
    for t in range(60):
        for r in range(16):
            rows.append({"job": "j", "rank": r, "time": 1.7e9 + t,
                         "step_seconds": 1.0 + rng.normal(0, 0.01) + (0.5 if r == 7 else 0),
                         "loss": 2.0 + rng.normal(0, 0.01) + (1.0 if r == 3 else 0),
                         "grad_norm": 1.0 + rng.normal(0, 0.05)})
    f = rank_features(pd.DataFrame(rows))
    worst = f.groupby("rank")[["step_ratio", "loss_z"]].mean()
    assert worst["step_ratio"].idxmax() == 7 and worst.loc[7, "step_ratio"] > 1.3
    assert worst["loss_z"].idxmax() == 3 and worst.loc[3, "loss_z"] > 10


def test_simulated_recording_plays_through_the_agent_replay_source(tmp_path: object) -> None:
    """The simulator writes the agent's replay format: the agent's ReplayBackend plays it
    back, and the live scorer fed from it gives the batch model's probabilities."""
    from pathlib import Path

    from forewarn.agent.sources.replay import ReplayBackend
    from forewarn.models.fleetsim import write_fleet
    from forewarn.models.persist import load_default_model

    out = Path(str(tmp_path))
    d = simulate_fleet(load_params().replace(nodes=1, gpus_per_node=4, days=1.0, seed=2,
                                             rate_per_1000_gpu_days=0.0, noise_scale=3.0))
    assert len(d.xids) > 0
    paths = write_fleet(d, out)
    clock = [0.0]
    backend = ReplayBackend(paths["samples"], xid_path=paths["xids"], retime=False,
                            speed=1e9, clock=lambda: clock[0])
    backend.open()
    assert backend.ignored_columns == []
    clock[0] = 1.0
    samples, xids = backend.sample(1.0), backend.drain_xids()
    assert len(samples) == len(d.samples) and len(xids) == len(d.xids)
    model = load_default_model()
    batch = gpu_features(d.samples, d.xids)
    batch["p"] = model.predict_proba(batch)
    live = LiveScorer(model)
    events = sorted([(s.time, 1, s) for s in samples] + [(x.time, 0, x) for x in xids],
                    key=lambda e: (e[0], e[1]))
    xs, expected, prev_minute = [], [], None
    for t, kind, ev in events:
        minute = int(t // 60)
        if prev_minute is not None and minute != prev_minute and minute % 5 == 0:
            slots, feats, ft = live.features(t)
            xs.append(np.column_stack([feats[c] for c in model.feature_names]))
            # The GPUs scored live: those with a sample in the last stale_s (the simulator
            # has telemetry gaps; batch rows go on through a gap).
            gpus = [live._gpus[i] for i in slots]
            expected.append(batch[batch.time == ft].set_index("gpu").loc[gpus, "p"]
                            .to_numpy())
        prev_minute = minute
        if kind:
            live.observe(ev)  # type: ignore[arg-type]
        else:
            live.observe_xid(ev)  # type: ignore[arg-type]
    assert len(xs) > 250
    np.testing.assert_allclose(model.predict_proba(np.vstack(xs)), np.concatenate(expected),
                               atol=1e-9)
    assert np.concatenate(expected).max() > 0  # not a trivially all-zero comparison


def test_a_constant_gauge_has_no_spread_live_or_batch() -> None:
    """A GPU held at its power cap reads a power spread of exactly zero, in batch and live
    alike: the variance of a constant is no residue of how the sums were rounded (a tree's
    split at zero turned on that residue, and live and batch disagreed)."""
    t = 1.75e9 + np.arange(0.0, 3 * 3600, 7.0)  # several samples per minute
    df = pd.DataFrame({"node": "n1", "gpu": 0, "time": t, "temperature_c": 61.3,
                       "power_w": 699.7, "power_limit_w": 700.0})
    batch = gpu_features(df)
    assert (batch["power_std15"] == 0.0).all()
    assert (batch["temp_std_vs_own"] == 0.0).all()
    scorer = LiveScorer(FailurePredictor(classifier=_Zero()))
    for row in df.itertuples(index=False):
        scorer.observe(GpuSample(node="n1", gpu=0, time=float(row.time), source="test",
                                 temperature_c=61.3, power_w=699.7, power_limit_w=700.0))
    _slots, feats, _ft = scorer.features(float(t[-1]) + 60.0)
    assert feats["power_std15"].tolist() == [0.0]
    assert feats["power_std_vs_own"].tolist() == [0.0]


def test_live_features_mid_minute_are_the_batch_features_of_the_last_minute() -> None:
    """The collector scores every 10 s: samples of the open minute have arrived by then.
    The features are those of the last complete minute, latest values included, as the
    batch row of that minute has them (the open minute's newer values are not mixed in)."""
    t0 = 1.75e9
    times = t0 + np.arange(0.0, 30 * 60, 10.0)
    margin = 20.0 + (np.arange(len(times)) % 7)  # changes with every sample
    df = pd.DataFrame({"node": "n1", "gpu": 0, "time": times, "temperature_c": 60.0,
                       "slowdown_margin_c": margin, "power_w": 500.0,
                       "power_limit_w": 700.0 - (np.arange(len(times)) % 3),
                       "pcie_link_width": np.where(np.arange(len(times)) % 2, 8, 16),
                       "pcie_link_width_max": 16})
    batch = gpu_features(df).set_index("time")
    scorer = LiveScorer(FailurePredictor(classifier=_Zero()))
    checked = 0
    for row in df.itertuples(index=False):
        scorer.observe(GpuSample(node="n1", gpu=0, time=float(row.time), source="test",
                                 temperature_c=60.0, slowdown_margin_c=float(row.slowdown_margin_c),
                                 power_w=500.0, power_limit_w=float(row.power_limit_w),
                                 pcie_link_width=int(row.pcie_link_width),
                                 pcie_link_width_max=16))
        if row.time % 60 == 30:  # mid-minute, three samples of the open minute in
            _slots, feats, ft = scorer.features(float(row.time) + 1.0)
            for c in ("margin_last", "width_ratio", "power_std15", "margin_mean5"):
                assert feats[c][0] == batch.loc[ft, c], (c, ft - t0)
            checked += 1
    assert checked >= 25


def test_scoring_within_a_minute_sees_a_gpu_that_came_back() -> None:
    """Scores are computed once a minute and reused by the scorings after it in that
    minute; a GPU heard from again after a long silence is scored at once all the same."""
    scorer = LiveScorer(FailurePredictor(classifier=_One(), threshold=0.5))
    t0 = 1.75e9

    def sample(gpu: int, t: float) -> GpuSample:
        return GpuSample(node="n1", gpu=gpu, time=t, source="test", temperature_c=60.0,
                         power_w=500.0, power_limit_w=700.0)

    for minute in range(25):
        for gpu in (0, 1) if minute < 3 else (0,):
            scorer.observe(sample(gpu, t0 + minute * 60 + 5))
    now = t0 + 25 * 60 + 1
    assert {f.subject.gpu for f in scorer.score(now)} == {0}
    scorer.observe(sample(1, now + 4))  # GPU 1 is back, in the same minute
    assert {f.subject.gpu for f in scorer.score(now + 10)} == {0, 1}
    slots, _feats, _ft = scorer.features(now + 10)
    assert sorted(scorer._gpus[i] for i in slots) == [0, 1]


class _Hotter:
    """A classifier stand-in whose probability grows with how much hotter than its node
    peers a GPU runs (a different probability for every GPU of the tests below)."""

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        p = 1.0 / (1.0 + np.exp(-x[:, FEATURE_NAMES.index("temp_vs_peers")]))
        return np.column_stack([1 - p, p])


def test_every_scoring_of_a_minute_gives_each_gpu_its_own_probability() -> None:
    """A minute's probabilities are computed for every GPU that may be a peer and reused
    by the scorings after it: each scored GPU's finding carries the model's probability on
    that GPU's features, also when a peer between them is no longer scored (silent for
    longer than stale_s) and on the later scorings of the minute."""
    model = FailurePredictor(classifier=_Hotter(), threshold=0.0)
    scorer = LiveScorer(model)
    t0 = 1.75e9 - 1.75e9 % 60
    for minute in range(25):
        for gpu in (0, 1, 2, 3) if minute < 20 else (0, 2, 3):  # GPU 1 goes quiet
            scorer.observe(GpuSample(node="n1", gpu=gpu, time=t0 + minute * 60 + 5,
                                     source="test", temperature_c=55.0 + 4 * gpu,
                                     power_w=500.0, power_limit_w=700.0))
    now = t0 + 25 * 60 + 1
    slots, feats, _ft = scorer.features(now)
    want = dict(zip((scorer._gpus[i] for i in slots),
                    model.predict_proba(np.column_stack([feats[c] for c in FEATURE_NAMES])),
                    strict=True))
    assert sorted(want) == [0, 2, 3] and len(set(want.values())) == 3
    for k in range(3):  # the first scoring of the minute and two that reuse it
        got = {f.subject.gpu: f.probability for f in scorer.score(now + 10 * k)}
        assert got == pytest.approx(want, abs=1e-12), k


def test_labels_from_telemetry_find_the_simulated_failures() -> None:
    from forewarn.models.labels import labels_from_telemetry

    d = simulate_fleet(load_params().replace(nodes=4, days=2.0, seed=8,
                                             rate_per_1000_gpu_days=300.0))
    found = labels_from_telemetry(d.samples, d.xids)
    visible = d.labels[d.labels["cause"].isin(["hbm3", "sram", "faulty_gpu", "thermal",
                                               "gsp", "network", "power_supply"])]
    assert len(visible) > 3
    merged = visible.merge(found, on=["node", "gpu"], suffixes=("", "_found"))
    assert len(merged) == len(visible)
    assert (merged["time_found"] - merged["time"]).abs().max() <= 60.0
    silent = d.labels[d.labels["cause"].isin(["nic", "sdc"])]
    assert not silent.merge(found, on=["node", "gpu"]).shape[0]


def test_a_sample_without_nvlink_counters_holds_them_live_and_in_batch() -> None:
    """GPU 0's samples of minutes 100 to 102 carry no NVLink counters (NaN in the table, no
    links on the wire), GPU 1's of minutes 120 to 122 a link without its CRC counter: the
    counter, at about 1,010, is not known to be 0 there, so when it comes back no burst of
    a thousand errors reads (before: the batch features took the absent counter as 0 and
    read ``nvl_crc_d5`` = log1p(1010) five minutes later, the 15- and 60-minute windows
    after them, while the live scorer held the last value, or took 0 for GPU 1), and the
    live features equal the batch ones."""
    t0, rng = 1.75e9, np.random.default_rng(0)
    gaps = {0: (100, 103), 1: (120, 123)}
    rows = [{"node": "n1", "gpu": g, "time": t0 + 60.0 * m + 5.0,
             "temperature_c": 60.0 + rng.normal(0, 0.5), "power_w": 500.0,
             "power_limit_w": 700.0, "nvlink0_replay": np.nan if g == 0 else 0.0,
             "nvlink0_crc_flit": np.nan if gaps.get(g, (0, 0))[0] <= m < gaps.get(g, (0, 0))[1]
             else 1000.0 + m // 10}
            for m in range(180) for g in range(4)]
    batch = gpu_features(pd.DataFrame(rows))
    assert batch["nvl_crc_d60"].max() < np.log1p(10.0)

    def sample(r: dict[str, Any]) -> GpuSample:
        crc, replay = (None if np.isnan(r[k]) else int(r[k])
                       for k in ("nvlink0_crc_flit", "nvlink0_replay"))
        links = () if crc is None and replay is None else (
            NvlinkCounters(link=0, crc_flit=crc, replay=replay),)
        return GpuSample(node="n1", gpu=r["gpu"], time=r["time"], source="replay",
                         temperature_c=r["temperature_c"], power_w=500.0, power_limit_w=700.0,
                         nvlink=links)

    names = [c for c in FEATURE_NAMES if c.startswith("nvl_crc")]
    assert _live_equals_batch(rows, batch, sample, names, t0 + 90 * 60.0) == 90


def _live_equals_batch(rows: list[dict[str, Any]], batch: pd.DataFrame,
                       sample: Any, names: list[str], start: float) -> int:
    """Feed ``rows`` (one dict a sample, in time order) to a live scorer as ``sample(row)``;
    before each of GPU 0's samples after ``start``, its features ``names`` equal ``batch``'s
    (the batch features of the rows) to 1e-6. Returns how many times they were compared."""
    live = LiveScorer(FailurePredictor(classifier=_Zero()))
    checked = 0
    for r in rows:
        if r["time"] > start and r["gpu"] == 0:
            _slots, feats, ft = live.features(r["time"])
            b = batch[batch.time == ft].sort_values("gpu")
            for c in names:
                np.testing.assert_allclose(feats[c], b[c].to_numpy(), atol=1e-6,
                                           err_msg=f"{c} at {ft - start:.0f} s")
            checked += 1
        live.observe(sample(r))
    return checked


def test_a_counter_reset_within_a_minute_leaves_the_minutes_last_value_live_and_in_batch(
        ) -> None:
    """GPU 0 samples every 30 s; its volatile ECC counter, at 1,000, resets to 0 (a driver
    reload) in the second half of minute 100. The grid holds a minute's last value of a
    counter, in batch as live (before: batch took the minute's largest, 1,000, live the
    last, 0, and the ECC features differed at that minute and at every window reaching
    back to it: ``ecc_d60`` by 6.4)."""
    t0, rng = 29166666 * 60.0, np.random.default_rng(0)  # on a minute's start
    rows = [{"node": "n1", "gpu": g, "time": t0 + 30.0 * h + 5.0,
             "temperature_c": 60.0 + rng.normal(0, 0.5), "power_w": 500.0,
             "ecc_corrected_volatile": 5.0 * (h if h < 201 else h - 201) * (g == 0)}
            for h in range(360) for g in range(3)]

    def sample(r: dict[str, Any]) -> GpuSample:
        return GpuSample(node="n1", gpu=r["gpu"], time=r["time"], source="replay",
                         temperature_c=r["temperature_c"], power_w=500.0,
                         ecc_corrected_volatile=int(r["ecc_corrected_volatile"]))

    names = [c for c in FEATURE_NAMES if c.startswith("ecc")]
    batch = gpu_features(pd.DataFrame(rows))
    assert _live_equals_batch(rows, batch, sample, names, t0 + 90 * 60.0) == 180


def test_the_collectors_summed_nvlink_columns_count_as_the_replay_files_per_link_ones() -> None:
    """The collector's telemetry history (what ``forewarn collector retrain`` trains on)
    holds NVLink counters already summed over links, ``nvlink_crc_flit`` and so on; a replay
    file holds them per link, ``nvlink0_crc_flit``. Both give the same features (before,
    the summed columns were not read: every NVLink feature of a model retrained from the
    collector's store was 0 in training, and not live)."""
    t0 = 1.75e9
    per_link = pd.DataFrame([{"node": "n1", "gpu": g, "time": t0 + 60.0 * m + 5.0,
                              "temperature_c": 60.0, "power_w": 500.0,
                              "nvlink0_crc_flit": 10.0 * m * (g == 1), "nvlink1_crc_flit": 2.0,
                              "nvlink0_replay": float(m // 3)}
                             for m in range(60) for g in range(3)])
    summed = per_link.drop(columns=["nvlink0_crc_flit", "nvlink1_crc_flit", "nvlink0_replay"])
    summed["nvlink_crc_flit"] = per_link["nvlink0_crc_flit"] + per_link["nvlink1_crc_flit"]
    summed["nvlink_replay"] = per_link["nvlink0_replay"]
    a, b = gpu_features(per_link), gpu_features(summed)
    assert a["nvl_crc_d15"].max() > 3 and a["nvl_replay_d15"].max() > 1
    pd.testing.assert_frame_equal(a, b)
