"""End to end, bad numerics: a real 2-rank torch.distributed job (gloo, CPU, DDP; the
tests/e2e_worker.py ranks, saving every 5 steps on their own with CheckpointWriter's DCP
format), one real ``forewarn agent`` per rank standing for two nodes, and a real collector
they push to over HTTP.

Rank 0 trains on a NaN input at step 20. Its agent reports the NaN (the job spans nodes, so
no agent holds it alone); the collector's policy holds the job's saves (a SaveHold through
both agents to both ranks); both ranks then refuse
the same saves (no rank left alone in a collective save: the job runs to its end),
checkpoints written from step 20 on are marked suspect, a restart resumes from the last
good checkpoint (step 15), and the collector's job view says so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.agent import AgentProc
from support.collector import serve
from support.polling import free_port, wait_for

pytest.importorskip("torch")

from forewarn.hook.checkpoint import SUSPECT

from support.paths import TESTS

WORKER = TESTS / "e2e_worker.py"
NAN_AT, SAVE_EVERY = 20, 5
TOKENS = {"node-a": "token-a-0123456789", "node-b": "token-b-0123456789"}


def _start(work: Path, ckpt: Path, socks: list[Path], *extra: str
           ) -> list[subprocess.Popen[bytes]]:
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return [subprocess.Popen(
        [sys.executable, str(WORKER), "--dir", str(work), "--ckpt", str(ckpt), "--rank",
         str(rank), "--job", "e2e-nan", "--socket", str(socks[rank]), "--save-every",
         str(SAVE_EVERY), *extra],
        env=env, stdout=(work / f"rank{rank}.log").open("a"), stderr=subprocess.STDOUT)
        for rank in (0, 1)]


def _events(work: Path, rank: int, kind: str) -> list[dict[str, Any]]:
    path = work / f"events-r{rank}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def _wait(procs: list[subprocess.Popen[bytes]], work: Path) -> None:
    for p in procs:
        try:
            assert p.wait(timeout=120) == 0, (work / "rank0.log").read_text()[-3000:]
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            log = (work / "rank1.log").read_text()[-3000:]
            raise AssertionError("a rank hung: " + log) from None


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="fw-nan-"))  # short: AF_UNIX path limit
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_nan_holds_saves_job_wide_and_a_restart_resumes_from_the_last_good_step(
        work: Path) -> None:
    server, store, client = serve(work / "collector", TOKENS, advise_hooks=False)
    ckpt = work / "ckpt"
    socks = [work / f"agent-{node}.sock" for node in TOKENS]
    agents = [AgentProc(work, sock, node, node=node, collector_url=server.url, token=token,
                        push_interval_s="0.2", spool_dir=str(work / f"spool-{node}"))
              for sock, (node, token) in zip(socks, TOKENS.items(), strict=True)]
    try:
        procs = _start(work, ckpt, socks, "--nan-at", str(NAN_AT))
        # both ranks get the hold and refuse a save; then they may finish
        wait_for(lambda: all(_events(work, r, "refused") for r in (0, 1)), 120,
                 "both ranks to refuse a save: " + (work / "rank0.log").read_text()[-2000:])
        last = max(e["step"] for r in (0, 1) for e in _events(work, r, "refused"))
        (work / "finish_at").write_text(str(last + 2 * SAVE_EVERY))
        _wait(procs, work)

        refused = [[e["step"] for e in _events(work, r, "refused")] for r in (0, 1)]
        saved = [[e["step"] for e in _events(work, r, "checkpoint")] for r in (0, 1)]
        assert refused[0] == refused[1] and saved[0] == saved[1], (refused, saved)
        assert all(e["onset"] == NAN_AT for e in _events(work, 0, "refused"))

        on_disk = {int(p.name[5:]): (p / SUSPECT).exists() for p in ckpt.glob("step-*")}
        assert on_disk[15] is False  # the last good one survives keep_last=3
        assert all(marked == (step >= NAN_AT) for step, marked in on_disk.items()), on_disk

        job = wait_for(lambda: client.get("/api/v1/jobs/e2e-nan").json().get("numerics"),
                       30, "the job view's numerics")
        assert job["onset_step"] == NAN_AT and job["last_good_step"] == 15
        # saved up to the hold's step, refused from it on, on both ranks alike
        held_from = job["held_from_step"]
        assert NAN_AT < held_from <= refused[0][0] < held_from + SAVE_EVERY
        assert saved[0] and all(s < held_from for s in saved[0])

        # a restart resumes from the last good checkpoint, not the newest one
        (work / "finish_at").write_text("16")
        _wait(_start(work, ckpt, socks, "--resume"), work)
        assert [e["step"] for e in _events(work, 0, "resumed")] == [15]
    finally:
        for agent in agents:
            agent.stop()
        client.close()
        server.stop()
        store.close()
