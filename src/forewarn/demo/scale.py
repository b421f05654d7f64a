"""The scale-out demo (``forewarn demo --scale-out``): the embedded demo's loop on
NATS JetStream, PostgreSQL and VictoriaMetrics with two collector replicas, one
killed mid-run. What it does is the command's help: :mod:`forewarn.demo.cli`."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from forewarn.demo import servers
from forewarn.demo.launch import free_port
from forewarn.demo.run import NODES, Demo, DemoResult, Stack, run_demo, summary_lines
from forewarn.demo.scale_account import ScaleAccount, account_scale
from forewarn.spawn.commands import collector_command
from forewarn.spawn.interrupts import interrupts_held
from forewarn.spawn.procs import get_json, leader_role, one_leader, wait_http, wait_until

__all__ = ["ScaleResult", "preflight", "run_scale_demo", "scale_summary_lines"]

_S = TypeVar("_S")

REPLICAS = ("collector-a", "collector-b")
"""The two replicas; whichever leads first is killed."""

def preflight() -> list[str]:
    """What this machine lacks to run the scale-out demo, one message each (empty: all
    there)."""
    return servers.scale_out_missing()


@dataclasses.dataclass
class ScaleResult(DemoResult, ScaleAccount):
    """:class:`DemoResult`, the telemetry account (:class:`ScaleAccount`) and the
    failover."""

    killed_replica: str = ""
    failover_s: float | None = None
    """From the SIGKILL of the leading replica until the other reports itself leader."""
    new_leader: str = ""
    orders_issued: int = 0
    """Checkpoint commands the policy queued (one per node of the job per order)."""
    orders_delivered: int = 0
    """Of those, the ones the node's agent acknowledged (over NATS) as applied."""

    def derived(self) -> dict[str, Any]:
        return {"samples_lost": self.samples_lost}


class ScaleStack(Stack):
    """The demo's processes, then the servers."""

    def __init__(self) -> None:
        super().__init__()
        self.servers: list[Any] = []

    def close(self) -> None:
        super().close()
        for server in reversed(self.servers):
            with contextlib.suppress(Exception):  # stop the others whatever happens
                server.stop()


