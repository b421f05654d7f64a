"""``forewarn agent``: run the node agent.

Every key of :class:`~forewarn.agent.config.AgentConfig` is a flag (``--interval-s``) and a
``FOREWARN_AGENT_*`` environment variable, generated from the config definition; a flag
overrides the variable, which overrides the config file (``/etc/forewarn/agent.toml``, see
``deploy/agent.toml``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any

from forewarn.agent.config import DEFAULT_CONFIG_PATH, AgentConfig
from forewarn.config import ConfigError, add_config_arguments, load_from_args

__all__ = ["add_source_arguments", "config_from_args", "register", "run_agent"]

log = logging.getLogger(__name__)

# Short flags kept beside the generated ones (``--socket`` for ``--socket-path``): scripts,
# units and docs have used them since the first release.
ALIASES = {"interval_s": "--interval", "socket_path": "--socket",
           "collector_url": "--collector", "replay_path": "--replay"}

# The keys ``forewarn check`` takes: those that choose the GPU source and the node.
SOURCE_KEYS = ("source", "scenario", "sim_gpus", "sim_speed", "replay_path", "replay_speed",
               "dcgm_url", "dcgm_timeout_s", "node")


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
    add_config_arguments(p, AgentConfig, service="agent", aliases=ALIASES)
    p.set_defaults(func=_run)


def add_source_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that choose the agent's config, GPU source and node name: shared by
    ``forewarn agent`` and ``forewarn check`` (the preflight runs the same checks)."""
    add_config_arguments(p, AgentConfig, service="agent", only=SOURCE_KEYS, aliases=ALIASES)


def config_from_args(args: argparse.Namespace, env: dict[str, str] | None = None,
                     **fixed: Any) -> AgentConfig:
    """Load the agent config: TOML file, ``FOREWARN_AGENT_*``, the flags, then ``fixed``
    (keys the command itself sets, such as ``kmsg=False`` for the preflight)."""
    return load_from_args(AgentConfig, service="agent", args=args,
                          default_path=DEFAULT_CONFIG_PATH, env=env, overrides=fixed)


def _run(args: argparse.Namespace) -> int:
    from forewarn.logs import setup_logging

    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"forewarn agent: config error: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level, config.log_format)
    return run_agent(config)


def run_agent(config: AgentConfig) -> int:
    """Run the agent of ``config`` until SIGTERM/SIGINT. Exit 2 on a configuration error,
    1 when the metrics port cannot be bound."""
    # Imported here: `forewarn --help` must not load the agent's runtime.
    from forewarn.agent.backend import SourceUnavailable
    from forewarn.agent.build import build_backend, build_components, build_xid_sources
    from forewarn.agent.daemon import Agent

    try:
        backend = build_backend(config)
    except ConfigError as exc:
        print(f"forewarn agent: config error: {exc}", file=sys.stderr)
        return 2
    except (SourceUnavailable, ValueError) as exc:
        print(f"forewarn agent: {exc}", file=sys.stderr)
        return 2
    if config.source in ("sim", "replay"):
        # A scenario or replay file the user named: a bad one is a config error, said now.
        try:
            backend.open()
            backend.close()
        except SourceUnavailable as exc:
            print(f"forewarn agent: {config.source} source: {exc}", file=sys.stderr)
            return 2
    agent = Agent(config, backend, xid_sources=build_xid_sources(config),
                  process_metrics=True)
    try:
        components = build_components(config)
    except ConfigError as exc:
        print(f"forewarn agent: config error: {exc}", file=sys.stderr)
        return 2
    for comp in components:
        agent.add_component(comp)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("%s: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        agent.start()
    except OSError as exc:
        print(f"forewarn agent: cannot listen on {config.listen}: {exc}", file=sys.stderr)
        agent.stop()
        return 1
    try:
        agent.run(stop)
    finally:
        agent.stop()
    return 0
