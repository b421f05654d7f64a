"""Ctrl-C and SIGTERM held while a process is started and recorded (:func:`interrupts_held`).

An interrupt between a ``Popen`` (or a server's start) and the line that records the new
process would leave a process that nobody stops: the demo's cleanup ends only what it
recorded. So starting and recording happen inside ``with interrupts_held():``, and an
interrupt that arrives there is raised when the block ends (KeyboardInterrupt, or what the
SIGTERM handler raises).

Not a signal mask: the children would inherit it. One handler, installed once and left in
place, decides whether to hold or deliver: swapping the handlers in and out around each
block left windows between the two swaps where one signal escaped with the other's
handler still swapped, and from then on that other signal was swallowed (a Ctrl-C
ignored, the demo running to its end). Outside a block the handler hands the signal to the
handler it replaced, as if it were not there.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

__all__ = ["interrupts_held"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_depth = 0
_pending: list[int] = []
_replaced: dict[int, Any] = {}


def _handler(signum: int, frame: FrameType | None) -> None:
    if _depth:
        _pending.append(signum)  # raised when the outermost block ends
        return
    _deliver(signum, frame)


def _deliver(signum: int, frame: FrameType | None) -> None:
    """What the handler replaced by :func:`_install` does with ``signum``."""
    replaced = _replaced.get(signum, signal.SIG_DFL)
    if callable(replaced):
        replaced(signum, frame)
    elif replaced != signal.SIG_IGN:  # the default action (SIGTERM: the process ends)
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)


def _install() -> None:
    """Put :func:`_handler` in front of each signal's handler (again if it was replaced).
    A signal during this is either the old handler's or already ours: never lost."""
    for sig in _SIGNALS:
        current = signal.getsignal(sig)
        if current is not _handler:
            _replaced[sig] = current
            signal.signal(sig, _handler)


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM (main thread) until the block ends, then deliver the first
    that came. Blocks nest; elsewhere than in the main thread nothing is held (Python runs
    signal handlers in the main thread only)."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _install()
    if not _depth:
        _pending.clear()  # one delivered already, when a block ended
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if not _depth and _pending:
            signum = _pending[0]
            _pending.clear()
            _deliver(signum, None)
