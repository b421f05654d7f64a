"""The job read routes over real HTTP (uvicorn on loopback, SQLite): every job name the wire
accepts can be fetched, the job list says whether a job runs, finished or stopped and how
healthy its GPUs are, and a job that ended cleanly keeps the goodput it had at its end.
The status page that reads them: tests/collector/test_status_page_browser.py."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from forewarn.wire import Finding, GpuSample, GpuState, Health, RankSummary, Subject

from support.collector import NODE, Clock, start_clocked, start_service, stop_service
from support.hostile import AWKWARD
from support.polling import poll


def test_every_job_name_the_wire_accepts_is_fetchable(tmp_path: Path) -> None:
    svc = start_service(tmp_path)
    try:
        now = time.time()
        svc.push("node1", ranks=[
            RankSummary(job=job, rank=0, node="node1", gpu=0, pid=100 + i, last_step=i,
                        last_step_time=now) for i, job in enumerate(AWKWARD)])
        for i, job in enumerate(AWKWARD):
            r = svc.client.get("/api/v1/job", params={"name": job})
            assert r.status_code == 200, (job, r.text)
            body = r.json()
            assert body["job"] == job and body["last_step"] == i
            assert [(k["rank"], k["node"]) for k in body["ranks"]] == [(0, "node1")]
        assert svc.client.get("/api/v1/job", params={"name": "nope"}).status_code == 404
        missing = svc.client.get("/api/v1/job")
        assert missing.status_code == 400 and "name" in missing.json()["error"]
    finally:
        stop_service(svc)


def _jobs(svc: Any) -> dict[str, dict[str, Any]]:
    rows = svc.client.get("/api/v1/jobs").json()
    return {row["job"]: row for row in rows}


@pytest.mark.usefixtures("state_backend")  # both state backends
def test_job_list_says_state_and_the_health_of_its_gpus(tmp_path: Path) -> None:
    """A job whose ranks all ended cleanly is finished, one whose ranks are gone without
    saying so is stopped; a job's health is the worst of its GPUs' (the GPU's worst current
    finding, or unhealthy when the GPU itself stopped answering)."""
    svc = start_service(tmp_path, predictor_enabled=False)
    try:
        now = time.time()

        def ranks(job: str, first_gpu: int, **kw: Any) -> list[RankSummary]:
            return [RankSummary(job=job, rank=g, world_size=2, node="node1",
                                gpu=first_gpu + g, pid=1000 + first_gpu + g, last_step=50,
                                last_step_time=now, **kw) for g in range(2)]

        samples = [GpuSample(node="node1", gpu=g, time=now, source="sim", simulated=True,
                             state=GpuState.LOST if g == 7 else GpuState.OK)
                   for g in range(8)]
        # every GPU's checks have spoken: GPUs 0 and 1 are red, GPU 7 is off the bus
        red = [Finding(check="xid", health=Health.UNHEALTHY if g < 2 else Health.HEALTHY,
                       reason="XID 79" if g < 2 else "no XID", time=now,
                       subject=Subject(kind="gpu", node="node1", gpu=g)) for g in range(8)]
        svc.push("node1", samples=samples, findings=red, ranks=[
            *ranks("all-red", 0), *ranks("done", 2, alive=False, finished=True),
            *ranks("stopped", 4, alive=False), *ranks("lost-gpu", 6)])
        jobs = _jobs(svc)
        assert jobs["all-red"]["state"] == "running" and jobs["all-red"]["alive"] == 2
        assert jobs["all-red"]["health"] == "unhealthy"
        assert jobs["all-red"]["worst_gpu"] in ("node1/0", "node1/1")
        assert jobs["done"]["state"] == "finished" and jobs["done"]["finished"] == 2
        assert jobs["done"]["alive"] == 0
        assert jobs["stopped"]["state"] == "stopped" and jobs["stopped"]["finished"] == 0
        assert jobs["lost-gpu"]["health"] == "unhealthy"
        assert jobs["lost-gpu"]["worst_gpu"] == "node1/7"
        assert jobs["done"]["health"] == "healthy"
        # the detail says it per rank
        detail = svc.client.get("/api/v1/job", params={"name": "done"}).json()
        assert [(r["alive"], r["finished"]) for r in detail["ranks"]] == [(0, 1), (0, 1)]
    finally:
        stop_service(svc)


T0 = 1_767_225_600.0


def test_goodput_is_frozen_when_the_job_finished(tmp_path: Path) -> None:
    """The agent keeps reporting a finished rank for a while: its goodput (wall time and
    ratio) stays what it was at the end instead of drifting down."""
    svc = start_clocked(tmp_path, Clock(T0), predictor_enabled=False)
    try:
        def summary(step: int, at: float, **kw: Any) -> RankSummary:
            return RankSummary(job="clean", rank=0, node=NODE, gpu=0, pid=10, last_step=step,
                               last_step_time=at, step_seconds_p50=1.0, **kw)

        for step in range(0, 101, 10):
            svc.clock.t = T0 + step
            svc.push(ranks=[summary(step, T0 + step)])
        for later in (101.0, 200.0, 400.0):  # the clean end at T0+101, then the echoes
            svc.clock.t = T0 + later
            svc.push(ranks=[summary(100, T0 + 100, alive=False, finished=True,
                                    last_beat=T0 + 101)])

        def settled() -> dict[str, Any] | None:
            rows = svc.get("/api/v1/goodput", job="clean")
            return rows[0] if rows and svc.store.scalar(
                "SELECT COUNT(*) FROM batches") == 14 else None

        row = poll(settled)
        assert row is not None
        assert row["wall_s"] == pytest.approx(101.0)
        assert row["ratio"] == pytest.approx(100.0 / 101.0, abs=1e-4)
        assert svc.get("/api/v1/jobs")[0]["state"] == "finished"
    finally:
        stop_service(svc)
