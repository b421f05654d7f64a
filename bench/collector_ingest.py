"""Collector ingest throughput: GPU-samples/s of ONE collector process on ONE core.

Real HTTP on loopback, the real ``forewarn collector`` command (real SQLite WAL with
synchronous=FULL and group commit, Parquet flushes running), pinned with ``taskset -c 0``.
A load generator in this process, pinned to another core, simulates ``--agents`` agents
(each its own token and keep-alive connection) with ``--gpus`` GPUs each, posting batches
of ``--samples`` samples per GPU as fast as the collector acknowledges them (closed loop).

Reported: acknowledged GPU-samples/s over the measuring window, batches/s, request latency
p50/p99, and the collector's CPU use in that window (from /proc; ~100% means the one core
is the limit). At the end every acknowledged batch is checked to be in the database.

    python bench/collector_ingest.py --agents 100 --gpus 8 --samples 5 --seconds 20
    python bench/collector_ingest.py --samples 5 --rate 20000   # latency at 20k samples/s
    python bench/collector_ingest.py --collector-python ../main/.venv/bin/python  # before
    python bench/collector_ingest.py --state both    # SQLite, then PostgreSQL, same load

``--state postgresql`` starts a PostgreSQL from the machine's binaries (as the tests do,
:class:`forewarn.demo.servers.PostgresServer`; fsync on, as in production) and adds the
database server's CPU in the window (``postgres_cpu_pct``): with shared state the
replica's cost is the collector's CPU plus the share of PostgreSQL's it causes.

Goal (issue 4): >= 20,000 GPU-samples/s on one core (a 20k-GPU fleet at 1 s resolution).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from forewarn.collector.http.auth import hash_token
from forewarn.wire import AgentBatch, GpuSample, NvlinkCounters


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds of ``root`` and every process below it (PostgreSQL's backends)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += cpu_seconds(pid)
        todo.extend(child for child, parent in parents.items() if parent == pid)
    return total


def make_samples(node: str, gpus: int, per_gpu: int, t0: float) -> list[GpuSample]:
    """Realistic samples: every field an NVML source fills on an H100, 18 NVLinks."""
    links = tuple(NvlinkCounters(link=i, crc_flit=0, crc_data=0, replay=0, recovery=0)
                  for i in range(18))
    return [
        GpuSample(node=node, gpu=g, uuid=f"GPU-{node}-{g:02d}", pci_bus_id=f"0000:{g:02x}:00.0",
                  name="NVIDIA H100 80GB HBM3", time=t0 + i, source="bench", simulated=True,
                  temperature_c=55.0 + g, memory_temperature_c=60.0, slowdown_margin_c=30.0,
                  power_w=450.0, power_limit_w=700.0, sm_clock_mhz=1980.0, mem_clock_mhz=2619.0,
                  gpu_util_pct=97.0, mem_util_pct=60.0, memory_used_bytes=70 * 2**30,
                  memory_total_bytes=80 * 2**30, throttle_reasons=0, ecc_corrected_volatile=0,
                  ecc_uncorrected_volatile=0, ecc_corrected_aggregate=3,
                  ecc_uncorrected_aggregate=0, retired_pages_sbe=0, retired_pages_dbe=0,
                  retired_pages_pending=False, remapped_rows_correctable=0,
                  remapped_rows_uncorrectable=0, remap_pending=False, remap_failure=False,
                  pcie_replay_total=0, pcie_link_gen=5, pcie_link_gen_max=5, pcie_link_width=16,
                  pcie_link_width_max=16, nvlink=links, pstate=0)
        for i in range(per_gpu) for g in range(gpus)
    ]


class Stats:
    def __init__(self) -> None:
        self.samples = 0
        self.batches = 0
        self.errors = 0
        self.latencies: list[float] = []
        self.measuring = False


async def agent(host: str, port: int, node: str, token: str, gpus: int, per_gpu: int,
                stats: Stats, stop: asyncio.Event, acked: list[tuple[str, int]],
                interval: float = 0.0) -> None:
    """One simulated agent: closed loop, or one batch every ``interval`` s (open loop)."""
    reader, writer = await asyncio.open_connection(host, port)
    samples = make_samples(node, gpus, per_gpu, time.time())
    encoder = msgspec.msgpack.Encoder()
    head = (f"POST /api/v1/ingest HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}"
            "\r\nContent-Type: application/msgpack\r\nForewarn-Sent-At: ").encode()
    seq = 0
    loop = asyncio.get_running_loop()
    next_send = loop.time() + (interval * (hash(node) % 1000) / 1000.0)
    try:
        while not stop.is_set():
            if interval > 0:
                delay = next_send - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                next_send += interval
            body = encoder.encode(AgentBatch(node=node, agent_id=node, seq=seq,
                                             created=time.time(), samples=samples))
            started = time.perf_counter()
            writer.write(head + f"{time.time():.3f}\r\nContent-Length: {len(body)}\r\n\r\n"
                         .encode() + body)
            status_head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in status_head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
            ok = status_head.startswith(b"HTTP/1.1 200")
            if ok:
                acked.append((node, seq))
            if stats.measuring:
                if ok:
                    stats.samples += len(samples)
                    stats.batches += 1
                    stats.latencies.append(time.perf_counter() - started)
                else:
                    stats.errors += 1
            seq += 1
    finally:
        writer.close()


async def drive(args: argparse.Namespace, port: int, pid: int, tokens: dict[str, str],
                db_pid: int | None = None) -> dict[str, float]:
    stats = Stats()
    stop = asyncio.Event()
    acked: list[tuple[str, int]] = []
    per_batch = args.gpus * args.samples
    interval = len(tokens) * per_batch / args.rate if args.rate > 0 else 0.0
    tasks = [asyncio.create_task(agent("127.0.0.1", port, node, tok, args.gpus, args.samples,
                                       stats, stop, acked, interval))
             for node, tok in tokens.items()]
    await asyncio.sleep(args.warmup)
    stats.measuring = True
    db0 = tree_cpu_seconds(db_pid) if db_pid else 0.0
    cpu0, t0, me0 = cpu_seconds(pid), time.perf_counter(), cpu_seconds(os.getpid())
    await asyncio.sleep(args.seconds)
    stats.measuring = False
    cpu1, t1, me1 = cpu_seconds(pid), time.perf_counter(), cpu_seconds(os.getpid())
    db1 = tree_cpu_seconds(db_pid) if db_pid else 0.0
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    elapsed = t1 - t0
    lat = sorted(stats.latencies) or [0.0]
    return {
        "gpu_samples_per_s": stats.samples / elapsed,
        "batches_per_s": stats.batches / elapsed,
        "latency_p50_ms": 1000 * statistics.median(lat),
        "latency_p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "collector_cpu_pct": 100 * (cpu1 - cpu0) / elapsed,
        "postgres_cpu_pct": 100 * (db1 - db0) / elapsed,
        "samples_per_collector_cpu_s": stats.samples / max(cpu1 - cpu0, 1e-9),
        "samples_per_cpu_s_with_db": stats.samples / max(cpu1 - cpu0 + db1 - db0, 1e-9),
        "load_generator_cpu_pct": 100 * (me1 - me0) / elapsed,
        "errors": stats.errors,
        "acked_batches": len(acked),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=100)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--samples", type=int, default=10, help="samples per GPU per batch")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--rate", type=float, default=0.0,
                   help="offered GPU-samples/s in total (open loop: latency at a given load);"
                        " 0 = closed loop, as fast as acknowledged (throughput)")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--collector-core", type=int, default=0)
    p.add_argument("--client-core", type=int, default=1)
    p.add_argument("--synchronous", default="FULL", choices=["FULL", "NORMAL"])
    p.add_argument("--http", default="auto", choices=["auto", "httptools", "h11"],
                   help="the collector's HTTP parser (config key http)")
    p.add_argument("--flush-samples", type=int, default=None,
                   help="the collector's flush_samples (staged samples per Parquet flush)")
    p.add_argument("--state", default="sqlite", choices=["sqlite", "postgresql", "both"],
                   help="the collector's state backend; both = one run each, same load")
    p.add_argument("--collector-python", default=sys.executable,
                   help="interpreter that runs the collector: another checkout's venv runs"
                        " that checkout's collector under the same load (before/after)")
    p.add_argument("--json", action="store_true", help="print one JSON line per run")
    p.add_argument("--profile", type=Path, default=None,
                   help="run the collector under cProfile (event-loop thread) into this file")
    args = p.parse_args()
    states = ["sqlite", "postgresql"] if args.state == "both" else [args.state]
    postgres = _postgres() if "postgresql" in states else None
    try:
        for state in states:
            result = run(args, state, postgres)
            config = {"state": state, "agents": args.agents, "gpus": args.gpus,
                      "samples_per_gpu": args.samples, "synchronous": args.synchronous,
                      "http": args.http, "rate": args.rate, "cpus": os.cpu_count()}
            if args.json:
                print(json.dumps({**config, **result}), flush=True)
            else:
                print(f"config: {config}")
                for k, v in result.items():
                    print(f"  {k:>28}: {v:,.1f}" if isinstance(v, float) else
                          f"  {k:>28}: {v}", flush=True)
    finally:
        if postgres is not None:
            postgres.stop()
    return 0


def _postgres() -> Any:
    """A PostgreSQL server of the machine's binaries (as the tests start one), with
    fsync on: the bench measures durable commits on both backends."""
    from forewarn.demo.servers import PostgresServer, find_postgres_bin

    bin_dir = find_postgres_bin()
    if bin_dir is None:
        raise SystemExit("PostgreSQL is not installed (Debian: apt install postgresql)")
    return PostgresServer(bin_dir, fsync=True)


def run(args: argparse.Namespace, state: str, postgres: Any) -> dict[str, Any]:
    """One collector process under the load; the figures, checked against the store."""
    tmp = Path(tempfile.mkdtemp(prefix="fw-bench-"))
    port = free_port()
    tokens = {f"bench-node-{i:04d}": f"token-{i:04d}-{os.urandom(8).hex()}"
              for i in range(args.agents)}
    (tmp / "tokens.toml").write_text("".join(f'"{n}" = "{hash_token(t)}"\n'
                                             for n, t in tokens.items()))
    dsn = postgres.database() if state == "postgresql" else ""
    (tmp / "collector.toml").write_text(
        f'listen = "127.0.0.1:{port}"\ndata_dir = "{tmp / "data"}"\n'
        f'tokens_file = "{tmp / "tokens.toml"}"\nlog_level = "warning"\n'
        f'sqlite_synchronous = "{args.synchronous}"\nhttp = "{args.http}"\n'
        f'state = "{state}"\npostgres_dsn = "{dsn}"\n'
        + (f"flush_samples = {args.flush_samples}\n" if args.flush_samples else ""))
    cmd = [args.collector_python, "-m", "forewarn", "collector", "--config",
           str(tmp / "collector.toml")]
    if args.profile:
        # uvicorn re-raises SIGTERM after its shutdown: dump the profile in that handler.
        cmd[1:3] = ["-c", "import cProfile, signal, sys; from forewarn.cli import main; "
                    "pr = cProfile.Profile(); signal.signal(signal.SIGTERM, lambda *a: "
                    f"(pr.disable(), pr.dump_stats({str(args.profile)!r}), sys.exit(0))); "
                    "pr.enable(); main(sys.argv[1:])"]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", str(args.collector_core), *cmd]
    proc = subprocess.Popen(cmd)
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {args.client_core})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("collector did not start") from None
                time.sleep(0.1)
        result: dict[str, Any] = asyncio.run(drive(
            args, port, proc.pid, tokens, postgres.pid() if dsn else None))
    finally:
        proc.terminate()
        proc.wait(60)
    stored, parquet_rows, staged, samples = _counts(tmp, dsn)
    assert parquet_rows + staged == samples, "every stored sample once in Parquet or staging"
    result["stored_batches"] = stored
    result["parquet_rows"] = parquet_rows
    assert stored >= result["acked_batches"], "an acknowledged batch is missing"
    shutil.rmtree(tmp, ignore_errors=True)
    return result


_COUNTS = ("SELECT (SELECT COUNT(*) FROM batches), (SELECT COALESCE(SUM(rows), 0) FROM"
           " telemetry_files), (SELECT COALESCE(SUM(samples), 0) FROM staged_samples),"
           " (SELECT COALESCE(SUM(samples), 0) FROM batches)")


def _counts(tmp: Path, dsn: str) -> tuple[int, int, int, int]:
    """Stored batches, Parquet rows, staged samples, samples of stored batches."""
    if dsn:
        import psycopg

        with psycopg.connect(dsn) as conn:
            row = conn.execute(_COUNTS).fetchone()
    else:
        db = sqlite3.connect(tmp / "data" / "collector.db")
        row = db.execute(_COUNTS).fetchone()
        db.close()
    assert row is not None
    stored, parquet, staged, samples = (int(v) for v in row)
    return stored, parquet, staged, samples


if __name__ == "__main__":
    sys.exit(main())
