"""End to end: a real 2-rank torch.distributed job (gloo, CPU, DDP) using forewarn.hook's
Monitor and CheckpointWriter, and real ``forewarn agent`` processes on a Unix socket.

Three runs cover the six claims (each run is a module fixture, the tests assert on it):

* run A (agent up, then killed with SIGKILL and started again): a grad-norm spike reported
  by rank 1 makes the agent order a checkpoint on its own (local fast path); both ranks
  save the same step (3); training goes on untouched while the agent is away and the hooks
  report to the new agent once it is back (5); junk, forged and oversized datagrams sent
  to the live agent are counted and dropped.
* run B (no agent at all): resumes from run A's ordered checkpoint and reproduces run A's
  next losses bit for bit (4); then SIGTERM to both ranks ends in a saved, loadable
  checkpoint before they exit (6).
* run C (agent with hang_action=terminate): a NaN injected at step k is reported at step
  k (1); rank 1 stops stepping and is reported hung within max(3 x p99 step time, 2 s),
  measured and printed (2); the agent then ends both ranks (SIGTERM, SIGKILL after grace).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from support.agent import AgentProc
from support.polling import free_port, wait_for

pytest.importorskip("torch")

from forewarn.wire import StepRecord, encode

from support.paths import TESTS

WORKER = TESTS / "e2e_worker.py"
SLACK_S = 1.5
"""Scheduling slack allowed on top of the hang bound on a loaded 2-core machine."""


@pytest.fixture(scope="module")
def workroot() -> Iterator[Path]:
    """Our own temporary root: pytest's basetemp rotation (other pytest sessions on this
    machine keep only their newest three) must not delete files under a running job."""
    root = Path(tempfile.mkdtemp(prefix="fw-e2e-"))
    yield root
    if not os.environ.get("FOREWARN_E2E_KEEP"):  # set it to inspect a failed run
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class Job:
    """Two worker ranks of the tiny training job."""

    workdir: Path
    ckpt: Path
    sock: Path
    job: str
    args: list[str]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self) -> Job:
        port = free_port()
        for rank in (0, 1):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            log = (self.workdir / f"rank{rank}.log").open("w")
            self.procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), "--dir", str(self.workdir), "--ckpt",
                 str(self.ckpt), "--rank", str(rank), "--job", self.job, "--socket",
                 str(self.sock), *self.args],
                env=env, stdout=log, stderr=subprocess.STDOUT))
        return self

    def losses(self, rank: int) -> dict[int, tuple[float, float]]:
        path = self.workdir / f"losses-r{rank}.txt"
        out = {}
        if path.exists():
            for line in path.read_text().splitlines():
                parts = line.split()
                if len(parts) == 3:
                    out[int(parts[0])] = (float(parts[1]), float(parts[2]))
        return out

    def last_step(self) -> int:
        steps = [max(self.losses(r), default=-1) for r in (0, 1)]
        return min(steps)

    def events(self, rank: int, kind: str | None = None) -> list[dict[str, Any]]:
        path = self.workdir / f"events-r{rank}.jsonl"
        if not path.exists():
            return []
        items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [e for e in items if kind is None or e["event"] == kind]

    def finish_at(self, step: int) -> None:
        tmp = self.workdir / "finish_at.tmp"
        tmp.write_text(str(step))
        tmp.replace(self.workdir / "finish_at")

    def wait(self, timeout: float) -> list[int]:
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=timeout))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank did not exit; logs: {self.logs()}") from None
        return codes

    def logs(self) -> str:
        return "\n".join((self.workdir / f"rank{r}.log").read_text()[-2000:] for r in (0, 1))

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def send_bad_datagrams(sock: Path) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        s.sendto(b"\xc1 not msgpack", str(sock))
        s.sendto(b"\x00" * 70_000, str(sock))
        forged = StepRecord(job="e2e-a", rank=0, world_size=2, pid=1, host="h", step=10**6,
                            time=time.time(), loss=1.0)
        s.sendto(encode(forged), str(sock))
        # the right pid, but rank 0 of the job belongs to a live training process
        taken = StepRecord(job="e2e-a", rank=0, world_size=2, pid=os.getpid(), host="h",
                           step=3, time=time.time(), loss=1.0)
        s.sendto(encode(taken), str(sock))
    finally:
        s.close()


# -- run A -------------------------------------------------------------------------------


@dataclass
class RunA:
    job: Job
    ordered_steps: list[int]
    order_metric: float | None
    drops: dict[str, float | None]
    killed_at: int
    outage_steps: list[int]
    outage_max_step_s: float
    seen_by_new_agent: float | None
    codes: list[int]
    finish: int


@pytest.fixture(scope="module")
def run_a(workroot: Path) -> Iterator[RunA]:
    work = workroot / "run-a"
    work.mkdir()
    sock = work / "run" / "agent.sock"
    agent = AgentProc(work, sock, "a1")
    job = Job(work, work / "ckpt", sock, "e2e-a", ["--spike-at", "15"]).start()
    agent2: AgentProc | None = None
    try:
        wait_for(lambda: job.last_step() >= 3, 120, f"training to start: {job.logs()}")
        send_bad_datagrams(sock)
        # the spike at step 15 -> fast-path order -> both ranks save the same step
        wait_for(lambda: job.events(0, "checkpoint") and job.events(1, "checkpoint"), 60,
                 "the ordered checkpoint on both ranks")
        wait_for(lambda: agent.metric("forewarn_checkpoint_order_outcomes_total",
                                      outcome="done"), 10, "the order to complete")
        ordered = [job.events(r, "checkpoint")[0]["step"] for r in (0, 1)]
        order_metric = agent.metric("forewarn_checkpoint_orders_total", training_job="e2e-a",
                                    reason="grad_spike")
        drops = {r: agent.metric("forewarn_agent_datagrams_dropped_total", reason=r)
                 for r in ("malformed", "oversized", "forged", "slot_taken")}
        # kill the agent mid-run: training must not notice
        agent.stop(signal.SIGKILL)
        killed_at = job.last_step()
        wait_for(lambda: job.last_step() >= killed_at + 30, 60, "training without the agent")
        agent2 = AgentProc(work, sock, "a2")
        seen = wait_for(lambda: agent2.metric("forewarn_rank_step", training_job="e2e-a", rank="1"),
                        30, "the hooks to reconnect to the new agent")
        back_at = job.last_step()
        finish = back_at + 10
        job.finish_at(finish)
        codes = job.wait(120)
        losses = job.losses(0)
        outage = [s for s in losses if killed_at < s <= back_at]
        times = [losses[s][1] for s in sorted(outage)]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        yield RunA(job, ordered, order_metric, drops, killed_at, outage,
                   max(gaps, default=0.0), seen, codes, finish)
    finally:
        job.kill()
        agent.stop()
        if agent2 is not None:
            agent2.stop()


def test_checkpoint_order_makes_both_ranks_save_the_same_step(run_a: RunA) -> None:
    a, b = run_a.ordered_steps
    assert a == b, f"ranks saved different steps: {run_a.ordered_steps}"
    assert a > 15  # chosen ahead of the fastest rank when the spike arrived
    assert run_a.order_metric == 1.0
    saved = sorted(int(p.name.split("-")[1]) for p in run_a.job.ckpt.glob("step-*"))
    assert saved[0] == a
    for r in (0, 1):
        (stats,) = run_a.job.events(r, "stats")
        assert stats["checkpoints"] == 1 and stats["missed"] == 0


def test_bad_datagrams_to_the_live_agent_are_counted(run_a: RunA) -> None:
    assert run_a.drops == {"malformed": 1.0, "oversized": 1.0, "forged": 1.0,
                           "slot_taken": 1.0}


def test_training_untouched_while_agent_is_away_and_hook_reconnects(run_a: RunA) -> None:
    assert run_a.codes == [0, 0]
    for r in (0, 1):
        steps = sorted(run_a.job.losses(r))
        assert steps == list(range(0, run_a.finish + 1)), "a step was skipped or repeated"
        (stats,) = run_a.job.events(r, "stats")
        assert stats["dropped"] > 0  # reports nobody received while the agent was dead
        assert stats["connected"] is True
    assert len(run_a.outage_steps) >= 30
    assert run_a.outage_max_step_s < 5.0, "a step stalled while the agent was away"
    assert run_a.seen_by_new_agent is not None and run_a.seen_by_new_agent > run_a.killed_at


# -- run B: resume, then SIGTERM ---------------------------------------------------------


@dataclass
class RunB:
    job: Job
    resumed_from: int
    expected: dict[int, float]
    got: dict[int, float]
    codes: list[int]
    saving: list[dict[str, Any]]


@pytest.fixture(scope="module")
def run_b(run_a: RunA, workroot: Path) -> Iterator[RunB]:
    work = workroot / "run-b"
    work.mkdir()
    # no agent on this socket: the hook must run the job unchanged
    job = Job(work, run_a.job.ckpt, work / "no-agent.sock", "e2e-b",
              ["--resume", "--agree", "2"]).start()
    try:
        wait_for(lambda: job.events(0, "resumed") and job.events(1, "resumed"), 120,
                 f"resume: {job.logs()}")
        resumed = job.events(0, "resumed")[0]["step"]
        wait_for(lambda: job.last_step() >= run_a.finish + 3, 60, "steps past run A's end")
        for p in job.procs:
            p.send_signal(signal.SIGTERM)  # a scheduler's preemption notice to every rank
        codes = job.wait(60)
        expected = {s: v[0] for s, v in run_a.job.losses(0).items() if s > resumed}
        got = {s: v[0] for s, v in job.losses(0).items() if s <= run_a.finish}
        saving = [job.events(r, "saving") for r in (0, 1)]
        yield RunB(job, resumed, expected, got, codes, [s[-1] for s in saving if s])
    finally:
        job.kill()


def test_resume_reproduces_the_uninterrupted_losses_exactly(run_a: RunA, run_b: RunB) -> None:
    assert run_b.resumed_from == run_a.ordered_steps[0]
    assert run_b.expected and run_b.got == run_b.expected
    assert all(math.isfinite(v) for v in run_b.got.values())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_sigterm_saves_a_checkpoint_before_exit(run_a: RunA, run_b: RunB) -> None:
    assert all(c in (-signal.SIGTERM, 128 + signal.SIGTERM) for c in run_b.codes), run_b.codes
    assert len(run_b.saving) == 2
    s0, s1 = run_b.saving
    assert s0["preempted"] and s1["preempted"] and s0["step"] == s1["step"] > run_a.finish
    import torch

    from forewarn.hook import CheckpointWriter

    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    loaded = CheckpointWriter(run_b.job.ckpt).load_latest({"model": net.state_dict()})
    assert loaded is not None and loaded.step == s0["step"] and not loaded.skipped
    net.load_state_dict(loaded.state["model"])
    checksum = float(sum(p.detach().double().sum() for p in net.parameters()))
    assert checksum == pytest.approx(s0["checksum"], rel=0, abs=1e-9)


# -- run C: NaN, hang, termination --------------------------------------------------------


@dataclass
class RunC:
    job: Job
    nan_step_metric: float | None
    nan_finding: dict[str, Any]
    nan_latency_s: float
    hang_finding: dict[str, Any]
    hang_latency_s: float
    p99_s: float
    codes: list[int]
    signals: dict[str, float | None]


NAN_AT, HANG_AT = 12, 40


@pytest.fixture(scope="module")
def run_c(workroot: Path) -> Iterator[RunC]:
    work = workroot / "run-c"
    work.mkdir()
    sock = work / "agent.sock"
    agent = AgentProc(work, sock, "c", hang_action="terminate", hang_grace_s="2")
    job = Job(work, work / "ckpt", sock, "e2e-c",
              ["--nan-at", str(NAN_AT), "--hang-at", str(HANG_AT)]).start()
    try:
        def nan_found() -> dict[str, Any] | None:
            for f in agent.findings():
                if f["check"] == "nan_loss" and f["subject"]["rank"] == 0 \
                        and f["health"] == "unhealthy":
                    return f
            return None

        nan = wait_for(nan_found, 120, f"the NaN finding: {job.logs()}")
        nan_metric = agent.metric("forewarn_rank_finding_step", training_job="e2e-c", rank="0",
                                  check="nan_loss")
        injected = job.events(0, "injected")[0]
        wait_for(lambda: job.events(1, "hang"), 60, "rank 1 to stop stepping")
        p99 = wait_for(lambda: agent.metric("forewarn_rank_step_seconds", training_job="e2e-c",
                                            rank="1", quantile="0.99"), 10, "step time p99")

        def hang_found() -> dict[str, Any] | None:
            for f in agent.findings():
                if f["check"] == "rank_hang" and f["subject"]["rank"] == 1 \
                        and f["health"] == "unhealthy":
                    return f
            return None

        hang = wait_for(hang_found, 60, "the hang finding")
        # first detection (the finding itself is re-judged every poll) minus the time of
        # the last step rank 1 reported before it stopped
        hang_t = agent.metric("forewarn_rank_finding_timestamp_seconds", training_job="e2e-c",
                              rank="1", check="rank_hang")
        nan_t = agent.metric("forewarn_rank_finding_timestamp_seconds", training_job="e2e-c",
                             rank="0", check="nan_loss")
        assert hang_t is not None and nan_t is not None
        last_t = job.losses(1)[HANG_AT - 1][1]
        codes = job.wait(60)  # hang_action=terminate ends both ranks
        signals = {s: agent.metric("forewarn_rank_hang_signals_total", training_job="e2e-c",
                                   signal=s)
                   for s in ("SIGTERM", "SIGKILL")}
        yield RunC(job, nan_metric, nan, nan_t - injected["time"], hang,
                   hang_t - last_t, p99, codes, signals)
    finally:
        job.kill()
        agent.stop()


def test_nan_is_reported_at_the_step_it_happened(run_c: RunC) -> None:
    assert run_c.nan_step_metric == NAN_AT
    assert run_c.nan_finding["evidence"]["bad_step"] == NAN_AT
    assert run_c.nan_finding["action"] == "restart_job"
    print(f"\nNaN detection latency: {run_c.nan_latency_s * 1000:.1f} ms after the step")
    assert run_c.nan_latency_s < 1.0


def test_hang_reported_within_bound_and_ranks_ended(run_c: RunC) -> None:
    bound = max(3 * run_c.p99_s, 2.0)
    f = run_c.hang_finding
    assert f["evidence"]["step"] == HANG_AT - 1
    print(f"\nhang detection: {run_c.hang_latency_s:.3f} s after rank 1's last step record "
          f"(p99 step {run_c.p99_s * 1000:.0f} ms, bound max(3 x p99, 2 s) = {bound:.2f} s, "
          f"timeout used {f['evidence']['timeout_s']} s)")
    assert f["evidence"]["timeout_s"] == pytest.approx(bound, rel=0.05)
    assert bound <= run_c.hang_latency_s < bound + SLACK_S
    assert all(c in (-signal.SIGTERM, -signal.SIGKILL) for c in run_c.codes), run_c.codes
    assert run_c.signals["SIGTERM"] == 2.0
    with contextlib.suppress(AssertionError):
        assert run_c.signals["SIGKILL"]  # SIGTERM cannot interrupt a rank stuck in C++
