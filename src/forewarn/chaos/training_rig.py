"""The chaos lab's training rig: the shared collector, agent ``chaos-node-1`` and a 2-rank
gloo job on it under torchrun (see :mod:`forewarn.chaos.lab`).

The job's events are kept in ``train-events.jsonl`` in the lab's directory, beside
torchrun's log; a wait on the job that fails says what the job, torchrun and the agent did
last (:meth:`TrainingRig.diagnosis`), so a failure on CI, whose temp dirs are gone, can be
read from its message."""

from __future__ import annotations

import json
import os
import queue
import signal
import threading
from typing import TYPE_CHECKING, Any

from forewarn.chaos.daemons import LabAgent
from forewarn.demo.launch import Node, TorchrunJob
from forewarn.spawn import workload
from forewarn.spawn.procs import wait_until

if TYPE_CHECKING:
    from forewarn.chaos.lab import Lab

TRAIN_JOB = "chaos-train"


class TrainingRig:
    """The shared collector, agent ``chaos-node-1`` and the 2-rank job (module docstring)."""

    NODE = "chaos-node-1"

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        o = lab.options
        self.collector = lab.main_collector()
        self.agent = LabAgent(
            lab, "agent-node-1", self.NODE, self.collector.url, self.collector.tokens[self.NODE],
            'name = "chaos-node-1"\ndescription = "quiet: the training scenarios\' node"\n'
            "gpus = 2\nseed = 11\n", interval_s=o.agent_interval_s, push_s=o.push_interval_s,
            env={"FOREWARN_AGENT_HANG_ACTION": "terminate", "FOREWARN_AGENT_HANG_GRACE_S": "1.0"})
        self.ckpt = lab.dir / "train-ckpt"
        self.control = lab.dir / "train-control"
        self.control.mkdir(exist_ok=True)
        args = ["torch", "--job", TRAIN_JOB, "--checkpoint-dir", str(self.ckpt),
                "--control-dir", str(self.control), "--step-seconds", str(o.step_seconds),
                "--checkpoint-every", str(o.checkpoint_every)]
        self.launcher = TorchrunJob(workload.__name__, args,
                               [Node(self.NODE, self.agent.socket, nproc=2)], job=TRAIN_JOB,
                               log_dir=lab.dir, max_restarts=50)
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._fault_id = 0
        self.launcher.start()
        lab.launchers.append(self.launcher)
        self._pump = threading.Thread(target=self._take, name="chaos-events", daemon=True)
        self._pump.start()

    def _take(self) -> None:
        with (self.lab.dir / "train-events.jsonl").open("a") as kept:
            while not self._stop.is_set():
                try:
                    e = self.launcher.events.get(timeout=0.1)
                except queue.Empty:
                    continue
                with self._lock:
                    self.events.append(e)
                kept.write(json.dumps(e) + "\n")
                kept.flush()

    def close(self) -> None:
        self._stop.set()

    def select(self, event: str, **match: Any) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self.events if e.get("event") == event
                    and all(e.get(k) == v for k, v in match.items())]

    def last_step(self, rank: int, attempt: int | None = None) -> int | None:
        a = self.launcher.attempt if attempt is None else attempt
        steps = [int(e["step"]) for e in self.select("step", rank=rank, attempt=a)]
        return max(steps) if steps else None

    def ready(self, new_steps: int = 10, timeout: float = 90.0) -> int:
        """Wait until both ranks of the current attempt stepped ``new_steps`` more times;
        returns the attempt."""
        a = self.launcher.attempt
        base = min(self.last_step(r, a) or 0 for r in (0, 1))

        def ok() -> bool:
            return all((self.last_step(r, a) or 0) >= base + new_steps for r in (0, 1))

        if wait_until(ok, timeout) is None:
            raise RuntimeError(f"the training job did not step {new_steps} times in "
                               f"{timeout:.0f} s (attempt {a})\n{self.diagnosis()}")
        return a

    def diagnosis(self, lines: int = 12) -> str:
        """What the job did last: each attempt's last steps, its restarts and rank exits,
        and the tails of torchrun's log and of the agent's (module docstring)."""
        with self._lock:
            events = list(self.events)
        last: dict[tuple[int, int], int] = {}
        for e in events:
            if e.get("event") == "step":
                last[(int(e["attempt"]), int(e["rank"]))] = int(e["step"])
        ended = [f"{e['event']} attempt {e.get('attempt')} rank {e.get('rank')} "
                 f"code {e.get('code')}" for e in events
                 if e.get("event") in ("restart", "rank_exit")]
        parts = [f"now attempt {self.launcher.attempt}; last step by (attempt, rank): {last}",
                 "restarts and exits: " + "; ".join(ended[-lines:])]
        for log in (self.lab.dir / f"torchrun-{self.NODE}.log", self.agent.dir / "agent.log"):
            try:
                text = log.read_text(errors="replace").splitlines()
            except OSError as exc:
                text = [f"unreadable: {exc}"]
            # a worker's traceback: its error line only
            tail = [t for t in text if not t.startswith("[rank") or "Error" in t][-lines:]
            parts.append(f"--- {log.name}, last {len(tail)} lines:\n" + "\n".join(tail))
        return "\n".join(parts)

    def inject(self, rank: int, fault: str, **params: Any) -> str:
        """Add a fault to rank ``rank``'s control file (applied at its next step)."""
        self._fault_id += 1
        fid = f"f{self._fault_id}"
        path = self.control / f"control-r{rank}.json"
        try:
            entries = json.loads(path.read_text())
        except (OSError, ValueError):
            entries = []
        entries.append({"id": fid, "fault": fault, **params})
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entries))
        os.replace(tmp, path)
        return fid

    def fault_applied(self, fid: str, timeout: float = 30.0) -> dict[str, Any] | None:
        got: dict[str, Any] | None = wait_until(
            lambda: next(iter(self.select("fault", id=fid)), None), timeout)
        return got

    def resumed(self, attempt: int, timeout: float = 90.0) -> dict[int, dict[str, Any]] | None:
        """The ``resumed`` (or ``started``) events of both ranks in an attempt after
        ``attempt``."""
        def got() -> dict[int, dict[str, Any]] | None:
            with self._lock:
                ev = [e for e in self.events if e.get("event") in ("resumed", "started")
                      and int(e.get("attempt", -1)) > attempt]
            by_rank = {int(e["rank"]): e for e in ev}
            return by_rank if len(by_rank) == 2 else None

        out: dict[int, dict[str, Any]] | None = wait_until(got, timeout)
        return out

    def complete_checkpoints(self) -> list[int]:
        """Steps of the checkpoints both ranks reported saved (oldest first)."""
        by_step: dict[int, set[int]] = {}
        for e in self.select("checkpoint"):
            by_step.setdefault(int(e["step"]), set()).add(int(e["rank"]))
        return sorted(s for s, ranks in by_step.items() if ranks == {0, 1})

    def signal_rank(self, rank: int, sig: int = signal.SIGKILL) -> bool:
        return self.launcher.signal_rank(rank, sig)
