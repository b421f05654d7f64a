"""The programs the demo and the chaos suite run as training ranks.

``python -m forewarn.spawn.workload torch ...``: one rank of a real ``torch.distributed``
(gloo, CPU) data-parallel job (a small MLP on seeded synthetic batches, DDP), reporting
every step through :class:`forewarn.hook.Monitor` and saving through
:class:`forewarn.hook.CheckpointWriter` (``torch.distributed.checkpoint``), started by
torchrun (:class:`forewarn.demo.launch.TorchrunJob`). ``--placement-file`` (JSON
``{"<rank>": <gpu>}``, read at each start) names the GPU a rank reports, which torchrun
cannot change on a restart (its ``LOCAL_RANK`` is the slot on the node): the demo moves
a rank off a failed GPU with it, as a scheduler would restart the node's launcher with
another ``CUDA_VISIBLE_DEVICES``.

``python -m forewarn.spawn.workload light ...``: one rank of a job with no model and no
torch (the hook only, standard library): it steps, obeys checkpoint orders by writing its
step atomically, and reports. The hardware scenarios put one on each faulty simulated
GPU so that a GPU fault has a job to protect, without paying a torch start per GPU.

Fault injection is by a control file, ``<control-dir>/control-r<rank>.json``: a JSON list
of ``{"id": ..., "fault": ..., ...}`` entries, each applied once at the next step:

* ``hang``: stop stepping; the process and the hook's beat thread live on (a rank stuck
  in a collective looks like this);
* ``nan``: the next step's loss is NaN (a real NaN input, so the NaN is computed);
* ``grad``: the next step's loss is scaled by ``factor`` before ``backward`` (a real
  gradient explosion, all-reduced by DDP; the update is clipped, as trainers do);
* ``slow``: every later step spends ``seconds`` more in this rank's compute (0 ends it).

Every event is one JSON line on stdout (``step``, ``saving``, ``checkpoint``, ``resumed``,
``fault``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["Control", "main"]


def emit(**event: Any) -> None:
    event.setdefault("time", time.time())
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


class Control:
    """Reads the rank's control file when it changes (one ``stat`` per step). Entries
    already there when the rank starts belong to an earlier run of it and are ignored
    (a restarted rank must not hang again on the old entry)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mtime = 0
        self._done: set[str] = set()
        self.poll()

    def poll(self) -> list[dict[str, Any]]:
        """New fault entries since the last call (each entry once)."""
        try:
            mtime = self.path.stat().st_mtime_ns
        except OSError:
            return []
        if mtime == self._mtime:
            return []
        self._mtime = mtime
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return []
        new = [e for e in entries if isinstance(e, dict) and str(e.get("id")) not in self._done]
        self._done.update(str(e.get("id")) for e in new)
        return new


def _torch_rank(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch import nn

    from forewarn.hook import CheckpointWriter, Monitor

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    control = Control(Path(args.control_dir) / f"control-r{rank}.json")

    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    true_w = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))

    monitor = Monitor(job=args.job, beat_interval_s=0.25, local_rank=_placed_gpu(args, rank))
    writer = CheckpointWriter(args.checkpoint_dir, keep_last=4, monitor=monitor)
    state: dict[str, Any] = {"model": model.state_dict(), "optim": opt.state_dict(),
                             "step": torch.tensor(0)}
    start = 0
    loaded = writer.load_latest(state)
    if loaded is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = int(state["step"])
        emit(event="resumed", rank=rank, pid=os.getpid(), world_size=dist.get_world_size(),
             step=start, path=loaded.path,
             skipped=[list(s) for s in loaded.skipped])
    else:
        emit(event="started", rank=rank, pid=os.getpid(), world_size=dist.get_world_size())
        if args.initial_checkpoint:
            # Proves the checkpoint path works and measures its cost, which the collector's
            # cost-aware policy weighs against the risk.
            result = writer.save(0, state)
            emit(event="checkpoint", rank=rank, step=0, ordered=False, path=result.path,
                 seconds=result.seconds, bytes=result.bytes)

    hang = nan_next = False
    grad_factor = 1.0
    slow_s = 0.0
    for step in range(start + 1, args.steps + 1):
        for e in control.poll():
            fault = e.get("fault")
            emit(event="fault", rank=rank, step=step, fault=fault, id=e.get("id"))
            if fault == "hang":
                hang = True
            elif fault == "nan":
                nan_next = True
            elif fault == "grad":
                grad_factor = float(e.get("factor", 1000.0))
            elif fault == "slow":
                slow_s = float(e.get("seconds", 0.0))
        while hang:  # stuck: no more steps, the beats go on
            time.sleep(0.05)
        t0 = time.monotonic()
        g = torch.Generator().manual_seed(100_003 * step + rank)
        x = torch.randn(64, 32, generator=g)
        y = x @ true_w + 0.1 * torch.randn(64, 1, generator=g)
        if nan_next:
            x[0, 0] = math.nan
        # This rank's own compute (forward plus the padding that stands in for a real
        # model's work), measured before backward: the all-reduce inside backward makes
        # every rank's wall step time equal, so only this tells a straggler apart.
        time.sleep(args.step_seconds + slow_s)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        compute = time.monotonic() - t0
        (loss * grad_factor).backward()  # type: ignore[no-untyped-call]
        # Pre-clip norm is what is reported; the update is clipped (max_norm 10).
        grad_norm = float(nn.utils.clip_grad_norm_(model.parameters(), 10.0))
        if math.isfinite(grad_norm):
            opt.step()
        value = float(loss.detach())
        if nan_next:
            nan_next = False
        grad_factor = 1.0
        monitor.step(step, loss=value, grad_norm=grad_norm, compute_seconds=compute)
        emit(event="step", rank=rank, step=step, loss=value if math.isfinite(value) else None,
             nan=not math.isfinite(value), grad_norm=grad_norm if math.isfinite(grad_norm)
             else None)
        ordered = monitor.should_checkpoint(step)
        if ordered or step % args.checkpoint_every == 0:
            # before the save: a preemption save ends the process inside it
            emit(event="saving", rank=rank, step=step, ordered=ordered)
            state["step"] = torch.tensor(step)
            result = writer.save(step, {"model": model.state_dict(), "optim": opt.state_dict(),
                                        "step": state["step"]})
            emit(event="checkpoint", rank=rank, step=step, ordered=ordered, path=result.path,
                 seconds=result.seconds, bytes=result.bytes)
    monitor.close()
    dist.destroy_process_group()
    return 0


