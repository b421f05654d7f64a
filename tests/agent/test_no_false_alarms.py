"""No false alarms from normal training, against a real ``forewarn agent`` with
``hang_action = terminate``: an 8 s evaluation pass marked with ``monitor.phase("eval")``
is not called a hang (the job is not killed), a rank that really stops stepping is still
reported within max(3 x p99 step time, 2 s) and ended, and a clean exit is reported
finished, not gone."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.agent import AgentProc
from support.polling import wait_for

SLACK_S = 1.5
"""Scheduling slack on top of the hang bound on a loaded 2-core machine."""

_RANK = textwrap.dedent(
    """
    import sys, time
    from forewarn.hook import Monitor
    sock, job, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    mon = Monitor(job=job, rank=0, world_size=1, socket_path=sock, beat_interval_s=0.25)
    step = 0

    def steps(n):
        global step
        for _ in range(n):
            time.sleep(0.03)
            mon.step(step, loss=1.0, grad_norm=1.0)
            print(step, time.time(), flush=True)
            step += 1

    steps(40)
    if mode == "eval":
        with mon.phase("eval"):
            time.sleep(8.0)  # a long evaluation pass: no steps for 8 s
        steps(20)
    else:
        time.sleep(3600)  # hung in the training phase
    """
)


@pytest.fixture
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="fw-fa-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _finding(agent: AgentProc, job: str, check: str) -> dict[str, Any] | None:
    for f in agent.findings():
        if f["check"] == check and f["subject"]["job"] == job:
            return f
    return None


def test_eval_pass_is_not_a_hang_a_real_hang_is_and_a_clean_end_is_finished(
    workdir: Path,
) -> None:
    sock = workdir / "agent.sock"
    agent = AgentProc(workdir, sock, "fa", hang_action="terminate", hang_grace_s="2")
    script = workdir / "rank.py"
    script.write_text(_RANK)
    procs = {mode: subprocess.Popen([sys.executable, str(script), str(sock), f"fa-{mode}", mode],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for mode in ("eval", "hang")}
    try:
        out, err = procs["eval"].communicate(timeout=120)
        assert procs["eval"].returncode == 0, err  # not terminated during the 8 s pass
        assert len(out.splitlines()) == 60
        hang_check = _finding(agent, "fa-eval", "rank_hang")
        assert hang_check is None or hang_check["health"] == "healthy", hang_check
        assert not agent.metric("forewarn_rank_hang_signals_total", training_job="fa-eval",
                                signal="SIGTERM")

        def ended() -> dict[str, Any] | None:
            f = _finding(agent, "fa-eval", "rank_gone")
            return f if f is not None and "alive" not in f["reason"] else None

        gone = wait_for(ended, 10, "the agent to see the end of the evaluating rank")
        assert gone["health"] == "healthy" and "finished cleanly" in gone["reason"], gone

        hout, _ = procs["hang"].communicate(timeout=60)  # the agent ends the hung rank
        assert procs["hang"].returncode in (-signal.SIGTERM, -signal.SIGKILL)
        last_step_t = float(hout.splitlines()[-1].split()[1])
        found_t = agent.metric("forewarn_rank_finding_timestamp_seconds", training_job="fa-hang",
                               rank="0", check="rank_hang")
        p99 = agent.metric("forewarn_rank_step_seconds", training_job="fa-hang", rank="0",
                           quantile="0.99")
        assert found_t is not None and p99 is not None
        bound = max(3 * p99, 2.0)
        latency = found_t - last_step_t
        print(f"\nhang reported {latency:.3f} s after the last step (bound {bound:.2f} s)")
        # the step's record time precedes the printed time by microseconds
        assert bound - 0.01 <= latency < bound + SLACK_S
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
        agent.stop()
