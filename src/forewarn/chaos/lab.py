"""The chaos lab: real collectors, real agents on simulated nodes, and real training jobs,
started on demand and shared by the scenarios that can share them without touching each
other.

Three rigs:

* :class:`TrainingRig`: the shared collector, agent ``chaos-node-1`` (a quiet simulated
  2-GPU node, ``hang_action = terminate``) and a 2-rank gloo job on it, launched by
  torchrun (``--nproc-per-node=2``, c10d rendezvous, ``--max-restarts``; the job restarts
  from its newest checkpoint; :class:`~forewarn.demo.launch.TorchrunJob`). Both ranks
  share one node and one agent on purpose: the agent's straggler comparison and its own
  grad-spike order are per node. Training scenarios run one after the other on it; each
  waits for the job to be healthy and stepping first.
* :class:`HardwareRig`: the shared collector and agent ``chaos-node-2``, a simulated
  4-GPU node whose scenario scripts one fault per GPU (ECC storm to a double-bit error,
  PCIe replays to XID 79, row-remap growth to failure, thermal runaway), with one
  hook-only single-rank job on each GPU. The faults are on different GPUs and different
  jobs: independent, and all play out together within ``hw_window_s``.
* :class:`TelemetryRig`: a collector and an agent of their own, per scenario, with the
  agent's uplink going through a :class:`~forewarn.chaos.procs.TcpProxy`; kills and cuts
  here touch nothing else. :class:`BusRig` is the same over a nats-server of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forewarn.chaos.procs import Procs, TcpProxy, get_json, scrape, wait_http, wait_until
from forewarn.demo import servers
from forewarn.demo.launch import Node, TorchrunJob, free_port, python_module

__all__ = ["BusRig", "HardwareRig", "Lab", "Options", "TelemetryRig", "TrainingRig"]

TRAIN_JOB = "chaos-train"
HW_FAULTS = ("ecc_storm", "pcie_replay", "remap_growth", "thermal_runaway")
"""The fault on simulated GPU 0, 1, 2, 3 of ``chaos-node-2``."""


@dataclasses.dataclass(frozen=True)
class Options:
    """Knobs of a chaos run. Defaults are the CLI's; the tests scale some down."""

    cutoff_s: float = 120.0
    """How long the agent is cut off from the collector ("minutes": 2 min by default)."""
    spool_max_bytes: int = 128 * 1024
    """Spool bound in the spool-full scenario: a few batches (4 simulated GPUs with 18
    NVLinks each make batches of ~40 KB at the default intervals), so a cut overflows it."""
    disk_full_s: float = 3.0
    """How long the spool's file system refuses writes in the spool-full scenario."""
    step_seconds: float = 0.04
    """Padding per training step (the job's compute stand-in)."""
    checkpoint_every: int = 40
    """Periodic checkpoint interval of the training job, in steps."""
    hw_sim_speed: float = 5.0
    """Simulated seconds per real second on the hardware node."""
    hw_fault_start_s: float = 20.0
    hw_fault_duration_s: float = 150.0
    """Simulated seconds: every hardware fault starts here and ends this much later."""
    agent_interval_s: float = 0.25
    telemetry_interval_s: float = 0.1
    push_interval_s: float = 0.5

    @property
    def hw_window_s(self) -> float:
        """Wall seconds after the hardware agent starts by which every fault has ended."""
        return (self.hw_fault_start_s + self.hw_fault_duration_s) / self.hw_sim_speed


