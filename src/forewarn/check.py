"""``forewarn check``: a preflight that runs the agent's hardware checks once.

Meant for the moment before a job starts on a node: a Slurm prolog
(``deploy/slurm/prolog.sh``), a Kubernetes init container, a torchrun pre-start hook.
It reads the GPUs once through the same source and the same checks as the agent
(:class:`forewarn.agent.daemon.Agent`, one poll cycle, no server, no kernel log), prints
one line per check and exits:

* ``0``: no GPU is unhealthy (degraded findings are printed, they do not fail the check);
* ``1``: at least one GPU (or the node) is unhealthy; the line says which and why;
* ``2``: the check could not run (bad configuration, the source gave no sample).

Settings come from the agent's config file and ``FOREWARN_AGENT_*`` like ``forewarn
agent``; the flags override them.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, TextIO

from forewarn.agent.cli import add_source_arguments

__all__ = ["EXIT_CANNOT_RUN", "EXIT_HEALTHY", "EXIT_UNHEALTHY", "register", "run_check"]

EXIT_HEALTHY = 0
EXIT_UNHEALTHY = 1
EXIT_CANNOT_RUN = 2


def register(sub: Any) -> None:
    """Add the ``check`` subcommand to the ``forewarn`` parser."""
    p: argparse.ArgumentParser = sub.add_parser(
        "check",
        help="preflight: run the GPU hardware checks once; exit 1 when a GPU is unhealthy",
        description=(
            "Run the agent's hardware checks once against the configured GPU source and "
            "print one line per check. Exit 0 when healthy, 1 when a GPU is unhealthy, "
            "2 when the check cannot run. For Slurm prologs, Kubernetes init containers "
            "and torchrun pre-start hooks."
        ),
    )
    add_source_arguments(p)
    p.set_defaults(func=run_check)


def run_check(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the checks once with the agent's settings from ``args``; return the exit code."""
    from forewarn.agent.backend import SourceUnavailable
    from forewarn.agent.build import build_backend
    from forewarn.agent.cli import config_from_args
    from forewarn.agent.daemon import Agent
    from forewarn.agent.sdnotify import Notifier
    from forewarn.config import ConfigError

    out = sys.stdout if out is None else out
    # The agent logs why a source failed; the preflight shows only that on stderr.
    logging.basicConfig(level=logging.ERROR, format="forewarn check: %(message)s")
    try:
        # The kernel log holds the node's past, not its state now.
        config = config_from_args(args, kmsg=False)
        backend = build_backend(config)
    except (ConfigError, SourceUnavailable, ValueError) as exc:
        print(f"forewarn check: cannot run: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    agent = Agent(config, backend, notifier=Notifier(env={}))
    agent.start(serve=False)
    try:
        poll = agent.poll_once()
    finally:
        agent.stop()
    if not poll.samples:
        print(f"forewarn check: cannot run: no GPU sample from source {backend.name} on "
              f"{config.node}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    unhealthy = False
    for run in poll.check_runs:
        line, bad = _line(run.name, run.findings)
        unhealthy |= bad
        print(line, file=out)
    verdict = "UNHEALTHY" if unhealthy else "healthy"
    print(f"{config.node}: {verdict} ({len(poll.samples)} GPU(s) via {backend.name})", file=out)
    return EXIT_UNHEALTHY if unhealthy else EXIT_HEALTHY


def _line(check: str, findings: Any) -> tuple[str, bool]:
    """One line for one check: its worst findings, and whether any is unhealthy."""
    from forewarn.wire import Health

    bad = [f for f in findings if f.health != Health.HEALTHY]
    if not bad:
        return f"ok        {check}", False
    worst = max(bad, key=lambda f: f.health.severity)
    what = "; ".join(f"{_who(f.subject)}: {f.reason}" for f in bad if f.health == worst.health)
    return f"{worst.health.value:<9} {check}: {what}", worst.health == Health.UNHEALTHY


def _who(subject: Any) -> str:
    if subject.kind == "gpu":
        return f"GPU {subject.gpu}"
    return f"{subject.kind} {subject.node or subject.job}"
