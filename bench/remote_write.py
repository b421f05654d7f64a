"""The collector's remote write alone against a real VictoriaMetrics: GPU-samples/s written
with ``remote_write_shards`` = each of ``--shards``, interleaved in the same run.

Each round queues the same ``--samples`` realistic GPU samples (``--nodes`` nodes × 8
GPUs, :func:`collector_ingest.make_samples`) at fresh times into a new
:class:`RemoteWriter` and times until :meth:`RemoteWriter.written` is done (every request
taken by the store), with the writer's own process CPU over that time.

    python bench/remote_write.py --samples 100000 --shards 1 4 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.remote_write import RemoteWriter
from forewarn.demo.servers import VictoriaMetrics

sys.path.insert(0, str(Path(__file__).parent))
from collector_ingest import make_samples


def one(url: str, samples_per_gpu: int, nodes: int, shards: int, t0: float
        ) -> dict[str, float]:
    batches = [make_samples(f"bench-node-{n:04d}", 8, samples_per_gpu, t0)
               for n in range(nodes)]
    writer = RemoteWriter(url, CollectorMetrics(), shards=shards,
                          queue_samples=sum(len(b) for b in batches))
    for batch in batches:
        writer.offer(batch)
    cpu, started = time.process_time(), time.perf_counter()
    writer.start()
    writer.written().result(timeout=600)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    writer.stop()
    n = sum(len(b) for b in batches)
    return {"shards": shards, "samples": n, "seconds": elapsed,
            "gpu_samples_per_s": n / elapsed, "cpu_pct": 100 * cpu / elapsed}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=100_000)
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--shards", type=int, nargs="+", default=[1, 4])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    per_gpu = max(1, args.samples // (8 * args.nodes))
    vm = VictoriaMetrics()
    try:
        t0 = time.time() - 3600
        for r in range(args.rounds):
            for shards in args.shards:
                t0 += per_gpu + 1  # new times: the store never sees a round's sample again
                row = one(vm.write_url, per_gpu, args.nodes, shards, t0)
                print(json.dumps({"round": r + 1, **{k: round(v, 1) if isinstance(v, float)
                                                     else v for k, v in row.items()}}),
                      flush=True)
    finally:
        vm.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