class _Collector:
    """One ``forewarn collector run`` process with its config, tokens and data."""

    def __init__(self, lab: Lab, name: str, nodes: list[str], extra: str = "",
                 data: Path | None = None) -> None:
        self.lab = lab
        self.name = name
        self.dir = lab.dir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data = data or self.dir / "data"
        self.log = self.dir / "collector.log"
        self.config = self.dir / "collector.toml"
        self.config.write_text(
            "# forewarn chaos collector: short cooldowns so each scenario can act; the\n"
            "# circuit breaker is opened wide because the lab is 6 GPUs with several faults\n"
            "# at once (the breaker itself is tested in tests/collector/test_policy.py)\n"
            f'listen = "127.0.0.1:{self.port}"\n'
            f'data_dir = "{self.data}"\n'
            f'tokens_file = "{self.dir / "tokens.toml"}"\n'
            "policy_cooldown_checkpoint_s = 3.0\n"
            "policy_dedup_s = 3.0\n"
            "policy_breaker_checkpoint_share = 1.0\n"
            "command_redeliver_s = 2.0\n"
            "flush_interval_s = 0.5\n"
            'log_level = "warning"\n' + extra)
        from forewarn.collector.http.auth import add_token

        self.tokens: dict[str, Path] = {}
        for node in nodes:
            token = add_token(self.dir / "tokens.toml", node)
            path = self.dir / f"{node}.token"
            path.write_text(token + "\n")
            path.chmod(0o600)
            self.tokens[node] = path
        self.start()

    def start(self) -> None:
        proc = self.lab.procs.spawn(
            self.name, [sys.executable, "-m", "forewarn", "collector", "--config",
                        str(self.config), "run"], self.log)
        wait_http(self.url + "/healthz", 60, proc, self.log)

    @property
    def pid(self) -> int:
        return self.lab.procs.procs[self.name].pid

    def metric(self, name: str, **labels: str) -> float | None:
        return scrape(self.url + "/metrics", name, labels)

    def kill9(self) -> float:
        return self.lab.procs.kill9(self.name)

    def stop(self) -> int | None:
        return self.lab.procs.stop(self.name)

    def get(self, path: str) -> Any:
        return get_json(self.url + path)

    def findings(self, node: str, check: str, since: float = 0.0) -> list[dict[str, Any]]:
        """Stored finding transitions of ``check`` on ``node`` at or after ``since``,
        oldest first (the collector's history, ``/api/v1/findings``)."""
        rows = self.get(f"/api/v1/findings?node={node}&check_name={check}&limit=1000")
        return sorted((r for r in rows if float(r.get("time", 0)) >= since),
                      key=lambda r: float(r["time"]))


class _Agent:
    """One ``forewarn agent --source sim`` process."""

    def __init__(self, lab: Lab, name: str, node: str, collector_url: str, token: Path,
                 scenario: str, *, interval_s: float, push_s: float, sim_speed: float = 1.0,
                 env: dict[str, str] | None = None, spool: Path | None = None) -> None:
        self.lab = lab
        self.name = name
        self.node = node
        self.dir = lab.dir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.socket = str(self.dir / "agent.sock")
        self.spool = spool or self.dir / "spool"
        (self.dir / "scenario.toml").write_text(scenario)
        self.argv = [sys.executable, "-m", "forewarn", "agent", "--node", node, "--listen",
                     f"127.0.0.1:{self.port}", "--socket", self.socket, "--no-kmsg",
                     "--collector", collector_url, "--token-file", str(token),
                     "--interval", str(interval_s), "--source", "sim", "--scenario",
                     str(self.dir / "scenario.toml"), "--sim-speed", str(sim_speed),
                     "--log-level", "warning"]
        self.env = dict(os.environ)
        self.env.update(FOREWARN_AGENT_SPOOL_DIR=str(self.spool),
                        FOREWARN_AGENT_PUSH_INTERVAL_S=str(push_s), **(env or {}))
        self.started = 0.0
        self.start()

    def start(self) -> None:
        log = self.dir / "agent.log"
        self.started = time.time()
        proc = self.lab.procs.spawn(self.name, self.argv, log, self.env)
        wait_http(self.url + "/healthz", 60, proc, log)

    def kill9(self) -> float:
        return self.lab.procs.kill9(self.name)

    def stop(self) -> int | None:
        return self.lab.procs.stop(self.name)

    @property
    def pid(self) -> int:
        return self.lab.procs.procs[self.name].pid

    def metric(self, name: str, **labels: str) -> float | None:
        return scrape(self.url + "/metrics", name, labels)

    def findings(self) -> list[dict[str, Any]]:
        data = get_json(self.url + "/api/v1/findings")
        items = data.get("findings", data) if isinstance(data, dict) else data
        return [f for f in items if isinstance(f, dict)]

    def spool_state(self) -> dict[str, Any]:
        state: dict[str, Any] = json.loads((self.spool / "state.json").read_text())
        return state


