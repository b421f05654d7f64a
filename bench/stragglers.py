"""Benchmark: the collector's live cross-node straggler comparison
(:class:`forewarn.models.peers.JobStragglers`, issue 15 point 8 / issue 17 point 6).

Run: ``python bench/stragglers.py [--jobs 1000] [--ranks 8] [--slow-jobs 0]``. Feeds ten
minutes of rank summaries (one per rank every 5 s, as agents push them; ranks 4 to a
node) and times one comparison, the work the collector's policy thread does once per
bucket (5 s). ``--slow-jobs N`` gives N jobs one rank 1.5x slower, the case that pays
for the full peer comparison.
"""

from __future__ import annotations

import argparse
import time

from forewarn.models.peers import JobStragglers
from forewarn.wire import RankSummary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--slow-jobs", type=int, default=0)
    args = ap.parse_args()
    peers = JobStragglers()
    t0 = 1_700_000_000.0
    seconds = 0.0
    for k in range(120):
        now = t0 + 5 * k
        for j in range(args.jobs):
            for r in range(args.ranks):
                slow = j < args.slow_jobs and r == 0 and k >= 100
                peers.observe_rank(RankSummary(
                    job=f"j{j}", rank=r, world_size=args.ranks, node=f"n{j}-{r // 4}",
                    gpu=r % 4, pid=1 + r, step_seconds_p50=0.3,
                    compute_seconds_p50=(0.3 if slow else 0.2) + 0.001 * (r % 3)), now)
        if k == 119:
            started = time.process_time()
            found = peers.findings(now)
            seconds = time.process_time() - started
    print(f"{args.jobs} jobs x {args.ranks} ranks, {args.slow_jobs} with a slow rank: one "
          f"comparison {seconds * 1000:.0f} ms CPU ({seconds / 5 * 100:.1f} % of a core at "
          f"one per 5 s bucket), {len(found)} straggler(s) named")


if __name__ == "__main__":
    main()
