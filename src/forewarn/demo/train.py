"""The demo's training job: a small MLP on synthetic data, one process per rank.

Run by :mod:`forewarn.demo.supervisor` with torchrun-style environment variables (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and ``FOREWARN_SOCKET`` naming the
agent of the rank's (simulated) node. It is a real ``torch.distributed`` (gloo) job: the
gradients are all-reduced by DDP, every checkpoint goes through
:class:`forewarn.hook.CheckpointWriter` (``torch.distributed.checkpoint``), and it reports
each step with :class:`forewarn.hook.Monitor`.

Deterministic: weights and batches come from fixed seeds, so a resumed run computes the
same losses as an uninterrupted one.

Fault injection (the demo's, by signal): SIGUSR1 makes the rank hang (it stops stepping,
its heartbeat thread goes on, as a rank stuck in a collective would look); SIGUSR2 makes
the next reported loss NaN.

Every event is one JSON line on stdout: ``{"event": "step"|"checkpoint"|"resumed"|...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

__all__ = ["main"]

_hang = False
_nan_next = False


def _on_usr1(signum: int, frame: Any) -> None:
    global _hang
    _hang = True


def _on_usr2(signum: int, frame: Any) -> None:
    global _nan_next
    _nan_next = True


def emit(**event: Any) -> None:
    event.setdefault("time", time.time())
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m forewarn.demo.train")
    parser.add_argument("--job", required=True)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--steps", type=int, default=10**9)
    parser.add_argument("--step-seconds", type=float, default=0.1,
                        help="pad each step to about this long (a real model is slower)")
    parser.add_argument("--checkpoint-every", type=int, default=200,
                        help="periodic checkpoint interval in steps")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch import nn

    from forewarn.hook import CheckpointWriter, Monitor

    signal.signal(signal.SIGUSR1, _on_usr1)
    signal.signal(signal.SIGUSR2, _on_usr2)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    true_w = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(100_003 * step + rank)
        x = torch.randn(64, 32, generator=g)
        return x, x @ true_w + 0.1 * torch.randn(64, 1, generator=g)

    monitor = Monitor(job=args.job)
    writer = CheckpointWriter(args.checkpoint_dir, keep_last=4, monitor=monitor)
    state: dict[str, Any] = {"model": model.state_dict(), "optim": opt.state_dict(),
                             "step": torch.tensor(0)}
    start = 0
    loaded = writer.load_latest(state)
    if loaded is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = int(state["step"])
        emit(event="resumed", rank=rank, step=start, path=loaded.path,
             skipped=[list(s) for s in loaded.skipped])
    else:
        emit(event="started", rank=rank, world_size=world)
        # An initial checkpoint proves the checkpoint path works and measures its cost,
        # which the collector's cost-aware policy weighs against the risk.
        result = writer.save(0, state)
        emit(event="checkpoint", rank=rank, step=0, ordered=False, seconds=result.seconds,
             bytes=result.bytes)

    loss_fn = nn.MSELoss()
    global _nan_next
    for step in range(start + 1, args.steps + 1):
        t0 = time.monotonic()
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x), y)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
        opt.step()
        value = float(loss.detach())
        if _nan_next:
            value, _nan_next = float("nan"), False
        monitor.step(step, loss=value, grad_norm=grad_norm)
        emit(event="step", rank=rank, step=step, loss=value)
        ordered = monitor.should_checkpoint(step)
        if ordered or step % args.checkpoint_every == 0:
            state["step"] = torch.tensor(step)
            result = writer.save(step, {"model": model.state_dict(), "optim": opt.state_dict(),
                                        "step": state["step"]})
            emit(event="checkpoint", rank=rank, step=step, ordered=ordered,
                 seconds=result.seconds, bytes=result.bytes)
        while _hang:  # stuck: no more steps, but the process and its beats live on
            time.sleep(0.05)
        rest = args.step_seconds - (time.monotonic() - t0)
        if rest > 0:
            time.sleep(rest)
    emit(event="finished", rank=rank, step=args.steps)
    monitor.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
