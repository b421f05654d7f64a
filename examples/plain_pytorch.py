"""A plain PyTorch training loop with the forewarn hook and the default checkpoint writer.

Runs on CPU (gloo) or CUDA (NCCL), one process or many under torchrun::

    python examples/plain_pytorch.py --steps 50 --ckpt-dir /tmp/ck
    torchrun --standalone --nproc-per-node 2 examples/plain_pytorch.py --steps 50 --ckpt-dir /tmp/ck

or as two nodes (here both on this machine, each with its own agent socket), restarted by
torchrun on a failure (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: pytorch/pytorch#135712)::

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    FOREWARN_SOCKET=/run/forewarn-1/agent.sock torchrun --nnodes 2 --rdzv-backend c10d \
        --rdzv-endpoint 127.0.0.1:29400 --rdzv-id ex --max-restarts 3 --local-addr 127.0.0.1 \
        examples/plain_pytorch.py --steps 500 --ckpt-dir /tmp/ck &
    FOREWARN_SOCKET=/run/forewarn-2/agent.sock torchrun --nnodes 2 --rdzv-backend c10d \
        --rdzv-endpoint 127.0.0.1:29400 --rdzv-id ex --max-restarts 3 --local-addr 127.0.0.2 \
        examples/plain_pytorch.py --steps 500 --ckpt-dir /tmp/ck

It resumes from the newest intact checkpoint in ``--ckpt-dir`` through
:class:`forewarn.hook.TrainingState` (model, optimizer with its momentum, step, RNG
states). Everything is seeded: the model from ``--seed``, each batch from (seed, step,
rank), so a resumed run computes exactly the losses the uninterrupted run would have (on
CPU). Rank 0 prints ``step <n> loss <value>`` lines. Saves happen when the agent orders
one (every rank at the same step), on SIGTERM, and every ``--save-every`` steps if given.

Fault injection for tests and demos: ``--nan-at K`` makes the loss reported at step K
NaN (on ``--fault-rank``), ``--hang-at K`` makes that rank stop stepping at step K
(it sleeps, like a rank stuck in a collective), ``--exit-at K`` kills it. Faults fire in
the first run only (``TORCHELASTIC_RESTART_COUNT`` unset or 0): a job that torchrun
restarted goes on.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from forewarn.hook import CheckpointWriter, Monitor, TrainingState


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100, help="train until this step (exclusive)")
    ap.add_argument("--ckpt-dir", default="checkpoints", help="checkpoint directory")
    ap.add_argument("--save-every", type=int, default=0, help="periodic saves (0 = none)")
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--job", default=None, help="job id (default: from the launcher)")
    ap.add_argument("--socket", default=None, help="agent socket (default $FOREWARN_SOCKET)")
    ap.add_argument("--agree-every", type=int, default=0, help="opt-in agreement mode")
    ap.add_argument("--async-save", action="store_true", help="DCP async_save with >1 rank")
    ap.add_argument("--fault-rank", type=int, default=0)
    ap.add_argument("--nan-at", type=int, default=-1)
    ap.add_argument("--hang-at", type=int, default=-1)
    ap.add_argument("--exit-at", type=int, default=-1)
    return ap.parse_args(argv)


class TinyNet(nn.Module):
    """Two-layer MLP on 16 features: enough to show a falling loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]


def batch(seed: int, step: int, rank: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of (step, rank): a pure function, so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(32, 16, generator=g)
    y = x[:, :4].sum(dim=1, keepdim=True) + 0.1 * torch.randn(32, 1, generator=g)
    return x.to(device), y.to(device)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    distributed = world > 1
    if distributed:
        backend = "nccl" if args.device == "cuda" else "gloo"
        dist.init_process_group(backend)
        rank = dist.get_rank()
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        rank = 0
    device = f"cuda:{torch.cuda.current_device()}" if args.device == "cuda" else "cpu"
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    torch.use_deterministic_algorithms(True, warn_only=True)
    model: nn.Module = TinyNet().to(device)
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ddp: nn.Module = model
    if distributed:
        ddp = nn.parallel.DistributedDataParallel(model)

    monitor = Monitor(job=args.job, socket_path=args.socket, agree_every=args.agree_every)
    writer = CheckpointWriter(args.ckpt_dir, keep_last=args.keep_last)
    # model, optimizer (with its momentum), step and RNG states; a scheduler, GradScaler,
    # EMA or sampler would be passed here too
    state = TrainingState(ddp, optim)
    start = state.resume(writer)  # newest intact checkpoint, or 0
    if rank == 0:
        print(f"start step {start}", flush=True)
    # a restarted job (torchrun --max-restarts) runs on past the fault it recovered from
    faulty = rank == args.fault_rank and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for step in range(start, args.steps):
        x, y = batch(args.seed, step, rank, device)
        optim.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=float("inf"))
        optim.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        reported = loss.detach()
        if faulty and step == args.nan_at:
            reported = torch.full_like(reported, float("nan"))
        if faulty and step == args.hang_at:
            print(f"rank {rank} hanging at step {step}", flush=True)
            while True:
                time.sleep(3600)
        if faulty and step == args.exit_at:
            print(f"rank {rank} exiting at step {step}", flush=True)
            os._exit(3)
        # a 0-d tensor: on CPU read at once, on CUDA copied without a device sync
        monitor.step(step, loss=reported, grad_norm=grad_norm.detach())
        if rank == 0:
            print(f"step {step} loss {loss.item():.10f}", flush=True)
        periodic = args.save_every > 0 and (step + 1) % args.save_every == 0
        if monitor.should_checkpoint(step) or periodic:
            snapshot = state.state_dict(step)
            res = (writer.save_async(step, snapshot).wait() if args.async_save
                   else writer.save(step, snapshot))
            print(f"rank {rank} saved step {step} ({res.bytes} bytes, {res.seconds:.3f}s)",
                  flush=True)
            # after a preemption save this exits the process (exit code 128 + signal number)
            monitor.checkpoint_done(step, res.seconds, res.bytes, res.path)
    monitor.close()
    writer.close()
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
