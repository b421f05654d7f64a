"""``forewarn demo --fast`` end to end: its summary's claims hold against what happened,
and nothing it started is left running (also after Ctrl-C)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.leftovers import wait_gone, wait_started


@pytest.mark.timeout(240)
def test_demo_fast_claims_hold(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "forewarn", "demo", "--fast", "--workdir", str(work), "--json"],
        capture_output=True, text=True, timeout=220)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.strip().splitlines()[-1])
    # Every rank saved the same ordered step, before the failure.
    steps = set(result["ordered_steps"].values())
    assert len(result["ordered_steps"]) == 2 and len(steps) == 1, result
    ckpt = steps.pop()
    assert result["lead_s"] > 0, "the checkpoint order came after the failure"
    assert ckpt < result["failure_step"]
    # The restart resumed every rank from that checkpoint.
    assert set(result["resumed_ranks"].values()) == {ckpt}
    assert result["steps_lost"] == result["failure_step"] - ckpt
    assert result["steps_lost"] < result["steps_lost_without"]
    # The hang was caught long before NCCL's timeout, and the NaN at its own step.
    assert 0 < result["hang_latency_s"] < 30
    assert result["hang_resumed_step"] is not None
    assert result["nan_detected_step"] == result["nan_step"]
    assert result["nan_resumed_step"] is not None
    assert result["nan_resumed_step"] < result["nan_step"]
    assert result["problems"] == []
    # The printed summary says what the JSON says.
    assert f"checkpoint step           {ckpt} on every rank" in out
    assert f"steps lost with forewarn  {result['steps_lost']}" in out
    assert wait_gone(str(work)) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("signum", "after", "status"), [
    (signal.SIGINT, "training job", 130),  # Ctrl-C once the job runs
    (signal.SIGTERM, "status page", 143),  # `kill` as soon as the collector answers
])
def test_stop_signal_stops_everything(tmp_path: Path, signum: signal.Signals, after: str,
                                      status: int) -> None:
    """Ctrl-C and SIGTERM both stop the collector, the agents and the job the demo
    started."""
    work = tmp_path / "demo"
    # A shell runs a background job with SIGINT ignored, and Python then keeps it ignored:
    # give the demo the default disposition, as a terminal's Ctrl-C finds it.
    proc = subprocess.Popen(
        [sys.executable, "-m", "forewarn", "demo", "--fast", "--workdir", str(work)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout is not None
    for line in proc.stdout:
        if after in line:
            break
    assert wait_started(str(work)), "the demo should have started its processes"
    proc.send_signal(signum)
    rest = proc.communicate(timeout=60)[0]
    assert proc.returncode == status, rest
    assert "interrupted" in rest
    assert wait_gone(str(work)) == []
