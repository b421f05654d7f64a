"""One message (a checkpoint order, a save hold) to the local ranks of a job, retried until
each rank has it.

The message goes to every rank at once. A datagram that cannot go out -- the rank's socket
is not there for a moment, or its queue is full (``net.unix.max_dgram_qlen`` is 10 where
PID 1 is not systemd) -- is not lost: that rank's copy is retried on every poll
(:meth:`Delivery.retry`). The copies are for the processes the message was first sent to:
once one of them is replaced by a new process (the job restarted, its new round resumed
from an earlier checkpoint) the message *ends*, undelivered copies too, and so it does when
it is older than its issuer's time to live. Which ranks a message is for:
:mod:`forewarn.agent.order_ranks`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from forewarn.agent.rank_state import RankView

__all__ = ["Delivery", "Send"]

Send = Callable[[str, bytes], bool]
"""``send(path, data) -> bool``: one datagram to a rank's ``reply_to`` (the ingest socket's)."""

Proc = tuple[int, int | None]
"""A rank's process: ``(pid, start time)``."""


@dataclasses.dataclass
class Delivery:
    """A message's bytes, the rank processes it is for and those it has not reached."""

    data: bytes
    procs: dict[int, Proc]
    """Rank -> (pid, start time) of the process the message is for."""
    issued_mono: float
    """Monotonic time it was first sent (its time to live counts from here)."""
    unsent: set[int] = dataclasses.field(default_factory=set)
    """Ranks it has not reached yet."""

    @classmethod
    def send(cls, send: Send, views: Iterable[RankView], data: bytes,
             issued_mono: float) -> Delivery:
        """Send ``data`` to every rank of ``views`` at once; the ones it missed wait."""
        views = list(views)
        out = cls(data, {v.rank: (v.os_pid, v.start_time) for v in views}, issued_mono)
        out.unsent = {v.rank for v in views if not send(v.reply_to, data)}
        return out

    @property
    def reached(self) -> int:
        """How many ranks have it."""
        return len(self.procs) - len(self.unsent)

    def replaced(self, views: Iterable[RankView]) -> bool:
        """Whether a rank it is for is no longer the process it was sent to (``views``: the
        job's ranks now): the message has ended."""
        now = {v.rank: (v.os_pid, v.start_time) for v in views}
        return any(now.get(rank) != proc for rank, proc in self.procs.items())

    def expired(self, mono: float, ttl_s: float) -> bool:
        """Whether it is older than ``ttl_s`` at monotonic time ``mono``."""
        return mono - self.issued_mono > ttl_s

    def retry(self, send: Send, views: Iterable[RankView]) -> None:
        """Send it again to the ranks it has not reached (``views``: the job's ranks now);
        a rank the table no longer knows waits (it may beat again), and a new process in a
        rank's place never gets it (:meth:`replaced`)."""
        by_rank = {v.rank: v for v in views}
        for rank in list(self.unsent):
            v = by_rank.get(rank)
            if (v is not None and (v.os_pid, v.start_time) == self.procs[rank]
                    and send(v.reply_to, self.data)):
                self.unsent.discard(rank)
