"""How many datagrams the kernel queues on the agent socket: ``net.unix.max_dgram_qlen``.

A Unix datagram socket queues at most ``net.unix.max_dgram_qlen`` datagrams: the kernel's
default is 10; systemd as PID 1 raises it to 512 at boot, in its own network namespace
only, so a host or container whose PID 1 is not systemd (a Docker container or Kubernetes
pod with a network namespace of its own) keeps 10. A hook whose send finds the agent's
queue full drops its step records (:mod:`forewarn.hook._sender`). The kernel fixes the limit
of a socket when the socket is created, from the value of its network namespace, so the
agent reads the value once, just before it creates its socket: that is the limit its
socket has until the agent restarts.

``forewarn deploy install --role agent`` installs :data:`SYSCTL_FILE` (``net.unix.
max_dgram_qlen = 512``) and applies it; ``systemd-sysctl.service`` applies it at every boot.
Below :data:`RECOMMENDED`, :func:`read_limit` logs one warning naming the sysctl and the file;
the rank component exports the value (``forewarn_agent_socket_max_dgram_qlen``) and shows it
in ``/readyz``.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

__all__ = ["PROC_PATH", "RECOMMENDED", "SYSCTL", "SYSCTL_FILE", "QueueLimit", "read_limit"]

log = logging.getLogger(__name__)

SYSCTL = "net.unix.max_dgram_qlen"
PROC_PATH = Path("/proc/sys/net/unix/max_dgram_qlen")
SYSCTL_FILE = "/etc/sysctl.d/60-forewarn.conf"
RECOMMENDED = 512
"""Enough for a node's ranks to go on reporting through a stall of the agent of a second or
so (8 ranks, each flushing a batch of step records every 10 ms at most)."""


@dataclasses.dataclass(frozen=True)
class QueueLimit:
    """The value read (``None``: unreadable, not Linux) and why not, if so."""

    value: int | None
    error: str = ""

    @property
    def low(self) -> bool:
        """Known and below :data:`RECOMMENDED`."""
        return self.value is not None and self.value < RECOMMENDED

    def detail(self) -> str:
        """One line for ``/readyz``."""
        if self.value is None:
            return f"{SYSCTL} unknown ({self.error})"
        if self.low:
            return (f"{SYSCTL} = {self.value}, below {RECOMMENDED}: hooks drop step records "
                    f"when the agent stalls; install {SYSCTL_FILE} (forewarn deploy install "
                    "--role agent) and restart the agent")
        return f"{SYSCTL} = {self.value}"


def read_limit(path: Path = PROC_PATH) -> QueueLimit:
    """Read the limit from ``path``; log a warning when it is low or unreadable."""
    try:
        value = int(path.read_text().strip())
    except (OSError, ValueError) as exc:
        limit = QueueLimit(None, f"cannot read {path}: {exc}")
        log.warning("%s: the agent socket's queue length is not known", limit.error)
        return limit
    limit = QueueLimit(value)
    if limit.low:
        log.warning("%s", limit.detail())
    return limit
