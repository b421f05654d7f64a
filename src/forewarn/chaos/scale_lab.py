"""The chaos lab's scale-out rig: a 3-server NATS JetStream cluster (streams replicated
three times), PostgreSQL, VictoriaMetrics, two collector replicas sharing them, and agents
on simulated nodes publishing over NATS (``uplink = "nats"``). Built once per lab and
shared by the scale-out scenarios (:mod:`forewarn.chaos.scale_scenarios`); each scenario
leaves it whole (a killed replica or server is started again) and ends with
:meth:`ScaleRig.settle`, which accounts every batch and sample so far.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import time
from pathlib import Path
from typing import Any

from forewarn.chaos.daemons import LabAgent
from forewarn.chaos.exposition import scrape
from forewarn.chaos.lab import Lab
from forewarn.demo import servers
from forewarn.demo.launch import free_port
from forewarn.demo.scale_account import ScaleAccount, account_scale
from forewarn.spawn.commands import collector_command
from forewarn.spawn.procs import get_json, leader_role, one_leader, wait_http, wait_until

__all__ = ["ScaleRig", "scale_rig"]

NODES = ("scale-node-1", "scale-node-2", "scale-node-3")
"""Enrolled nodes: the first two run from the start, the third joins for the order."""
REPLICAS = ("scale-a", "scale-b")
def scale_rig(lab: Lab) -> ScaleRig:
    """The lab's scale-out rig, built on first use."""
    rig = lab.rigs.get("scale")
    if rig is None:
        with lab.undo_on_failure():
            rig = lab.rigs["scale"] = ScaleRig(lab)
    assert isinstance(rig, ScaleRig)
    return rig


