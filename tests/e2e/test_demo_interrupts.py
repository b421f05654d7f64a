"""Ctrl-C at the exact moments that used to lose it or leak a process, sent from a profile
hook (not by timing luck): between starting a process and recording it, and between the
two handler swaps of the demo's interrupt hold. The demo's own Ctrl-C tests
(test_demo.py, test_demo_scale.py) send it at whatever moment the demo has reached."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest

from forewarn.spawn.interrupts import interrupts_held
from forewarn.spawn.procs import Procs

from support.leftovers import wait_gone, wait_started


class Terminated(Exception):
    """What the test's SIGTERM handler raises (the demo's raises its _Terminated)."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise Terminated


@pytest.fixture
def handlers() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt, SIGTERM raises Terminated; put back afterwards."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminate)
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


def _signal_on_return(sig: int, returning: Callable[[FrameType], bool]) -> Callable[..., Any]:
    """A profile function that sends ``sig`` to this process once, when a Python function
    for which ``returning(frame)`` holds returns."""
    sent = False

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal sent
        if not sent and event == "return" and returning(frame):
            sent = True
            os.kill(os.getpid(), sig)

    return profile


def _is_popen_init(frame: FrameType) -> bool:
    return frame.f_code is subprocess.Popen.__init__.__code__


def _is_signal_signal(frame: FrameType) -> bool:
    return frame.f_code.co_name == "signal" and frame.f_globals.get("__name__") == "signal"


def test_ctrl_c_as_a_process_starts_leaves_it_recorded_and_stopped(
        handlers: None, tmp_path: Any) -> None:
    """Ctrl-C right after the fork, before the demo recorded the process: it was raised
    there and the process (an agent, a collector) was left running after the cleanup."""
    marker = f"fw-interrupt-{uuid.uuid4().hex}"
    procs = Procs()
    sys.setprofile(_signal_on_return(signal.SIGINT, _is_popen_init))
    try:
        with pytest.raises(KeyboardInterrupt):
            procs.spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(120)",
                                    marker], tmp_path / "sleeper.log")
        sys.setprofile(None)
        # Popen may return before the child's new command line shows in /proc
        assert wait_started(marker), "the process should have started"
    finally:
        sys.setprofile(None)
        procs.close()
    assert wait_gone(marker) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_between_the_handler_swaps_leaves_both_signals_working(
        handlers: None, sig: int) -> None:
    """A signal arriving while the hold installs or restores its handlers (between the
    SIGINT swap and the SIGTERM swap) must not leave the other signal swallowed."""
    for leaving in (False, True):
        hook = _signal_on_return(sig, _is_signal_signal)
        try:
            if not leaving:
                sys.setprofile(hook)
            with interrupts_held():
                if leaving:
                    sys.setprofile(hook)
        except (KeyboardInterrupt, Terminated):
            pass  # the signal sent between the swaps, delivered
        finally:
            sys.setprofile(None)
        with pytest.raises(KeyboardInterrupt):
            _send(signal.SIGINT)
        with pytest.raises(Terminated):
            _send(signal.SIGTERM)


def _send(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.01)  # the handler runs at the next bytecode (not a wait for anything)


def test_ctrl_c_in_a_hold_is_raised_when_the_outermost_hold_ends(handlers: None) -> None:
    reached = []
    with pytest.raises(KeyboardInterrupt), interrupts_held():
        _send(signal.SIGINT)
        with interrupts_held():
            pass
        reached.append("after the inner hold")
    assert reached == ["after the inner hold"]
