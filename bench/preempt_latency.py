"""Preemption: from the signal to the launcher until every rank has saved the same step,
under torchrun and under a real Slurm.

* ``--launcher torchrun``: a real ``forewarn agent`` (simulated quiet node) and a 2-rank
  gloo DDP job (``forewarn.spawn.workload torch``, 50 ms steps) launched by torchrun
  (``--nproc-per-node=2``, c10d). SIGTERM goes to torchrun, which forwards it to its
  workers; each rank tells the agent, the agent orders the job one step ahead of its
  fastest rank, both save that step and exit.
* ``--launcher slurm`` (root; Debian's slurm-wlm and munge): the cluster of
  ``tests/support/slurm.py``; a 2-task batch job of ``examples/plain_pytorch.py`` (50 ms
  steps, no agent: the tasks are signalled together, each saves at its next step);
  ``scancel`` sends SIGCONT+SIGTERM to every task.

The latency is from the signal (just before ``kill``/``scancel``) to the commit of the
saved checkpoint (the mtime of its ``manifest.json``: the DCP save is collective, so every
rank's shard is on disk by then). The goal is the next step plus the save: the figure is
also given in steps past the step running at the signal and next to the save's own time.

    python bench/preempt_latency.py --launcher torchrun --trials 3
    python bench/preempt_latency.py --launcher slurm --trials 3
"""

from __future__ import annotations

import argparse
import json
import queue
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

STEP_S = 0.05


def _committed(ckpt: Path) -> tuple[int, float] | None:
    """The newest committed checkpoint: (step, commit time)."""
    done = sorted(ckpt.glob("step-*/manifest.json"))
    if not done:
        return None
    m = done[-1]
    return int(m.parent.name.split("-")[1]), m.stat().st_mtime


def torchrun_trial(work: Path) -> dict[str, Any]:
    from forewarn.demo.launch import Node, TorchrunJob

    from support.agent import AgentProc

    agent = AgentProc(work, work / "agent.sock", "bench")
    (work / "control").mkdir()
    ckpt = work / "ckpt"
    job = TorchrunJob("forewarn.spawn.workload",
                      ["torch", "--job", "bench-preempt", "--checkpoint-dir", str(ckpt),
                       "--control-dir", str(work / "control"), "--step-seconds", str(STEP_S),
                       "--checkpoint-every", "1000000"],
                      [Node("bench", str(work / "agent.sock"), nproc=2)], job="bench-preempt",
                      log_dir=work, max_restarts=0)
    events: list[dict[str, Any]] = []
    try:
        job.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                events.append(job.events.get(timeout=0.5))
            except queue.Empty:
                continue
            steps = {e["rank"]: e["step"] for e in events if e.get("event") == "step"}
            if len(steps) == 2 and min(steps.values()) >= 40:
                break
        at_signal = max(e["step"] for e in events if e.get("event") == "step")
        t0 = time.time()
        job.signal_node("bench", signal.SIGTERM)
        code = job.procs["bench"].wait(timeout=60)
        while not job.events.empty():
            events.append(job.events.get())
        saving = {e["rank"]: e["step"] for e in events if e.get("event") == "saving"}
        got = _committed(ckpt)
        assert got is not None, "nothing committed"
        step, t_commit = got
        assert set(saving.values()) == {step} and len(saving) == 2, saving
        t_saving = min(e["time"] for e in events if e.get("event") == "saving")
        return {"latency_s": t_commit - t0, "steps_after_signal": step - at_signal,
                "save_s": t_commit - t_saving, "exit": code}
    finally:
        job.stop()
        agent.stop()


def _slurm_script(work: Path, ckpt: Path) -> Path:
    from support.polling import free_port

    script = work / "train.sh"
    script.write_text(f"""#!/bin/sh
#SBATCH --ntasks=2
#SBATCH --output={work}/train.out
export MASTER_ADDR=127.0.0.1 MASTER_PORT={free_port()} OMP_NUM_THREADS=1
exec srun --kill-on-bad-exit=0 sh -c 'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS \\
  LOCAL_RANK=$SLURM_LOCALID exec {sys.executable} {REPO}/examples/plain_pytorch.py \\
  --device cpu --steps 1000000 --ckpt-dir {ckpt} --step-sleep {STEP_S} \\
  --socket {work}/no-agent.sock'
""")
    return script


def slurm_trial(cluster: Any, work: Path) -> dict[str, Any]:
    ckpt = work / "ckpt"
    out = work / "train.out"
    job = cluster.run(["sbatch", "--parsable", f"--chdir={work}",
                       str(_slurm_script(work, ckpt))]).stdout.strip().split(";")[0]
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        text = out.read_text() if out.exists() else ""
        if re.search(r"^step 40 ", text, re.M):
            break
        time.sleep(0.1)
    text = out.read_text()
    at_signal = max(int(s) for s in re.findall(r"^step (\d+) ", text, re.M))
    t0 = time.time()
    cluster.run(["scancel", job])
    cluster.wait_job(job, ("CANCELLED", "COMPLETED", "FAILED"), timeout=60)
    text = out.read_text()
    saved = {int(r): (int(s), float(sec)) for r, s, sec in
             re.findall(r"^rank (\d) saved step (\d+) \(\d+ bytes, ([\d.]+)s\)", text, re.M)}
    got = _committed(ckpt)
    assert got is not None, text[-2000:]
    step, t_commit = got
    assert {s for s, _ in saved.values()} == {step} and len(saved) == 2, text[-2000:]
    return {"latency_s": t_commit - t0, "steps_after_signal": step - at_signal,
            "save_s": max(sec for _, sec in saved.values()), "job": job}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launcher", choices=("torchrun", "slurm"), required=True)
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fw-bpre-"))  # short: AF_UNIX paths are limited
    results = []
    cluster = None
    try:
        if args.launcher == "slurm":
            from support.slurm import SlurmCluster

            cluster = SlurmCluster(root / "slurm")
            (root / "slurm").mkdir()
            cluster.start()
            cluster.wait_state("idle")
        for i in range(args.trials):
            work = root / f"t{i}"
            work.mkdir()
            r = (torchrun_trial(work) if cluster is None else slurm_trial(cluster, work))
            print(json.dumps(r), flush=True)
            results.append(r)
            if cluster is not None:
                cluster.wait_state("idle")
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    lat = [r["latency_s"] for r in results]
    print(json.dumps({"launcher": args.launcher, "trials": len(results),
                      "latency_s_median": statistics.median(lat), "latency_s_max": max(lat),
                      "steps_after_signal": [r["steps_after_signal"] for r in results],
                      "save_s_median": statistics.median(r["save_s"] for r in results),
                      "step_s": STEP_S}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
