"""Benchmark: lemon-ranking fit time on one core (issue 17: under 10 s for 30,000 GPUs and
40,000 stints).

Run: ``python bench/lemon_fit.py [--gpus 27000] [--moves 0.12] [--seed 2]``. Generates a
fleet history with :mod:`forewarn.models.lifesim` (slots, not counting spares and
replacements: the fleet ends with more GPUs than slots), pins itself to one CPU and one
OpenMP thread, and times :meth:`LemonRanker.fit` and :meth:`LemonRanker.rank` (CPU
seconds of this process).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before numpy/sklearn load their pools

import json
import time

from forewarn.models.lemon import LemonRanker, read_events
from forewarn.models.lifesim import LifeParams, simulate_life


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gpus", type=int, default=27_000)
    ap.add_argument("--moves", type=float, default=0.12, help="moves per GPU-year")
    ap.add_argument("--seed", type=int, default=2)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    ev = read_events(simulate_life(LifeParams(gpus=args.gpus, seed=args.seed,
                                              moves_per_gpu_year=args.moves)))
    t0 = time.process_time()
    ranker = LemonRanker().fit(ev)
    t1 = time.process_time()
    ranked = ranker.rank()
    t2 = time.process_time()
    assert ranker.history is not None
    print(json.dumps({
        "gpus": int(ev["gpu_id"].nunique()), "stints": len(ranker.history.st),
        "events": len(ev), "hard_failures": int(ev["hard"].sum()),
        "fit_rows": sum(len(r[1]) for r in ranker.rows),
        "fit_cpu_s": round(t1 - t0, 2), "rank_cpu_s": round(t2 - t1, 2),
        "ranked_gpus": len(ranked)}))


if __name__ == "__main__":
    main()
