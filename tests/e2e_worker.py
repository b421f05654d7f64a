"""One rank of the tiny deterministic training job that tests/e2e/test_training_e2e.py runs.

Started twice (rank 0 and 1) as plain subprocesses with MASTER_ADDR/MASTER_PORT on
loopback; torch.distributed with gloo on CPU; a DDP MLP whose batch at each step is drawn
from a generator seeded by (step, rank), so a run resumed from a checkpoint at step S
computes exactly the losses an uninterrupted run computes after S.

Writes into ``--dir``: ``losses-r<rank>.txt`` (``step loss wall_time`` per step, flushed)
and ``events-r<rank>.jsonl`` (checkpoints saved, injected faults, final hook stats).
Stops after step F when ``<dir>/finish_at`` holds F (or at ``--steps``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--step-sleep", type=float, default=0.03)
    ap.add_argument("--spike-at", type=int, default=-1, help="rank 1 reports a 1000x grad norm")
    ap.add_argument("--nan-at", type=int, default=-1, help="rank 0 trains on a NaN input")
    ap.add_argument("--hang-at", type=int, default=-1, help="rank 1 stops before this step")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--agree", type=int, default=0)
    ap.add_argument("--term-straddling", type=int, default=-1,
                    help="SIGTERM to each rank itself at this step, rank 0 just before its "
                         "should_checkpoint and rank 1 just after it (one notice, two steps)")
    ap.add_argument("--save-every", type=int, default=0,
                    help="the loop's own periodic save (not ordered), every N steps")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from forewarn.hook import CheckpointWriter, Monitor

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    out = Path(args.dir)
    rank = args.rank
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    w_true = torch.linspace(-1.0, 1.0, 16).unsqueeze(1)

    mon = Monitor(job=args.job, rank=rank, world_size=2, local_rank=rank,
                  socket_path=args.socket, beat_interval_s=0.25, agree_every=args.agree)
    writer = CheckpointWriter(args.ckpt, keep_last=3, monitor=mon)
    events = open(out / f"events-r{rank}.jsonl", "a", buffering=1)  # noqa: SIM115
    losses = open(out / f"losses-r{rank}.txt", "a", buffering=1)  # noqa: SIM115

    def event(**kw: Any) -> None:
        events.write(json.dumps(kw) + "\n")

    def checksum() -> float:
        return float(sum(p.detach().double().sum() for p in net.parameters()))

    start = 0
    if args.resume:
        loaded = writer.load_latest({"model": net.state_dict()})
        assert loaded is not None, "no checkpoint to resume from"
        net.load_state_dict(loaded.state["model"])
        start = loaded.step + 1
        event(event="resumed", step=loaded.step, checksum=checksum())

    finish_file = out / "finish_at"
    suspect: int | None = None
    step = start
    while step <= args.steps:
        if finish_file.exists():
            text = finish_file.read_text().strip()
            if text and step > int(text):
                break
        if rank == 1 and step == args.hang_at:
            event(event="hang", last_step=step - 1, time=time.time())
            time.sleep(3600)  # stuck: rank 0 waits in the all-reduce forever
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 16, generator=g)
        y = x @ w_true + 0.01 * torch.randn(32, 1, generator=g)
        if rank == 0 and step == args.nan_at:
            x[0, 0] = math.nan
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        gn = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
        opt.step()
        lv = float(loss.detach())
        time.sleep(args.step_sleep)  # stands in for a real step's compute
        reported_gn = gn * 1000.0 if (rank == 1 and step == args.spike_at) else gn
        now = time.time()
        mon.step(step, loss=lv, grad_norm=reported_gn)
        if step in (args.nan_at, args.spike_at):
            event(event="injected", step=step, time=now)
        losses.write(f"{step} {lv!r} {now!r}\n")
        if suspect is None and mon.suspect_since is not None:
            suspect = mon.suspect_since
            event(event="suspect", step=step, onset=suspect)
        periodic = args.save_every > 0 and step > start and step % args.save_every == 0
        straddle = step == args.term_straddling
        if straddle and rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        should = mon.should_checkpoint(step)
        if straddle and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        if should or periodic:
            # logged first: after a SIGTERM checkpoint the hook ends the process in save()
            event(event="saving", step=step, checksum=checksum(), preempted=mon.preempted,
                  time=time.time())
            res = writer.save(step, {"model": net.state_dict()})
            event(event="refused" if res.refused else "checkpoint", step=step, bytes=res.bytes,
                  suspect=res.suspect, onset=mon.suspect_since)
        step += 1
    st = mon.stats
    event(event="stats", steps=st.steps, dropped=st.dropped, connected=st.connected,
          orders=st.orders, missed=st.missed, checkpoints=st.checkpoints)
    mon.close()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
