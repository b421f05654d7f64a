"""A small elastic launcher: start every rank of a job, and when one dies, stop the others
and start them all again from the latest checkpoint (what torchrun's ``--max-restarts``
does on one machine). Each rank may be placed on another (simulated) node and GPU at each
start, as a scheduler would move a job off a failed GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["Placement", "Supervisor"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a rank runs: the agent socket of its node, and its GPU (= LOCAL_RANK)."""

    node: str
    socket_path: str
    gpu: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Supervisor:
    """Runs ``world_size`` ranks of ``argv`` and restarts the whole job when a rank dies.

    Events the ranks print (JSON lines) land in :attr:`events` as dicts with ``rank`` and
    ``attempt`` added; the supervisor adds its own (``event``: ``launch``, ``rank_exit``,
    ``restart``, ``gave_up``).
    """

    def __init__(
        self,
        argv: Sequence[str],
        placements: Sequence[Placement],
        *,
        env: dict[str, str] | None = None,
        max_restarts: int = 5,
        restart_delay_s: float = 0.5,
        place: Callable[[int, Placement], Placement] | None = None,
    ) -> None:
        self.argv = list(argv)
        self.placements = list(placements)
        self.env = dict(os.environ if env is None else env)
        self.max_restarts = max_restarts
        self.restart_delay_s = restart_delay_s
        self.place = place
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.procs: list[subprocess.Popen[str]] = []
        self.attempt = 0
        self.restarts = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def world_size(self) -> int:
        return len(self.placements)

    def pid_of(self, rank: int) -> int | None:
        with self._lock:
            if rank < len(self.procs) and self.procs[rank].poll() is None:
                return self.procs[rank].pid
        return None

    def start(self) -> None:
        self._launch()
        self._thread = threading.Thread(target=self._watch, name="supervisor", daemon=True)
        self._thread.start()

    def _emit(self, **event: Any) -> None:
        event.setdefault("time", time.time())
        self.events.put(event)

    def _launch(self) -> None:
        with _interrupts_deferred():
            self._start_ranks()

    def _start_ranks(self) -> None:
        if self.place is not None:
            self.placements = [self.place(r, p) for r, p in enumerate(self.placements)]
        port = free_port()
        with self._lock:
            self.procs = []
        for rank, pl in enumerate(self.placements):
            env = dict(self.env)
            env.update(RANK=str(rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(pl.gpu),
                       LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       FOREWARN_SOCKET=pl.socket_path, OMP_NUM_THREADS="1",
                       PYTHONUNBUFFERED="1")
            p = subprocess.Popen(self.argv, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True, start_new_session=True)
            with self._lock:
                self.procs.append(p)
            threading.Thread(target=self._read, args=(p, rank, self.attempt),
                             daemon=True).start()
        self._emit(event="launch", attempt=self.attempt,
                   placements=[dataclasses.asdict(p) for p in self.placements])

    def _read(self, proc: subprocess.Popen[str], rank: int, attempt: int) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                event.setdefault("rank", rank)
                event["attempt"] = attempt
                self.events.put(event)

    def _watch(self) -> None:
        while not self._stop.is_set():
            time.sleep(0.05)
            with self._lock:
                codes = [p.poll() for p in self.procs]
            if all(c == 0 for c in codes):
                self._emit(event="job_finished", attempt=self.attempt)
                return
            dead = [(r, c) for r, c in enumerate(codes) if c is not None and c != 0]
            if not dead:
                continue
            for rank, code in dead:
                self._emit(event="rank_exit", rank=rank, code=code, attempt=self.attempt)
            self._kill_all()
            if self._stop.is_set():
                return
            if self.restarts >= self.max_restarts:
                self._emit(event="gave_up", attempt=self.attempt)
                return
            self.restarts += 1
            self.attempt += 1
            time.sleep(self.restart_delay_s)
            self._emit(event="restart", attempt=self.attempt)
            self._launch()

    def _kill_all(self) -> None:
        with self._lock:
            procs = list(self.procs)
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)

    def signal_rank(self, rank: int, sig: int) -> bool:
        """Send ``sig`` to a rank's process (the demo's fault injection)."""
        pid = self.pid_of(rank)
        if pid is None:
            return False
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        return True

    def stop(self) -> None:
        """Stop watching and kill every rank."""
        self._stop.set()
        self._kill_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
            # A restart the watcher was in the middle of has started ranks since.
            self._kill_all()


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM (main thread) until the block ends, then deliver them: an
    interrupt inside Popen, after the fork, would leave a rank nobody recorded or stops.
    (Not a signal mask: the ranks would inherit it.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: got.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if got:
            signal.raise_signal(got[0])


def python_module(module: str, *args: str) -> list[str]:
    """The argv to run ``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]
