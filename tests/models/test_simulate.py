"""The goodput simulator reproduces published figures before it claims anything."""

from __future__ import annotations

import dataclasses
import math

import pytest

from forewarn.collector.jobs.goodput import daly_interval
from forewarn.simulate import (
    ElasticParams,
    RunParams,
    compare,
    compare_elastic,
    mttf_hours,
    simulate,
    young_interval,
)


@pytest.mark.parametrize(("gpus", "published_h"), [(16384, 1.8)])
def test_meta_projected_mttf_by_job_size(gpus: int, published_h: float) -> None:
    # Kokolis et al. (HPCA 2025): 1.8 h projected at 16,384 GPUs. Tolerance: 5 %.
    assert mttf_hours(gpus, days=2000) == pytest.approx(published_h, rel=0.05)


def test_mttf_scales_inversely_with_nodes() -> None:
    small, large = mttf_hours(1024, days=20000), mttf_hours(4096, days=5000)
    assert small / large == pytest.approx(4.0, rel=0.08)


@pytest.mark.parametrize(("c", "m"), [(60.0, 6 * 3600.0), (30.0, 2 * 3600.0)])
def test_young_waste_at_optimum(c: float, m: float) -> None:
    # Young: waste at T = sqrt(2CM) is sqrt(2C/M) to first order (checkpoint + rework).
    # Tolerance: 10 % relative (second-order terms are about sqrt(C/M) smaller).
    gpus = 8 * round(86400.0 * 1000.0 / 6.5 / m)
    p = RunParams(gpus=gpus, days=60.0, checkpoint_s=c, restart_s=0.0, nccl_timeout_s=0.0)
    assert p.mtbf_s == pytest.approx(m, rel=0.01)
    runs = [simulate(p, "baseline", seed) for seed in range(30)]
    waste = sum(r.waste("checkpoint_s", "rework_s") for r in runs) / len(runs)
    assert waste == pytest.approx(math.sqrt(2 * c / p.mtbf_s), rel=0.10)
    assert young_interval(c, m) == pytest.approx(math.sqrt(2 * c * m))


def test_fast_detection_and_prediction_save_work() -> None:
    """A predictor that catches 91 % of the failures with a precursor, 39 min ahead, at 0.88
    false alarms per 1,000 GPU-days (the gradient-boosted model's figures on fleets from its
    own simulator) saves work; the shipped one's held-out figures do not (README)."""
    good = RunParams(gpus=4096, days=10.0, recall=0.91, lead_median_s=39 * 60.0,
                     false_alarms_per_1k_gpu_days=0.88)
    res = compare(good, runs=6)
    base, fast, pro = res["baseline"], res["fast_detection"], res["proactive"]
    assert fast.failures >= base.failures > 0
    assert fast.detection_s < base.detection_s / 50
    assert fast.goodput > base.goodput
    assert pro.rework_s < fast.rework_s
    assert pro.goodput > fast.goodput
    for b in res.values():
        parts = b.useful_s + b.checkpoint_s + b.rework_s + b.detection_s + b.restart_s
        assert parts == pytest.approx(b.wall_s, rel=1e-9)


def test_useless_predictor_costs_goodput() -> None:
    p = RunParams(gpus=1024, days=10.0, recall=0.0, false_alarms_per_1k_gpu_days=200.0)
    res = compare(p, runs=4)
    assert res["proactive"].goodput < res["fast_detection"].goodput


