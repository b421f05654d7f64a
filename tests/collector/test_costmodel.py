"""The cost-aware checkpoint decision: P x work x GPUs against measured checkpoint cost."""

from __future__ import annotations

import pytest

from forewarn.collector.decide.costmodel import (
    CHECK_PROBABILITY,
    DEFAULT_CHECKPOINT_S,
    HEALTH_PROBABILITY,
    CheckpointCostTracker,
    decide_checkpoint,
    failure_probability,
)
from forewarn.collector.jobs.jobview import JobInfo, RankTable
from forewarn.wire import CheckpointReport, Finding, Health, RankSummary, Subject

NOW = 1_700_000_000.0


def finding(health: Health = Health.UNHEALTHY, check: str = "ecc_rate", p: float | None = None
            ) -> Finding:
    return Finding(check=check, health=health, subject=Subject(kind="gpu", node="n1", gpu=0),
                   reason="r", time=NOW, probability=p)


def job(gpus: int = 8, last_ckpt: float | None = None, ckpt_s: float | None = None,
        first_seen: float = NOW - 7200) -> JobInfo:
    ranks = tuple(
        RankSummary(job="j", rank=i, world_size=gpus, node=f"n{i // 4}", gpu=i % 4, pid=100 + i,
                    last_checkpoint_time=last_ckpt, checkpoint_seconds=ckpt_s)
        for i in range(gpus)
    )
    return JobInfo(job="j", ranks=ranks, first_seen=first_seen)


def test_probability_sources_in_order() -> None:
    assert failure_probability(finding(p=0.3)) == (0.3, "finding")
    assert failure_probability(finding(check="x"), {"x": 0.7}) == (0.7, "config")
    assert failure_probability(finding(check="gpu_lost")) == (CHECK_PROBABILITY["gpu_lost"],
                                                               "check-table")
    # the per-check table applies to unhealthy findings only
    assert failure_probability(finding(Health.DEGRADED, check="gpu_lost")) == (
        HEALTH_PROBABILITY["degraded"], "health-table")
    assert failure_probability(finding(Health.HEALTHY))[0] == 0.0


def test_acts_when_expected_loss_exceeds_cost() -> None:
    tracker = CheckpointCostTracker()
    # 0.5 x 600 s x 8 GPUs = 2400 GPU-s at risk > 60 s x 8 = 480 GPU-s
    d = decide_checkpoint(finding(), job(last_ckpt=NOW - 600), NOW, tracker)
    assert d.act
    assert d.work_s == pytest.approx(600)
    assert d.gpus == 8
    assert d.expected_loss_gpu_s == pytest.approx(0.5 * 600 * 8)
    assert d.cost_gpu_s == pytest.approx(DEFAULT_CHECKPOINT_S * 8)
    assert d.checkpoint_source == "default"
    assert d.work_origin == "ranks"


def test_declines_right_after_a_checkpoint() -> None:
    d = decide_checkpoint(finding(), job(last_ckpt=NOW - 100), NOW, CheckpointCostTracker())
    # 0.5 x 100 = 50 s < 60 s
    assert not d.act
    assert d.inputs()["expected_loss_gpu_s"] == pytest.approx(0.5 * 100 * 8)


def test_low_probability_needs_more_work_at_risk() -> None:
    tracker = CheckpointCostTracker()
    f = finding(Health.DEGRADED)  # 0.05
    assert not decide_checkpoint(f, job(last_ckpt=NOW - 1000), NOW, tracker).act  # 50 s < 60
    assert decide_checkpoint(f, job(last_ckpt=NOW - 1300), NOW, tracker).act  # 65 s > 60


def test_measured_cost_wins_over_rank_reports_and_default() -> None:
    tracker = CheckpointCostTracker()
    j = job(last_ckpt=NOW - 600, ckpt_s=20.0)
    assert decide_checkpoint(finding(), j, NOW, tracker).checkpoint_s == 20.0
    # one order: the slowest rank's duration is the job's checkpoint cost
    for rank, secs in ((0, 200.0), (1, 400.0)):
        tracker.observe(CheckpointReport(job="j", rank=rank, request_id="o1", step=10,
                                         phase="done", seconds=secs, time=NOW - 700))
    tracker.observe(CheckpointReport(job="j", rank=0, request_id="o1", step=10,
                                     phase="started", seconds=999.0, time=NOW - 700))
    assert tracker.seconds("j") == 400.0
    assert tracker.samples("j") == 1
    d = decide_checkpoint(finding(), j, NOW, tracker)
    assert d.checkpoint_s == 400.0 and d.checkpoint_source == "measured(1)"
    # 0.5 x 600 = 300 < 400: a slow checkpoint is not worth it yet
    assert not d.act


def test_tracker_done_time_moves_the_work_origin() -> None:
    tracker = CheckpointCostTracker()
    tracker.observe(CheckpointReport(job="j", rank=0, request_id="o1", step=10, phase="done",
                                     seconds=5.0, time=NOW - 30))
    d = decide_checkpoint(finding(), job(last_ckpt=None), NOW, tracker)
    assert d.work_origin == "reports" and d.work_s == pytest.approx(30)


def test_never_checkpointed_job_counts_from_first_seen() -> None:
    d = decide_checkpoint(finding(), job(first_seen=NOW - 7200), NOW, CheckpointCostTracker())
    assert d.work_origin == "first-seen" and d.work_s == pytest.approx(7200) and d.act


def test_job_info_from_rank_table() -> None:
    table = RankTable()
    table.update([
        RankSummary(job="j", rank=0, world_size=4, node="a", gpu=0, pid=1, last_step=100,
                    last_step_time=NOW - 10, step_seconds_p50=0.5, last_checkpoint_time=NOW - 50),
        RankSummary(job="j", rank=1, world_size=4, node="b", gpu=0, pid=2, last_step=104,
                    last_step_time=NOW - 10, step_seconds_p50=1.0, last_checkpoint_time=NOW - 90),
    ], now=NOW - 100)
    info = table.job("j")
    assert info is not None
    assert info.nodes == ("a", "b") and info.gpu_count == 2 and info.world_size == 4
    assert info.last_checkpoint_time == NOW - 90  # the oldest rank's checkpoint
    assert info.step_seconds_p50 == 0.5
    # rank 0: 100 + 10/0.5 = 120; rank 1: 104 + 10/1 = 114
    assert info.estimated_step(NOW) == 120
    assert table.jobs_on("b", 0) == ["j"] and table.jobs_on("b", 1) == []
