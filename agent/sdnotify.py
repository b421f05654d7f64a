"""systemd's notify protocol in a few lines of socket code (no dependency).

With ``Type=notify`` systemd waits for ``READY=1`` before it calls the service started,
and with ``WatchdogSec=`` it kills and restarts a service that stops sending
``WATCHDOG=1`` (see ``sd_notify(3)`` and ``sd_watchdog_enabled(3)``). The protocol: one
``AF_UNIX`` datagram per message to the path in ``$NOTIFY_SOCKET``; a leading ``@`` means
the Linux abstract namespace (a NUL byte). Outside systemd (no ``NOTIFY_SOCKET``) every
method is a no-op, so the agent runs the same from a shell.

The agent sends READY after its first poll with ``/metrics`` up, WATCHDOG at half of
``$WATCHDOG_USEC`` from its poll loop (a stuck loop stops the pings, which is the point),
STATUS lines on changes, and STOPPING at exit.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

__all__ = ["Notifier"]

log = logging.getLogger(__name__)


class Notifier:
    """Sends sd_notify messages to ``$NOTIFY_SOCKET`` (taken from ``env``, default
    ``os.environ``). Never raises: a failed send is logged once and counted."""

    def __init__(self, env: Mapping[str, str] | None = None, pid: int | None = None) -> None:
        env = os.environ if env is None else env
        self._pid = os.getpid() if pid is None else pid
        raw = env.get("NOTIFY_SOCKET", "")
        self.address: str | bytes | None = None
        if raw.startswith("@"):
            self.address = b"\0" + raw[1:].encode()
        elif raw.startswith("/"):
            self.address = raw
        self.watchdog_interval_s: float | None = _watchdog_interval(env, self._pid)
        """Seconds between WATCHDOG pings (half of WATCHDOG_USEC), or None when disabled."""
        self.failures = 0
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        """True when started by systemd with a notify socket."""
        return self.address is not None

    def notify(self, *lines: str) -> bool:
        """Send ``KEY=value`` lines as one datagram; False when disabled or it failed."""
        if self.address is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto("\n".join(lines).encode(), self.address)
            return True
        except OSError as exc:
            if self.failures == 0:
                log.warning("sd_notify to %r failed: %s", self.address, exc)
            self.failures += 1
            return False

    def ready(self, status: str = "") -> bool:
        """READY=1 (and an optional STATUS line)."""
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def watchdog(self) -> bool:
        """WATCHDOG=1 (only when the watchdog is enabled for this process)."""
        if self.watchdog_interval_s is None:
            return False
        return self.notify("WATCHDOG=1")

    def status(self, text: str) -> bool:
        """STATUS=<one line> shown by ``systemctl status``."""
        return self.notify(f"STATUS={text.splitlines()[0] if text else ''}")

    def stopping(self) -> bool:
        """STOPPING=1: the service is shutting down."""
        return self.notify("STOPPING=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _watchdog_interval(env: Mapping[str, str], pid: int) -> float | None:
    """Half of ``$WATCHDOG_USEC`` if set and ``$WATCHDOG_PID`` is unset or ours
    (``sd_watchdog_enabled(3)`` recommends pinging at half the timeout)."""
    usec = env.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    wpid = env.get("WATCHDOG_PID", "")
    if wpid and (not wpid.isdigit() or int(wpid) != pid):
        return None
    return int(usec) / 2 / 1e6
