"""``forewarn agent``: run the node agent."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "agent",
        help="run the node agent (GPU telemetry, rank reports, local actions, /metrics)",
        description="Run the node agent.",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from forewarn.agent.daemon import main

    return main(args)
