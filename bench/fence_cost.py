"""What the fence (collector/storage/fence.py) adds to each order write on PostgreSQL.

One replica's :class:`PostgresStore` leads (its :class:`AdvisoryLockLeader` took the lock
and a lead epoch); it queues ``--writes`` checkpoint orders (one command for each of
``--nodes`` nodes and the order's ``actions`` row, one transaction, as the policy does),
alternating in rounds of 50 between fenced writes (the epoch read ``FOR SHARE`` first) and
the same writes with the fence unarmed (as before it existed), so both see the same
server, table sizes and load. PostgreSQL of the machine's binaries, fsync on.

    python bench/fence_cost.py --writes 400
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.commands import CommandQueue
from forewarn.collector.storage.leader import AdvisoryLockLeader
from forewarn.collector.storage.postgres import PostgresStore
from forewarn.demo.servers import PostgresServer, find_postgres_bin
from forewarn.wire import CheckpointOrder

ROUND = 50


def _write(queue: CommandQueue, i: int, nodes: list[str]) -> float:
    now = time.time()
    order = CheckpointOrder(request_id=f"bench-{i}", job=f"job-{i}", step=i, issued=now)
    action = {"time": now, "kind": "checkpoint", "subject": f"job:job-{i}", "job": f"job-{i}",
              "status": "ordered", "detail": {"request_id": order.request_id}}
    t0 = time.perf_counter()
    queue.order_checkpoint(nodes, order, action)
    return time.perf_counter() - t0


def measure(dsn: str, writes: int, nodes: int) -> dict[str, Any]:
    store = PostgresStore(dsn)
    leader = AdvisoryLockLeader(dsn, fence=store.fence)
    leader.start()
    try:
        deadline = time.monotonic() + 30
        while not leader.is_leader:
            if time.monotonic() > deadline:
                raise SystemExit("the bench's replica did not take the lock")
            time.sleep(0.05)
        queue = CommandQueue(store, CollectorMetrics())
        names = [f"node-{n:03d}" for n in range(nodes)]
        on_lost = store.fence.on_lost
        times: dict[str, list[float]] = {"fenced": [], "unfenced": []}
        for r in range(2 * writes // ROUND):
            kind = "fenced" if r % 2 == 0 else "unfenced"
            store.fence.on_lost = on_lost if kind == "fenced" else None  # armed or not
            for j in range(ROUND):
                times[kind].append(_write(queue, r * ROUND + j, names))
        store.fence.on_lost = on_lost
    finally:
        leader.stop()
        store.close()
    out: dict[str, Any] = {"writes_each": len(times["fenced"]), "nodes_per_order": nodes}
    for kind, t in times.items():
        out[kind] = {"median_ms": round(statistics.median(t) * 1e3, 3),
                     "mean_ms": round(statistics.fmean(t) * 1e3, 3),
                     "p90_ms": round(sorted(t)[int(0.9 * len(t))] * 1e3, 3)}
    out["added_median_ms"] = round(out["fenced"]["median_ms"] - out["unfenced"]["median_ms"], 3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--writes", type=int, default=400, help="order writes of each kind")
    parser.add_argument("--nodes", type=int, default=4, help="nodes (commands) per order")
    args = parser.parse_args()
    bin_dir = find_postgres_bin()
    if bin_dir is None:
        raise SystemExit("PostgreSQL is not installed (Debian: apt install postgresql)")
    server = PostgresServer(bin_dir, fsync=True)
    try:
        print(json.dumps(measure(server.database(), args.writes, args.nodes), indent=2))
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
