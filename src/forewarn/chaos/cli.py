"""``forewarn chaos``: inject every fault the design claims to handle into a real stack on
this machine and check that each is handled.

Runs a real collector, real agents on simulated nodes, a real 2-rank ``torch.distributed``
(gloo, CPU) job and hook-only jobs (see :mod:`forewarn.chaos.lab`), then the scenarios of
:mod:`forewarn.chaos.scenarios` one after the other. Each states its expected outcome and
checks it; the table says what was detected, how fast, what action ran and what was lost.
The exit status is 1 if any scenario failed its expectation.

The agent cut-off lasts ``--cutoff-s`` (default 120 s: "minutes"). A full run of the first
14 scenarios took 4 min 24 s on 2 shared cores (bench/RESULTS.md); the suite has 28 now,
among them two 60 s outages and the scale-out rig, and a full run has not been timed since:
``--only`` runs a few. Ctrl-C stops everything it started.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The lab and the scenarios are imported where they run, not at parser build, so every
# other subcommand (the agent, the collector) starts without them.
if TYPE_CHECKING:
    from forewarn.chaos.lab import Options
    from forewarn.chaos.scenarios import Outcome, Scenario

__all__ = ["register", "run_chaos"]


def run_chaos(scenarios: Sequence[Scenario], options: Options | None = None,
              workdir: Path | None = None, keep: bool = False,
              on_outcome: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """Run ``scenarios`` in one lab; every process is stopped on return."""
    from forewarn.chaos.lab import Lab
    from forewarn.chaos.scenarios import run_one

    made = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="forewarn-chaos-")) if workdir is None else workdir
    lab = Lab(wd, options)
    outcomes = []
    try:
        if any(s.rig == "hardware" for s in scenarios):
            lab.hardware()  # its faults play out while the others run
        for s in scenarios:
            out = run_one(lab, s)
            outcomes.append(out)
            if on_outcome is not None:
                on_outcome(out)
    finally:
        lab.close()
        if made and not keep:
            shutil.rmtree(wd, ignore_errors=True)
    return outcomes


def _fmt_s(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f} s"


def render(outcomes: Sequence[Outcome]) -> Any:
    """The outcomes as a rich table."""
    from rich.table import Table

    t = Table(title="forewarn chaos", show_lines=True)
    for col in ("scenario", "result", "detected", "how fast", "action", "lost"):
        t.add_column(col, overflow="fold")
    for o in outcomes:
        result = f"[yellow]skip[/yellow]\n{o.skipped}" if o.skipped else \
            "[green]pass[/green]" if o.passed else "[red]FAIL[/red]\n" + "\n".join(
            o.problems)
        t.add_row(o.name, result, o.detected, _fmt_s(o.detection_s), o.action, o.lost)
    return t


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "chaos", help="fault-injection suite: kill, hang, corrupt and cut a real stack on "
        "this machine and check each fault is handled", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", metavar="NAME", default=None,
                   help="run only these scenarios (see --list)")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument("--json", action="store_true", help="print the outcomes as JSON")
    p.add_argument("--cutoff-s", type=float, default=None,
                   help="how long the agent is cut off from the collector (default 120)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="keep logs, checkpoints and databases here (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    p.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    from rich.console import Console

    from forewarn.chaos.lab import Options
    from forewarn.chaos.scenarios import SCENARIOS, by_name

    console = Console(stderr=args.json)
    if args.list:
        for s in SCENARIOS:
            console.print(f"[bold]{s.name}[/bold] ({s.rig}): {s.expected}")
        return 0
    try:
        chosen = by_name(args.only)
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    t0 = time.monotonic()

    def progress(o: Outcome) -> None:
        mark = "[green]pass[/green]" if o.passed else "[red]FAIL[/red]"
        console.print(f"[cyan]{time.monotonic() - t0:6.1f}s[/cyan] {mark} {o.name}"
                      + ("" if o.passed else f": {'; '.join(o.problems)}"))

    options = Options() if args.cutoff_s is None else Options(cutoff_s=args.cutoff_s)
    console.print(f"running {len(chosen)} scenario(s) against a real collector, agents and "
                  "training job on this machine …")
    try:
        outcomes = run_chaos(chosen, options, args.workdir, args.keep, progress)
    except KeyboardInterrupt:
        console.print("interrupted: everything chaos started was stopped")
        return 130
    console.print(render(outcomes))
    if args.json:
        print(json.dumps([dataclasses.asdict(o) for o in outcomes], default=str))
    failed = [o.name for o in outcomes if not o.passed]
    console.print(f"{len(outcomes) - len(failed)}/{len(outcomes)} passed"
                  + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    from forewarn.cli import main

    sys.exit(main(["chaos", *sys.argv[1:]]))
