"""Preemption end to end: a real 2-rank DDP job (gloo, CPU; tests/e2e_worker.py) under
a real ``forewarn agent``, preempted the ways schedulers really do it. Every rank must save
the SAME step, exit with 128 + SIGTERM, and ``load_latest`` must return that step:

* Slurm 22.05 preemption: SIGTERM, SIGCONT, SIGTERM within ~5 ms to every rank;
* a signal to only one of the two ranks;
* signals to the two ranks one step apart;
* no agent at all, a signal to one rank: the collective fallback (``agree_every``);
* no agent at all, both ranks signalled at once but on either side of a step's
  ``should_checkpoint`` (what ``scancel --signal=TERM`` does to a job under load).

Before: the second SIGTERM killed the rank unsaved, and a rank saved at its own next step
(different steps, or none on the rank that was not signalled).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.agent import AgentProc
from support.paths import TESTS
from support.polling import free_port, wait_for

pytest.importorskip("torch")

WORKER = TESTS / "e2e_worker.py"


@pytest.fixture(scope="module")
def workroot() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="fw-pre-"))  # short: AF_UNIX paths are limited
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def agent(workroot: Path) -> Iterator[AgentProc]:
    a = AgentProc(workroot, workroot / "agent.sock", "pre")
    yield a
    a.stop()


class Job:
    """The two ranks of one preempted job."""

    def __init__(self, root: Path, name: str, sock: Path, *extra: str) -> None:
        self.dir = root / name
        self.dir.mkdir()
        self.ckpt = self.dir / "ckpt"
        port = free_port()
        self.procs = []
        self.signalled = 0.0
        for rank in (0, 1):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": "1"}
            self.procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), "--dir", str(self.dir), "--ckpt", str(self.ckpt),
                 "--rank", str(rank), "--job", name, "--socket", str(sock), *extra],
                env=env, stdout=(self.dir / f"rank{rank}.log").open("w"),
                stderr=subprocess.STDOUT))

    def last_step(self, rank: int) -> int:
        path = self.dir / f"losses-r{rank}.txt"
        lines = path.read_text().splitlines() if path.exists() else []
        full = [line for line in lines if len(line.split()) == 3]
        return int(full[-1].split()[0]) if full else -1

    def signal(self, rank: int, sig: int) -> None:
        os.kill(self.procs[rank].pid, sig)

    def saves(self, rank: int) -> list[dict[str, Any]]:
        path = self.dir / f"events-r{rank}.jsonl"
        if not path.exists():
            return []
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [e for e in events if e["event"] == "saving"]

    def logs(self) -> str:
        return "\n".join((self.dir / f"rank{r}.log").read_text()[-2000:] for r in (0, 1))

    def wait(self, timeout: float) -> list[int]:
        try:
            return [p.wait(timeout=timeout) for p in self.procs]
        except subprocess.TimeoutExpired:
            raise AssertionError(f"a rank did not exit (saves begun: "
                                 f"{[self.saves(r) for r in (0, 1)]}): {self.logs()}") from None

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _preempt(job: Job, how: str) -> None:
    job.signalled = time.time()
    if how == "slurm-double-sigterm":
        for rank in (0, 1):
            job.signal(rank, signal.SIGTERM)
            job.signal(rank, signal.SIGCONT)
        time.sleep(0.005)
        for rank in (0, 1):
            job.signal(rank, signal.SIGTERM)
    elif how == "one-rank-only":
        job.signal(1, signal.SIGTERM)
    elif how == "one-step-apart":
        at = job.last_step(0)
        job.signal(0, signal.SIGTERM)
        # the job saves the next step or the one after: rank 1's own signal comes while it
        # saves on the agent's order (absorbed), or just after it (the process is done)
        wait_for(lambda: job.last_step(1) > at, 30, "the next step")
        job.signal(1, signal.SIGTERM)
    else:
        raise AssertionError(how)


def _run(root: Path, name: str, sock: Path, how: str, *extra: str) -> tuple[Job, list[int]]:
    job = Job(root, name, sock, *extra)
    try:
        # enough steps for the agent's step-time estimate (the order's margin)
        wait_for(lambda: min(job.last_step(0), job.last_step(1)) >= 15, 120,
                 f"training to start: {job.logs() if job.dir.exists() else ''}")
        _preempt(job, how)
        return job, job.wait(60)
    finally:
        job.kill()


def _assert_one_step_saved_and_loadable(job: Job, codes: list[int]) -> tuple[int, float]:
    """The saved step, and seconds from the first signal until the last rank began it."""
    assert codes == [128 + signal.SIGTERM] * 2, (codes, job.logs())
    saves = [job.saves(r) for r in (0, 1)]
    assert all(len(s) == 1 and s[0]["preempted"] for s in saves), (saves, job.logs())
    (s0,), (s1,) = saves
    assert s0["step"] == s1["step"], (saves, job.logs())
    import torch

    from forewarn.hook import CheckpointWriter

    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    loaded = CheckpointWriter(job.ckpt).load_latest({"model": net.state_dict()})
    assert loaded is not None and loaded.step == s0["step"] and not loaded.skipped
    net.load_state_dict(loaded.state["model"])
    checksum = float(sum(p.detach().double().sum() for p in net.parameters()))
    assert checksum == pytest.approx(s0["checksum"], rel=0, abs=1e-9)
    return int(s0["step"]), max(s0["time"], s1["time"]) - job.signalled


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("how", ["slurm-double-sigterm", "one-rank-only", "one-step-apart"])
def test_every_rank_saves_the_same_step_through_the_agent(
    workroot: Path, agent: AgentProc, how: str
) -> None:
    name = f"pre-{how}"
    job, codes = _run(workroot, name, workroot / "agent.sock", how)
    step, latency = _assert_one_step_saved_and_loadable(job, codes)
    orders = agent.metric("forewarn_checkpoint_orders_total", training_job=name,
                          reason="preempted")
    assert orders is not None and orders >= 1
    print(f"\n{how}: both ranks saved step {step}, the last began {latency * 1000:.0f} ms after "
          f"the first signal (agent orders: {orders:.0f})")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_without_an_agent_the_collective_fallback_agrees(workroot: Path) -> None:
    job, codes = _run(workroot, "pre-no-agent", workroot / "nobody.sock", "one-rank-only",
                      "--agree", "4")
    step, latency = _assert_one_step_saved_and_loadable(job, codes)
    print(f"\nno agent, agree_every=4: both ranks saved step {step}, the last began "
          f"{latency * 1000:.0f} ms after the signal")



@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_without_an_agent_a_notice_straddling_a_step_saves_one_step_on_every_rank(
        workroot: Path) -> None:
    """Slurm signals every task at once, but a loaded rank may be a few milliseconds behind
    its peer: here rank 0 hears the notice just before its ``should_checkpoint(20)`` and
    rank 1 just after it. Saving at each rank's own next step (20 and 21) put the two ranks
    in different collectives (the DCP save's barrier against DDP's all-reduce) and the job
    hung until killed; they agree on one step through the process group's store."""
    job = Job(workroot, "pre-straddle", workroot / "nobody.sock", "--term-straddling", "20")
    try:
        codes = job.wait(90)
    finally:
        job.kill()
    step, _ = _assert_one_step_saved_and_loadable(job, codes)
    assert step == 21  # the next step of the rank that heard it first
