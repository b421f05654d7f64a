"""Collector ingest through NATS JetStream, against the embedded HTTP mode in the same run.

For each replica count in ``--replicas`` (default 1 and 2): a fresh nats-server with
JetStream (file storage), that many real ``forewarn collector`` processes with ``bus_url``
set (each its own data dir: SQLite FULL, group commit, Parquet flushes running), and a
load generator in this process publishing batches as agents do (JetStream publish with
``Nats-Msg-Id``, the bench's realistic 1.6 KB samples) at ``--rate`` GPU-samples/s. The
replicas share the one durable consumer. Measured over ``--seconds`` after ``--warmup``:
batches the replicas acknowledged (consumer info), their CPU time (from /proc), so

* GPU-samples/s stored, and collector CPU-seconds per million samples;
* the same for the HTTP mode: ``bench/collector_ingest.py`` (pinned to one core) on the
  same load shape, run first in the same invocation.

With ``--remote-write``, a VictoriaMetrics (the machine's ``victoria-metrics``) takes
the replicas' GPU series: a batch is then acknowledged only once its samples are in it.

At the end every published batch must be acknowledged and in exactly one replica's
database. On a shared machine raw samples/s measure contention; compare the CPU cost.

    python bench/bus_ingest.py --agents 100 --gpus 8 --samples 5 --rate 30000 --seconds 15
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import nats
from nats.js import JetStreamContext

from forewarn import bus
from forewarn.wire import AgentBatch

sys.path.insert(0, str(Path(__file__).parent))
from collector_ingest import cpu_seconds, free_port, make_samples

NATS = shutil.which("nats-server") or "/usr/sbin/nats-server"


def start_nats(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    conf = tmp / "nats.conf"
    conf.write_text(f'listen: "127.0.0.1:{port}"\nmax_payload: 8MB\n'
                    f'jetstream {{ store_dir: "{tmp / "js"}" }}\n')
    proc = subprocess.Popen([NATS, "-c", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    return proc, f"nats://127.0.0.1:{port}"


def start_replica(tmp: Path, url: str, index: int, core: int | None, write_url: str = ""
                  ) -> subprocess.Popen[bytes]:
    data = tmp / f"replica-{index}"
    data.mkdir()
    (data / "collector.toml").write_text(
        f'listen = "127.0.0.1:{free_port()}"\ndata_dir = "{data / "data"}"\n'
        f'tokens_file = "{data / "tokens.toml"}"\nlog_level = "warning"\n'
        f'bus_url = "{url}"\n' + (f'remote_write_url = "{write_url}"\n' if write_url else ""))
    cmd = [sys.executable, "-m", "forewarn", "collector", "--config",
           str(data / "collector.toml")]
    if core is not None and shutil.which("taskset"):
        cmd = ["taskset", "-c", str(core), *cmd]
    return subprocess.Popen(cmd)


async def consumer_acked(js: JetStreamContext) -> int:
    """Batches acknowledged: those in the stream less those not delivered yet and those
    delivered but not acknowledged (a batch delivered twice, after its replica's ack wait
    ran out, counts once; deliveries less pending counted it twice)."""
    stream = await js.stream_info(bus.BATCH_STREAM)
    info = await js.consumer_info(bus.BATCH_STREAM, bus.BATCH_CONSUMER)
    return (int(stream.state.messages) - int(info.num_pending or 0)
            - int(info.num_ack_pending or 0))


async def wait_consumer(js: JetStreamContext, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            await js.consumer_info(bus.BATCH_STREAM, bus.BATCH_CONSUMER)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise SystemExit("the collectors did not create their consumer") from None
            await asyncio.sleep(0.2)


async def generate(js: JetStreamContext, args: argparse.Namespace, stop: asyncio.Event,
                   published: list[int]) -> None:
    """``--agents`` simulated agents, each publishing its share of ``--rate``."""
    encoder = msgspec.msgpack.Encoder()
    per_batch = args.gpus * args.samples
    interval = args.agents * per_batch / args.rate

    async def agent(i: int) -> None:
        node = f"bench-node-{i:04d}"
        samples = make_samples(node, args.gpus, args.samples, time.time())
        subject = bus.subject(bus.BATCH_PREFIX, node)
        loop = asyncio.get_running_loop()
        next_send = loop.time() + interval * i / args.agents
        seq = 0
        while not stop.is_set():
            delay = next_send - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            next_send += interval
            body = encoder.encode(AgentBatch(node=node, agent_id=node, seq=seq,
                                             created=time.time(), samples=samples))
            await js.publish(subject, body, headers={"Nats-Msg-Id": f"{node}:{seq}"})
            published[0] += 1
            seq += 1

    await asyncio.gather(*(agent(i) for i in range(args.agents)))


async def run_bus(args: argparse.Namespace, replicas: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="fw-bus-bench-"))
    nats_proc, url = start_nats(tmp)
    vm = None
    if args.remote_write:
        from forewarn.demo.servers import VictoriaMetrics

        vm = VictoriaMetrics(root=tmp / "vm")
    procs = [start_replica(tmp, url, i, (args.collector_core + i) % (os.cpu_count() or 1),
                           vm.write_url if vm else "")
             for i in range(replicas)]
    nc = await nats.connect(url)
    js = nc.jetstream(timeout=30)
    try:
        await wait_consumer(js)
        stop = asyncio.Event()
        published = [0]
        gen = asyncio.create_task(generate(js, args, stop, published))
        await asyncio.sleep(args.warmup)
        acked0, cpu0, t0 = await consumer_acked(js), sum(cpu_seconds(p.pid) for p in procs), \
            time.perf_counter()
        await asyncio.sleep(args.seconds)
        acked1, cpu1, t1 = await consumer_acked(js), sum(cpu_seconds(p.pid) for p in procs), \
            time.perf_counter()
        stop.set()
        await gen
        deadline = time.monotonic() + 300
        while await consumer_acked(js) < published[0] and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        drained = await consumer_acked(js)
        redelivered = int((await js.consumer_info(bus.BATCH_STREAM, bus.BATCH_CONSUMER)
                           ).num_redelivered or 0)
    finally:
        await nc.close()
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(60)
        nats_proc.terminate()
        nats_proc.wait(30)
        if vm is not None:
            vm.stop()
    per_batch = args.gpus * args.samples
    keys: list[tuple[str, int]] = []
    for i in range(replicas):
        db = sqlite3.connect(tmp / f"replica-{i}" / "data" / "collector.db")
        keys += db.execute("SELECT agent_id, seq FROM batches").fetchall()
        db.close()
    shutil.rmtree(tmp, ignore_errors=True)
    samples = (acked1 - acked0) * per_batch
    cpu = cpu1 - cpu0
    return {
        "mode": f"nats, {replicas} replica(s)" + (", remote write" if vm else ""),
        "gpu_samples_per_s": samples / (t1 - t0),
        "collector_cpu_pct": 100 * cpu / (t1 - t0),
        "cpu_s_per_million_samples": 1e6 * cpu / samples if samples else float("nan"),
        "samples_per_cpu_s": samples / cpu if cpu else float("nan"),
        "published_batches": published[0],
        "acked_batches": drained,
        "redelivered_batches": redelivered,
        "stored_batches": len(keys),
        "distinct_stored": len(set(keys)),
    }


def run_http(args: argparse.Namespace) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("collector_ingest.py")), "--json",
         "--agents", str(args.agents), "--gpus", str(args.gpus), "--samples",
         str(args.samples), "--seconds", str(args.seconds), "--warmup", str(args.warmup),
         "--rate", str(args.rate)], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    elapsed_cpu = r["collector_cpu_pct"] / 100
    per_s = r["gpu_samples_per_s"]
    return {"mode": "http (embedded)", "gpu_samples_per_s": per_s,
            "collector_cpu_pct": r["collector_cpu_pct"],
            "cpu_s_per_million_samples": 1e6 * elapsed_cpu / per_s if per_s else float("nan"),
            "samples_per_cpu_s": per_s / elapsed_cpu if elapsed_cpu else float("nan"),
            "acked_batches": r["acked_batches"], "stored_batches": r["stored_batches"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=100)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--samples", type=int, default=5, help="samples per GPU per batch")
    p.add_argument("--rate", type=float, default=30000.0, help="offered GPU-samples/s")
    p.add_argument("--seconds", type=float, default=15.0)
    # Long enough for each replica's one-off start-up work (lazy imports, its first
    # flush and scoring) to end before the window: a 3 s warm-up counted it once per
    # replica and showed 2 replicas 30 % dearer per sample than 1 (bench/RESULTS.md).
    p.add_argument("--warmup", type=float, default=40.0)
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    p.add_argument("--collector-core", type=int, default=0)
    p.add_argument("--no-http", action="store_true", help="skip the HTTP comparison")
    p.add_argument("--remote-write", action="store_true",
                   help="the replicas remote-write their GPU series to a VictoriaMetrics")
    args = p.parse_args()
    rows = [] if args.no_http else [run_http(args)]
    rows += [asyncio.run(run_bus(args, n)) for n in args.replicas]
    for row in rows:  # the figures first, also when a check below fails
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v
                          for k, v in row.items()}))
    for row in rows[0 if args.no_http else 1:]:
        assert row["acked_batches"] == row["published_batches"], \
            "not every batch acknowledged within the drain's 300 s"
        assert row["stored_batches"] == row["distinct_stored"] == row["published_batches"], \
            "a batch stored twice or missing"
    return 0


if __name__ == "__main__":
    sys.exit(main())