class TrainingRig:
    """The shared collector, agent ``chaos-node-1`` and the 2-rank job (module docstring)."""

    NODE = "chaos-node-1"

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        o = lab.options
        self.collector = lab.main_collector()
        self.agent = _Agent(
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
        self.launcher = TorchrunJob("forewarn.chaos.workload", args,
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
        while not self._stop.is_set():
            try:
                e = self.launcher.events.get(timeout=0.1)
            except queue.Empty:
                continue
            with self._lock:
                self.events.append(e)

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
                               f"{timeout:.0f} s (attempt {a})")
        return a

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


class HardwareRig:
    """Agent ``chaos-node-2`` with one scripted fault per GPU and one job per GPU."""

    NODE = "chaos-node-2"

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        o = lab.options
        self.collector = lab.main_collector()
        faults = "".join(
            f'\n[[faults]]\ngpu = {g}\nkind = "{kind}"\nstart_s = {o.hw_fault_start_s}\n'
            f"duration_s = {o.hw_fault_duration_s}\n"
            + ("recover = false\n" if kind == "thermal_runaway" else "")
            for g, kind in enumerate(HW_FAULTS))
        self.scenario = (
            '# forewarn chaos: one fault per simulated GPU, all values simulated\n'
            'name = "chaos-node-2"\ndescription = "one scripted fault per GPU"\n'
            f"gpus = {len(HW_FAULTS)}\nseed = 5\n{faults}")
        self.agent = _Agent(lab, "agent-node-2", self.NODE, self.collector.url,
                            self.collector.tokens[self.NODE], self.scenario,
                            interval_s=o.agent_interval_s, push_s=o.push_interval_s,
                            sim_speed=o.hw_sim_speed)
        self.logs: dict[int, Path] = {}
        for g in range(len(HW_FAULTS)):
            log = lab.dir / f"hw-job-gpu{g}.jsonl"
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            lab.procs.spawn(f"hw-job-{g}", python_module(
                "forewarn.chaos.workload", "light", "--job", self.job(g), "--gpu", str(g),
                "--socket", self.agent.socket, "--checkpoint-dir",
                str(lab.dir / f"hw-ckpt-{g}")), log, env)
            self.logs[g] = log

    @staticmethod
    def job(gpu: int) -> str:
        return f"chaos-hw-gpu{gpu}"

    def events(self, gpu: int) -> list[dict[str, Any]]:
        out = []
        for line in self.logs[gpu].read_text(errors="replace").splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if isinstance(e, dict):
                out.append(e)
        return out

    def sim_start(self) -> float:
        """Wall time the simulated node's scenario began (from the agent's start; the
        sim clock starts when the agent opens its backend, within a second of this)."""
        return self.agent.started


@dataclasses.dataclass
class TelemetryRig:
    """A collector and an agent of their own, the uplink through a cuttable proxy.

    ``others``: more nodes with tokens on that collector, for a scenario's own client
    (an impostor, a poisoned or skewed agent) beside the real agent. ``disk``: a folder
    (a small file system) that holds the collector's data dir and the agent's spool.
    ``collector_extra``: more collector config lines."""

    lab: Lab
    name: str
    spool_max_bytes: int | None = None
    others: tuple[str, ...] = ()
    disk: Path | None = None
    collector_extra: str = ""
    collector: _Collector = dataclasses.field(init=False)
    agent: _Agent = dataclasses.field(init=False)
    proxy: TcpProxy = dataclasses.field(init=False)

    @property
    def node(self) -> str:
        return f"chaos-{self.name}"

    def __post_init__(self) -> None:
        node = self.node
        o = self.lab.options
        self.collector = _Collector(self.lab, f"{self.name}-collector", [node, *self.others],
                                    self.collector_extra,
                                    data=self.disk / "data" if self.disk else None)
        self.proxy = TcpProxy(("127.0.0.1", self.collector.port))
        self.lab.proxies.append(self.proxy)
        env = {}
        if self.spool_max_bytes is not None:
            env["FOREWARN_AGENT_SPOOL_MAX_BYTES"] = str(self.spool_max_bytes)
        self.agent = _Agent(
            self.lab, f"{self.name}-agent", node, self.proxy.url, self.collector.tokens[node],
            f'name = "{node}"\ndescription = "quiet"\ngpus = 4\nseed = 2\n',
            interval_s=o.telemetry_interval_s, push_s=o.push_interval_s, env=env,
            spool=self.disk / "spool" if self.disk else None)

    def token(self, node: str) -> str:
        """The bearer token of ``node`` on this rig's collector."""
        return self.collector.tokens[node].read_text().strip()

    @property
    def gpus(self) -> int:
        return 4

    def stored_batches(self) -> int:
        nodes = self.collector.get("/api/v1/nodes")
        return int(nodes[0]["batches"]) if nodes else 0

    def spool_empty(self) -> bool:
        return self.agent.metric("forewarn_uplink_spool_batches") == 0


@dataclasses.dataclass
class BusRig(TelemetryRig):
    """A :class:`TelemetryRig` whose agent and collector talk through a nats-server of
    its own (``uplink = "nats"``, ``bus_url``) instead of the proxy; the server can be
    stopped and started again on the same port and JetStream store."""

    nats: str = "nats-server"

    def __post_init__(self) -> None:
        o = self.lab.options
        self.dir = self.lab.dir / self.name
        self.nats_server = servers.start_nats(self.dir, binary=self.nats)
        self.lab.closers.append(self.nats_server.stop)
        self.nats_url = self.nats_server.url
        node = self.node
        self.collector = _Collector(self.lab, f"{self.name}-collector", [node],
                                    f'bus_url = "{self.nats_url}"\nbus_ack_wait_s = 2.0\n')
        self.agent = _Agent(
            self.lab, f"{self.name}-agent", node, self.collector.url,
            self.collector.tokens[node],
            f'name = "{node}"\ndescription = "quiet"\ngpus = 4\nseed = 2\n',
            interval_s=o.telemetry_interval_s, push_s=o.push_interval_s,
            env={"FOREWARN_AGENT_UPLINK": "nats", "FOREWARN_AGENT_NATS_URL": self.nats_url})

    def start_nats(self) -> None:
        """Start the nats-server again, on the same port and JetStream store."""
        self.nats_server.start()

    def stop_nats(self) -> float:
        """Stop the nats-server (SIGTERM); returns when."""
        t = time.time()
        self.nats_server.stop()
        return t


class Lab:
    """Owns every process, rig and proxy of a chaos run; :meth:`close` ends them all."""

    def __init__(self, workdir: Path, options: Options | None = None) -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.options = options or Options()
        self.procs = Procs()
        self.launchers: list[TorchrunJob] = []
        self.proxies: list[TcpProxy] = []
        self._main: _Collector | None = None
        self._training: TrainingRig | None = None
        self._hardware: HardwareRig | None = None
        self.rigs: dict[str, Any] = {}
        """Rigs other modules build once per lab (the scale-out rig), by name."""
        self.closers: list[Callable[[], None]] = []
        """Stops for what is not a process of :attr:`procs` (servers), run by close()."""

    def main_collector(self) -> _Collector:
        if self._main is None:
            self._main = _Collector(self, "collector", [TrainingRig.NODE, HardwareRig.NODE])
        return self._main

    def training(self) -> TrainingRig:
        if self._training is None:
            self._training = TrainingRig(self)
        return self._training

    def hardware(self) -> HardwareRig:
        if self._hardware is None:
            self._hardware = HardwareRig(self)
        return self._hardware

    def telemetry(self, name: str, spool_max_bytes: int | None = None, *,
                  others: tuple[str, ...] = (), disk: Path | None = None,
                  collector_extra: str = "") -> TelemetryRig:
        return TelemetryRig(self, name, spool_max_bytes, others, disk, collector_extra)

    def bus(self, name: str) -> BusRig | None:
        """A :class:`BusRig`, or None when nats-server is not installed."""
        try:
            nats = servers.find_binary("nats-server")
        except servers.MissingServer:
            return None
        return BusRig(self, name, nats=nats)

    def close(self) -> None:
        if self._training is not None:
            self._training.close()
        for launcher in self.launchers:
            launcher.stop()
        for p in self.proxies:
            p.close()
        self.procs.close()
        for close in reversed(self.closers):
            with contextlib.suppress(Exception):  # every server is stopped whatever happens
                close()