class ScaleDemo(Demo):
    """The demo on NATS, PostgreSQL, VictoriaMetrics and two replicas (module docstring)."""

    def __init__(self, workdir: Path, fast: bool, say: Any) -> None:
        super().__init__(workdir, fast, say)
        self.stack: ScaleStack = ScaleStack()
        self.result: ScaleResult = ScaleResult(workdir=str(workdir))
        self.urls: dict[str, str] = {}
        self.leader = self.follower = ""
        self.dsn = ""
        self.vm: servers.VictoriaMetrics | None = None

    # ------------------------------------------------------------------ start-up

    def start_servers(self) -> str:
        """NATS (with one user per node), PostgreSQL and VictoriaMetrics; returns the
        collectors' NATS password."""
        from forewarn import bus
        from forewarn.collector.http.auth import hash_token

        password = secrets.token_hex(16)
        hashes = {n: hash_token((self.dir / f"{n}.token").read_text().strip()) for n in NODES}
        self.say("starting nats-server (JetStream), PostgreSQL and VictoriaMetrics …")
        nats = self._server(lambda: servers.start_nats(
            self.dir / "nats", authorization=bus.authorization(hashes, password)))
        self.agent_env = {"FOREWARN_AGENT_UPLINK": "nats", "FOREWARN_AGENT_NATS_URL": nats.url}
        root = None if os.geteuid() == 0 else self.dir / "postgresql"
        pg = self._server(lambda: servers.PostgresServer(root=root))
        self.say(f"PostgreSQL data in {pg.root}")
        self.dsn = pg.database()
        self.vm = self._server(lambda: servers.VictoriaMetrics(root=self.dir / "victoria-metrics"))
        return password

    def _server(self, start: Callable[[], _S]) -> _S:
        """Start a server and record it for the cleanup: both, or neither (a Ctrl-C waits:
        pg_ctl's postmaster outlives an interrupted pg_ctl)."""
        with interrupts_held():
            server = start()
            self.stack.servers.append(server)
        return server

    def start_collector(self) -> None:
        self.write_tokens()
        password = self.start_servers()
        assert self.vm is not None
        secret = self.dir / "nats-password"
        secret.write_text(password)
        secret.chmod(0o600)
        nats_url = self.agent_env["FOREWARN_AGENT_NATS_URL"]
        extra = (f'state = "postgresql"\npostgres_dsn = "{self.dsn}"\n'
                 f'bus_url = "{nats_url}"\nbus_password_file = "{secret}"\n'
                 # a killed replica's batches come back to the other after 2 s, not 10
                 "bus_ack_wait_s = 2.0\n"
                 f'remote_write_url = "{self.vm.write_url}"\n')
        ports = {name: free_port() for name in REPLICAS}
        # both start together (a replica's start takes seconds on a loaded machine)
        configs = {n: self.collector_config(n, p, extra) for n, p in ports.items()}
        procs = {n: self.stack.spawn(n, collector_command(configs[n]), self.dir / f"{n}.log")
                 for n in REPLICAS}
        for n, port in ports.items():
            self.urls[n] = f"http://127.0.0.1:{port}"
            wait_http(self.urls[n] + "/healthz", 60, procs[n], self.dir / f"{n}.log")
        roles = one_leader(self.urls)
        if roles is None:
            raise RuntimeError("no collector replica took the lead")
        self.leader = next(n for n, role in roles.items() if role == "leader")
        self.follower = next(n for n in REPLICAS if n != self.leader)
        # reads go to the replica that survives (the state is shared)
        self.collector_url = self.urls[self.follower]
        self.result.url = self.collector_url + "/"
        self.say(f"two collector replicas: {self.leader} leads, {self.follower} follows")

    # ------------------------------------------------------------------ the failover

    def start_job(self) -> None:
        super().start_job()
        # While the job starts and the agents publish, before the GPU degrades: the new
        # leader decides every order of the run.
        if wait_until(lambda: len(get_json(self.collector_url + "/api/v1/nodes")) == 2,
                      30) is None:
            self.result.problems.append("the agents' batches did not reach the collectors")
        self.fail_over()

    def fail_over(self) -> None:
        """SIGKILL the leading replica while the agents publish; time the takeover."""
        r = self.result
        self.say(f"[bold]0. The leading collector replica dies[/bold] (SIGKILL "
                 f"{self.leader} mid-ingest)")
        r.killed_replica = self.leader
        self.stack.kill9(self.leader)
        killed = time.monotonic()
        led = wait_until(lambda: leader_role(self.urls[self.follower]) == "leader", 30, step=0.05)
        if led is None:
            r.problems.append(f"{self.follower} did not take over within 30 s")
            return
        r.failover_s = round(time.monotonic() - killed, 2)
        r.new_leader = self.follower
        self.say(f"   {self.follower} leads {r.failover_s:.2f} s after the kill")

    # ------------------------------------------------------------------ the count

    def finish(self) -> None:
        super().finish()
        self.count_orders()
        job = self.stack.job
        if job is not None:
            job.stop()
        for node in NODES:  # gracefully: each seals what it holds and publishes it
            self.stack.stop(node)
        self.count_samples()

    def count_orders(self) -> None:
        rows = [c for c in get_json(self.collector_url + "/api/v1/commands/log?limit=10000")
                if c.get("kind") == "checkpoint"]
        self.result.orders_issued = len(rows)
        self.result.orders_delivered = sum(1 for c in rows if c.get("acked_at"))

    def count_samples(self) -> None:
        assert self.vm is not None
        acc = account_scale([self.dir / node / "spool" for node in NODES], self.dsn, self.vm,
                            'forewarn_gpu_info{node=~"demo-node-.*"}')
        for field in dataclasses.fields(ScaleAccount):
            setattr(self.result, field.name, getattr(acc, field.name))
        self.result.problems += acc.shortfalls()


def run_scale_demo(fast: bool = False, workdir: Path | None = None, keep: bool = False,
                   say: Any = print) -> ScaleResult:
    """Run the scale-out demo; returns what happened. Everything started is stopped on
    return. Raises :class:`~forewarn.demo.servers.MissingServer` when a server is not
    installed (:func:`preflight` says so beforehand)."""
    result = run_demo(fast, workdir, keep, say, make=ScaleDemo)
    assert isinstance(result, ScaleResult)
    return result


def scale_summary_lines(r: ScaleResult) -> list[str]:
    """The demo's summary and the scale-out's figures."""
    failover = "n/a" if r.failover_s is None else f"{r.failover_s:.2f} s"
    return [
        f"collector failover        {failover} ({r.killed_replica} SIGKILLed, "
        f"{r.new_leader or 'no replica'} took the lead)",
        f"checkpoint orders         {r.orders_issued} issued, {r.orders_delivered} "
        "delivered (acknowledged over NATS)",
        f"telemetry samples         {r.samples_sent} sent, {r.samples_stored} stored in "
        f"VictoriaMetrics, {r.samples_lost} lost, {r.samples_duplicated} duplicated "
        f"({r.batches_stored}/{r.batches_sealed} batches in PostgreSQL)",
        *summary_lines(r),
    ]

