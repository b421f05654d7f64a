"""``forewarn agent``: run the node agent.

Every flag overrides the key of the same meaning in the config file
(``/etc/forewarn/agent.toml``, see ``deploy/agent.toml``) and in ``FOREWARN_AGENT_*``
environment variables.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_source_arguments", "register"]


def register(sub: Any) -> None:
    """Add the ``agent`` subcommand to the ``forewarn`` parser."""
    p: argparse.ArgumentParser = sub.add_parser(
        "agent",
        help="run the node agent (GPU telemetry, hardware checks, rank reports, /metrics)",
        description=(
            "Run the node agent: poll the GPUs (NVML, DCGM exporter, simulation or a "
            "replay file) and the kernel log, run the hardware checks, serve Prometheus "
            "metrics, hear the training ranks and forward everything to the collector. "
            "Settings come from the config file, then FOREWARN_AGENT_<KEY> environment "
            "variables, then these flags."
        ),
    )
    add_source_arguments(p)
    p.add_argument("--interval", type=float, metavar="SECONDS",
                   help="poll interval of the GPU source and the checks (default 1; "
                        "config key: interval_s)")
    p.add_argument("--listen", metavar="HOST:PORT",
                   help="address of the /metrics, /healthz and /api/v1/findings endpoint "
                        "(default 127.0.0.1:9403)")
    p.add_argument("--sim-speed", type=float, metavar="X",
                   help="sim source: simulated seconds per real second (e.g. 30 to see a "
                        "scenario's faults within seconds)")
    p.add_argument("--no-kmsg", action="store_true", default=None,
                   help="do not read NVRM Xid lines from the kernel log")
    p.add_argument("--kmsg-path", metavar="PATH",
                   help="kernel log to read XIDs from (default /dev/kmsg)")
    p.add_argument("--socket", metavar="PATH",
                   help="Unix datagram socket the training hooks report to "
                        "(default /run/forewarn/agent.sock; config key: socket_path)")
    p.add_argument("--collector", metavar="URL",
                   help="base URL of the collector; empty = run standalone "
                        "(config key: collector_url)")
    p.add_argument("--token-file", metavar="FILE",
                   help="file holding this agent's collector token")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"],
                   help="logging level (default info)")
    p.set_defaults(func=_run)


def add_source_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that choose the agent's config, GPU source and node name: shared by
    ``forewarn agent`` and ``forewarn check`` (the preflight runs the same checks)."""
    p.add_argument("--config", metavar="FILE",
                   help="config file (TOML; default /etc/forewarn/agent.toml, used if present)")
    p.add_argument("--source", choices=["auto", "nvml", "dcgm", "sim", "replay"],
                   help="GPU telemetry source: nvml (NVIDIA driver), dcgm (a dcgm-exporter "
                        "endpoint), sim (simulated GPUs), replay (a recorded file); "
                        "auto = nvml (config key: source)")
    p.add_argument("--scenario", metavar="FILE",
                   help="sim source: scenario file of scripted faults (default: the "
                        "embedded demo scenario)")
    p.add_argument("--sim-gpus", type=int, metavar="N",
                   help="sim source: number of simulated GPUs when the scenario does not say")
    p.add_argument("--replay", metavar="FILE",
                   help="replay source: recorded telemetry (CSV or Parquet; config key: "
                        "replay_path)")
    p.add_argument("--dcgm-url", metavar="URL",
                   help="dcgm source: dcgm-exporter /metrics URL "
                        "(default http://127.0.0.1:9400/metrics)")
    p.add_argument("--node", metavar="NAME",
                   help="name of this node in metrics and at the collector (default: hostname)")


def _run(args: argparse.Namespace) -> int:
    from forewarn.agent.daemon import main

    return main(args)
