"""The rank's background thread: sends queued reports, sends beats, receives orders.

Why a queue: on this kind of machine a datagram ``send`` costs ~1.4 µs when the agent is
already awake but ~9-13 µs when it has to be woken (measured in ``bench/hook_step.py``;
the wake-up is charged to the sender). A training step that sent its own datagram would
pay that every step. Instead ``Monitor.step()`` appends the step's values to a deque
(no syscall, no lock, ~50 ns) and this thread encodes and sends everything queued every
``flush_interval_s`` (default 10 ms): the agent wakes once per batch, and the sends run
on this thread with the GIL released. Urgent records (non-finite loss or grad norm,
checkpoint reports) wake the thread at once through a pipe.

What is queued: an encoded datagram (``bytes``), or the common step record's five values
(:data:`StepValues`), which this thread packs (:mod:`._pack`): the pack is most of what a
step would otherwise cost the training thread (~0.5 µs of ~1 µs, more with cold caches
after a training step). Values that cannot be packed (a step outside ``[0, 2**64)`` or
not an integer) are left out and counted in :attr:`Sender.bad_records`; the rest of the
queue is sent.

The socket to the agent is blocking with a short timeout *on this thread only*; the
training thread never touches it. The queue is bounded: beyond ``queue_limit`` records,
new ones are dropped and counted (the beat's ``last_step`` still shows progress).

When a send fails with the agent there (its socket full: the kernel queues only
``net.unix.max_dgram_qlen`` datagrams: 10 by the kernel's default, 512 where systemd
or ``forewarn deploy install`` raised it (:mod:`forewarn.agent.socket_queue`), so a busy
agent fills it in moments), the queued step records are dropped and counted, but
:class:`Urgent` records (checkpoint reports, non-finite values: what the agent's orders
and holds wait on) stay at the head of the queue and go again ``RETRY_S`` later, in
order. When the agent is gone
(no socket), everything is dropped: a restarted agent has no orders waiting for them.
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import threading
import time
from collections.abc import Callable
from typing import TypeAlias

from ._channel import AgentChannel
from ._pack import StepPacker

__all__ = ["RETRY_S", "Sender", "StepValues", "Urgent"]

StepValues: TypeAlias = tuple[int, float, float, float, float]
"""``(step, time, step_seconds, loss, grad_norm)``: a step record packed on this thread."""

RETRY_S = 0.1
"""How long urgent records wait before they are sent again after the agent's socket was
full (each try may block this thread for the channel's send timeout)."""


class Urgent(bytes):
    """An encoded record the agent must get: kept and sent again while its socket is full."""


class Sender:
    """Owns the queue and the thread (see module docstring)."""

    def __init__(
        self,
        channel: AgentChannel,
        make_beat: Callable[[int], bytes],
        on_datagram: Callable[[bytes], None],
        on_error: Callable[[BaseException], None],
        pack_step: StepPacker,
        *,
        beat_interval_s: float = 1.0,
        flush_interval_s: float = 0.01,
        queue_limit: int = 4096,
        name: str = "forewarn-hook",
    ) -> None:
        self.channel = channel
        self.queue: collections.deque[bytes | StepValues] = collections.deque()
        self._retry_at = 0.0
        self.queue_limit = queue_limit
        """Most records queued: ``Monitor.step()`` and the Reporter drop (and count) beyond."""
        self.pack_step = pack_step
        self.dropped = 0
        self.bad_records = 0
        """Queued step values that could not be packed (left out, the rest sent)."""
        self.beats = 0
        self._make_beat = make_beat
        self._on_datagram = on_datagram
        self._on_error = on_error
        self.beat_interval_s = beat_interval_s
        self.flush_interval_s = flush_interval_s
        self._stop = threading.Event()
        self._beat_now = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Send the first beat now (from the caller's thread), then start the thread."""
        self.beat()
        self._thread.start()

    def kick(self) -> None:
        """Wake the thread now (urgent record queued)."""
        with contextlib.suppress(OSError):  # pipe full: the thread is due to wake anyway
            os.write(self._wake_w, b"\0")

    def beat_soon(self) -> None:
        """Send a beat now rather than at the next interval (a phase began, a preemption
        notice came). Safe in a signal handler: a flag and one pipe write, no lock."""
        self._beat_now = True
        self.kick()

    def stop(self, timeout: float = 5.0) -> None:
        """Flush what is queued, stop the thread, close the pipe."""
        self._stop.set()
        self.kick()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _send(self, data: bytes) -> bool:
        ch = self.channel
        if not ch.up and not ch.connect():
            return False
        try:
            ch.send(data)
            return True
        except TimeoutError:
            return False  # the agent's queue stayed full for the whole timeout
        except OSError as exc:
            if ch.error(exc):
                return False
            # the agent went away (e.g. restarted): one reconnect, one retry
            if not ch.connect():
                return False
            try:
                ch.send(data)
                return True
            except OSError:
                return False

    def flush(self) -> None:
        """Send everything queued, in order; on failure drop (and count) the rest."""
        q = self.queue
        while q:
            try:
                item = q.popleft()
            except IndexError:
                return
            if isinstance(item, bytes):
                data = item
            else:
                try:
                    data = self.pack_step(*item)
                except Exception as exc:  # a bad step value: this record only
                    self.bad_records += 1
                    self._on_error(ValueError(f"step() record left out: step {item[0]!r} is "
                                              f"not an integer in [0, 2**64) ({exc})"))
                    continue
            if self._send(data):
                continue
            self._drop_queued(item)
            return

    def _drop_queued(self, failed: bytes | StepValues) -> None:
        """After ``failed`` could not be sent: drop (and count) what is queued, but keep
        the :class:`Urgent` records, in order, for a retry while the agent is there."""
        q = self.queue
        rest = [failed]
        while True:
            try:
                rest.append(q.popleft())
            except IndexError:
                break
        kept = [i for i in rest if type(i) is Urgent] if self.channel.up else []
        self.dropped += len(rest) - len(kept)
        q.extendleft(reversed(kept))  # ahead of anything queued meanwhile
        if kept:
            self._retry_at = time.monotonic() + RETRY_S

    def beat(self) -> None:
        """Send one beat (carrying the total dropped count)."""
        if self._send(self._make_beat(self.dropped)):
            self.beats += 1
        else:
            self.dropped += 1

    def _drain_pipe(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except OSError:
            pass

    def _drain_orders(self) -> None:
        reply = self.channel.reply
        if reply is None:
            return
        for _ in range(64):
            try:
                data = reply.recv(65536)
            except OSError:
                return  # BlockingIOError: nothing left
            if data:
                self._on_datagram(data)

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        reply = self.channel.reply
        if reply is not None:
            poller.register(reply.fileno(), select.POLLIN)
        mono = time.monotonic
        next_beat = mono() + self.beat_interval_s
        while True:
            try:
                stopping = self._stop.is_set()
                if self.queue and (stopping or mono() >= self._retry_at):
                    self.flush()
                if stopping:
                    if self._beat_now:  # an early beat asked for just before close()
                        self._beat_now = False
                        self.beat()
                    self.dropped += len(self.queue)  # urgent records the agent never took
                    self.queue.clear()
                    return
                now = mono()
                if now >= next_beat or self._beat_now:
                    self._beat_now = False
                    self.beat()
                    next_beat = max(next_beat + self.beat_interval_s, now)
                wait = min(next_beat - now, self.flush_interval_s)
                for fd, _ in poller.poll(max(0.0, wait) * 1000.0):
                    if fd == self._wake_r:
                        self._drain_pipe()
                    else:
                        self._drain_orders()
            except Exception as exc:  # this thread must outlive any bug
                self._on_error(exc)
                self._stop.wait(self.beat_interval_s)
