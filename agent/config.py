"""Agent configuration: ``/etc/forewarn/agent.toml``, ``FOREWARN_AGENT_*``, then flags."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

from forewarn.config import ConfigError, check_logging

__all__ = ["DEFAULT_CONFIG_PATH", "AgentConfig"]

DEFAULT_CONFIG_PATH = Path("/etc/forewarn/agent.toml")

SOURCES = ("auto", "nvml", "dcgm", "sim", "replay")


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """Everything the agent can be told. Field names are the TOML keys."""

    node: str = dataclasses.field(default_factory=socket.gethostname)
    """Name of this node in metrics and at the collector."""
    source: str = "auto"
    """GPU source: nvml, dcgm, sim, replay; auto = nvml."""
    interval_s: float = 1.0
    """Poll interval of the GPU source and the checks."""
    listen: str = "127.0.0.1:9403"
    """host:port of the Prometheus /metrics endpoint."""
    # sim source
    scenario: Path | None = None
    """Scenario file for --source sim; none = the embedded default scenario."""
    sim_gpus: int = 8
    """Number of simulated GPUs when the scenario does not say."""
    sim_speed: float = 1.0
    """Simulated seconds per real second."""
    # replay source
    replay_path: Path | None = None
    """Recorded telemetry (CSV or Parquet) for source = replay."""
    replay_speed: float = 1.0
    """Recorded seconds replayed per real second."""
    # dcgm source
    dcgm_url: str = "http://127.0.0.1:9400/metrics"
    """dcgm-exporter /metrics URL for source = dcgm."""
    dcgm_timeout_s: float = 2.0
    """Seconds to wait for one dcgm-exporter scrape."""
    # kernel log
    kmsg: bool = True
    """Read NVRM Xid lines from the kernel log."""
    kmsg_path: Path = Path("/dev/kmsg")
    """Kernel log to read XIDs from."""
    # training ranks
    socket_path: Path = Path("/run/forewarn/agent.sock")
    """Unix datagram socket the training hooks report to."""
    hang_action: str = "shadow"
    """On a confirmed rank hang: shadow (report only) or terminate (SIGTERM, then SIGKILL)."""
    hang_grace_s: float = 30.0
    """Seconds between SIGTERM and SIGKILL when hang_action = terminate."""
    hang_floor_s: float = 2.0
    """A rank is never called hung sooner than this."""
    socket_mode: str = "0660"
    """Octal mode of the agent socket; must grant nothing to others (0660 or 0600)."""
    socket_group: str = ""
    """Group (name or gid) owning the agent socket: training users in it may report."""
    grad_spike_factor: float = 10.0
    """Grad norm above this many times the rank's rolling median is a spike."""
    order_safety_s: float = 0.25
    """Checkpoint order margin: seconds of step-time jitter added ahead of the fastest rank
    (not for preemption orders: those are placed by the measured delivery and each rank's
    phase, see agent/orders.py)."""
    # collector uplink
    uplink: str = "http"
    """Transport to the collector: ``http`` (``collector_url``) or ``nats`` (``nats_url``,
    JetStream; see docs/scale.md)."""
    collector_url: str = ""
    """Base URL of the collector; empty = run standalone (uplink = http)."""
    nats_url: str = ""
    """NATS server(s) for uplink = nats: ``nats://host:4222``, comma-separated for a cluster."""
    nats_ca_file: Path | None = None
    """PEM CA bundle that signed the NATS servers' TLS certificates (uplink = nats)."""
    token: str = ""
    """This node's collector token (visible to other users in a flag or variable: prefer
    token_file)."""
    token_file: Path | None = None
    """File holding this node's collector token (``forewarn collector token add`` prints it)."""
    collector_ca_file: Path | None = None
    """PEM CA bundle that signed the collector's TLS certificate (none = system CAs)."""
    spool_dir: Path = Path("/var/lib/forewarn/spool")
    """Batches not yet accepted by the collector wait here, replayed in order."""
    spool_max_bytes: int = 256 * 1024 * 1024
    """Spool size limit; over it the oldest batches are dropped (and counted)."""
    push_interval_s: float = 5.0
    """Seconds between batches sent to the collector (urgent events go at once)."""
    # systemd and logging
    watchdog: bool = True
    """Send READY and WATCHDOG pings when started by systemd (NOTIFY_SOCKET set)."""
    log_level: str = "info"
    """Logging level: critical, error, warning, info, debug."""
    log_format: str = "text"
    """Log lines: text (no timestamp under systemd's journal, which adds its own) or json
    (one JSON object per line)."""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ConfigError(f"source: must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if not 0.05 <= self.interval_s <= 3600:
            raise ConfigError(f"interval_s: must be within 0.05..3600, got {self.interval_s}")
        try:
            mode = int(self.socket_mode, 8)
        except ValueError:
            raise ConfigError(f"socket_mode: expected an octal mode such as 0660, got "
                              f"{self.socket_mode!r}") from None
        if mode & 0o007 or mode > 0o777:
            raise ConfigError(f"socket_mode: {self.socket_mode} would let other users write to "
                              "the socket; use 0660 (with socket_group) or 0600")
        if self.grad_spike_factor <= 1.0:
            raise ConfigError(f"grad_spike_factor: must be above 1, got {self.grad_spike_factor}")
        if self.uplink not in ("http", "nats"):
            raise ConfigError(f"uplink: must be http or nats, got {self.uplink!r}")
        if self.hang_action not in ("shadow", "terminate"):
            raise ConfigError(f"hang_action: must be shadow or terminate, got {self.hang_action!r}")
        if self.sim_gpus < 1 or self.sim_gpus > 64:
            raise ConfigError(f"sim_gpus: must be within 1..64, got {self.sim_gpus}")
        positive = (
            "sim_speed", "replay_speed", "push_interval_s", "dcgm_timeout_s", "hang_grace_s",
            "hang_floor_s", "order_safety_s",
        )
        for key in positive:
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key}: must be positive, got {getattr(self, key)}")
        _host, sep, port = self.listen.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ConfigError(f"listen: expected host:port, got {self.listen!r}")
        if not self.node:
            raise ConfigError("node: must not be empty")
        check_logging(self.log_level, self.log_format)
