"""Opt-in agreement mode: an order that reaches only one rank still makes every rank of a
real 2-rank gloo job save at the same step (one all_reduce(MAX) every k steps)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from forewarn import wire

pytest.importorskip("torch")

_SCRIPT = textwrap.dedent(
    """
    import sys, time, torch.distributed as dist
    from forewarn.hook import Monitor
    rank, init, sock = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    mon = Monitor(job="agree", rank=rank, world_size=2, socket_path=sock, agree_every=2,
                  beat_interval_s=0.1, handle_sigterm=False)
    for step in range(60):
        time.sleep(0.05)
        mon.step(step, loss=1.0, grad_norm=1.0)
        if mon.should_checkpoint(step):
            print("checkpoint", step, flush=True)
            mon.checkpoint_done(step, 0.1, 1)
    mon.close()
    dist.destroy_process_group()
    """
)


def test_order_to_one_rank_is_agreed_by_all(tmp_path: Path) -> None:
    d = tempfile.mkdtemp(prefix="fw-")
    path = os.path.join(d, "agent.sock")
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    agent.bind(path)
    beats: dict[int, wire.Beat] = {}
    reports: list[wire.CheckpointReport] = []
    stop = threading.Event()

    def receive() -> None:
        agent.settimeout(0.2)
        while not stop.is_set():
            try:
                msg = wire.decode_hook_message(agent.recv(65536))
            except TimeoutError:
                continue
            if isinstance(msg, wire.Beat):
                beats[msg.rank] = msg
            elif isinstance(msg, wire.CheckpointReport):
                reports.append(msg)

    reader = threading.Thread(target=receive, daemon=True)
    reader.start()
    script = tmp_path / "agree.py"
    script.write_text(_SCRIPT)
    init = f"file://{tmp_path / 'rdzv'}"
    procs = [subprocess.Popen([sys.executable, str(script), str(r), init, path],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        deadline = time.monotonic() + 120
        while 0 not in beats or beats[0].last_step is None:
            assert time.monotonic() < deadline, "rank 0 never started stepping"
            time.sleep(0.02)
        order = wire.CheckpointOrder(request_id="only-r0", job="agree", step=50,
                                     issued=time.time())
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(wire.encode(order), beats[0].reply_to)  # rank 1 never hears of it
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
        stop.set()
        reader.join(5)
        agent.close()
        shutil.rmtree(d, ignore_errors=True)
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert [o.splitlines() for o, _ in outs] == [["checkpoint 50"], ["checkpoint 50"]]
    started = sorted((r.rank, r.step, r.request_id) for r in reports if r.phase == "started")
    assert started == [(0, 50, "only-r0"), (1, 50, "")]
