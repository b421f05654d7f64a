"""Elastic goodput in a real torchrun run: a 2-node job loses a node; one that shrinks and
goes on (``--nnodes=1:2``) against one that waits for the replacement (``--nnodes=2``).

Two torchrun "nodes" on this machine (:class:`forewarn.demo.launch.TorchrunJob`), one
rank each, the demo's workload (``forewarn.spawn.workload torch``: gloo DDP, 50 ms steps,
a checkpoint every ``--checkpoint-every`` steps). After a warm-up that measures the
per-rank step rate at full size, node 2 is killed (torchrun and worker, SIGKILL); its
replacement starts ``--replace-s`` later and rejoins; the window ends ``--window-s`` after
the failure.

GPU utilisation over the window, as ``forewarn simulate --elastic`` defines it: useful work
(steps that survive, each worth its round's world size; steps redone after a resume count
once) over the work the nodes the job holds could do at the full-size rate (both jobs hold
node 1 throughout and node 2 from its replacement on). Also printed: the stall of each
membership change (last step of a round to the first step of the next), the figures
``forewarn simulate --elastic --rendezvous-s`` takes.

    python bench/elastic_goodput.py --replace-s 30 --window-s 60
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from forewarn.demo.launch import Node, TorchrunJob

STEP_S = 0.05


def _pump(job: TorchrunJob, events: list[dict[str, Any]], until: float) -> None:
    while time.monotonic() < until:
        with contextlib.suppress(queue.Empty):
            events.append(job.events.get(timeout=0.1))


def run(mode: str, work: Path, replace_s: float, window_s: float, every: int,
        rdzv_conf: str) -> dict[str, Any]:
    work.mkdir()
    (work / "control").mkdir()
    nodes = [Node(f"node-{i}", str(work / "no-agent.sock")) for i in (1, 2)]
    job = TorchrunJob(
        "forewarn.spawn.workload",
        ["torch", "--job", f"goodput-{mode}", "--checkpoint-dir", str(work / "ckpt"),
         "--control-dir", str(work / "control"), "--step-seconds", str(STEP_S),
         "--checkpoint-every", str(every)],
        nodes, job=f"goodput-{mode}", log_dir=work, max_restarts=20,
        nnodes="1:2" if mode == "elastic" else "2", rdzv_conf=rdzv_conf)
    events: list[dict[str, Any]] = []
    try:
        job.start()
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not any(
                e.get("event") == "step" and e["rank"] == 1 and e["step"] >= 40 for e in events):
            _pump(job, events, time.monotonic() + 0.5)
        warm_from = time.time()
        _pump(job, events, time.monotonic() + 10)
        warm = [e for e in events if e.get("event") == "step" and e["rank"] == 0
                and e["time"] >= warm_from]
        rate = (len(warm) - 1) / (warm[-1]["time"] - warm[0]["time"])  # steps/s per rank
        t_fail = time.time()
        job.kill_node("node-2")
        _pump(job, events, time.monotonic() + replace_s)
        t_replace = time.time()
        job.start_node(1)
        _pump(job, events, time.monotonic() + (window_s - replace_s))
        t_end = time.time()
    finally:
        job.stop()
    return _account(events, rate, t_fail, t_replace, t_end) | {"mode": mode}


def _account(events: list[dict[str, Any]], rate: float, t_fail: float, t_replace: float,
             t_end: float) -> dict[str, Any]:
    """Useful work and utilisation in [t_fail, t_end] from rank 0's events (node 1 runs
    rank 0 in every round)."""
    rounds: dict[int, dict[str, Any]] = {}
    for e in events:
        if e.get("rank") != 0:
            continue
        r = rounds.setdefault(int(e["attempt"]), {"steps": {}, "start": None, "ws": None})
        if e.get("event") in ("started", "resumed"):
            r["start"], r["ws"] = int(e.get("step", 0)), int(e["world_size"])
        elif e.get("event") == "step":
            r["steps"][int(e["step"])] = float(e["time"])
    order = sorted(a for a in rounds if rounds[a]["ws"] is not None)
    useful = 0.0
    stalls = []
    for i, a in enumerate(order):
        r = rounds[a]
        keep_to = rounds[order[i + 1]]["start"] if i + 1 < len(order) else None
        for step, t in r["steps"].items():
            if t_fail <= t <= t_end and (keep_to is None or step <= keep_to):
                useful += r["ws"]
        if i and r["steps"] and rounds[order[i - 1]]["steps"]:
            stalls.append(min(r["steps"].values()) - max(rounds[order[i - 1]]["steps"].values()))
    capacity = rate * (1 * (t_replace - t_fail) + 2 * (t_end - t_replace))
    return {"utilisation": useful / capacity, "useful_rank_steps": useful,
            "capacity_rank_steps": round(capacity, 1), "rate_steps_per_s": round(rate, 2),
            "rounds": [(rounds[a]["ws"], rounds[a]["start"]) for a in order],
            "stalls_s": [round(s, 1) for s in stalls],
            "window_s": round(t_end - t_fail, 1), "replace_s": round(t_replace - t_fail, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replace-s", type=float, default=30.0)
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--checkpoint-every", type=int, default=20)
    ap.add_argument("--rdzv-conf", default="last_call_timeout=2",
                    help="torchrun --rdzv-conf additions (a dead node leaves the rendezvous "
                    "after keep_alive_interval x keep_alive_max_attempt, 5 s x 3 by default)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fw-elastic-"))
    try:
        for mode in ("elastic", "wait"):
            print(json.dumps(run(mode, root / mode, args.replace_s, args.window_s,
                                 args.checkpoint_every, args.rdzv_conf)), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
