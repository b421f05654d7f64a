"""The agent's Unix datagram socket: hears the training hooks, talks back to them.

One background thread receives datagrams and feeds a :class:`~forewarn.agent.ranks.RankTable`.
Every datagram carries the sender's kernel-verified credentials (``SO_PASSCRED`` +
``SCM_CREDENTIALS``, unix(7)); a datagram whose pid does not match the record is forged.
Nothing that arrives can stop the thread: each bad datagram is dropped, counted under a
reason (:data:`DROP_REASONS`) and logged at a limited rate.

The socket is created safely: the parent directory gets ``dir_mode`` if the agent creates it,
the socket is bound under a temporary name, given ``mode`` (default 0o660, never writable by
others) and ``group``, then renamed into place, so there is no moment when another user could
write to it. A stale socket from a dead agent is replaced; any other file at the path is an
error (never unlinked).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import grp
import logging
import os
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from forewarn.agent.procview import Credentials
from forewarn.agent.ranks import RankTable
from forewarn.agent.socket_queue import PROC_PATH, QueueLimit, read_limit
from forewarn.errors import UnavailableError
from forewarn.wire import Beat, CheckpointReport, StepRecord, WireError, decode_hook_message

__all__ = ["DROP_REASONS", "MAX_DATAGRAM", "RankIngest", "SocketError"]

log = logging.getLogger(__name__)

MAX_DATAGRAM = 16 * 1024
"""Largest datagram accepted. A step record with a dozen extras is ~300 bytes."""

DROP_REASONS = (
    "oversized", "malformed", "no_credentials", "forged", "absurd", "slot_taken",
    "wrong_job", "world_size_mismatch", "unknown_rank", "table_full", "internal",
)
"""Every reason a datagram can be dropped for (label values of the drop counter)."""

_CRED = struct.Struct("3i")  # struct ucred { pid_t pid; uid_t uid; gid_t gid; }
_LOG_EVERY_S = 60.0


class SocketError(UnavailableError, OSError):
    """The agent socket cannot be created (path taken by a non-socket, bad group, ...)."""


class RankIngest:
    """Receive hook datagrams on ``path`` into ``table`` on a background thread.

    ``mode`` must not grant anything to others (``mode & 0o007 == 0``); ``group`` (name or
    gid) owns the socket so training users in that group can send. ``clock`` returns Unix
    time (injectable). ``qlen_path`` is where ``net.unix.max_dgram_qlen`` is read
    (:mod:`forewarn.agent.socket_queue`).
    """

    def __init__(
        self,
        table: RankTable,
        path: Path,
        *,
        mode: int = 0o660,
        group: str | int | None = None,
        dir_mode: int = 0o755,
        max_datagram: int = MAX_DATAGRAM,
        clock: Callable[[], float] = time.time,
        qlen_path: Path = PROC_PATH,
    ) -> None:
        if mode & 0o007:
            raise SocketError(f"socket mode {mode:#o} would let other users write to {path}")
        self.table = table
        self.path = Path(path)
        self.mode = mode
        self.group = group
        self.dir_mode = dir_mode
        self.max_datagram = max_datagram
        self.clock = clock
        self.qlen_path = qlen_path
        self.queue_limit: QueueLimit | None = None
        """``net.unix.max_dgram_qlen`` as read when the socket was created (its limit)."""
        self.received: collections.Counter[str] = collections.Counter()
        self.dropped: collections.Counter[str] = collections.Counter({r: 0 for r in DROP_REASONS})
        self.sent = 0
        self.send_errors = 0
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake_r, self._wake_w = -1, -1
        self._send_lock = threading.Lock()
        self._last_log: dict[str, float] = {}

    # -- socket ------------------------------------------------------------------------------
    def _gid(self) -> int | None:
        if self.group is None or self.group == "":
            return None
        if isinstance(self.group, int):
            return self.group
        if self.group.isdigit():
            return int(self.group)
        try:
            return grp.getgrnam(self.group).gr_gid
        except KeyError:
            raise SocketError(f"socket group {self.group!r} does not exist") from None

    def bind(self) -> None:
        """Create the socket (see module doc); raises :class:`SocketError`."""
        parent = self.path.parent
        if not parent.exists():
            parent.mkdir(mode=self.dir_mode, parents=True, exist_ok=True)
            os.chmod(parent, self.dir_mode)
        if self.path.exists() or self.path.is_symlink():
            st = os.lstat(self.path)
            if not stat.S_ISSOCK(st.st_mode):
                raise SocketError(f"{self.path} exists and is not a socket; refusing to replace it")
            if self._in_use():
                raise SocketError(f"{self.path} is in use by another agent")
        self.queue_limit = read_limit(self.qlen_path)  # the new socket's limit: read it now
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        tmp = parent / f".{self.path.name}.{os.getpid()}.tmp"
        try:
            tmp.unlink(missing_ok=True)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            with contextlib.suppress(OSError):  # capped by net.core.rmem_max
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            old = os.umask(0o177)  # the socket is born 0o600, widened to `mode` below
            try:
                sock.bind(str(tmp))
            finally:
                os.umask(old)
            gid = self._gid()
            if gid is not None:
                os.chown(tmp, -1, gid)
            os.chmod(tmp, self.mode)
            os.replace(tmp, self.path)
        except OSError as exc:
            sock.close()
            tmp.unlink(missing_ok=True)
            if isinstance(exc, SocketError):
                raise
            raise SocketError(f"cannot create agent socket {self.path}: {exc}") from None
        sock.setblocking(False)
        self._sock = sock

    def _in_use(self) -> bool:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            probe.connect(str(self.path))
            return True
        except OSError:
            return False
        finally:
            probe.close()

    @property
    def listening(self) -> bool:
        """The socket is bound and the receive thread runs."""
        thread = self._thread
        return self._sock is not None and thread is not None and thread.is_alive()

    # -- thread ------------------------------------------------------------------------------
    def start(self) -> None:
        """Bind (if not yet) and start the receive thread."""
        if self._sock is None:
            self.bind()
        self._stop.clear()
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="forewarn-rank-ingest", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread, close and remove the socket."""
        self._stop.set()
        if self._wake_w >= 0:
            os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            with contextlib.suppress(OSError):
                self.path.unlink()

    def _run(self) -> None:
        assert self._sock is not None
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                sel.select()  # blocks: no idle wake-ups
                if self._stop.is_set():
                    break
                self.drain()
        except Exception:  # pragma: no cover - the socket itself broke
            log.exception("rank ingest thread stopped")
        finally:
            sel.close()

    def drain(self, limit: int = 1024) -> int:
        """Handle up to ``limit`` waiting datagrams without blocking; returns how many."""
        sock = self._sock
        if sock is None:
            return 0
        n = 0
        anc = socket.CMSG_SPACE(_CRED.size)
        while n < limit:
            try:
                data, ancdata, flags, _addr = sock.recvmsg(self.max_datagram, anc)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    break
                self._drop("internal", f"recvmsg: {exc}")
                break
            n += 1
            try:
                self.handle(data, ancdata, flags)
            except Exception as exc:  # never let one datagram end the thread
                log.exception("rank ingest: unexpected error")
                self._drop("internal", f"{type(exc).__name__}: {exc}")
        return n

    # -- one datagram -----------------------------------------------------------------------
    def handle(self, data: bytes, ancdata: list[tuple[int, int, bytes]], flags: int) -> None:
        """Decode, authenticate and apply one datagram (public for tests and benches)."""
        if flags & socket.MSG_TRUNC or len(data) > self.max_datagram:
            self._drop("oversized", f"datagram over {self.max_datagram} bytes")
            return
        cred = _credentials(ancdata)
        if cred is None:
            self._drop("no_credentials", "datagram without SCM_CREDENTIALS")
            return
        try:
            msg = decode_hook_message(data)
        except WireError as exc:
            self._drop("malformed", f"from pid {cred.pid}: {exc}")
            return
        reason = self.table.admit(msg, cred, self.clock())
        if reason is not None:
            self._drop(reason, f"{_describe(msg)} from pid {cred.pid}")
            return
        self.received[_kind(msg)] += 1

    def _drop(self, reason: str, detail: str) -> None:
        self.dropped[reason] += 1
        now = time.monotonic()
        last = self._last_log.get(reason)
        if last is None or now - last >= _LOG_EVERY_S:
            self._last_log[reason] = now
            log.warning(
                "dropped datagram (%s): %s [%d dropped for this reason so far]",
                reason, detail, self.dropped[reason],
            )

    # -- talking back --------------------------------------------------------------------------
    def send(self, path: str, data: bytes) -> bool:
        """Send one datagram to a hook's ``reply_to`` socket without blocking."""
        sock = self._sock
        if sock is None or not path:
            return False
        try:
            sock.sendto(data, socket.MSG_DONTWAIT, path)
        except OSError as exc:
            with self._send_lock:
                self.send_errors += 1
            log.debug("send to %s failed: %s", path, exc)
            return False
        with self._send_lock:
            self.sent += 1
        return True


def _credentials(ancdata: list[tuple[int, int, bytes]]) -> Credentials | None:
    for level, kind, payload in ancdata:
        if (level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS
                and len(payload) >= _CRED.size):
            pid, uid, gid = _CRED.unpack_from(payload)
            return Credentials(pid=pid, uid=uid, gid=gid)
    return None


def _kind(msg: StepRecord | Beat | CheckpointReport) -> str:
    if isinstance(msg, StepRecord):
        return "step"
    if isinstance(msg, Beat):
        return "beat"
    return "checkpoint"


def _describe(msg: StepRecord | Beat | CheckpointReport) -> str:
    return f"{_kind(msg)} job={msg.job!r} rank={msg.rank}"
