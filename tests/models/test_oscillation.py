"""Temperature oscillating with a period against the node's peers, and staying up for hours
against the GPU's own baseline (``temp_osc_vs_peers``, ``temp_recent_vs_own_vs_peers``;
models/oscillation.py, models/gauges.py): what they read, and that the live scorer computes
the same numbers as the batch features."""

from __future__ import annotations

import numpy as np
import pandas as pd

from forewarn.models.features import FEATURE_NAMES, GRID_S, LEGACY_NAMES, gpu_features
from forewarn.models.live import LiveScorer
from forewarn.models.persist import load_default_model
from forewarn.wire import GpuSample

_T0 = 1.75e9
_GPUS = 4


def _node(hours: float, seed: int = 0) -> np.ndarray:
    """Temperatures of one node's GPUs, (GPUs, minutes): a workload shared by the node
    (busy and idle every few hours) and noise."""
    rng = np.random.default_rng(seed)
    t = int(hours * 60)
    load = np.where((np.arange(t) // 150) % 3 == 2, 0.1, 0.9)[None, :]
    out: np.ndarray = 35.0 + 40.0 * load + rng.normal(0, 0.8, (_GPUS, t))
    return out


def _samples(temp: np.ndarray, keep: np.ndarray | None = None) -> pd.DataFrame:
    g, t = temp.shape
    gpu, minute = np.meshgrid(np.arange(g), np.arange(t), indexing="ij")
    df = pd.DataFrame({
        "node": "n1", "gpu": gpu.ravel(), "time": _T0 + 60.0 * minute.ravel() + 7.0,
        "temperature_c": temp.ravel().round(1), "slowdown_margin_c": 20.0,
        "power_w": 500.0, "power_limit_w": 700.0,
    })
    if keep is not None:
        df = df[keep.ravel()]
    return df.sort_values(["time", "gpu"], kind="stable", ignore_index=True)


def _sine(minutes: int, period: float, amp: float) -> np.ndarray:
    out: np.ndarray = amp * np.sin(2 * np.pi * np.arange(minutes) / period)
    return out


def test_a_gpu_swinging_alone_reads_its_amplitude_and_a_node_swinging_together_zero() -> None:
    """GPU 1 swings +-5 C with a 9-minute period for the last 40 minutes: it reads about 5
    C of oscillation (more than 4), its peers under 1. When every GPU of the node swings
    together (the workload's pace), none reads more than 1."""
    temp = _node(6.0)
    temp[1, -40:] += _sine(40, 9.0, 5.0)
    f = gpu_features(_samples(temp))
    last = f[f["time"] == f["time"].max()].set_index("gpu")["temp_osc_vs_peers"]
    assert 4.0 < last[1] < 6.0, last
    assert last.drop(1).max() < 1.0, last
    temp = _node(6.0)
    temp[:, -40:] += _sine(40, 9.0, 5.0)
    f = gpu_features(_samples(temp))
    assert f.loc[f["time"] == f["time"].max(), "temp_osc_vs_peers"].max() < 1.0


def test_a_smooth_rise_is_no_oscillation() -> None:
    """GPU 2 heats 15 C over 20 minutes and cools again (a hot spell): a straight line over
    the half hour takes most of it, and what is left is not periodic."""
    temp = _node(6.0)
    temp[2, -45:] += 15.0 * np.sin(np.linspace(0.0, np.pi, 45))
    f = gpu_features(_samples(temp))
    assert f.loc[f["gpu"] == 2, "temp_osc_vs_peers"].max() < 2.5


def test_a_gap_in_the_window_reads_zero() -> None:
    """A GPU missing 5 of the last 30 minutes (a gap bends the fitted line) reads zero,
    whatever it swings."""
    temp = _node(6.0)
    temp[1, -40:] += _sine(40, 9.0, 5.0)
    keep = np.ones(temp.shape, bool)
    keep[1, -20:-15] = False
    f = gpu_features(_samples(temp, keep))
    assert f.loc[(f["gpu"] == 1) & (f["time"] == f["time"].max()),
                 "temp_osc_vs_peers"].item() == 0.0


def test_a_sample_without_a_temperature_is_no_swing() -> None:
    """GPU 0's agent fails to read the temperature (power read) at one sample in 30 from hour
    6: such a sample counts at the GPU's last temperature, so the shipped model does not
    alarm on it and ``temp_osc_vs_peers`` stays under 3 C (the rule's is 4.4; what is left,
    2.5, is a failed read in the very minute the node's load steps 32 C: the held value is
    the minute before's). Before, it counted at 0 C in the minute's mean: 5.6 C of
    oscillation for 30 minutes after each and the model alarmed 90 of 180 minutes."""
    temp = _node(9.0, seed=3)
    temp[0, 6 * 60::30] = np.nan
    f = gpu_features(_samples(temp))
    gpu0 = f[(f["gpu"] == 0) & (f["time"] > _T0 + 6 * 3600)]
    assert gpu0["temp_osc_vs_peers"].max() < 3.0
    assert gpu0["temp_vs_own_vs_peers"].abs().max() < 1.0
    model = load_default_model()
    assert model.predict_proba(gpu0).max() < model.threshold


def test_recent_hours_against_the_own_baseline() -> None:
    """GPU 3 runs 8 C hotter from hour 16 on: 7 hours later, its mean since the baseline's
    end (hour 16 to 23) stands about 8 C above its own long-run level beyond its peers'."""
    temp = _node(23.0)
    temp[3, 16 * 60:] += 8.0
    f = gpu_features(_samples(temp))
    last = f[f["time"] == f["time"].max()].set_index("gpu")["temp_recent_vs_own_vs_peers"]
    assert 6.5 < last[3] < 9.5, last
    assert last.drop(3).abs().max() < 1.0, last


def _live_against_batch(df: pd.DataFrame, cols: tuple[str, ...], start_h: float,
                        step: int) -> dict[str, float]:
    """Feed ``df`` sample by sample to a live scorer, compare its features ``cols`` at every
    ``step`` minutes from ``start_h`` hours on with the batch features to 1e-6 (for the GPUs
    both have a row of), and return each column's largest live value."""
    batch = gpu_features(df)
    scorer = LiveScorer(load_default_model())
    seen = {c: 0.0 for c in cols}
    next_check = _T0 + start_h * 3600
    for row in df.itertuples(index=False):
        while row.time >= next_check:
            slots, feats, ft = scorer.features(next_check)
            b = batch[batch["time"] == ft].set_index("gpu")
            gpus = np.array([scorer._gpus[i] for i in slots])
            both = np.isin(gpus, b.index)
            for c in cols:
                np.testing.assert_allclose(feats[c][both], b.loc[gpus[both], c].to_numpy(),
                                           atol=1e-6, err_msg=f"{c} at {ft - _T0:.0f} s")
                seen[c] = max(seen[c], float(np.max(feats[c])))
            next_check += step * GRID_S
        temp = None if np.isnan(row.temperature_c) else float(row.temperature_c)
        scorer.observe(GpuSample(node="n1", gpu=int(row.gpu), time=float(row.time),
                                 source="replay", temperature_c=temp,
                                 slowdown_margin_c=20.0, power_w=500.0,
                                 power_limit_w=700.0))
    return seen


def test_live_oscillation_and_recent_hours_equal_the_batch_features() -> None:
    """A node with one GPU swinging, one drifting, one that starts late (hour 6.5: its
    window reaches back before its first sample) and gaps everywhere, and samples without a
    temperature (power only) on GPU 0, fed sample by sample to the live scorer: its
    features equal the batch features to 1e-6 (and are not all zero)."""
    hours = 9.0
    temp = _node(hours, seed=3)
    temp[1, -120:] += _sine(120, 7.0, 5.0)
    temp[2, 4 * 60:] += np.linspace(0.0, 12.0, temp.shape[1] - 4 * 60)
    temp[0, ::7] = np.nan
    keep = np.random.default_rng(4).random(temp.shape) > 0.03
    keep[3, :390] = False
    cols = ("temp_osc_vs_peers", "temp_recent_vs_own_vs_peers")
    seen = _live_against_batch(_samples(temp, keep), cols, hours - 2.6, 3)
    assert seen["temp_osc_vs_peers"] > 3.0 and seen["temp_recent_vs_own_vs_peers"] > 3.0, seen


def test_a_gpu_gone_for_good_is_a_peer_as_long_in_batch_as_live() -> None:
    """GPU 2 sends its last sample at minute 500 (it fell off the bus): live, it stays its
    peers' peer while it sent a sample in the last PEER_MINUTES, as after any gap; the
    batch features, whose grid of a GPU ended at its last sample, dropped it at once and
    its peers' features differed from the live ones (``temp_vs_peers`` by 0.45 C,
    ``temp_osc_vs_peers`` by 0.24). Every feature of the GPUs both have equal to 1e-6."""
    temp = _node(9.0, seed=3)
    temp[1, -120:] += _sine(120, 7.0, 5.0)
    keep = np.ones(temp.shape, bool)
    keep[2, 500:] = False
    _live_against_batch(_samples(temp, keep), FEATURE_NAMES + LEGACY_NAMES, 8.2, 1)