def test_mtbf_column_follows_the_failure_rate_given(capsys: pytest.CaptureFixture[str]) -> None:
    """The table's MTBF is the simulated job's, not the default rate's (it used to ignore
    --failures-per-1k-node-days)."""
    from forewarn.cli import main

    assert main(["simulate", "--gpus", "1024", "--failures-per-1k-node-days", "187.5",
                 "--runs", "1", "--days", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.strip().startswith("1024")]
    assert rows and all(float(r[1]) == pytest.approx(1.00) for r in rows), rows


def test_elastic_continuation_beats_waiting_for_a_replacement() -> None:
    """One node failure per hour on 1,024 GPUs: shrinking and going on keeps more of the
    held GPU time than waiting for the replacement; both lose nothing without failures."""
    p = RunParams(gpus=1024, days=5.0, failures_per_1k_node_days=187.5, checkpoint_s=30.0)
    assert p.mtbf_s == pytest.approx(3600.0)
    e = ElasticParams(replace_s=1800.0, rendezvous_s=60.0)
    res = compare_elastic(p, e, runs=4)
    wait, elastic = res["wait_replace"], res["elastic"]
    assert wait.failures > 50 and elastic.failures > 50
    assert elastic.utilisation > wait.utilisation + 0.1
    # The only loss left without failures is the checkpoint overhead at Daly's interval.
    calm = dataclasses.replace(p, failures_per_1k_node_days=1e-9)
    for r in compare_elastic(calm, e, runs=1).values():
        interval = daly_interval(p.checkpoint_s, calm.mtbf_s)
        assert r.failures == 0
        assert r.utilisation == pytest.approx(interval / (interval + p.checkpoint_s), rel=1e-3)


def test_the_cost_models_gate_orders_a_save_only_where_p_times_work_pays() -> None:
    """(d) weighs each alarm with the collector's own ``decide_checkpoint``. False alarms
    at P 0.001 would need 16 h of unsaved work to pay for a 60 s checkpoint (Daly's interval
    here is half an hour): none is ordered. Predictions at P 0.5 pay after 2 minutes: those
    are. So (d) orders far fewer saves than (c), loses less work to failures than without
    prediction, and its goodput is higher than (c)'s."""
    from forewarn.simulate_gate import Gate

    p = RunParams(gpus=4096, days=10.0, false_alarms_per_1k_gpu_days=30.0,
                  true_alarm_p=((0.5, 1.0),), false_alarm_p=((0.001, 1.0),))
    res = compare(p, runs=4)
    every, gated = res["proactive"], res["gated"]
    # (a false alarm while a checkpoint stalls the job is absorbed: (c) stalls more often)
    assert gated.alarms >= every.alarms > 0 and every.ordered == every.alarms
    assert 0 < gated.ordered < every.ordered / 10
    assert gated.goodput > every.goodput
    assert gated.rework_s <= res["fast_detection"].rework_s

    gate = Gate(p.checkpoint_s)
    one = simulate(p, "gated", seed=1, gate=gate)
    assert len(gate.decisions) == one.alarms > 0
    assert one.ordered == sum(d.act for d in gate.decisions)
    for d in gate.decisions:
        assert d.act == (d.probability * d.work_s > d.checkpoint_s), d
        assert d.probability_source == "finding" and d.checkpoint_s == 60.0
    assert not [d for d in gate.decisions if d.probability == 0.001 and d.act]
    assert [d for d in gate.decisions if d.probability == 0.5 and d.act]


def test_alarm_p_bands_from_the_command_line() -> None:
    from forewarn.simulate_gate import parse_band

    assert parse_band("0.29:0.4") == (0.29, 0.4) and parse_band("0.5") == (0.5, 1.0)
    for bad in ("1.5:1", "0.2:0", "x"):
        with pytest.raises(ValueError):
            parse_band(bad)


def test_the_gate_weighs_a_declined_prediction_again_while_the_gpu_stays_alarmed() -> None:
    """The collector weighs an alarmed GPU's finding again every 5 minutes (the policy's
    dedup) until the failure, with the work at risk grown since. Every prediction here
    reaches back past the restart before it, so it fires with no unsaved work, where P 0.29
    does not pay for a 60 s checkpoint; 207 s of work later it does: the gate orders a save
    before nearly every predicted failure, each alarm counted once."""
    from forewarn.simulate_gate import Gate

    p = RunParams(gpus=4096, days=10.0, predictable_share=1.0, recall=1.0,
                  lead_median_s=30 * 86400.0, false_alarms_per_1k_gpu_days=0.0,
                  true_alarm_p=((0.29, 1.0),))
    gate = Gate(p.checkpoint_s)
    b = simulate(p, "gated", seed=0, gate=gate)
    assert b.alarms > 10 and gate.decisions[0].work_s == 0.0 and not gate.decisions[0].act
    assert b.ordered >= 0.8 * b.alarms
    assert b.alarms == sum(d.work_s == 0.0 for d in gate.decisions)


def test_the_gates_default_alarm_p_is_the_shipped_models() -> None:
    """``forewarn simulate``'s (d) draws a false alarm's P as the shipped model's P at its
    threshold (the lowest alarming score: bench/alarm_p.py found no false alarm on a
    healthy GPU), and its true alarms' lowest band is no lower: a model recalibrated since
    (the shipped model's P at 0.5 went from 0.0016 to 0.0018) leaves the README's (d) and
    the defaults stale, as they were after s9-thermal's."""
    import numpy as np

    from forewarn.models.persist import load_default_model
    from forewarn.simulate_gate import FALSE_ALARM_P, TRUE_ALARM_P

    model = load_default_model()
    at = model.failure_probability(np.array([model.threshold]))
    assert at is not None
    ((false_p, share),) = FALSE_ALARM_P
    assert share == 1.0 and false_p == pytest.approx(float(at[0]), rel=0.05), (false_p, at)
    assert min(p for p, _ in TRUE_ALARM_P) >= false_p * 0.95
    assert sum(s for _, s in TRUE_ALARM_P) == pytest.approx(1.0)
