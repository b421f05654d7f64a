"""``forewarn check``: the preflight, run as the real command against the sim source."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import TESTS

FOREWARN = str(Path(sys.executable).with_name("forewarn"))

DATA = TESTS / "data"
BAD_GPU = DATA / "gpu1-off-the-bus.toml"
HEALTHY = DATA / "gpus2-healthy.toml"


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FOREWARN, "check", "--node", "n1", *args], capture_output=True,
                          text=True, timeout=60, check=False, env={"PATH": "/usr/bin:/bin"})


def test_healthy_node_exits_0_with_one_line_per_check() -> None:
    res = _check("--source", "sim", "--scenario", str(HEALTHY))
    assert res.returncode == 0, res
    lines = res.stdout.splitlines()
    assert lines[-1] == "n1: healthy (2 GPU(s) via sim)"
    checks = [line.split()[1] for line in lines[:-1]]
    assert {"gpu_lost", "xid", "ecc", "thermal", "pcie", "nvlink"} <= set(checks)
    assert all(line.startswith("ok ") for line in lines[:-1])


def test_unhealthy_gpu_exits_1_saying_which_and_why(tmp_path: Path) -> None:
    res = _check("--source", "sim", "--scenario", str(BAD_GPU))
    assert res.returncode == 1, res
    bad = [line for line in res.stdout.splitlines() if line.startswith("unhealthy")]
    assert any("gpu_lost: GPU 1: GPU is lost" in line for line in bad), res.stdout
    assert any("xid: GPU 1: XID 79" in line for line in bad), res.stdout
    assert res.stdout.splitlines()[-1] == "n1: UNHEALTHY (2 GPU(s) via sim)"


@pytest.mark.parametrize("args, says", [
    (["--source", "replay"], "replay_path: required"),
    (["--config", "/nonexistent/agent.toml"], "/nonexistent/agent.toml"),
    (["--source", "sim", "--scenario", "/nonexistent.toml"], "/nonexistent.toml"),
])
def test_cannot_run_exits_2(args: list[str], says: str) -> None:
    res = _check(*args)
    assert res.returncode == 2, res
    assert says in res.stderr
    assert res.stdout == ""
