"""The embedded demo (``forewarn demo``): starts the stack and the job, injects the
faults and measures the run. What it does, step by step, is the command's help:
:mod:`forewarn.demo.cli`."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import queue
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forewarn.demo.launch import Node, TorchrunJob, free_port
from forewarn.demo.report import DemoResult, summary_lines
from forewarn.spawn import workload
from forewarn.spawn.commands import agent_command, collector_command
from forewarn.spawn.interrupts import interrupts_held
from forewarn.spawn.procs import Procs, get_json

__all__ = ["Demo", "DemoResult", "run_demo", "summary_lines"]

JOB = "demo-job"
NODES = ("demo-node-1", "demo-node-2")


@dataclasses.dataclass(frozen=True)
class Timing:
    """Phase lengths: ``--fast`` fits in about a minute, the default is worth watching."""

    step_seconds: float
    checkpoint_every: int
    storm_start_s: float
    """From the job's first steps (the scenario's ``start_file``) to the storm's start."""
    storm_s: float
    settle_s: float
    give_up_s: float

    @staticmethod
    def of(fast: bool) -> Timing:
        if fast:
            return Timing(step_seconds=0.05, checkpoint_every=1000, storm_start_s=3.0,
                          storm_s=12.0, settle_s=2.0, give_up_s=40.0)
        return Timing(step_seconds=0.2, checkpoint_every=600, storm_start_s=10.0,
                      storm_s=80.0, settle_s=10.0, give_up_s=120.0)



class Stack(Procs):
    """Every process the demo starts, so that Ctrl-C (or any error) stops them all."""

    def __init__(self) -> None:
        super().__init__()
        self.job: TorchrunJob | None = None

    def close(self) -> None:
        if self.job is not None:
            self.job.stop()
        super().close()


def _nvml_present() -> bool:
    try:
        from forewarn.agent.sources.nvml import NvmlBackend

        backend = NvmlBackend(node="probe")
        backend.open()
        backend.close()
        return True
    except Exception:
        return False


def _scenario(timing: Timing, failing_gpu: int, start_file: Path) -> str:
    # The storm's clock starts when the demo creates start_file, once the job trains: timed
    # from the agent's start, a slow job start (torchrun's rendezvous on a loaded machine)
    # left the precursor with no job, or no work at risk, to order a checkpoint for.
    return f"""# forewarn demo: node 2, a correctable-ECC storm on GPU {failing_gpu} ending in a
# double-bit error (XID 48), under rank 1 of the demo job. Everything here is simulated.
name = "demo-node-2"
description = "ECC storm to a double-bit error under the demo job's rank 1"
gpus = 4
seed = 7
start_file = "{start_file}"

[[faults]]
gpu = {failing_gpu}
kind = "ecc_storm"
start_s = {timing.storm_start_s}
duration_s = {timing.storm_s}
"""


