"""Goodput accounting and checkpoint interval advice (Daly's optimum)."""

from __future__ import annotations

import math

import pytest

from forewarn.collector.jobs.goodput import (
    GoodputTracker,
    advise_interval,
    daly_interval,
    expected_goodput,
)


def test_clean_run_is_all_useful_but_checkpoints() -> None:
    t = GoodputTracker()
    for step in range(0, 101):
        t.observe_step("j", step, 100.0 + step, 1.0)
    t.observe_checkpoint("j", "r1", 4.0, 200.0)
    t.observe_checkpoint("j", "r1", 5.0, 200.0)  # slower rank of the same order
    t.observe_checkpoint("j", "r1", 3.0, 200.0)
    g = t.jobs["j"]
    assert g.wall_s == 100.0
    assert g.checkpoint_s == 5.0
    assert g.useful_s == pytest.approx(95.0)
    assert g.goodput == pytest.approx(0.95)


def test_failure_splits_into_detection_restart_and_rework() -> None:
    t = GoodputTracker()
    for step in range(0, 51):  # steps 0..50 at 1 s each, t = 0..50
        t.observe_step("j", step, float(step), 1.0)
        t.observe_step("j", step, float(step), 1.0)  # the second rank: no double count
    t.observe_failure("j", noticed=53.0)  # last progress at 50: 3 s to notice
    # restart from checkpoint 40: step 41 completes at t = 80
    for i, step in enumerate(range(41, 56)):
        t.observe_step("j", step, 80.0 + i, 1.0)
    g = t.jobs["j"]
    assert g.detection_s == pytest.approx(3.0)
    assert g.restart_s == pytest.approx(26.0)  # step 41 began at 79
    assert g.restarts == 1
    assert g.rework_s == pytest.approx(10.0)  # steps 41..50 again
    assert g.useful_s == pytest.approx(50.0 + 5.0)  # 1..50 first time, then 51..55
    assert sum(g.lost().values()) + g.useful_s == pytest.approx(g.wall_s)


def test_unnoticed_failure_counts_the_whole_outage_as_detection() -> None:
    t = GoodputTracker()
    for step in range(0, 11):
        t.observe_step("j", step, float(step), 1.0)
    t.observe_step("j", 6, 700.0, 1.0)  # rolled back to 5 after a 690 s outage
    g = t.jobs["j"]
    assert g.restart_s == 0.0 and g.detection_s == pytest.approx(689.0)
    assert g.rework_s == pytest.approx(1.0)


def best_interval(c: float, r: float, m: float) -> float:
    """The interval that maximises Daly's exact goodput model, by a fine grid search."""
    grid = [m * 1e-4 * k for k in range(1, 20_001)]
    return max(grid, key=lambda t: expected_goodput(t, c, r, m))


@pytest.mark.parametrize(("c", "m"), [(60.0, 36_000.0), (600.0, 7_200.0), (600.0, 3_600.0),
                                      (1_800.0, 3_600.0)])
def test_advised_interval_is_the_optimum_when_checkpoints_are_slow(c: float, m: float) -> None:
    """Daly's estimate sits within 1 % of the exact model's optimum, also where C/M is large
    and Young's first-order sqrt(2CM) overshoots by 15-40 % (advice used to be Young's)."""
    best = best_interval(c, 0.0, m)
    gpus, gpu_mtbf_h = 8, m * 8 / 3600.0
    assert advise_interval(c, gpus, gpu_mtbf_h=gpu_mtbf_h) == pytest.approx(best, rel=0.01)
    assert daly_interval(c, m) == pytest.approx(best, rel=0.01)
    if c / m > 0.05:
        assert math.sqrt(2 * c * m) > 1.1 * best


def test_expected_goodput_is_youngs_waste_for_small_checkpoints() -> None:
    """For C << M the model's waste at the optimum is Young's sqrt(2C/M) (first order)."""
    c, m = 10.0, 1e6
    waste = 1 - expected_goodput(daly_interval(c, m), c, 0.0, m)
    assert waste == pytest.approx(math.sqrt(2 * c / m), rel=0.01)
    # Restart time costs wall time on every failure: e^(R/M) in Daly's model.
    assert expected_goodput(1000.0, c, 600.0, 7200.0) < expected_goodput(1000.0, c, 0.0, 7200.0)


def test_interval_advice_shrinks_with_risk() -> None:
    gpu_mtbf_h = 1000.0
    base = advise_interval(60.0, 100, gpu_mtbf_h=gpu_mtbf_h)
    assert base == pytest.approx(daly_interval(60.0, gpu_mtbf_h * 3600.0 / 100))
    risky = advise_interval(60.0, 100, gpu_mtbf_h=gpu_mtbf_h, risk=0.5, horizon_s=3600.0)
    assert risky < base / 2
    assert advise_interval(60.0, 100, gpu_mtbf_h=gpu_mtbf_h, risk=1e-9) == pytest.approx(base)
    with pytest.raises(ValueError):
        advise_interval(0.0, 8)
