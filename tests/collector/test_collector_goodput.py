"""Goodput inside a real collector (uvicorn on loopback, SQLite): rank summaries, a
checkpoint, a dead rank and a restart from the checkpoint, posted as agent batches, come out
as the ratio, lost time by cause and interval advice in ``/api/v1/goodput`` and
``/metrics``; plus the tracker's summary semantics (lagging ranks, one restart seen by every
rank, resume step)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from forewarn.collector.decide.goodput_service import GoodputService
from forewarn.collector.jobs.goodput import (
    GoodputTracker,
    advise_interval,
    daly_interval,
    expected_goodput,
)
from forewarn.collector.jobs.jobview import RankTable
from forewarn.wire import (
    AgentBatch,
    CheckpointReport,
    Finding,
    Health,
    RankSummary,
    Subject,
    SuggestedAction,
)

from support.collector import NODE, Clock, start_clocked, stop_service
from support.polling import poll

JOB = "train-g"
T0 = 1_767_225_600.0
MTBF_H = 20_000.0


def summary(rank: int, step: int, at: float, pid: int, ckpt: int | None = None) -> RankSummary:
    return RankSummary(job=JOB, rank=rank, world_size=2, node=NODE, gpu=rank, pid=pid,
                       last_step=step, last_step_time=at, step_seconds_p50=1.0,
                       last_checkpoint_step=ckpt, last_checkpoint_time=None if ckpt is None
                       else T0 + 54.0)


def timeline() -> list[AgentBatch]:
    """One step a second; steps 0..50, a 4 s checkpoint at step 50 (ranks save 3 s and 4 s),
    steps to 100 at T0+104; rank 1 dies, noticed at T0+134 (rank_gone); both ranks restart
    (new pids) from checkpoint 50, step 60 done at T0+204, up to step 120 at T0+264. Rank 1
    always reports half a second and one step behind rank 0."""
    batches: list[AgentBatch] = []

    def batch(at: float, **kw: object) -> None:
        batches.append(AgentBatch(node=NODE, agent_id="agent-0", seq=len(batches),
                                  created=at, **kw))  # type: ignore[arg-type]

    def both(step: int, at: float, pids: tuple[int, int], ckpt: int | None) -> None:
        batch(at, ranks=[summary(0, step, at, pids[0], ckpt),
                         summary(1, max(0, step - 1), at - 0.5, pids[1], ckpt)])

    for step in range(0, 51, 10):
        both(step, T0 + step, (10, 11), None)
    batch(T0 + 54, checkpoints=[
        CheckpointReport(job=JOB, rank=r, request_id="r1", step=50, phase="done",
                         seconds=s, bytes=1000, time=T0 + 54) for r, s in ((0, 3.0), (1, 4.0))])
    for step in range(60, 101, 10):
        both(step, T0 + step + 4, (10, 11), 50)
    gone = Finding(check="rank_gone", health=Health.UNHEALTHY, action=SuggestedAction.RESTART_JOB,
                   subject=Subject(kind="rank", node=NODE, job=JOB, rank=1), time=T0 + 134,
                   reason="rank 1 process gone")
    batch(T0 + 134, urgent=True, findings=[gone])
    for step in range(60, 121, 10):
        both(step, T0 + step + 144, (20, 21), 50)
    return batches


EXPECTED = {"checkpoint": 4.0, "rework": 50.0, "detection": 30.0, "restart": 60.0}
USEFUL = 120.0
WALL = 264.0


def test_summaries_split_wall_time_into_useful_and_causes() -> None:
    svc = GoodputService(checkpoint_default_s=60.0)
    jobs = RankTable()
    for b in timeline():
        jobs.update(b.ranks, b.created)
        svc.on_batches([b])
        svc.on_findings(b.findings, jobs)
    g = svc.tracker.jobs[JOB]
    assert g.lost() == pytest.approx(EXPECTED)
    assert g.useful_s == pytest.approx(USEFUL)
    assert g.wall_s == pytest.approx(WALL)
    assert g.restarts == 1  # rank 1 showing the same restart does not count it again
    assert g.unaccounted_s == pytest.approx(0.0, abs=1e-6)
    assert g.goodput == pytest.approx(USEFUL / WALL)


def test_unnoticed_restart_and_unknown_checkpoint() -> None:
    t = GoodputTracker()
    for step in range(0, 11):
        t.observe_step("j", step, float(step), 1.0)
    # a new process reports step 15 at t = 100: past the old furthest step, but restarted
    # from step 8; 7 steps since resuming at t = 93
    t.observe_step("j", 15, 100.0, 1.0, restarted=True, resumed_from=8)
    g = t.jobs["j"]
    assert g.restarts == 1
    assert g.detection_s == pytest.approx(83.0)  # nothing noticed: all detection
    assert g.rework_s == pytest.approx(2.0) and g.useful_s == pytest.approx(15.0)
    # steps cannot take longer than the wall time between two observations
    t.observe_step("j", 25, 102.0, 1.0)
    assert g.useful_s == pytest.approx(17.0)


def test_checkpoint_in_summaries_is_not_taken_out_of_useful_time() -> None:
    t = GoodputTracker()
    t.observe_step("j", 0, 0.0, 1.0)
    t.observe_step("j", 10, 14.0, 1.0)  # 10 steps and a 4 s save
    t.observe_checkpoint("j", "r", 4.0, 14.0, in_step_time=False)
    g = t.jobs["j"]
    assert g.useful_s == pytest.approx(10.0) and g.checkpoint_s == pytest.approx(4.0)


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Any]:
    svc = start_clocked(tmp_path, Clock(T0), predictor_enabled=False,
                        goodput_gpu_mtbf_h=MTBF_H)
    yield svc
    stop_service(svc)


def test_rollback_and_restart_through_the_collector(running: Any) -> None:
    svc = running
    for b in timeline():
        svc.clock.t = b.created  # the batch is created now (push stamps the clock)
        svc.push(**{k: getattr(b, k) for k in ("urgent", "ranks", "checkpoints", "findings")})

    def settled() -> list[dict[str, object]] | None:
        rows: list[dict[str, object]] = svc.get("/api/v1/goodput", job=JOB)
        return rows if rows and rows[0]["last_step"] == 120 else None

    rows = poll(settled)
    assert rows, svc.get("/api/v1/goodput")
    row = rows[0]
    assert row["lost_s"] == pytest.approx(EXPECTED)
    assert row["ratio"] == pytest.approx(USEFUL / WALL, abs=1e-5)
    assert row["restarts"] == 1 and row["high_water_step"] == 120
    advice = row["advice"]
    # the cost model measured the checkpoint (slowest rank, 4 s); 2 GPUs; no predictor: P
    # unknown (null, not 0), the interval from the fleet's failure rate alone
    assert advice["checkpoint_s"] == 4.0 and advice["checkpoint_source"].startswith("measured")
    assert advice["gpus"] == 2 and advice["gpu_mtbf_h"] == MTBF_H
    assert advice["risk"] is None and advice["risk_source"] == "unknown: no failure predictor"
    want = advise_interval(4.0, 2, gpu_mtbf_h=MTBF_H)
    assert advice["interval_s"] == pytest.approx(want)
    assert math.isclose(want, daly_interval(4.0, MTBF_H * 3600 / 2))  # 2 GPUs
    # Daly's model with the job's measured restart (its one restart) says what is left
    assert advice["restart_source"] == "measured(1)"
    assert advice["restart_s"] == pytest.approx(EXPECTED["restart"])
    assert advice["expected_goodput"] == pytest.approx(expected_goodput(
        want, 4.0, EXPECTED["restart"], MTBF_H * 3600 / 2))

    # the metrics render the same snapshot
    assert svc.metric("forewarn_job_goodput_ratio", training_job=JOB) == pytest.approx(
        USEFUL / WALL, abs=1e-5)
    for cause, seconds in EXPECTED.items():
        got = svc.metric("forewarn_job_lost_seconds_total", training_job=JOB, cause=cause)
        assert got == pytest.approx(seconds), cause
    assert svc.metric("forewarn_job_checkpoint_interval_advice_seconds",
                      training_job=JOB) == pytest.approx(want)
    # the predictor is off: no risk route
    assert svc.client.get("/api/v1/risk").status_code == 404


def test_goodput_api_honours_the_read_token(tmp_path: Path) -> None:
    svc = start_clocked(tmp_path, Clock(T0), predictor_enabled=False,
                        api_token="reader-token-0123")
    try:
        assert svc.client.get("/api/v1/goodput").status_code == 401
        r = svc.client.get("/api/v1/goodput",
                           headers={"authorization": "Bearer reader-token-0123"})
        assert r.status_code == 200 and r.json() == []
    finally:
        stop_service(svc)


@pytest.mark.timeout(120)
def test_status_page_shows_goodput_and_advice(running: Any,
                                              require_binary: Callable[[str], str]) -> None:
    """The jobs table of the status page (headless Chromium) shows the job's goodput, lost
    time by cause and advised interval from ``/api/v1/goodput``."""
    chromium = require_binary("chromium")
    sync_api = pytest.importorskip("playwright.sync_api")
    svc = running
    for b in timeline():
        svc.clock.t = b.created
        svc.push(**{k: getattr(b, k) for k in ("urgent", "ranks", "checkpoints", "findings")})
    assert poll(lambda: (r := svc.get("/api/v1/goodput", job=JOB))
                and r[0]["last_step"] == 120)
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--disable-background-networking", "--disable-component-update"]
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=args)
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(svc.server.url + "/")
            row = page.locator(f'#jobs tr[data-job="{JOB}"]')
            row.locator("td.goodput").wait_for(timeout=30_000)
            assert row.locator("td.goodput").inner_text() == f"{100 * USEFUL / WALL:.1f} %"
            assert "50 s / 30 s / 1.0 min" in row.inner_text()  # rework / detection / restart
            want = advise_interval(4.0, 2, gpu_mtbf_h=MTBF_H) / 3600
            assert row.locator("td.advice").inner_text() == f"{want:.1f} h"
            assert not errors, errors
        finally:
            browser.close()