class Demo:
    """The orchestration; :func:`run_demo` is the entry point."""

    def __init__(self, workdir: Path, fast: bool, say: Any) -> None:
        self.dir = workdir
        self.fast = fast
        self.t = Timing.of(fast)
        self.say = say
        self.stack = Stack()
        self.result = DemoResult(workdir=str(workdir))
        self.collector_url = ""
        self.agent_urls: dict[str, str] = {}
        self.sockets: dict[str, str] = {}
        self.last_step: dict[int, int] = {}
        self.step_times: list[float] = []
        self.events: list[dict[str, Any]] = []
        self.storm_start = workdir / "demo-node-2" / "storm.start"
        """Created once the job trains: node 2's simulated GPU 0 starts degrading."""
        self.agent_env: dict[str, str] = {}
        """More environment for the agents (the scale-out demo's NATS uplink)."""

    # ------------------------------------------------------------------ start-up

    def write_tokens(self) -> None:
        """Enrol both demo nodes: the collector's tokens file and one token file each."""
        from forewarn.collector.http.auth import enroll

        for node in NODES:
            enroll(self.dir / "tokens.toml", node, self.dir / f"{node}.token")

    def collector_config(self, name: str, port: int, extra: str = "") -> Path:
        """Write collector ``name``'s config (listening on ``port``); returns its path."""
        data = self.dir / name
        data.mkdir()
        config = self.dir / f"{name}.toml"
        config.write_text(
            "# forewarn demo collector: short cooldowns so each phase can act\n"
            f'listen = "127.0.0.1:{port}"\n'
            f'data_dir = "{data}"\n'
            f'tokens_file = "{self.dir / "tokens.toml"}"\n'
            "policy_cooldown_checkpoint_s = 5.0\n"
            "policy_dedup_s = 5.0\n"
            "command_redeliver_s = 2.0\n"
            "flush_interval_s = 2.0\n"
            'log_level = "warning"\n' + extra)
        return config

    def spawn_collector(self, name: str, port: int, config: Path) -> None:
        """Start collector ``name`` and wait until it answers."""
        self.stack.start(name, collector_command(config), self.dir / f"{name}.log",
                         f"http://127.0.0.1:{port}/healthz")

    def start_collector(self) -> None:
        port = free_port()
        self.collector_url = f"http://127.0.0.1:{port}"
        self.write_tokens()
        self.spawn_collector("collector", port, self.collector_config("collector", port))
        self.result.url = self.collector_url + "/"

    def start_agents(self) -> None:
        real = _nvml_present()
        for i, node in enumerate(NODES, start=1):
            ndir = self.dir / node
            ndir.mkdir()
            port = free_port()
            self.agent_urls[node] = f"http://127.0.0.1:{port}"
            self.sockets[node] = str(ndir / "agent.sock")
            scenario = None if i == 1 and real else ndir / "scenario.toml"
            if scenario is not None and i == 2:
                scenario.write_text(_scenario(self.t, failing_gpu=0, start_file=self.storm_start))
            elif scenario is not None:
                scenario.write_text('name = "demo-node-1"\ndescription = "healthy"\n'
                                    "gpus = 4\nseed = 3\n")
            argv = agent_command(node, scenario=scenario, source="sim" if scenario else "nvml",
                                 socket=self.sockets[node], listen=f"127.0.0.1:{port}",
                                 interval=0.5, collector=self.collector_url,
                                 token_file=self.dir / f"{node}.token")
            env = dict(os.environ)
            env.update(FOREWARN_AGENT_SPOOL_DIR=str(ndir / "spool"),
                       FOREWARN_AGENT_PUSH_INTERVAL_S="0.5",
                       FOREWARN_AGENT_HANG_ACTION="terminate",
                       FOREWARN_AGENT_HANG_GRACE_S="1.0", **self.agent_env)
            self.stack.start(node, argv, ndir / "agent.log", self.agent_urls[node] + "/healthz",
                             30, env)

    def start_job(self) -> None:
        self.control = self.dir / "control"
        self.control.mkdir()
        # Where the "scheduler" puts each rank: rank 1 moves off its GPU once it failed.
        self.placement = self.dir / "placement.json"
        self.placement.write_text(json.dumps({"0": 0, "1": 0}))
        args = ["torch", "--job", JOB, "--checkpoint-dir", str(self.dir / "ckpt"),
                "--control-dir", str(self.control), "--step-seconds", str(self.t.step_seconds),
                "--checkpoint-every", str(self.t.checkpoint_every), "--initial-checkpoint",
                "--placement-file", str(self.placement)]
        nodes = [Node(n, self.sockets[n]) for n in NODES]
        job = TorchrunJob(workload.__name__, args, nodes, job=JOB, log_dir=self.dir,
                          max_restarts=6)
        self.stack.job = job
        job.start()

    def move_rank(self, rank: int, gpu: int) -> None:
        """Place ``rank`` on ``gpu`` from its next start (the placement file)."""
        placement = json.loads(self.placement.read_text())
        placement[str(rank)] = gpu
        tmp = self.placement.with_suffix(".tmp")
        tmp.write_text(json.dumps(placement))
        tmp.replace(self.placement)

    # ------------------------------------------------------------------ observing

    def pump(self, until: float) -> None:
        """Take the job's events until ``until`` (monotonic)."""
        job = self.stack.job
        assert job is not None
        while True:
            left = until - time.monotonic()
            if left <= 0:
                return
            try:
                e = job.events.get(timeout=min(left, 0.1))
            except queue.Empty:
                continue
            self.events.append(e)
            kind = e.get("event")
            if kind == "step":
                rank, step = int(e["rank"]), int(e["step"])
                prev = self.last_step.get(rank)
                self.last_step[rank] = step
                if prev is not None and step == prev + 1 and rank == 0:
                    self.step_times.append(e["time"])
                if e.get("nan") and self.result.nan_step is None:
                    self.result.nan_step = step
            elif (kind == "checkpoint" and not e.get("ordered")
                  and self.result.failure_step is None):
                self.result.last_periodic_step = max(self.result.last_periodic_step or 0,
                                                     int(e["step"]))
            elif kind in ("rank_exit", "restart", "gave_up"):
                self.say(f"[dim]torchrun: {kind} {self._fmt(e)}[/dim]")
                if kind == "restart":
                    self.result.restarts += 1

    def wait_for(self, pred: Callable[[], Any], timeout: float, what: str) -> Any:
        """Pump events until ``pred()`` is truthy and return it; None, with the problem
        recorded, after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.pump(time.monotonic() + 0.1)
            if got := pred():
                return got
        self.result.problems.append(f"timed out waiting for {what}")
        self.say(f"[red]timed out waiting for {what}[/red]")
        return None

    @staticmethod
    def _fmt(e: dict[str, Any]) -> str:
        return " ".join(f"{k}={v}" for k, v in e.items() if k not in ("event", "time"))

    def _agent_findings(self, node: str) -> list[dict[str, Any]]:
        try:
            data = get_json(self.agent_urls[node] + "/api/v1/findings")
        except OSError:
            return []
        items = data.get("findings", data) if isinstance(data, dict) else data
        return [f for f in items if isinstance(f, dict)]

    def _finding(self, node: str, check: str, **subject: Any) -> dict[str, Any] | None:
        for f in self._agent_findings(node):
            subj = f.get("subject", {})
            if f.get("check") != check or f.get("health") not in ("unhealthy", "degraded"):
                continue
            if all(subj.get(k) == v for k, v in subject.items()):
                return f
        return None

    def _ordered_checkpoints(self, attempt: int) -> dict[int, int]:
        return {int(e["rank"]): int(e["step"]) for e in self.events
                if e.get("event") == "checkpoint" and e.get("ordered")
                and e.get("attempt") == attempt}

    def _order_issued(self) -> tuple[float, str] | None:
        try:
            rows = get_json(self.collector_url + "/api/v1/commands/log?limit=50")
        except OSError:
            return None
        orders = [r for r in rows if r.get("kind") == "checkpoint"]
        if not orders:
            return None
        first = min(orders, key=lambda r: r["created"])
        return float(first["created"]), str(first["command"]["order"].get("reason", ""))

    # ------------------------------------------------------------------ phases

    def phase_prediction(self) -> None:
        r = self.result
        self.say("[bold]1. A GPU degrades under rank 1[/bold] (simulated correctable-ECC storm "
                 "on demo-node-2 GPU 0, ending in a double-bit error)")
        self.storm_start.touch()
        attempt = 0
        ok = self.wait_for(lambda: len(self._ordered_checkpoints(attempt)) == 2,
                           self.t.storm_start_s + self.t.storm_s + 30, "an ordered checkpoint")
        if ok:
            r.ordered_steps = self._ordered_checkpoints(attempt)
            issued = self._order_issued()
            if issued is not None:
                r.order_time, r.order_reason = issued
            self.say(f"   forewarn ordered a checkpoint ({r.order_reason or 'reason unknown'}); "
                     f"ranks saved steps {sorted(r.ordered_steps.items())}")
        # The failure: the double-bit error kills the process on that GPU.
        self.wait_for(lambda: (self._finding("demo-node-2", "ecc", gpu=0) or {}).get("health")
                      == "unhealthy", self.t.storm_s + 30, "the double-bit error")
        job = self.stack.job
        assert job is not None
        r.failure_step = self.last_step.get(1)
        self.move_rank(1, 1)
        job.signal_rank(1, signal.SIGKILL)
        r.failure_time = self._xid_time("demo-node-2", 48) or time.time()
        self.say(f"   the double-bit error killed rank 1 at step {r.failure_step}; "
                 "torchrun restarts the job, rank 1 on a healthy GPU")
        resumed = self.wait_for(lambda: self._resumed(1), self.t.give_up_s, "the restart")
        if resumed:
            r.resumed_ranks = resumed
            r.resumed_step = min(resumed.values())
            self.say(f"   resumed from step {r.resumed_step} on every rank")

    def _xid_time(self, node: str, code: int) -> float | None:
        """When the collector recorded XID ``code`` on ``node`` (the failure's own time)."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                rows = get_json(f"{self.collector_url}/api/v1/xids?node={node}&code={code}")
            except OSError:
                rows = []
            if rows:
                return float(min(r["time"] for r in rows))
            time.sleep(0.2)
        return None

    def _nan_finding(self, since: float) -> dict[str, Any] | None:
        try:
            rows = get_json(f"{self.collector_url}/api/v1/findings?job={JOB}&check_name=nan_loss"
                        f"&health=unhealthy&since={since - 1.0}")
        except OSError:
            return None
        return min(rows, key=lambda row: row["time"]) if rows else None

    def inject(self, rank: int, fault: str) -> None:
        """Fault injection through the rank's control file (forewarn.spawn.workload)."""
        path = self.control / f"control-r{rank}.json"
        entries = json.loads(path.read_text()) if path.exists() else []
        entries.append({"id": f"{fault}-{len(entries)}", "fault": fault})
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entries))
        tmp.replace(path)

    def _resumed(self, attempt: int) -> dict[int, int] | None:
        got = {int(e["rank"]): int(e["step"]) for e in self.events
               if e.get("event") == "resumed" and int(e.get("attempt", -1)) >= attempt}
        return got if len(got) == 2 else None

    def phase_hang(self) -> None:
        r = self.result
        job = self.stack.job
        assert job is not None
        self.pump(time.monotonic() + self.t.settle_s)
        self.say("[bold]2. Rank 0 hangs[/bold] (stops stepping; its process and heartbeats "
                 "live on, as a rank stuck in a collective)")
        attempt = job.attempt
        r.hang_injected = time.time()
        self.inject(0, "hang")
        if self.wait_for(lambda: self._finding("demo-node-1", "rank_hang", job=JOB) is not None,
                         30, "hang detection"):
            r.hang_detected = time.time()
            self.say(f"   the agent called rank 0 hung after {r.hang_latency_s:.1f} s and ended "
                     "the job's ranks (NCCL would have waited 600 s)")
        got = self.wait_for(lambda: self._resumed(attempt + 1), self.t.give_up_s,
                            "the restart after the hang")
        if got:
            r.hang_resumed_step = min(got.values())
            self.say(f"   resumed from step {r.hang_resumed_step}")

    def phase_nan(self) -> None:
        r = self.result
        job = self.stack.job
        assert job is not None
        self.pump(time.monotonic() + self.t.settle_s)
        self.say("[bold]3. The loss turns NaN[/bold] on rank 1")
        attempt = job.attempt
        injected = time.time()
        self.inject(1, "nan")
        # The finding clears at the next finite step (the NaN update was skipped), so read
        # it from the collector's finding history rather than the agent's current findings.
        f = self.wait_for(lambda: self._nan_finding(injected), 20, "NaN detection")
        if f:
            r.nan_detected_latency_s = float(f["time"]) - injected
            step = f.get("finding", {}).get("evidence", {}).get("step")
            r.nan_detected_step = int(step) if step is not None else None
            self.say(f"   NaN caught at step {r.nan_detected_step} (injected at step "
                     f"{r.nan_step}); rolling back to the last good checkpoint")
            job.signal_rank(1, signal.SIGKILL)
        got = self.wait_for(lambda: self._resumed(attempt + 1), self.t.give_up_s,
                            "the restart after the NaN")
        if got:
            r.nan_resumed_step = min(got.values())
            self.say(f"   resumed from step {r.nan_resumed_step}")
        self.pump(time.monotonic() + self.t.settle_s)

    def finish(self) -> None:
        times = self.step_times
        if len(times) > 10:
            gaps = sorted(b - a for a, b in itertools.pairwise(times) if b > a)
            self.result.mean_step_s = gaps[len(gaps) // 2]




def run_demo(fast: bool = False, workdir: Path | None = None, keep: bool = False,
             say: Any = print, make: Callable[[Path, bool, Any], Demo] = Demo) -> DemoResult:
    """Run the demo (``make``: the :class:`Demo` to run, e.g. the scale-out one); returns
    what happened. Everything started is stopped on return."""
    made = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="forewarn-demo-")) if workdir is None else workdir
    wd.mkdir(parents=True, exist_ok=True)
    demo = make(wd, fast, say)
    try:
        say("starting the collector …")
        demo.start_collector()
        say(f"status page: [link]{demo.result.url}[/link]")
        say("starting two agents on simulated 4-GPU nodes …")
        demo.start_agents()
        say("starting a 2-rank torch.distributed (gloo) training job …")
        demo.start_job()
        demo.wait_for(lambda: len(demo.last_step) == 2, 60, "the first training steps")
        demo.phase_prediction()
        demo.phase_hang()
        demo.phase_nan()
        demo.finish()
    finally:
        with interrupts_held():  # a second Ctrl-C waits until everything is stopped
            demo.stack.close()
        if made and not keep:
            shutil.rmtree(wd, ignore_errors=True)
    return demo.result
