"""A GPU's own history is its baseline: a steady trickle of correctable ECC errors is
normal for that GPU (common on healthy GPUs in real fleets, issue 17), while the same
GPU's rate accelerating is a warning."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from forewarn.models.features import FEATURE_NAMES, GRID_S, LEGACY_NAMES, gpu_features
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
            for c in FEATURE_NAMES + LEGACY_NAMES:
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


# -- every gauge against its own baseline and its node peers; missing telemetry ----------

def _node(hours: float, *, hot_gpu: int | None = None, thin_gpu: int | None = None,
          thin_minutes: float = 60.0, node_gap: tuple[float, float] | None = None,
          node_hot: tuple[float, float] | None = None,
          node_loss: tuple[float, float, float] | None = None, seed: int = 0) -> pd.DataFrame:
    """Telemetry of one 8-GPU node at 60 s for ``hours``, busy with workload changes.
    ``hot_gpu`` runs 14 C hotter than its peers throughout, near its slowdown margin and
    throttling, at the power limit: chronic and stable. ``thin_gpu`` loses ever more
    samples over the last ``thin_minutes`` (up to 90 %) and then falls off the bus.
    ``node_gap`` (start h, minutes): no GPU of the node reports (an agent restart).
    ``node_hot`` (start h, hours): every GPU 10 C hotter (cooling trouble).
    ``node_loss`` (start h, hours, share): every GPU of the node loses that share of its
    samples, each sample at random (a congested network)."""
    rng = np.random.default_rng(seed)
    t = np.arange(0.0, hours * 3600, GRID_S)
    n = len(t)
    load = np.where((t // 5400) % 4 == 3, 0.1, 0.9)  # idle 90 min out of every 6 h
    frames = []
    for g in range(8):
        temp = 35 + 40 * load + rng.normal(0, 0.8, n)
        power = 700 * (0.1 + 0.85 * load) + rng.normal(0, 15, n)
        if node_hot is not None:
            temp += np.where((t >= node_hot[0] * 3600)
                             & (t < (node_hot[0] + node_hot[1]) * 3600), 10.0, 0.0)
        if g == hot_gpu:
            temp += 14.0
            power = np.minimum(power + 60, 700.0)
        margin = 87.0 - temp
        thr = np.where(margin < 3.0, 0x20, 0) | np.where(power >= 700.0, 0x4, 0)
        df = pd.DataFrame({
            "node": "n1", "gpu": g, "time": _T0 + t, "state": "ok",
            "temperature_c": temp, "slowdown_margin_c": margin, "power_w": power,
            "power_limit_w": 700.0, "throttle_reasons": thr,
            "ecc_corrected_volatile": 0, "ecc_uncorrected_volatile": 0,
            "remapped_rows_correctable": 0, "remapped_rows_uncorrectable": 0,
            "remap_pending": 0, "pcie_replay_total": 0, "pcie_link_width": 16,
            "pcie_link_width_max": 16,
        })
        keep = np.ones(n, bool)
        if g == thin_gpu:
            prog = np.clip((t - (t[-1] - thin_minutes * 60)) / (thin_minutes * 60), 0, 1)
            keep = rng.random(n) >= 0.9 * prog
            keep[-1] = True
            df.loc[n - 1, "state"] = "lost"
        if node_gap is not None:
            keep &= ~((t >= node_gap[0] * 3600) & (t < node_gap[0] * 3600 + node_gap[1] * 60))
        if node_loss is not None:
            during = (t >= node_loss[0] * 3600) & (t < (node_loss[0] + node_loss[1]) * 3600)
            keep &= ~(during & (rng.random(n) < node_loss[2]))
        frames.append(df[keep])
    return pd.concat(frames, ignore_index=True)


def _alarms(model: FailurePredictor, f: pd.DataFrame, after_h: float) -> pd.DataFrame:
    f = f[f["time"] >= _T0 + after_h * 3600]
    return f.loc[model.predict_proba(f) >= model.threshold, ["gpu", "time"]]


def test_chronically_hot_gpu_reads_normal_against_its_own_baseline() -> None:
    f = gpu_features(_node(30.0, hot_gpu=2))
    f = f[f["time"] >= _T0 + _BASELINE_H * 3600]
    hot, peer = f[f["gpu"] == 2].set_index("time"), f[f["gpu"] == 3].set_index("time")
    assert hot["temp_vs_peers"].median() > 10  # hotter than its peers, as it always is
    # but against its own long-run level it moves with the workload as its peers do
    assert (hot["temp_vs_own"] - peer["temp_vs_own"]).abs().quantile(0.9) < 3
    assert (hot["power_vs_own"] - peer["power_vs_own"]).abs().quantile(0.9) < 0.1


def test_chronically_hot_power_hungry_gpu_does_not_alarm(model: FailurePredictor) -> None:
    found = _alarms(model, gpu_features(_node(30.0, hot_gpu=2)), _BASELINE_H)
    assert found.empty, f"alarms on a chronically hot, stable GPU: {found.head()}"


def test_node_wide_heat_and_agent_restart_do_not_alarm(model: FailurePredictor) -> None:
    f = gpu_features(_node(30.0, node_gap=(14.0, 20.0), node_hot=(20.0, 3.0)))
    gap = f[(f["time"] > _T0 + 14 * 3600 + 20 * 60) & (f["time"] < _T0 + 14.5 * 3600)]
    assert gap["samples_vs_peers"].abs().max() < 1e-9  # every GPU went quiet together
    found = _alarms(model, f, _BASELINE_H)
    assert found.empty, f"alarms on a node-wide event: {found.head()}"


def test_gpu_going_quiet_before_it_falls_off_the_bus_alarms(model: FailurePredictor) -> None:
    hours = 14.0
    f = gpu_features(_node(hours, thin_gpu=5, thin_minutes=60.0, seed=1))
    end = _T0 + hours * 3600
    last = f[(f["gpu"] == 5) & (f["time"] >= end - 3600)]
    assert last["samples_missing15"].max() > 0.5
    found = _alarms(model, f, _BASELINE_H)
    assert (found["gpu"] != 5).sum() == 0, f"alarms on healthy GPUs: {found.head()}"
    early = found[(found["gpu"] == 5) & (found["time"] <= end - 10 * 60)]
    assert len(early), "no alarm 10 minutes or more before the GPU fell off the bus"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_node_wide_loss_of_samples_does_not_alarm(model: FailurePredictor, seed: int) -> None:
    """Every GPU of the node goes quiet together: no sample for 25 minutes (an agent
    restart), then 60 % of them lost at random for an hour (a congested network). Each GPU
    misses most of its usual samples, none more than its peers: no GPU alarms."""
    f = gpu_features(_node(30.0, node_gap=(14.0, 25.0), node_loss=(20.0, 1.0, 0.6), seed=seed))
    quiet = f[(f["time"] > _T0 + 20.25 * 3600) & (f["time"] < _T0 + 21 * 3600)]
    assert quiet["samples_missing15"].median() > 0.4  # they all went quiet
    assert quiet["samples_missing15_vs_peers"].max() < 0.6  # none much more than its peers
    found = _alarms(model, f, _BASELINE_H)
    assert found.empty, f"alarms on a node-wide loss of samples: {found.head()}"


def test_live_features_equal_batch_features_for_gauges_peers_and_gaps() -> None:
    """Own-baseline gauges, node peers and missing samples come out the same live (the
    collector's path) as in batch (training)."""
    from forewarn.models.live import LiveScorer
    from forewarn.wire import GpuSample

    hours = 10.0
    df = _node(hours, hot_gpu=2, thin_gpu=5, thin_minutes=90.0, node_gap=(8.5, 12.0),
               seed=4)
    df = df[df["state"] == "ok"].sort_values(["time", "gpu"], kind="stable")
    batch = gpu_features(df)
    scorer = LiveScorer(load_default_model())
    cols = [c for c in df.columns if c not in ("node", "gpu", "time", "state")]
    checked = 0
    next_check = _T0 + 8.0 * 3600
    for row in df.itertuples(index=False):
        while row.time >= next_check:  # score before the samples after it (a gap)
            slots, feats, ft = scorer.features(next_check)
            b = batch[batch["time"] == ft].set_index("gpu")
            gpus = [scorer._gpus[i] for i in slots]  # the GPUs fresh now
            assert set(gpus) <= set(b.index)
            for c in FEATURE_NAMES + LEGACY_NAMES:
                np.testing.assert_allclose(feats[c], b.loc[gpus, c].to_numpy(), atol=1e-6,
                                           err_msg=f"{c} at {ft - _T0:.0f} s")
            checked += 1
            next_check += 5 * GRID_S
        kw = {c: getattr(row, c) for c in cols}
        kw = {k: (int(v) if k in ("throttle_reasons", "pcie_link_width", "pcie_link_width_max")
                  or k.startswith(("ecc", "remap", "pcie_replay")) else float(v))
              for k, v in kw.items()}
        scorer.observe(GpuSample(node="n1", gpu=int(row.gpu), time=float(row.time),
                                 source="replay", **kw))
    assert checked >= 20


def test_gpu_without_its_own_baseline_reads_no_gauge_change_beside_peers_that_have_one(
        model: FailurePredictor) -> None:
    """GPU 7 is swapped in (a repaired GPU) at hour 17, as its 7 peers, at load since hour
    0, go idle for 90 minutes (hour 16.5 to 18): each peer reads 30-40 C below its own
    long-run level. GPU 7 has no baseline of its own yet, so it changed against nothing:
    its ``<g>_vs_own_vs_peers`` is zero and the gauge rules do not alarm on it."""
    df = _node(24.0)
    df = df[(df["gpu"] != 7) | (df["time"] >= _T0 + 17 * 3600)]
    f = gpu_features(df)
    idle = f[(f["time"] > _T0 + 17.25 * 3600) & (f["time"] < _T0 + 18 * 3600)]
    peers = idle[idle["gpu"] != 7]
    assert peers["temp_vs_own"].median() < -20  # the peers cooled against their own level
    new = idle[idle["gpu"] == 7]
    assert (new["baseline_hours"] == 0).all()
    for g in ("temp", "temp_std", "power_std"):
        assert (new[f"{g}_vs_own_vs_peers"] == 0).all(), g
    found = _alarms(model, f, _BASELINE_H)
    assert found.empty, f"alarms on a GPU without its own baseline: {found.head()}"