def _placed_gpu(args: argparse.Namespace, rank: int) -> int | None:
    """The GPU ``--placement-file`` gives ``rank``; None (torchrun's LOCAL_RANK) without."""
    if not args.placement_file:
        return None
    try:
        placement = json.loads(Path(args.placement_file).read_text())
        return int(placement[str(rank)])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _light_rank(args: argparse.Namespace) -> int:
    from forewarn.hook import Monitor

    rank = args.rank
    monitor = Monitor(job=args.job, rank=rank, world_size=args.world_size, local_rank=args.gpu,
                      socket_path=args.socket, beat_interval_s=0.25)
    ckpt = Path(args.checkpoint_dir)
    ckpt.mkdir(parents=True, exist_ok=True)
    emit(event="started", rank=rank, job=args.job, gpu=args.gpu)
    for step in range(1, args.steps + 1):
        time.sleep(args.step_seconds)
        monitor.step(step, loss=1.0 / step, grad_norm=1.0)
        emit(event="step", rank=rank, step=step)
        ordered = monitor.should_checkpoint(step)
        if ordered or step == args.first_checkpoint:
            t0 = time.monotonic()
            tmp = ckpt / f".step-{step}.tmp"
            data = json.dumps({"job": args.job, "step": step}).encode()
            with tmp.open("wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, ckpt / f"step-{step:09d}.json")
            seconds = time.monotonic() - t0
            monitor.checkpoint_done(step, seconds, len(data))
            emit(event="checkpoint", rank=rank, step=step, ordered=ordered, seconds=seconds,
                 bytes=len(data))
    monitor.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one rank (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m forewarn.spawn.workload")
    sub = p.add_subparsers(dest="kind", required=True)
    t = sub.add_parser("torch", help="a rank of the 2-rank gloo job (under torchrun)")
    t.add_argument("--job", required=True)
    t.add_argument("--checkpoint-dir", required=True)
    t.add_argument("--control-dir", required=True)
    t.add_argument("--steps", type=int, default=10**9)
    t.add_argument("--step-seconds", type=float, default=0.04)
    t.add_argument("--checkpoint-every", type=int, default=40)
    t.add_argument("--initial-checkpoint", action="store_true",
                   help="save step 0 at a fresh start (measures the checkpoint cost early)")
    t.add_argument("--placement-file", default="",
                   help='JSON {"<rank>": <gpu>}: the GPU a rank reports (default LOCAL_RANK)')
    lt = sub.add_parser("light", help="a hook-only rank on one simulated GPU (no torch)")
    lt.add_argument("--job", required=True)
    lt.add_argument("--gpu", type=int, required=True)
    lt.add_argument("--socket", required=True)
    lt.add_argument("--rank", type=int, default=0, help="this rank of a job over nodes")
    lt.add_argument("--world-size", type=int, default=1)
    lt.add_argument("--checkpoint-dir", required=True)
    lt.add_argument("--steps", type=int, default=10**9)
    lt.add_argument("--step-seconds", type=float, default=0.1)
    lt.add_argument("--first-checkpoint", type=int, default=10,
                    help="one early checkpoint of its own, so the policy has measured the "
                    "job's checkpoint cost (then only ordered ones)")
    args = p.parse_args(argv)
    return _torch_rank(args) if args.kind == "torch" else _light_rank(args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
