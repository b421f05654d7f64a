"""Preemption signals: which ones, their handlers, and the two ways the process ends.

The decisions (is this a notice, a repeat within the grace, time to save) are
:class:`~forewarn.hook.monitor.Monitor`'s; this module installs and restores the handlers
and ends the process: *as before* (the handler that was installed before the Monitor, or
the signal's default action) or *after the save* (the user's own handler if there was one,
else ``os._exit`` with 128 + the signal number unless an exit code is configured).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, Final

from forewarn.wire import PREEMPTED

__all__ = ["PREEMPT_REQUEST", "SignalExit", "is_preemption", "parse_signals"]

_log = logging.getLogger("forewarn.hook")

PREEMPT_REQUEST: Final = PREEMPTED
"""Request id and reason of a rank's own preemption save."""

Handler = Callable[[int, FrameType | None], None]


def is_preemption(reason: str) -> bool:
    """An order's reason that means the whole job is being preempted."""
    return reason == PREEMPTED or reason.startswith(PREEMPTED + ":")


def parse_signals(names: Sequence[int | str] | str) -> tuple[signal.Signals, ...]:
    """``"TERM,USR1"``, ``["SIGTERM", 10]`` -> signals; ValueError names a bad entry."""
    items = names.split(",") if isinstance(names, str) else list(names)
    out = []
    for item in items:
        try:
            if isinstance(item, int):
                out.append(signal.Signals(item))
                continue
            name = item.strip().upper()
            out.append(signal.Signals[name if name.startswith("SIG") else "SIG" + name])
        except (KeyError, ValueError):
            raise ValueError(f"preempt_signals: unknown signal {item!r}") from None
    return tuple(dict.fromkeys(out))


class SignalExit:
    """The preemption signals' handlers and the ways out of the process.

    ``close(finished)`` is the Monitor's own close, run before the process ends."""

    def __init__(self, signals: tuple[signal.Signals, ...], exit_code: int | None,
                 close: Callable[[bool], None]) -> None:
        self.signals = signals
        self.exit_code = exit_code
        self._close = close
        self._prev: dict[int, Any] = {}
        self._handler: Handler | None = None

    def install(self, handler: Handler) -> None:
        """Install ``handler`` for every signal (main thread only: Python's rule)."""
        if threading.current_thread() is not threading.main_thread():
            _log.info("forewarn: not in the main thread; preemption handlers not installed")
            return
        self._handler = handler
        for sig in self.signals:
            self._prev[sig] = signal.getsignal(sig)
            signal.signal(sig, handler)

    def restore(self) -> None:
        """Put back the previous handlers (where ours is still installed)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, prev in self._prev.items():
            if signal.getsignal(sig) == self._handler:
                signal.signal(sig, signal.SIG_DFL if prev is None else prev)

    def as_before(self, signum: int | None, frame: FrameType | None = None) -> None:
        """What the process would have done without the Monitor: the previous handler, or
        the signal's default action (SIGTERM's for the notice file, ``signum`` None)."""
        sig = signum or signal.SIGTERM
        prev = self._prev.get(sig, signal.SIG_DFL)
        if callable(prev):
            prev(sig, frame)
            return
        if prev == signal.SIG_IGN and signum is not None:
            return
        self._close(False)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        time.sleep(5.0)  # the default action ends the process before this returns
        os._exit(128 + sig)

    def after_save(self, signum: int | None) -> None:
        """The preemption save is over: the user's own handler if there was one, else exit
        with ``exit_code`` or 128 + the signal number (SIGTERM's for the notice file or a
        job-wide order). atexit handlers do not run: the process is being preempted, and
        a cleanup that blocks must not eat the scheduler's kill wait."""
        prev = self._prev.get(signum) if signum is not None else None
        if callable(prev):
            prev(signum, None)
            return
        if prev == signal.SIG_IGN:
            return
        code = self.exit_code if self.exit_code is not None else 128 + (signum or signal.SIGTERM)
        _log.warning("forewarn: preemption checkpoint done; exiting with code %d", code)
        if threading.current_thread() is threading.main_thread():
            # The process exits with ``code`` now: a repeated notice in the last milliseconds
            # (Slurm's second SIGTERM) must not end it by the default action instead.
            for sig in self.signals:
                signal.signal(sig, signal.SIG_IGN)
        self._close(True)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
