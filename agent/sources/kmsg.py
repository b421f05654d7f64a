"""``kmsg``: NVIDIA XID errors from the kernel log.

The NVIDIA driver (``NVRM``) prints each XID as a kernel message::

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.
    NVRM: Xid (PCI:0000:3b:00): 13, Graphics SM Warp Exception on (GPC 0, TPC 0): ...
    NVRM: Xid (0000:03:00): 48, An uncorrectable double bit error (DBE) has been ...

(older drivers omit ``PCI:``, newer ones add ``pid=``/``name=``; the text after the code
is kept as it is). Records are read from ``/dev/kmsg`` (``<prio>,<seq>,<usec since
boot>,<flags>;<message>``, one record per ``read``) or from a file/FIFO of ``dmesg``
(``[  123.456789] NVRM: ...``, or ``dmesg -T``), syslog/journal (``Jan 12 10:11:12 host
kernel: NVRM: ...``) or bare ``NVRM:`` lines, which tests use as fixtures.

Reading never blocks: the file is opened ``O_RDONLY | O_NONBLOCK`` and read until
``EAGAIN`` (no more records) or end of file; ``/dev/kmsg`` reports ``EPIPE`` when the
ring buffer overwrote records we had not read yet, which is counted in ``lost`` and
reading goes on. At start it seeks to the end, so old messages are not re-reported,
unless ``from_start=True``.

Lines that are not a kernel-log record of a known shape, and ``NVRM: Xid`` lines that do
not parse, are counted in ``skipped`` and logged at a limited rate; they never raise.
Mapping the PCI bus id to a GPU index is the caller's job
(:meth:`forewarn.agent.state.AgentState.gpu_for_bus_id`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from forewarn.agent.backend import SourceUnavailable
from forewarn.wire import XidEvent

__all__ = ["KmsgXidSource", "ParsedXid", "parse_line"]

log = logging.getLogger(__name__)

READ_SIZE = 8192
"""Bytes per read: more than one /dev/kmsg record (the kernel caps a record at 1 KiB of
text plus dictionary); a smaller buffer would make the kernel answer EINVAL."""
MAX_RECORDS_PER_DRAIN = 10_000
"""Bound the work of one drain (a flood of kernel messages must not stall the poll)."""
MAX_LINE = 16_384
LOG_EVERY_S = 60.0

_KMSG = re.compile(r"^(\d+),(\d+),(\d+),[^;]*;(.*)$", re.S)
_DMESG = re.compile(r"^\[\s*(\d+\.\d+)\]\s?(.*)$", re.S)
_DMESG_T = re.compile(
    r"^\[[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4}\]\s?(.*)$", re.S)
_SYSLOG = re.compile(
    r"^(?:[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d|\d{4}-\d\d-\d\dT[\d:.]+(?:Z|[+-]\d\d:?\d\d)?)"
    r" \S+ kernel: (?:\[\s*\d+\.\d+\]\s?)?(.*)$", re.S)
_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)\):"
    r"\s*(?P<code>\d{1,6})(?:,\s*(?P<text>.*))?$", re.S)


class ParsedXid:
    """An XID parsed from one line: bus id, code, text, and seconds since boot if known."""

    __slots__ = ("bus_id", "code", "text", "uptime_s")

    def __init__(self, bus_id: str, code: int, text: str, uptime_s: float | None) -> None:
        self.bus_id = bus_id
        self.code = code
        self.text = text
        self.uptime_s = uptime_s


def parse_line(line: str) -> ParsedXid | Literal[False] | None:
    """Parse one kernel-log line.

    Returns a :class:`ParsedXid`; ``None`` for a well-formed line that is not an XID; or
    ``False`` for garbage (not a kernel-log record, or an ``NVRM: Xid`` line that does not
    parse).
    """
    line = line.rstrip("\r\n")
    if not line.strip() or len(line) > MAX_LINE or "\x00" in line:
        return False if line.strip() else None
    uptime: float | None = None
    m = _KMSG.match(line)
    if m:
        uptime = int(m.group(3)) / 1e6
        message = m.group(4)
    elif (m := _DMESG.match(line)) is not None:
        uptime = float(m.group(1))
        message = m.group(2)
    elif (m := _SYSLOG.match(line) or _DMESG_T.match(line)) is not None:
        message = m.group(1)  # wall-clock stamped: no uptime, the reader's clock is used
    elif line.startswith("NVRM:"):
        message = line
    else:
        return False
    if "NVRM: Xid" not in message:
        return None
    x = _XID.search(message)
    if x is None:
        return False
    code = int(x.group("code"))
    if code > 100_000:
        return False
    text = (x.group("text") or "").strip()
    return ParsedXid(x.group("bus"), code, text[:4096], uptime)


def _default_boot_time() -> float:
    # kmsg timestamps count CLOCK_MONOTONIC microseconds since boot.
    return time.time() - time.clock_gettime(time.CLOCK_MONOTONIC)


class KmsgXidSource:
    """XID events from ``/dev/kmsg`` (implements :class:`forewarn.agent.backend.XidSource`).

    ``boot_time`` (Unix seconds) turns kernel timestamps into wall time; ``clock`` stamps
    lines that carry no timestamp. ``reader`` is the ``read(fd, n)`` call: the kernel-device
    seam, replaced in tests to produce ``EPIPE``. The file is opened here; an unreadable
    path raises :class:`SourceUnavailable`.
    """

    def __init__(
        self,
        path: str | Path = "/dev/kmsg",
        *,
        node: str,
        from_start: bool = False,
        boot_time: float | None = None,
        clock: Callable[[], float] = time.time,
        reader: Callable[[int, int], bytes] = os.read,
    ) -> None:
        self.path = Path(path)
        self.node = node
        self.boot_time = _default_boot_time() if boot_time is None else boot_time
        self.skipped = 0
        """Garbage lines (not a kernel-log record, or an unparseable Xid line)."""
        self.lost = 0
        """Times /dev/kmsg said records were overwritten before we read them (EPIPE)."""
        self.errors = 0
        self._clock = clock
        self._read = reader
        self._tail = b""
        self._last_log = -LOG_EVERY_S
        try:
            self._fd: int | None = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise SourceUnavailable(f"kmsg {self.path}: cannot open: {exc.strerror}") from None
        if not from_start:
            # A FIFO cannot seek; it only holds what comes next anyway.
            with contextlib.suppress(OSError):
                os.lseek(self._fd, 0, os.SEEK_END)

    def drain(self) -> list[XidEvent]:
        """XID events logged since the last call. Never blocks, never raises."""
        if self._fd is None:
            return []
        events: list[XidEvent] = []
        for _ in range(MAX_RECORDS_PER_DRAIN):
            try:
                chunk = self._read(self._fd, READ_SIZE)
            except BlockingIOError:  # EAGAIN: nothing more for now
                break
            except BrokenPipeError:  # EPIPE: the ring buffer overwrote unread records
                self.lost += 1
                self._rate_limited("kmsg %s: kernel log records were overwritten before "
                                   "they were read (%d times)", self.path, self.lost)
                continue
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                self.errors += 1
                self._rate_limited("kmsg %s: read failed: %s", self.path, exc.strerror)
                break
            if not chunk:  # end of a regular file, or a FIFO with no writer
                break
            self._feed(chunk, events)
        return events

    def _feed(self, chunk: bytes, events: list[XidEvent]) -> None:
        data = self._tail + chunk
        lines = data.split(b"\n")
        self._tail = lines.pop()
        if len(self._tail) > MAX_LINE:  # a line without end: garbage, drop it
            self._tail = b""
            self._skip("over-long line")
        for raw in lines:
            if raw.startswith((b" ", b"\t")):
                continue  # /dev/kmsg continuation lines (" SUBSYSTEM=pci", " DEVICE=+pci:...")
            self._line(raw.decode("utf-8", "replace"), events)

    def _line(self, line: str, events: list[XidEvent]) -> None:
        parsed = parse_line(line)
        if parsed is None:
            return
        if parsed is False:
            self._skip(line)
            return
        up = parsed.uptime_s
        when = self.boot_time + up if up is not None else self._clock()
        events.append(XidEvent(node=self.node, pci_bus_id=parsed.bus_id, code=parsed.code,
                               text=parsed.text, time=max(0.0, when), source="kmsg"))

    def _skip(self, line: str) -> None:
        self.skipped += 1
        self._rate_limited("kmsg %s: skipped unparseable line (%d so far): %.200r",
                           self.path, self.skipped, line)

    def _rate_limited(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            log.warning(msg, *args)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
