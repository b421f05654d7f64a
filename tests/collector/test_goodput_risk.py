"""Goodput advice and a job's failure probability P: a P the predictor does not know (a
model without a calibration, a job none of whose GPUs was scored, no predictor) reads as
unknown (``null``), never 0, and the advice says it weighed the fleet's failure rate
alone."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from forewarn.collector.decide.goodput_service import AdviceSender, GoodputService
from forewarn.collector.decide.orders import OrderSettings
from forewarn.collector.decide.risk import RiskScores
from forewarn.collector.jobs.goodput import advise_interval
from forewarn.collector.jobs.jobview import RankTable
from forewarn.wire import RankSummary

JOB, NODE = "train-r", "n0"
T0 = 1_767_225_600.0
MTBF_H = 20_000.0
CKPT_S = 60.0


def _jobs() -> RankTable:
    jobs = RankTable()
    jobs.update([RankSummary(job=JOB, rank=r, world_size=2, node=NODE, gpu=r, pid=10 + r,
                             last_step=100, last_step_time=T0, step_seconds_p50=1.0)
                 for r in (0, 1)], T0)
    return jobs


def _scores(gpus: list[int], probs: list[float]) -> RiskScores:
    """A scoring of ``gpus`` on :data:`NODE`, the last one scored highest."""
    return RiskScores(T0, np.array([NODE] * len(gpus), dtype=object), np.array(gpus),
                      np.linspace(0.5, 0.9, len(gpus)), np.array(probs, dtype=float))


def _advise(scores: RiskScores | None) -> tuple[GoodputService, RankTable]:
    svc, jobs = GoodputService(checkpoint_default_s=CKPT_S, gpu_mtbf_h=MTBF_H), _jobs()
    svc.tracker.observe_step(JOB, 100, T0, 1.0)
    svc.refresh(T0, jobs, risk=scores.job_risk if scores is not None else None)
    return svc, jobs


@pytest.mark.parametrize("scores, where, why", [
    (_scores([0, 1], [math.nan, math.nan]), f"{NODE}/1", "the model has no calibration"),
    (_scores([5], [0.7]), "", "none of the job's GPUs was scored"),
    (None, "", "no failure predictor"),
])
def test_an_unknown_p_is_null_and_the_advice_weighs_the_fleet_rate_alone(
        scores: RiskScores | None, where: str, why: str) -> None:
    svc, jobs = _advise(scores)
    (row,) = svc.report_for(JOB)
    advice = row["advice"]
    assert advice["risk"] is None, advice  # unknown, not 0
    assert advice["risk_gpu"] == where
    assert advice["risk_source"] == f"unknown: {why}"
    assert advice["interval_s"] == pytest.approx(advise_interval(CKPT_S, 2, gpu_mtbf_h=MTBF_H))
    # the hooks are told so, not "risk 0.00"
    (command,) = AdviceSender(OrderSettings()).due(svc.advice, jobs, T0)
    assert command.command.advice is not None
    reason = command.command.advice.reason
    assert f"P unknown: {why} (fleet failure rate alone)" in reason, reason


def test_a_known_p_is_weighed() -> None:
    svc, jobs = _advise(_scores([0, 1], [0.2, 0.6]))
    a = svc.advice[JOB]
    assert (a.risk, a.risk_gpu, a.risk_source) == (0.6, f"{NODE}/1", "predictor")
    assert a.interval_s == pytest.approx(advise_interval(CKPT_S, 2, gpu_mtbf_h=MTBF_H,
                                                         risk=0.6))
    assert a.interval_s < advise_interval(CKPT_S, 2, gpu_mtbf_h=MTBF_H)
    (command,) = AdviceSender(OrderSettings()).due(svc.advice, jobs, T0)
    assert command.command.advice is not None
    assert "risk 0.60" in command.command.advice.reason
    assert dataclasses.asdict(a)["risk"] == 0.6


def test_advice_counts_as_sent_only_once_it_was_queued() -> None:
    """The queue's write may be refused (a stale leader: collector/storage/fence.py), so
    advice not queued stays due; advice queued is held back."""
    svc, jobs = _advise(None)
    sender = AdviceSender(OrderSettings())
    queued = sender.due(svc.advice, jobs, T0)
    assert [c.node for c in queued] == [NODE]
    assert [c.node for c in sender.due(svc.advice, jobs, T0 + 1)] == [NODE]
    sender.sent(queued)
    assert sender.due(svc.advice, jobs, T0 + 1) == []
