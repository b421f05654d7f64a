"""The series store under a replica's SIGKILL (issue 16): two real collector replicas
(``forewarn collector run``) on NATS JetStream, PostgreSQL and VictoriaMetrics, two agents
publishing. VictoriaMetrics stalls (SIGSTOP), so each replica holds samples it stored in
PostgreSQL but has not written to the series store; one replica is SIGKILLed holding them.
Once the store resumes, every sample the agents sent is in it, once."""

from __future__ import annotations

import signal
from pathlib import Path

import psycopg
import pytest

from forewarn.demo.scale_account import account_scale
from forewarn.demo.servers import PostgresServer, VictoriaMetrics

from support.bus_stack import COLLECTOR_PASSWORD, TOKENS, FedAgent, auth_block
from support.nats_server import start_server
from support.polling import wait_for
from support.replicas import Replica

QUEUED = "forewarn_collector_remote_write_queued_samples"
"""GPU samples a replica holds for the series store."""


def replica(tmp: Path, name: str, dsn: str, nats_url: str, write_url: str) -> Replica:
    """One ``forewarn collector`` process of the scale-out mode, its agents on NATS."""
    secret = tmp / "nats-password"
    secret.write_text(COLLECTOR_PASSWORD)
    secret.chmod(0o600)
    tokens = tmp / "tokens.toml"
    tokens.touch()
    return Replica(tmp, name, dsn, tokens, bus_url=nats_url, bus_password_file=str(secret),
                   bus_ack_wait_s=2.0, remote_write_url=write_url)


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
    replicas = [replica(tmp_path, name, dsn, server.url, vm.write_url) for name in ("r1", "r2")]
    agents: list[FedAgent] = []
    stopped = False
    try:
        for r in replicas:
            r.start()
        agents = [FedAgent(tmp_path, server.url, node).start() for node in TOKENS]
        wait_for(lambda: vm.export('forewarn_gpu_info{node=~"gpu.*"}'), 30,
                 "samples in the series store")
        vm.proc.send_signal(signal.SIGSTOP)
        stopped = True
        at_stall = batches(dsn)
        # Ingest goes on into PostgreSQL while the series store stalls; the victim holds
        # samples it has not written.
        wait_for(lambda: batches(dsn) >= at_stall + 20 and replicas[0].metric(QUEUED) > 0, 60,
                 "batches stored while the series store stalls, r1 holding samples")
        replicas[0].kill()
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
        assert replicas[1].metric("forewarn_collector_remote_write_resent_samples_total") > 0
    finally:
        if stopped:
            vm.proc.send_signal(signal.SIGCONT)
        for a in agents:
            a.stop()
        for r in replicas:
            r.stop()
        server.stop()
        vm.stop()
