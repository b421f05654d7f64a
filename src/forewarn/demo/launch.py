"""Run a training job under torchrun, as users do: one ``torchrun`` per (simulated) node,
all meeting at one c10d rendezvous on this machine, restarted by torchrun's own
``--max-restarts``.

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is set for every torchrun started here: with the
rendezvous store shared with the workers (torch 2.4 and later) a restart round can hang in
``init_process_group`` (pytorch/pytorch#135712). Node ``i`` listens on ``127.0.0.<i+1>``
(``--local-addr``): torchrun assigns ranks by sorting the nodes' addresses, so node 0 runs
the lowest ranks in every round, and the first node hosts the rendezvous store
(``is_host``), so another node can leave and rejoin.

The workers print their events as JSON lines on stdout (:mod:`forewarn.spawn.workload`);
:class:`TorchrunJob` collects them, adding ``attempt`` (the restart round, counted here:
torchrun's ``TORCHELASTIC_RESTART_COUNT`` is per node and does not count a round that a
peer node's failure started; a round begins when a rank starts again or a worker starts
with another world size) and ``node``. Its own events: ``restart`` (a new round's
first worker started) and ``rank_exit`` (torchrun reported a worker failed, with its exit
code).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from forewarn.spawn.interrupts import interrupts_held

__all__ = ["TORCHRUN_ENV", "Node", "TorchrunJob", "free_port", "python_module"]

TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""Environment for torchrun's ``--max-restarts`` rounds not to hang (pytorch#135712)."""

