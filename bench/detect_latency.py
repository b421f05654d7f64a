"""Hang and NaN detection latency of a real ``forewarn agent`` against real hooks.

Starts one agent (``--source sim``, poll interval 1 s: the latencies below must not hinge
on the poll ticker) and many short-lived "training" processes, each a
:class:`forewarn.hook.Monitor` stepping at ``--step-ms`` with a little jitter:

* NaN trials report a NaN loss at a known step; latency = the agent's first detection
  time (``forewarn_rank_finding_timestamp_seconds{check="nan_loss"}``) minus the wall time
  of the ``step()`` call that carried the NaN;
* hang trials stop calling ``step()`` (beats go on from the hook's thread); latency = first
  ``rank_hang`` detection minus the wall time of the last ``step()`` call. The agent's
  bound is max(hang_floor_s = 2 s, 3 × p99 step time), so a perfect detector measures the
  bound itself; what exceeds it is the detector's own delay.

Usage: ``python bench/detect_latency.py [--trials 20] [--step-ms 20] [--parallel 10]``.
Prints median / p99 / max for both kinds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _trial(args: argparse.Namespace) -> None:
    from forewarn.hook import Monitor

    mon = Monitor(job=args.job, rank=0, world_size=1, local_rank=0, socket_path=args.socket,
                  beat_interval_s=0.25, handle_sigterm=False)
    rng = random.Random(args.job)
    period = args.step_ms / 1000.0
    event_t = 0.0
    gaps: list[float] = []
    prev = None
    for step in range(args.warmup):
        time.sleep(period * rng.uniform(0.9, 1.1))
        event_t = time.time()
        mono = time.monotonic()
        if prev is not None:
            gaps.append(mono - prev)
        prev = mono
        mon.step(step, loss=1.0, grad_norm=1.0)
    bound = max(2.0, 3.0 * _pct(gaps, 0.99))  # the agent's rule, from the same step times
    if args.kind == "nan":
        time.sleep(period)
        event_t = time.time()
        mon.step(args.warmup, loss=float("nan"), grad_norm=1.0)
        time.sleep(1.0)
    else:
        time.sleep(args.hold_s)  # stuck: no step() while the beat thread keeps beating
    print(json.dumps({"event_t": event_t, "bound": bound}), flush=True)
    mon.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _metric(port: int, name: str, labels: dict[str, str]) -> float | None:
    from forewarn.chaos.exposition import scrape

    return scrape(f"http://127.0.0.1:{port}/metrics", name, labels, timeout=5)


def _pct(values: list[float], q: float) -> float:
    """Nearest-rank quantile, as the agent computes it."""
    data = sorted(values)
    return data[min(len(data) - 1, max(0, math.ceil(q * len(data)) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20, help="trials per kind")
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--parallel", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--hold-s", type=float, default=4.0)
    # trial mode (internal)
    ap.add_argument("--trial", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kind", default="nan", help=argparse.SUPPRESS)
    ap.add_argument("--job", default="", help=argparse.SUPPRESS)
    ap.add_argument("--socket", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trial:
        _trial(args)
        return

    work = Path(tempfile.mkdtemp(prefix="fw-detect-"))
    sock = work / "agent.sock"
    port = _free_port()
    (work / "quiet.toml").write_text('name = "quiet"\ngpus = 1\nseed = 1\n')
    (work / "none.toml").touch()
    agent = subprocess.Popen(
        [sys.executable, "-m", "forewarn", "agent", "--source", "sim", "--scenario",
         str(work / "quiet.toml"), "--socket", str(sock), "--listen", f"127.0.0.1:{port}",
         "--no-kmsg", "--interval", "1.0", "--node", "bench", "--config",
         str(work / "none.toml"), "--log-level", "error"])
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            if time.monotonic() > deadline or agent.poll() is not None:
                raise SystemExit("agent did not start")
            time.sleep(0.05)
        results: dict[str, list[float]] = {"nan": [], "hang": []}
        excess: list[float] = []
        check = {"nan": "nan_loss", "hang": "rank_hang"}
        jobs = [(kind, f"{kind}-{i}") for i in range(args.trials) for kind in ("nan", "hang")]
        for start in range(0, len(jobs), args.parallel):
            batch = jobs[start : start + args.parallel]
            procs = [
                (kind, job, subprocess.Popen(
                    [sys.executable, __file__, "--trial", "--kind", kind, "--job", job,
                     "--socket", str(sock), "--step-ms", str(args.step_ms),
                     "--warmup", str(args.warmup), "--hold-s", str(args.hold_s)],
                    stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}))
                for kind, job in batch
            ]
            for kind, job, p in procs:
                out, _ = p.communicate(timeout=120)
                res = json.loads(out.strip().splitlines()[-1])
                event_t = res["event_t"]
                t = _metric(port, "forewarn_rank_finding_timestamp_seconds",
                            {"training_job": job, "rank": "0", "check": check[kind]})
                if t is None:
                    print(f"{job}: not detected", file=sys.stderr)
                    continue
                results[kind].append(t - event_t)
                if kind == "hang":
                    excess.append(t - event_t - res["bound"])
        for kind, values in results.items():
            if not values:
                continue
            print(f"{kind:4s} detection latency over {len(values)} trials "
                  f"(step {args.step_ms:g} ms): median {statistics.median(values) * 1000:.1f} ms, "
                  f"p99 {_pct(values, 0.99) * 1000:.1f} ms, max {max(values) * 1000:.1f} ms, "
                  f"min {min(values) * 1000:.1f} ms")
        if excess:
            med, p99 = statistics.median(excess) * 1000, _pct(excess, 0.99) * 1000
            print(f"hang detection minus its bound max(2 s, 3 x p99 step): median "
                  f"{med:+.1f} ms, p99 {p99:+.1f} ms, max {max(excess) * 1000:+.1f} ms")
    finally:
        agent.terminate()
        agent.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
