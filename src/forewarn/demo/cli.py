"""``forewarn demo``: the whole loop on one machine, with nothing configured.

It starts a real collector, two real agents on simulated 4-GPU nodes (node 1 on the real
GPUs through NVML where this machine has them), and a real two-rank ``torch.distributed``
(gloo, CPU) training job that reports through the hook and saves with the default
checkpoint writer, launched as on two nodes: one torchrun per node, meeting at a c10d
rendezvous, restarted by torchrun's own ``--max-restarts`` when a rank dies
(:class:`~forewarn.demo.launch.TorchrunJob`). Then it injects, in turn:

1. a degrading GPU under rank 1 (a correctable-ECC storm ending in a double-bit error):
   forewarn should see it coming and order a checkpoint, every rank saves the same step, the
   double-bit error kills the rank, and torchrun restarts the job from that checkpoint,
   the rank on a healthy GPU;
2. a hang of rank 0: the agent notices within seconds and ends the job's ranks, so
   torchrun restarts it minutes before NCCL's 10-minute timeout would have;
3. a NaN loss: caught at its step; the job is rolled back to the last good checkpoint.

The summary compares what was lost with what the same run loses without forewarn: the work
since the last periodic checkpoint plus NCCL's timeout for each failure. What was measured
and the summary are :mod:`forewarn.demo.report`.

``forewarn demo --scale-out``: the demo's loop on the scale-out engines, with a collector
replica lost on the way.

The same agents, training job and injected faults as ``forewarn demo``
(:mod:`forewarn.demo.run`), but the agents publish to NATS JetStream (``uplink = "nats"``)
and two collector replicas share PostgreSQL state, pull from one durable consumer and
remote-write the GPU series to VictoriaMetrics. The three servers are started from this
machine's binaries (:mod:`forewarn.demo.servers`) in the demo's work dir (PostgreSQL's
under a temp dir when run as root: the server runs as the ``postgres`` user, which must
reach its folder).

While the training job starts and the agents publish, before the GPU degrades, the replica
leading the policy is killed with SIGKILL, so the other decides every order of the run.
The summary says how long the other took to lead (the failover time), how many
checkpoint orders were issued and acknowledged by the agents, and how many telemetry
samples the agents sent, how many the series store holds (each counted once) and how many
were lost.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from forewarn.demo.run import DemoResult

__all__ = ["as_json", "register"]


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "demo", help="run the whole loop on this machine: collector, agents, a real training "
        "job, injected faults", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fast", action="store_true", help="a run of about a minute (for tests)")
    p.add_argument("--scale-out", action="store_true",
                   help="on NATS JetStream, PostgreSQL and VictoriaMetrics (this machine's "
                   "nats-server, postgresql and victoria-metrics packages) with two "
                   "collector replicas, one killed with SIGKILL mid-run")
    p.add_argument("--workdir", type=Path, default=None,
                   help="keep logs, checkpoints and databases here (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    p.add_argument("--json", action="store_true", help="print the result as JSON at the end")
    p.set_defaults(func=_cli)


def as_json(result: DemoResult) -> dict[str, Any]:
    """The result and the figures derived from it."""
    from forewarn.demo.scale import ScaleResult

    out = dataclasses.asdict(result) | {
        "lead_s": result.lead_s, "checkpoint_step": result.checkpoint_step,
        "steps_lost": result.steps_lost, "steps_lost_without": result.steps_lost_without,
        "hang_latency_s": result.hang_latency_s}
    if isinstance(result, ScaleResult):
        out |= result.derived()
    return out


class _Terminated(KeyboardInterrupt):
    """SIGTERM arrived: stop as on Ctrl-C, exit 143 (128 + SIGTERM)."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated


def _cli(args: argparse.Namespace) -> int:
    # The demo's runs, launchers and servers are imported here, not at parser build, so
    # every other subcommand (the agent, the collector) starts without them.
    from rich.console import Console

    from forewarn.demo import run, scale
    from forewarn.demo.scale import ScaleResult

    # The job's ranks need torch: without it they would fail and be restarted over and
    # over. Importing it here lets `forewarn` name what to install before anything starts.
    importlib.import_module("torch")
    console = Console()
    if args.scale_out and (missing := scale.preflight()):
        for problem in missing:
            print(f"forewarn demo --scale-out: {problem}", file=sys.stderr)
        return 2
    t0 = time.monotonic()

    def say(msg: str) -> None:
        console.print(f"[cyan]{time.monotonic() - t0:6.1f}s[/cyan] {msg}")

    # SIGTERM (`kill`, a service manager) stops the demo as Ctrl-C
    # does: run_demo's cleanup ends every process it started, which the default action
    # (die at once) would leave running in their own sessions.
    signal.signal(signal.SIGTERM, _terminate)
    try:
        result = (scale.run_scale_demo if args.scale_out else run.run_demo)(
            args.fast, args.workdir, args.keep, say)
    except KeyboardInterrupt as exc:
        console.print("interrupted: everything the demo started was stopped")
        return 128 + (signal.SIGTERM if isinstance(exc, _Terminated) else signal.SIGINT)
    console.rule("summary")
    lines = (scale.scale_summary_lines(result) if isinstance(result, ScaleResult)
             else run.summary_lines(result))
    for line in lines:
        console.print(line)
    if args.json:
        print(json.dumps(as_json(result)))
    return 0 if not result.problems else 1


if __name__ == "__main__":
    from forewarn.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