_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def python_module(module: str, *args: str) -> list[str]:
    """The argv to run ``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


@dataclasses.dataclass(frozen=True)
class Node:
    """A simulated node: its name, its agent's socket, how many ranks it runs and its
    address (``--local-addr``; default ``127.0.0.<index + 1>``)."""

    name: str
    socket_path: str
    nproc: int = 1
    addr: str = ""


class TorchrunJob:
    """``module args`` run by one torchrun per node of ``nodes`` (module docstring).

    ``nnodes`` is torchrun's ``--nnodes`` (``"2"``, or ``"1:2"`` for an elastic job);
    it defaults to the number of nodes. ``rdzv_conf`` adds to ``--rdzv-conf`` (e.g.
    ``last_call_timeout=2``: how long a round that has its minimum waits for more nodes).
    Worker events land in :attr:`events`.
    """

    def __init__(self, module: str, args: Sequence[str], nodes: Sequence[Node], *,
                 job: str, log_dir: Path, max_restarts: int = 5, nnodes: str | None = None,
                 env: dict[str, str] | None = None, rdzv_conf: str = "") -> None:
        self.module = module
        self.args = list(args)
        self.nodes = list(nodes)
        self.job = job
        self.log_dir = log_dir
        self.max_restarts = max_restarts
        self.nnodes = nnodes or str(len(self.nodes))
        self.rdzv_conf = rdzv_conf
        self.env = dict(os.environ if env is None else env)
        self.port = free_port()
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.attempt = 0
        """The restart round of the newest worker start (0: the first launch)."""
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self._lock = threading.Lock()
        self._round_ranks: set[int] = set()
        self._round_size: int | None = None
        self._attempt_of: dict[tuple[str, int], int] = {}
        self._pid_of: dict[int, int] = {}  # rank -> pid of its newest worker
        self._rank_of_pid: dict[int, int] = {}

    # ------------------------------------------------------------------ launching

    def argv(self, index: int) -> list[str]:
        """torchrun's command line for node ``index``."""
        node = self.nodes[index]
        return [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.nnodes}",
            f"--nproc-per-node={node.nproc}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id={self.job}",
            f"--rdzv-conf=is_host={int(index == 0)}" + (self.rdzv_conf and "," + self.rdzv_conf),
            f"--local-addr={node.addr or f'127.0.0.{index + 1}'}",
            f"--max-restarts={self.max_restarts}", "--monitor-interval=0.1",
            "--module", self.module, *self.args,
        ]

    def start(self, indices: Sequence[int] | None = None) -> None:
        """Start the torchrun of each node (all by default)."""
        for i in range(len(self.nodes)) if indices is None else indices:
            self.start_node(i)

    def start_node(self, index: int) -> None:
        """Start node ``index``'s torchrun (again, after :meth:`kill_node`: a replacement)."""
        node = self.nodes[index]
        env = dict(self.env)
        env.update(TORCHRUN_ENV, FOREWARN_SOCKET=node.socket_path, OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1", LOGLEVEL="WARNING")
        with interrupts_held():  # started and recorded, or neither
            p = subprocess.Popen(self.argv(index), env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True)
            with self._lock:
                self.procs[node.name] = p
        assert p.stdout is not None and p.stderr is not None
        # the workers' other output and torchrun's log, each file owned by its reader
        out = self.log_dir / f"torchrun-{node.name}.out"
        threading.Thread(target=self._read_events, args=(node.name, p.stdout, out),
                         daemon=True).start()
        threading.Thread(target=self._read_log, args=(node.name, p.stderr,
                                                      out.with_suffix(".log")),
                         daemon=True).start()

    # ------------------------------------------------------------------ events

    def _read_events(self, node: str, out: IO[str], path: Path) -> None:
        with path.open("a") as log:
            for line in out:
                try:
                    event = json.loads(line)
                except ValueError:
                    log.write(line)
                    continue
                if isinstance(event, dict) and isinstance(event.get("rank"), int):
                    self._take(node, event)

    def _take(self, node: str, event: dict[str, Any]) -> None:
        rank = int(event["rank"])
        with self._lock:
            if event.get("event") in ("started", "resumed"):
                size = event.get("world_size", self._round_size)
                size = None if size is None else int(size)
                if self._round_ranks and (rank in self._round_ranks
                                          or size != self._round_size):
                    # this rank started again, or the world changed size: a new round
                    self.attempt += 1
                    self._round_ranks = set()
                    self.events.put({"event": "restart", "attempt": self.attempt,
                                     "time": time.time()})
                self._round_size = size
                self._round_ranks.add(rank)
                self._attempt_of[(node, rank)] = self.attempt
                pid = int(event.get("pid", 0))
                self._pid_of[rank] = pid
                self._rank_of_pid[pid] = rank
            event["attempt"] = self._attempt_of.get((node, rank), self.attempt)
        event["node"] = node
        self.events.put(event)

    def _read_log(self, node: str, err: IO[str], path: Path) -> None:
        with path.open("a") as log:
            for line in err:
                log.write(line)
                log.flush()
                m = _FAILED.search(line)
                if m is not None:
                    self._exited(node, code=int(m.group(1)), pid=int(m.group(3)))

    def _exited(self, node: str, code: int, pid: int) -> None:
        with self._lock:
            rank = self._rank_of_pid.get(pid)
            attempt = self._attempt_of.get((node, rank if rank is not None else -1),
                                           self.attempt)
        self.events.put({"event": "rank_exit", "rank": rank, "code": code, "pid": pid,
                         "node": node, "attempt": attempt, "time": time.time()})

    # ------------------------------------------------------------------ control

    def pid_of(self, rank: int) -> int | None:
        """The pid of ``rank``'s newest worker, if it still runs."""
        with self._lock:
            pid = self._pid_of.get(rank)
        return pid if pid and _alive(pid) else None

    def signal_rank(self, rank: int, sig: int) -> bool:
        """Send ``sig`` to ``rank``'s worker (fault injection); False when none runs."""
        pid = self.pid_of(rank)
        if pid is None:
            return False
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        return True

    def signal_node(self, name: str, sig: int) -> None:
        """Send ``sig`` to node ``name``'s torchrun (it forwards SIGTERM to its workers)."""
        p = self.procs[name]
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(sig)

    def kill_node(self, name: str) -> None:
        """The node dies: its torchrun and its workers, at once (SIGKILL)."""
        p = self.procs[name]
        if p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGSTOP)  # no new worker while its children are found
        for pid in _children(p.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)

    def stop(self) -> None:
        """Kill every torchrun started here and its workers (they run in sessions of
        their own, so a signal to torchrun's group would miss them)."""
        with self._lock:
            names = list(self.procs)
        for name in names:
            self.kill_node(name)


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from ``/proc``)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
