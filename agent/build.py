"""Building the real parts of ``forewarn agent`` from its config: the GPU source, the kernel
log, and the components, wired to each other explicitly.

Sources are imported lazily: only :mod:`forewarn.agent.sources.nvml` imports ``pynvml``,
and only when that source is chosen.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from forewarn.agent.backend import GpuBackend, SourceUnavailable, XidSource
from forewarn.agent.config import AgentConfig
from forewarn.agent.protocols import Component, OrderSink, RankFeed
from forewarn.config import ConfigError

if TYPE_CHECKING:
    from forewarn.agent.uplink import Uplink

__all__ = ["build_backend", "build_components", "build_uplink", "build_xid_sources"]

log = logging.getLogger(__name__)


def build_backend(config: AgentConfig) -> GpuBackend:
    """The GPU source named by ``config.source`` (``auto`` = nvml).

    Raises :class:`ConfigError` for a missing setting and :class:`SourceUnavailable`
    (e.g. ``ScenarioError``) for a bad scenario file.
    """
    source = "nvml" if config.source == "auto" else config.source
    if source == "nvml":
        from forewarn.agent.sources.nvml import NvmlBackend

        return NvmlBackend(node=config.node)
    if source == "sim":
        from forewarn.agent.sources.scenario import load_scenario
        from forewarn.agent.sources.sim import SimBackend

        # A bad scenario file raises ScenarioError (a SourceUnavailable naming the key).
        scenario = load_scenario(config.scenario) if config.scenario is not None else None
        return SimBackend(scenario, node=config.node, gpus=config.sim_gpus,
                          speed=config.sim_speed)
    if source == "replay":
        from forewarn.agent.sources.replay import ReplayBackend

        if config.replay_path is None:
            raise ConfigError("replay_path: required with source = replay (--replay FILE)")
        return ReplayBackend(path=config.replay_path, node=config.node,
                             speed=config.replay_speed)
    if source == "dcgm":
        from forewarn.agent.sources.dcgm import DcgmBackend

        return DcgmBackend(url=config.dcgm_url, node=config.node,
                           timeout_s=config.dcgm_timeout_s)
    raise ConfigError(f"source: unknown source {config.source!r}")


def build_xid_sources(config: AgentConfig) -> list[tuple[str, XidSource]]:
    """The kernel-log XID source when enabled and readable; otherwise a warning and none
    (the agent keeps running: NVML's event set still reports XIDs)."""
    if not config.kmsg or config.source in ("sim", "replay"):
        return []
    from forewarn.agent.sources.kmsg import KmsgXidSource

    try:
        kmsg = KmsgXidSource(path=config.kmsg_path, node=config.node)
    except (OSError, SourceUnavailable) as exc:
        log.warning("cannot read XIDs from %s (%s): run as root or with CAP_SYSLOG, or pass "
                    "--no-kmsg; continuing without the kernel log", config.kmsg_path, exc)
        return []
    return [("kmsg", kmsg)]


def build_components(config: AgentConfig) -> list[Component]:
    """The components ``forewarn agent`` runs, in start order: the training ranks (socket,
    orders, hangs), then the collector uplink (spool, batches, commands) when
    ``collector_url`` or ``uplink = "nats"`` asks for one, fed the ranks' table and
    order book. Raises :class:`ConfigError` for a bad setting."""
    from forewarn.agent.rank_component import RankComponent

    ranks = RankComponent(config)
    uplink = build_uplink(config, feed=ranks.table, orders=ranks.orders)
    return [ranks] if uplink is None else [ranks, uplink]


def build_uplink(config: AgentConfig, *, feed: RankFeed | None = None,
                 orders: OrderSink | None = None) -> Uplink | None:
    """The collector uplink: over HTTP when ``collector_url`` is set, over NATS when
    ``uplink = "nats"`` (:mod:`forewarn.agent.bus`); None when standalone. ``feed`` and
    ``orders`` are the rank component's table and order book."""
    if config.uplink == "nats":
        from forewarn.agent.bus import build_nats  # nats-py only where it is used

        return build_nats(config, feed=feed, orders=orders)
    if not config.collector_url:
        return None
    from forewarn.agent.uplink import Uplink, check_uplink_config

    if not config.collector_url.startswith(("http://", "https://")):
        raise ConfigError(f"collector_url: expected http(s)://host:port, got "
                          f"{config.collector_url!r}")
    check_uplink_config(config)
    if config.collector_ca_file is not None and not config.collector_ca_file.is_file():
        raise ConfigError(f"collector_ca_file: no such file {config.collector_ca_file}")
    return Uplink(config, feed=feed, orders=orders)
