"""The ``forewarn demo`` command: the embedded demo (:mod:`forewarn.demo.run`) or, with
``--scale-out``, the same loop on NATS JetStream, PostgreSQL, VictoriaMetrics and two
collector replicas (:mod:`forewarn.demo.scale`)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from forewarn.demo import run, scale
from forewarn.demo.run import DemoResult
from forewarn.demo.scale import ScaleResult

__all__ = ["as_json", "register"]


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "demo", help="run the whole loop on this machine: collector, agents, a real training "
        "job, injected faults", description=f"{run.__doc__}\n{scale.__doc__}",
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
    from rich.console import Console

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