class ScaleRig:
    """Servers, replicas and agents of the scale-out mode (module docstring)."""

    def __init__(self, lab: Lab) -> None:
        from forewarn import bus
        from forewarn.collector.http.auth import enroll, hash_token

        self.lab = lab
        self.dir = lab.dir / "scale"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tokens: dict[str, Path] = {}
        hashes = {}
        for node in NODES:
            self.tokens[node] = self.dir / f"{node}.token"
            hashes[node] = hash_token(enroll(self.dir / "tokens.toml", node, self.tokens[node]))
        password = secrets.token_hex(16)
        self.nats = servers.nats_cluster(self.dir / "nats", 3,
                                         authorization=bus.authorization(hashes, password))
        for s in self.nats:
            lab.closers.append(s.stop)
            s.start()
        self.nats_url = ",".join(s.url for s in self.nats)
        self.pg = servers.PostgresServer(root=None if os.geteuid() == 0 else self.dir / "pg")
        lab.closers.append(self.pg.stop)
        self.dsn = self.pg.database()
        self.vm = servers.VictoriaMetrics(root=self.dir / "vm")
        lab.closers.append(self.vm.stop)
        secret = self.dir / "nats-password"
        secret.write_text(password)
        secret.chmod(0o600)
        self.urls: dict[str, str] = {}
        for name in REPLICAS:
            self._configure(name, secret)
        for name in REPLICAS:
            self.start_replica(name, wait=False)
        for name in REPLICAS:
            self._wait_replica(name)
        self.agents: dict[str, LabAgent] = {}
        for node in NODES[:2]:
            self.start_agent(node)

    # ------------------------------------------------------------------ replicas

    def _configure(self, name: str, secret: Path) -> None:
        port = free_port()
        self.urls[name] = f"http://127.0.0.1:{port}"
        (self.dir / name).mkdir(exist_ok=True)
        (self.dir / f"{name}.toml").write_text(
            "# forewarn chaos: a scale-out replica; short cooldowns, the breaker wide open\n"
            f'listen = "127.0.0.1:{port}"\ndata_dir = "{self.dir / name}"\n'
            f'tokens_file = "{self.dir / "tokens.toml"}"\n'
            "policy_cooldown_checkpoint_s = 3.0\npolicy_dedup_s = 3.0\n"
            "policy_breaker_checkpoint_share = 1.0\ncommand_redeliver_s = 2.0\n"
            'log_level = "warning"\n'
            f'state = "postgresql"\npostgres_dsn = "{self.dsn}"\n'
            f'bus_url = "{self.nats_url}"\nbus_password_file = "{secret}"\n'
            "bus_stream_replicas = 3\nbus_ack_wait_s = 2.0\n"
            f'remote_write_url = "{self.vm.write_url}"\n')

    def start_replica(self, name: str, wait: bool = True) -> None:
        self.lab.procs.spawn(name, collector_command(self.dir / f"{name}.toml"),
                             self.dir / f"{name}.log")
        if wait:
            self._wait_replica(name)

    def _wait_replica(self, name: str) -> None:
        wait_http(self.urls[name] + "/healthz", 90, self.lab.procs.procs[name],
                  self.dir / f"{name}.log")

    def roles(self) -> dict[str, str]:
        """Replica -> leader or follower, once exactly one leads (else empty)."""
        return one_leader(self.urls) or {}

    def kill_leader(self) -> tuple[str, float, float | None]:
        """SIGKILL the leading replica; (its name, the time of the kill, seconds until the
        other leads or None)."""
        roles = self.roles()
        leader = next(n for n, r in roles.items() if r == "leader")
        other = next(n for n in REPLICAS if n != leader)
        at = self.lab.procs.kill9(leader)
        killed = time.monotonic()
        led = wait_until(lambda: leader_role(self.urls[other]) == "leader", 30, step=0.05)
        return leader, at, None if led is None else round(time.monotonic() - killed, 2)

    def survivor(self) -> str:
        """The URL of a replica that runs."""
        return next(u for n, u in self.urls.items() if self.lab.procs.procs[n].poll() is None)

    def metric(self, name: str) -> float:
        """``name`` summed over the replicas that run."""
        return sum(scrape(u + "/metrics", name) or 0.0 for n, u in self.urls.items()
                   if self.lab.procs.procs[n].poll() is None)

    # ------------------------------------------------------------------ agents

    def start_agent(self, node: str, scenario: str = "") -> LabAgent:
        o = self.lab.options
        agent = self.agents.get(node)
        if agent is not None:
            agent.start()
            return agent
        self.agents[node] = LabAgent(
            self.lab, f"agent-{node}", node, self.survivor(), self.tokens[node],
            scenario or f'name = "{node}"\ndescription = "quiet"\ngpus = 4\nseed = 4\n',
            interval_s=o.telemetry_interval_s, push_s=o.push_interval_s,
            env={"FOREWARN_AGENT_UPLINK": "nats", "FOREWARN_AGENT_NATS_URL": self.nats_url})
        return self.agents[node]

    def stored_batches(self) -> int:
        """Batches in the shared state (every node)."""
        return sum(int(n["batches"]) for n in get_json(self.survivor() + "/api/v1/nodes"))

    def ingesting(self, more: int = 5, timeout: float = 60.0) -> bool:
        """Wait until ``more`` batches more are stored."""
        n = self.stored_batches()
        return wait_until(lambda: self.stored_batches() >= n + more, timeout) is not None

    def settle(self) -> ScaleAccount:
        """Stop the agents gracefully (each seals and publishes what it holds), account
        every batch and sample so far, then start them again on their spools."""
        running = [a for a in self.agents.values()
                   if self.lab.procs.procs[a.name].poll() is None]
        for a in running:
            a.stop()
        acc = account_scale([a.spool for a in self.agents.values()], self.dsn, self.vm,
                            'forewarn_gpu_info{node=~"scale-node-.*"}')
        for a in running:
            a.start()
        return acc

    @staticmethod
    def as_figures(acc: ScaleAccount) -> dict[str, Any]:
        return dataclasses.asdict(acc) | {"samples_lost": acc.samples_lost}
