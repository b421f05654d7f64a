"""Time the training loop is blocked per checkpoint save: sync vs async vs two-tier.

A 1 GiB state (16 CPU float32 tensors of 64 MiB, as a model plus optimizer would be)
saved ``--repeats`` times by :class:`forewarn.hook.CheckpointWriter`, one process:

* ``sync``: ``save()`` into the durable directory: the loop waits for write + fsync +
  sha256 + commit;
* ``async``: ``save_async()`` into the durable directory: the loop waits for the copy to
  host memory; write and commit run in the background;
* ``two-tier sync`` / ``two-tier async``: the same into the fast directory, with
  ``durable=`` the durable one; the copy to the durable tier runs in the background.

For each: the median time the call blocked, the time until the checkpoint was committed
(loadable), and for two tiers until it was in the durable tier. Between saves the
benchmark waits for the previous one (``flush``), so saves do not queue.

Usage: ``python bench/checkpoint_save.py [--gib 1] [--repeats 3] [--fast /dev/shm/x]
[--durable /tmp/x]``. Defaults: the fast tier in ``/dev/shm`` (tmpfs, standing in for a
node's local NVMe), the durable tier on the machine's disk (standing in for shared storage).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from forewarn.hook import CheckpointWriter


def _state(gib: float) -> dict[str, object]:
    n = int(gib * (1 << 30) / 4 / 16)
    return {"step": 0, "tensors": {f"t{i}": torch.full((n,), float(i)) for i in range(16)}}


def _measure(mode: str, state: dict[str, object], fast: Path, durable: Path, repeats: int
             ) -> dict[str, float]:
    for d in (fast, durable):
        shutil.rmtree(d, ignore_errors=True)
    two_tier = mode.startswith("two-tier")
    w = CheckpointWriter(fast if two_tier else durable, keep_last=1,
                         durable=durable if two_tier else None)
    blocked, committed, in_durable = [], [], []
    for step in range(repeats):
        t0 = time.perf_counter()
        if mode.endswith("async"):
            pending = w.save_async(step, state)
            blocked.append(time.perf_counter() - t0)
            pending.wait()
        else:
            w.save(step, state)
            blocked.append(time.perf_counter() - t0)
        committed.append(time.perf_counter() - t0)
        w.flush()
        in_durable.append(time.perf_counter() - t0)
    w.close()
    return {"blocked": statistics.median(blocked), "committed": statistics.median(committed),
            "durable": statistics.median(in_durable)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fast", type=Path, default=None)
    ap.add_argument("--durable", type=Path, default=None)
    args = ap.parse_args()
    fast = args.fast or Path(tempfile.mkdtemp(prefix="fw-fast-", dir="/dev/shm"))
    durable = args.durable or Path(tempfile.mkdtemp(prefix="fw-durable-"))
    state = _state(args.gib)
    print(f"state {args.gib:g} GiB; fast tier {fast}; durable tier {durable}")
    print(f"{'mode':<16} {'blocked s':>10} {'committed s':>12} {'durable s':>10}")
    try:
        for mode in ("sync", "async", "two-tier sync", "two-tier async"):
            r = _measure(mode, state, fast, durable, args.repeats)
            print(f"{mode:<16} {r['blocked']:>10.3f} {r['committed']:>12.3f} {r['durable']:>10.3f}",
                  flush=True)
    finally:
        shutil.rmtree(fast, ignore_errors=True)
        shutil.rmtree(durable, ignore_errors=True)


if __name__ == "__main__":
    main()
