"""The series store under a replica's SIGKILL (issue 16): two real collector replicas
(``forewarn collector run``) on NATS JetStream, PostgreSQL and VictoriaMetrics, two agents
publishing. VictoriaMetrics stalls (SIGSTOP), so each replica holds samples it stored in
PostgreSQL but has not written to the series store; one replica is SIGKILLed holding them.
Once the store resumes, every sample the agents sent is in it, once."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from forewarn.chaos.procs import scrape, wait_http
from forewarn.chaos.scale_account import account_scale
from forewarn.demo.servers import PostgresServer

from support.bus_stack import COLLECTOR_PASSWORD, TOKENS, FedAgent, auth_block
from support.nats_server import start_server
from support.polling import free_port, wait_for
from support.victoria import VictoriaMetrics


class Replica:
    """One ``forewarn collector run`` process of the scale-out mode."""

    def __init__(self, tmp: Path, name: str, *, dsn: str, nats_url: str, write_url: str
                 ) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        secret = tmp / "nats-password"
        secret.write_text(COLLECTOR_PASSWORD)
        secret.chmod(0o600)
        (tmp / "tokens.toml").touch()
        data = tmp / name
        data.mkdir()
        config = tmp / f"{name}.toml"
        config.write_text(
            f'listen = "{self.url.removeprefix("http://")}"\ndata_dir = "{data}"\n'
            f'tokens_file = "{tmp / "tokens.toml"}"\nlog_level = "warning"\n'
            f'state = "postgresql"\npostgres_dsn = "{dsn}"\n'
            f'bus_url = "{nats_url}"\nbus_password_file = "{secret}"\nbus_ack_wait_s = 2.0\n'
            f'remote_write_url = "{write_url}"\n')
        self.log = tmp / f"{name}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "forewarn", "collector", "--config", str(config), "run"],
                stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        wait_http(self.url + "/healthz", 90, self.proc, self.log)

    def queued(self) -> float:
        """GPU samples waiting for the series store."""
        return scrape(self.url + "/metrics",
                      "forewarn_collector_remote_write_queued_samples") or 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def batches(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT COUNT(*) FROM batches").fetchone()
    return int(row[0]) if row else 0


@pytest.mark.timeout(240)
def test_samples_a_killed_replica_held_for_a_stalled_series_store_arrive_once(
        tmp_path: Path, postgres_server: PostgresServer) -> None:
    dsn = postgres_server.database()
    vm = VictoriaMetrics(root=tmp_path / "vm")
    server = start_server(tmp_path / "nats", authorization=auth_block())
    replicas = [Replica(tmp_path, name, dsn=dsn, nats_url=server.url, write_url=vm.write_url)
                for name in ("r1", "r2")]
    agents: list[FedAgent] = []
    stopped = False
    try:
        for r in replicas:
            r.wait_ready()
        agents = [FedAgent(tmp_path, server.url, node).start() for node in TOKENS]
        wait_for(lambda: vm.export('forewarn_gpu_info{node=~"gpu.*"}'), 30,
                 "samples in the series store")
        vm.proc.send_signal(signal.SIGSTOP)
        stopped = True
        at_stall = batches(dsn)
        # Ingest goes on into PostgreSQL while the series store stalls; the victim holds
        # samples it has not written.
        wait_for(lambda: batches(dsn) >= at_stall + 20 and replicas[0].queued() > 0, 60,
                 "batches stored while the series store stalls, r1 holding samples")
        replicas[0].proc.kill()
        replicas[0].proc.wait(10)
        vm.proc.send_signal(signal.SIGCONT)
        stopped = False
        for a in agents:
            a.drain()
        acc = account_scale([a.uplink.spool.root for a in agents], dsn, vm,
                            'forewarn_gpu_info{node=~"gpu.*"}', wait_s=60)
        assert acc.batches_sealed == acc.batches_stored > 0, acc
        assert acc.samples_sent == sum(a.sent for a in agents), acc
        assert acc.samples_stored == acc.samples_sent, acc.shortfalls()
        assert acc.samples_duplicated == 0, acc.shortfalls()
        # r2 got the batches r1 held and sent their samples again
        assert (scrape(replicas[1].url + "/metrics",
                       "forewarn_collector_remote_write_resent_samples_total") or 0) > 0
    finally:
        if stopped:
            vm.proc.send_signal(signal.SIGCONT)
        for a in agents:
            a.stop()
        for r in replicas:
            r.stop()
        server.stop()
        vm.stop()
