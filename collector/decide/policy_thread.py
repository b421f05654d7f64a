"""The collector's one policy thread, with three lanes so that neither telemetry nor bulk
work delays a decision.

Every policy hook runs on this thread, one at a time, so the policy need not be
thread-safe. :meth:`PolicyThread.submit` (agent batches, acknowledgements, timers, reads of
the policy's state) is the decision lane; :meth:`PolicyThread.submit_urgent` (urgent agent
batches: findings, checkpoint reports; findings read from shared state) runs ahead of it,
and :meth:`PolicyThread.submit_bulk` (alert webhook findings) only while both are empty. A
fatal finding from an agent thus waits at most for the one item in progress, however many
telemetry batches or alerts are queued; bulk callers keep their items small
(:mod:`.policy_service` hands alerts over in chunks). Each lane runs in the order it was
given. :meth:`PolicyThread.submit_next` continues the item in progress: its next part goes
first on the decision lane (urgent work still before it), so long work split into parts
(a scoring of the fleet: :mod:`.scoring_pass`) lets urgent items run between them and is
not interleaved with other decision work.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["PolicyThread"]

T = TypeVar("T")
_Item = tuple["concurrent.futures.Future[Any]", Callable[..., Any], tuple[Any, ...],
              dict[str, Any]]


class PolicyThread(concurrent.futures.Executor):
    """A one-thread executor with an urgent, a decision and a bulk lane (module docstring).
    Usable with ``loop.run_in_executor``; ``shutdown`` runs what is queued, then ends."""

    def __init__(self, name: str = "forewarn-policy") -> None:
        self._cond = threading.Condition()
        self._lanes: tuple[collections.deque[_Item], ...] = (
            collections.deque(), collections.deque(), collections.deque())
        self._shutdown = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit_urgent(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
                      ) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args, **kwargs)`` on the urgent lane (before the decision lane)."""
        return self._put(0, fn, args, kwargs)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
               ) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args, **kwargs)`` on the decision lane."""
        return self._put(1, fn, args, kwargs)

    def submit_next(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
                    ) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args, **kwargs)`` at the head of the decision lane: after the urgent
        lane, before everything else (the next part of the item in progress)."""
        return self._put(1, fn, args, kwargs, first=True)

    def submit_bulk(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
                    ) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args, **kwargs)`` on the bulk lane (after every decision)."""
        return self._put(2, fn, args, kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._cond:
            self._shutdown = True
            if cancel_futures:
                for lane in self._lanes:
                    while lane:
                        lane.popleft()[0].cancel()
            self._cond.notify()
        if wait and self._thread is not threading.current_thread():
            self._thread.join()

    def _put(self, lane: int, fn: Callable[..., T], args: tuple[Any, ...],
             kwargs: dict[str, Any], *, first: bool = False
             ) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cond:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            item = (future, fn, args, kwargs)
            if first:
                self._lanes[lane].appendleft(item)
            else:
                self._lanes[lane].append(item)
            self._cond.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._cond:
                while not any(self._lanes) and not self._shutdown:
                    self._cond.wait()
                lane = next((q for q in self._lanes if q), None)
                if lane is None:
                    return  # shut down and nothing left
                future, fn, args, kwargs = lane.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)
