"""The rank checks (hang, gone, NaN, grad spike, straggler) on a rank table fed with
records at chosen times; ``/proc`` is a fixture tree read by the real parser."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest

from forewarn.agent.checks import ALL_CHECKS, default_checks
from forewarn.agent.checks.grad_spike import GradSpikeCheck
from forewarn.agent.checks.nan_loss import NanLossCheck
from forewarn.agent.checks.rank_gone import RankGoneCheck
from forewarn.agent.checks.rank_hang import RankHangCheck
from forewarn.agent.checks.straggler import StragglerCheck
from forewarn.agent.procview import Credentials, ProcView
from forewarn.agent.ranks import RankLimits, RankTable
from forewarn.agent.state import AgentState
from forewarn.wire import Beat, CheckpointReport, Finding, Health, StepRecord, SuggestedAction

T0 = 1_700_000_000.0


def make_proc(root: Path, *pids: int) -> Path:
    (root / "self" / "ns").mkdir(parents=True)
    os.symlink("pid:[1]", root / "self" / "ns" / "pid")
    for pid in pids:
        add_pid(root, pid)
    return root


def add_pid(root: Path, pid: int) -> None:
    d = root / str(pid)
    (d / "ns").mkdir(parents=True)
    (d / "stat").write_text(f"{pid} (x) " + " ".join(["S"] + ["0"] * 18 + ["5"] + ["0"] * 4))
    (d / "status").write_text("Uid:\t0\t0\t0\t0\n")
    os.symlink("pid:[1]", d / "ns" / "pid")


def kill_pid(root: Path, pid: int) -> None:
    d = root / str(pid)
    (d / "stat").unlink()


class Job:
    """Feeds a table with two ranks of one job (pids 100 + rank)."""

    def __init__(self, tmp: Path, ranks: int = 2, **limits: Any) -> None:
        self.proc = make_proc(tmp / "proc", *(100 + r for r in range(ranks)))
        self.table = RankTable(RankLimits(**limits), proc=ProcView(self.proc))
        self.state = AgentState(node="n1", ranks=self.table)
        self.ranks = ranks
        self.steps = [0] * ranks

    def step(self, rank: int, now: float, **kw: Any) -> None:
        self.steps[rank] += 1
        rec = StepRecord(job="j", rank=rank, local_rank=rank, world_size=self.ranks,
                         pid=100 + rank, host="h", step=self.steps[rank], time=now, **kw)
        assert self.table.admit(rec, Credentials(100 + rank, 0, 0), now) is None

    def beat(self, rank: int, now: float, **kw: Any) -> None:
        b = Beat(job="j", rank=rank, local_rank=rank, world_size=self.ranks, pid=100 + rank,
                 host="h", time=now, last_step=self.steps[rank], **kw)
        assert self.table.admit(b, Credentials(100 + rank, 0, 0), now) is None

    def run_steps(self, n: int, seconds: float, t: float, **kw: Any) -> float:
        for _ in range(n):
            t += seconds
            for r in range(self.ranks):
                self.step(r, t, step_seconds=seconds, **kw)
                self.beat(r, t)
        return t


def by_rank(findings: list[Finding]) -> dict[int, Finding]:
    return {f.subject.rank: f for f in findings if f.subject.rank is not None}


def test_rank_checks_are_listed() -> None:
    for cls in (RankHangCheck, RankGoneCheck, NanLossCheck, GradSpikeCheck, StragglerCheck):
        assert cls in ALL_CHECKS
    assert len({c.name for c in default_checks()}) == len(ALL_CHECKS)


def test_checks_do_not_apply_without_ranks() -> None:
    state = AgentState(node="n1")
    for check in (RankHangCheck(), RankGoneCheck(), NanLossCheck(), GradSpikeCheck()):
        assert not check.applies(state)
        assert check.run(state, T0) == []


def test_hang_after_floor_for_fast_steps(tmp_path: Path) -> None:
    job = Job(tmp_path)
    t = job.run_steps(30, 0.1, T0)  # p99 0.1 s: 3 x p99 < 2 s floor
    check = RankHangCheck()
    for dt in (0.5, 1.0, 1.5, 1.9):
        job.beat(0, t + dt)
        job.beat(1, t + dt)
    f = by_rank(check.run(job.state, t + 1.95))
    assert f[0].health == Health.HEALTHY
    f = by_rank(check.run(job.state, t + 2.05))
    assert f[0].health == Health.UNHEALTHY and f[1].health == Health.UNHEALTHY
    assert f[0].action == SuggestedAction.RESTART_JOB
    assert f[0].evidence["step"] == 30 and f[0].evidence["timeout_s"] == 2.0


def test_hang_timeout_scales_with_p99(tmp_path: Path) -> None:
    job = Job(tmp_path)
    t = job.run_steps(20, 1.0, T0)  # p99 = 1 s: timeout 3 s
    for dt in (1.0, 2.0, 2.9):
        job.beat(0, t + dt)
        job.beat(1, t + dt)
    check = RankHangCheck()
    assert by_rank(check.run(job.state, t + 2.9))[0].health == Health.HEALTHY
    job.beat(0, t + 3.05)
    job.beat(1, t + 3.05)
    f = by_rank(check.run(job.state, t + 3.1))[0]
    assert f.health == Health.UNHEALTHY and f.evidence["timeout_s"] == 3.0


def test_no_hang_while_checkpointing_or_when_beats_stop(tmp_path: Path) -> None:
    job = Job(tmp_path)
    t = job.run_steps(10, 0.1, T0)
    rep = CheckpointReport(job="j", rank=0, request_id="r", step=11, phase="started", time=t)
    assert job.table.admit(rep, Credentials(100, 0, 0), t) is None
    for dt in (1.0, 2.0, 3.0):
        job.beat(0, t + dt)
    f = by_rank(RankHangCheck().run(job.state, t + 3.1))
    assert f[0].health == Health.HEALTHY  # saving is a legitimate stall
    assert 1 not in f  # rank 1 stopped beating: rank_gone's business, not a hang


def test_startup_timeout_before_enough_steps(tmp_path: Path) -> None:
    job = Job(tmp_path, startup_timeout_s=60.0)
    job.step(0, T0)
    for dt in (1.0, 2.0, 3.0, 4.0, 5.0):
        job.beat(0, T0 + dt)
    assert by_rank(RankHangCheck().run(job.state, T0 + 5.0))[0].health == Health.HEALTHY


def test_a_marked_phase_gets_its_own_learned_bound_and_training_keeps_its_own(
    tmp_path: Path,
) -> None:
    job = Job(tmp_path, startup_timeout_s=60.0)
    t = job.run_steps(30, 0.1, T0)  # training steps: bound max(3 x 0.1 s, 2 s) = 2 s
    check = RankHangCheck()
    # the first evaluation pass: no stay learned yet, the startup timeout applies
    for dt in range(1, 9):
        job.beat(0, t + dt, phase="eval", phase_started=t)
        job.beat(1, t + dt, phase="eval", phase_started=t)
    f = by_rank(check.run(job.state, t + 8.5))
    assert f[0].health == Health.HEALTHY and f[0].evidence["limit_s"] == 60.0
    # back to training after 8 s: the hang clock starts when the phase ended, 2 s bound
    end = t + 8.5
    learned = {"eval": 8.5}
    for r in (0, 1):
        job.beat(r, end + 0.5, phase_started=end, phase_longest=learned)
    assert by_rank(check.run(job.state, end + 1.9))[0].health == Health.HEALTHY
    f = by_rank(check.run(job.state, end + 2.1))
    assert f[0].health == Health.UNHEALTHY and f[0].evidence["limit_s"] == 2.0
    # the next evaluation pass is judged against 3 x the longest earlier one (25.5 s)
    t2 = end + 3.0
    for wait in (1.0, 20.0, 25.0):
        for r in (0, 1):
            job.beat(r, t2 + wait, phase="eval", phase_started=t2, phase_longest=learned)
    assert by_rank(check.run(job.state, t2 + 25.0))[0].health == Health.HEALTHY
    f = by_rank(check.run(job.state, t2 + 25.6))
    assert f[0].health == Health.UNHEALTHY and f[0].evidence["limit_s"] == 25.5
    assert "longest eval phase" in f[0].reason


def test_a_rank_that_finished_cleanly_is_neither_hung_nor_gone(tmp_path: Path) -> None:
    job = Job(tmp_path)
    t = job.run_steps(10, 0.1, T0)
    job.beat(0, t + 0.01, finished=True)
    job.beat(1, t + 0.01, finished=True)
    kill_pid(job.proc, 100)
    job.beat(1, t + 5.0, finished=True)  # rank 1 lingers a moment after its close()
    assert all(f.health == Health.HEALTHY for f in RankHangCheck().run(job.state, t + 5.0))
    check = RankGoneCheck(grace_s=0.0)
    for now in (t + 5.0, t + 60.0):
        f = by_rank(check.run(job.state, now))
        assert [f[r].health for r in (0, 1)] == [Health.HEALTHY, Health.HEALTHY]
        assert "finished cleanly" in f[0].reason
    summaries = job.table.summaries("n1", t + 60.0)
    assert [(s.finished, s.alive) for s in summaries] == [(True, False), (True, False)]


def test_gone_when_pid_exits_with_peers_alive(tmp_path: Path) -> None:
    job = Job(tmp_path)
    t = job.run_steps(5, 0.1, T0)
    kill_pid(job.proc, 101)
    check = RankGoneCheck(grace_s=3.0)
    f = by_rank(check.run(job.state, t + 0.1))
    assert f[0].health == Health.HEALTHY
    assert f[1].health == Health.DEGRADED and "exited" in f[1].reason
    job.beat(0, t + 3.5)
    f = by_rank(check.run(job.state, t + 3.6))
    assert f[1].health == Health.UNHEALTHY and f[1].action == SuggestedAction.RESTART_JOB


def test_gone_when_beats_stop_and_all_gone_is_degraded(tmp_path: Path) -> None:
    job = Job(tmp_path)
    t = job.run_steps(5, 0.1, T0)
    f = by_rank(RankGoneCheck().run(job.state, t + 10.0))  # 3 beat intervals long passed
    assert f[0].health == Health.DEGRADED and f[0].action == SuggestedAction.NONE
    assert "no beat" in f[0].reason and "finished or stopped" in f[0].reason


def test_nan_loss_reports_the_first_bad_step(tmp_path: Path) -> None:
    job = Job(tmp_path, ranks=1)
    t = job.run_steps(5, 0.1, T0, loss=1.0)
    job.step(0, t + 0.1, loss=math.nan)
    job.step(0, t + 0.2, loss=math.nan)
    (f,) = NanLossCheck().run(job.state, t + 0.3)
    assert f.health == Health.UNHEALTHY and f.action == SuggestedAction.RESTART_JOB
    assert f.evidence["bad_step"] == 6 and f.evidence["loss"] == "nan"


def test_nonfinite_grad_norm_degraded_then_unhealthy(tmp_path: Path) -> None:
    job = Job(tmp_path, ranks=1)
    t = job.run_steps(5, 0.1, T0, loss=1.0, grad_norm=1.0)
    job.step(0, t, loss=1.0, grad_norm=math.inf)
    (f,) = NanLossCheck().run(job.state, t)
    assert f.health == Health.DEGRADED  # an AMP loss scaler skips such a step
    job.step(0, t, loss=1.0, grad_norm=math.inf)
    job.step(0, t, loss=1.0, grad_norm=math.nan)
    (f,) = NanLossCheck().run(job.state, t)
    assert f.health == Health.UNHEALTHY and f.evidence["streak"] == 3
    job.step(0, t, loss=1.0, grad_norm=1.0)
    (f,) = NanLossCheck().run(job.state, t)
    assert f.health == Health.HEALTHY


def test_grad_spike_fires_and_clears(tmp_path: Path) -> None:
    job = Job(tmp_path, ranks=1)
    t = job.run_steps(20, 0.1, T0, grad_norm=2.0)
    job.step(0, t, grad_norm=30.0)  # 15x the median
    (f,) = GradSpikeCheck(hold_steps=5).run(job.state, t)
    assert f.health == Health.UNHEALTHY and f.action == SuggestedAction.CHECKPOINT
    assert f.evidence["bad_step"] == 21 and f.evidence["ratio"] == 15.0
    t = job.run_steps(6, 0.1, t, grad_norm=2.0)
    (f,) = GradSpikeCheck(hold_steps=5).run(job.state, t)
    assert f.health == Health.HEALTHY


def test_grad_spike_factor_is_configurable(tmp_path: Path) -> None:
    job = Job(tmp_path, ranks=1)
    job.table.spike_factor = 20.0
    t = job.run_steps(20, 0.1, T0, grad_norm=2.0)
    job.step(0, t, grad_norm=30.0)
    (f,) = GradSpikeCheck().run(job.state, t)
    assert f.health == Health.HEALTHY


def test_straggler_needs_continuity(tmp_path: Path) -> None:
    job = Job(tmp_path, ranks=3)
    t = T0
    check = StragglerCheck(factor=1.5, window=4, continuity=3)
    results = []
    for _poll in range(4):
        for _ in range(4):
            t += 0.1
            for r in range(3):
                # compute time: rank 2 is twice as slow (wall step times would be equal)
                job.step(r, t, step_seconds=0.1,
                         extras={"compute_seconds": 0.16 if r == 2 else 0.08})
                job.beat(r, t)
        results.append(by_rank(check.run(job.state, t)))
    assert [res[2].health for res in results] == [
        Health.HEALTHY, Health.HEALTHY, Health.DEGRADED, Health.DEGRADED]
    assert all(res[0].health == Health.HEALTHY for res in results)
    assert results[-1][2].evidence["ratio"] == pytest.approx(2.0)
