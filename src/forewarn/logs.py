"""Logging of the daemons (``forewarn agent``, ``forewarn collector run``): one handler on
the root logger, on standard error, set up once from the ``log_level`` and ``log_format``
config keys.

- ``text``: ``2026-01-02 03:04:05,678 INFO forewarn.agent.daemon: message``. Under systemd
  (``JOURNAL_STREAM`` names the device and inode of our standard error, systemd.exec(5))
  the time is left out, since the journal stamps every line itself, and each line starts
  with the syslog priority ``<N>`` that journald turns into the entry's priority
  (sd-daemon(3)), so ``journalctl -p warning`` works.
- ``json``: one JSON object per line, ``{"ts", "level", "logger", "message"}`` and
  ``"exc"`` with a traceback; under the journal the priority prefix comes first too.

httpx logs every request at INFO (``HTTP Request: POST .../ingest "200 OK"``): for the
agent's uplink and the collector's webhooks that is routine traffic, so it is demoted to
DEBUG; failures are logged by forewarn itself at WARNING or above.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
from collections.abc import Mapping
from typing import TextIO

__all__ = ["JsonFormatter", "setup_logging", "under_journal"]

# syslog priorities (RFC 5424) of Python's levels, for journald's "<N>" line prefix.
_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6,
             logging.DEBUG: 7}

ROUTINE_LOGGERS = ("httpx",)
"""Loggers whose INFO lines are per-request chatter, logged at DEBUG instead."""


def under_journal(stream: TextIO, env: Mapping[str, str] | None = None) -> bool:
    """Whether ``stream`` is connected to systemd's journal: ``JOURNAL_STREAM`` is
    ``<device>:<inode>`` of it (a variable inherited by a child whose output was redirected
    does not match, so its lines keep their time)."""
    value = (os.environ if env is None else env).get("JOURNAL_STREAM", "")
    device, sep, inode = value.partition(":")
    if not sep or not device.isdigit() or not inode.isdigit():
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (int(device), int(inode))


def _priority(record: logging.LogRecord) -> str:
    level = max((lv for lv in _PRIORITY if lv <= record.levelno), default=logging.DEBUG)
    return f"<{_PRIORITY[level]}>"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in a message are escaped)."""

    def __init__(self, journal: bool = False) -> None:
        super().__init__()
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        line = json.dumps(entry)
        return _priority(record) + line if self.journal else line


class _TextFormatter(logging.Formatter):
    def __init__(self, journal: bool) -> None:
        fmt = "%(levelname)s %(name)s: %(message)s"
        super().__init__(fmt if journal else "%(asctime)s " + fmt)
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return _priority(record) + text if self.journal else text


class _Routine(logging.Filter):
    """Logs a logger's INFO records at DEBUG (shown only when the root level allows)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO:
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger().isEnabledFor(logging.DEBUG)


def setup_logging(level: str, fmt: str, stream: TextIO | None = None,
                  env: Mapping[str, str] | None = None) -> logging.Handler:
    """Send every log record at ``level`` or above to ``stream`` (standard error) in
    format ``fmt`` (``text`` or ``json``, as validated by the config); replaces handlers
    set up before. Returns the handler."""
    stream = sys.stderr if stream is None else stream
    journal = under_journal(stream, env)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter(journal) if fmt == "json" else _TextFormatter(journal))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    for name in ROUTINE_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Routine) for f in logger.filters):
            logger.addFilter(_Routine())
    return handler
