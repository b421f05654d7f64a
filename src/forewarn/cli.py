"""The ``forewarn`` command. Each subcommand lives with its part and registers itself
here through an explicit list, so ``forewarn --help`` lists all of them."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from forewarn import __version__
from forewarn.extras import missing_extra

# (subcommand, module exposing ``register(subparsers)``). Modules keep heavy imports
# inside their command functions so ``--help`` stays fast.
SUBCOMMANDS: tuple[tuple[str, str], ...] = (
    ("agent", "forewarn.agent.cli"),
    ("collector", "forewarn.collector.cli"),
    ("status", "forewarn.status"),
    ("demo", "forewarn.demo.cli"),
    ("chaos", "forewarn.chaos.cli"),
    ("simulate", "forewarn.simulate"),
    ("check", "forewarn.check"),
    ("dashboards", "forewarn.dashboards.cli"),
    ("models", "forewarn.models.cli"),
    ("deploy", "forewarn.deploy.cli"),
)

# Actions a part adds to another part's command: (command, module exposing
# ``register_actions(actions)``). ``forewarn models retrain`` reads the collector's store,
# which forewarn.models may not import.
EXTRA_ACTIONS: tuple[tuple[str, str], ...] = (
    ("models", "forewarn.collector.retrain"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="forewarn",
        description=(
            "forewarn watches GPU nodes and the training jobs on them, sees failures "
            "coming, and makes the job checkpoint before it dies."
        ),
    )
    parser.add_argument("--version", action="version", version=f"forewarn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    actions = {name: importlib.import_module(module).register(sub)
               for name, module in SUBCOMMANDS}
    for name, module in EXTRA_ACTIONS:
        importlib.import_module(module).register_actions(actions[name])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``forewarn`` command; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.func(args)
    except ImportError as exc:
        # A module of an extra that is not installed: say which extra, exit 2.
        message = missing_extra(exc, f"forewarn {args.command}")
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 2
    return result


if __name__ == "__main__":
    sys.exit(main())
