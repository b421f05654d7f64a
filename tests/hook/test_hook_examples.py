"""The examples run as users would run them: resume reproduces the uninterrupted losses
exactly (one process, and two ranks under torchrun with DCP), and a corrupt newest
checkpoint is skipped for the previous good one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import REPO

pytest.importorskip("torch")

ROOT = REPO
EXAMPLES = ROOT / "examples"


def _run(cmd: list[str], tmp_path: Path, timeout: float = 240) -> str:
    env = dict(os.environ, FOREWARN_SOCKET=str(tmp_path / "no-agent.sock"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def _losses(out: str) -> dict[int, str]:
    return {int(s): v for s, v in re.findall(r"^step (\d+) loss (\S+)$", out, re.M)}


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x5A
    path.write_bytes(bytes(data))


def _plain(tmp_path: Path, launcher: list[str], shard: str) -> None:
    ck = tmp_path / "ck"
    cmd = [*launcher, str(EXAMPLES / "plain_pytorch.py"), "--steps", "8", "--save-every", "4",
           "--ckpt-dir", str(ck)]
    first = _run(cmd, tmp_path)
    assert "start step 0" in first
    full = _losses(first)
    assert sorted(full) == list(range(8))
    assert sorted(p.name for p in ck.iterdir()) == ["step-000000003", "step-000000007"]
    _corrupt(ck / "step-000000007" / shard)
    again = _run(cmd, tmp_path)
    assert "start step 4" in again  # step 7 was corrupt: resumed after step 3
    resumed = _losses(again)
    assert resumed == {s: full[s] for s in range(4, 8)}


def test_plain_example_resumes_exactly_and_skips_a_corrupt_checkpoint(tmp_path: Path) -> None:
    _plain(tmp_path, [sys.executable], "state.pt")


def test_plain_example_under_torchrun_two_ranks_with_dcp(tmp_path: Path) -> None:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2"]
    _plain(tmp_path, launcher, "__1_0.distcp")


def test_plain_example_on_two_torchrun_nodes_restarts_and_resumes_exactly(
        tmp_path: Path) -> None:
    """Two torchrun "nodes" (c10d rendezvous, as the example's docstring shows): rank 1 dies
    at step 6, torchrun's --max-restarts restarts both from the step-3 save, and the losses
    are the uninterrupted run's."""
    from forewarn.demo.launch import TORCHRUN_ENV, free_port

    def run(ck: Path, *extra: str) -> str:
        port = free_port()
        env = dict(os.environ, FOREWARN_SOCKET=str(tmp_path / "no-agent.sock"),
                   OMP_NUM_THREADS="1", **TORCHRUN_ENV)
        procs = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-id", "ex", "--rdzv-conf", f"is_host={int(i == 0)}", "--max-restarts", "1",
             "--local-addr", f"127.0.0.{i + 1}", str(EXAMPLES / "plain_pytorch.py"),
             "--steps", "10", "--save-every", "4", "--ckpt-dir", str(ck), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
            for i in range(2)]
        outs = [p.communicate(timeout=300) for p in procs]
        for p, (out, err) in zip(procs, outs, strict=True):
            assert p.returncode == 0, out[-2000:] + err[-4000:]
        return outs[0][0]  # node 1 runs rank 0, which prints the losses

    full = _losses(run(tmp_path / "a"))
    assert sorted(full) == list(range(10))
    out = run(tmp_path / "b", "--exit-at", "6", "--fault-rank", "1")
    assert "start step 0" in out and "start step 4" in out  # restarted from the step-3 save
    assert _losses(out) == full


def test_lightning_example_runs_without_an_agent(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    out = _run([sys.executable, str(EXAMPLES / "lightning_example.py"), "--steps", "4",
                "--out", str(tmp_path / "pl")], tmp_path)
    assert "done: 4 steps" in out


def test_huggingface_example_runs_without_an_agent(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = _run([sys.executable, str(EXAMPLES / "huggingface_example.py"), "--steps", "3",
                "--out", str(tmp_path / "hf")], tmp_path)
    assert "done: 3 steps" in out
