"""One rank of the bitwise-resume test (tests/hook/test_hook_state.py), launched with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.

Trains a small model with dropout on a shuffled, rank-sharded dataset, with python and
numpy randomness in the data path, AdamW, a StepLR schedule, a GradScaler and (DDP) an
EMA, resuming from forewarn's newest checkpoint. Saves the state after ``--save-at``,
SIGKILLs itself after ``--kill-at``, and writes its final parameters and optimizer state
to ``<out>/rank<r>.pt``. ``--without rng,sampler`` leaves those parts out of the
checkpoint (to show that they matter).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from forewarn.hook import CheckpointWriter, ResumableSampler, TrainingState


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ddp", "fsdp"], required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--save-at", type=int, default=-1)
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--async-save", action="store_true")
    ap.add_argument("--without", default="")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    without = set(filter(None, args.without.split(",")))

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    torch.manual_seed(0)  # the same initial weights on every rank
    model: nn.Module = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3),
                                     nn.Linear(32, 1))
    ema = None
    if args.mode == "ddp":
        ema = torch.optim.swa_utils.AveragedModel(
            model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    # from here on each rank draws its own random numbers (dropout, augmentation)
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)

    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(96, 16, generator=g),
                                          torch.randn(96, 1, generator=g))
    sampler = ResumableSampler(len(data), seed=7)
    # the loader's own generator: creating its iterator must not draw from the global one
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler,
                                         generator=torch.Generator())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=5, gamma=0.7)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)

    state = TrainingState(model, optim, scheduler=sched, scaler=scaler, ema=ema,
                          sampler=None if "sampler" in without else sampler,
                          rng="rng" not in without)
    writer = CheckpointWriter(args.ckpt, keep_last=2)
    start = state.resume(writer)
    print(f"rank {rank} start {start}", flush=True)

    batches = iter(loader)
    for step in range(start, args.steps):
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        if random.random() < 0.5:  # python RNG in the data path
            x = -x
        x = x + torch.from_numpy(np.random.normal(0, 0.01, x.shape).astype(np.float32))
        loss = nn.functional.mse_loss(model(x), y)
        optim.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optim)
        scaler.update()
        sched.step()
        if ema is not None:
            ema.update_parameters(model.module)
        if step == args.save_at:
            if args.async_save:
                pending = writer.save_async(step, state.state_dict(step))
            else:
                writer.save(step, state.state_dict(step))
        if step == args.kill_at:
            while args.async_save and not pending.done():
                time.sleep(0.01)  # committed in the background: nobody calls wait()
            os.kill(os.getpid(), signal.SIGKILL)
    writer.close()

    msd, osd = get_state_dict(model, optim)
    final = {f"model.{k}": v for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        final.update({f"optim.{fqn}.{k}": v for k, v in st.items()})
    if ema is not None:
        final.update({f"ema.{k}": v for k, v in ema.state_dict().items()})
    final = {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in final.items()}
    final["sampler"] = torch.tensor([sampler.epoch, sampler.consumed])
    torch.save(final, os.path.join(args.out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
