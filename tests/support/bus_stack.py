"""A bus stack for failover tests: collector replica processes sharing one store, and
agents (the real NATS uplink) fed at a steady rate, with what each sent and what the
store holds."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from forewarn import bus
from forewarn.agent.bus import NatsUplink
from forewarn.agent.config import AgentConfig
from forewarn.agent.uplink import Uplink
from forewarn.collector.http.auth import hash_token
from forewarn.collector.storage.store import Store
from forewarn.spawn.procs import stop_process
from forewarn.wire import GpuSample

from support.metrics import value
from support.polling import wait_for

__all__ = ["COLLECTOR_PASSWORD", "TOKENS", "FedAgent", "ReplicaProc", "auth_block",
           "send_one_batch", "stored"]

TOKENS = {"gpu.a": "token-a-0123456789", "gpu_b": "token-b-0123456789"}
COLLECTOR_PASSWORD = "collector-password-0123456789"
REPLICA = Path(__file__).with_name("bus_replica.py")


def auth_block() -> str:
    """The nats-server authorization for :data:`TOKENS` and the collector."""
    return bus.authorization({n: hash_token(t) for n, t in TOKENS.items()},
                             COLLECTOR_PASSWORD)


def send_one_batch(url: str, node: str, spool: Path, stored: Callable[[], object]) -> None:
    """One batch (one GPU sample) from ``node``'s real NATS uplink; returns once
    ``stored()`` is true, with the uplink stopped: the node says nothing more."""
    up = NatsUplink(AgentConfig(node=node, uplink="nats", nats_url=url, token=TOKENS[node],
                                spool_dir=spool, push_interval_s=0.2),
                    registry=CollectorRegistry(), retry_s=0.05, publish_timeout_s=2.0,
                    fetch_wait_s=0.5)
    up.start()
    try:
        up.add(samples=[GpuSample(node=node, gpu=0, time=time.time(), source="sim",
                                  simulated=True, temperature_c=50.0)])
        wait_for(stored, 30, f"{node}'s batch stored")
    finally:
        up.stop()


class ReplicaProc:
    """``tests/support/bus_replica.py`` as a process (see there)."""

    def __init__(self, db: Path, url: str, name: str, ack_wait_s: float = 2.0,
                 stream_replicas: int = 1) -> None:
        self.log = db.parent / f"replica-{name}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-P", str(REPLICA), str(db), url, COLLECTOR_PASSWORD, str(ack_wait_s),
             str(stream_replicas)],
            stdout=subprocess.PIPE, stderr=self.log.open("w"))
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == b"ready", f"replica {name}: {self.log.read_text()[-3000:]}"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        stop_process(self.proc, timeout=20, group=False)


class FedAgent:
    """A node's uplink (NATS at ``url``; with ``uplink="http"``, HTTP to the collector at
    ``url``) with a thread adding ``gpus`` samples every ``every_s``."""

    def __init__(self, tmp: Path, url: str, node: str, *, gpus: int = 4,
                 every_s: float = 0.05, uplink: str = "nats", **kw: Any) -> None:
        http = uplink == "http"
        cfg = AgentConfig(node=node, uplink=uplink, token=TOKENS[node],
                          spool_dir=tmp / f"spool-{bus.node_token(node)}",
                          push_interval_s=0.1, collector_url=url if http else "",
                          nats_url="" if http else url, **kw)
        self.node = node
        self.gpus = gpus
        self.every_s = every_s
        self.sent = 0
        self.registry = CollectorRegistry()
        self.uplink: Uplink = Uplink(cfg, registry=self.registry, retry_s=0.1) \
            if http else NatsUplink(cfg, registry=self.registry, retry_s=0.1,
                                                publish_timeout_s=2.0, fetch_wait_s=0.5)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._feed, daemon=True)

    def start(self) -> FedAgent:
        self.uplink.start()
        self._thread.start()
        return self

    def _feed(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            self.uplink.add(samples=[GpuSample(node=self.node, gpu=g, time=now, source="sim",
                                               simulated=True, temperature_c=50.0)
                                     for g in range(self.gpus)])
            self.sent += self.gpus
            self._stop.wait(self.every_s)

    def stop_feeding(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def drain(self, timeout: float = 60.0) -> None:
        """Stop feeding, wait until the spool is empty, then stop the uplink (it seals and
        sends what is left; the push thread seals an empty batch every push interval, so
        only a stopped uplink has a final ``next_seq``)."""
        self.stop_feeding()
        wait_for(lambda: not self.uplink._samples and len(self.uplink.spool) == 0, timeout,
                 f"{self.node}'s spool to empty ({self.uplink.readiness()['detail']})")
        self.uplink.stop()
        assert len(self.uplink.spool) == 0, self.uplink.readiness()

    def stop(self) -> None:
        self.stop_feeding()
        self.uplink.stop()

    def metric(self, name: str) -> float:
        return value(self.registry, name)


def stored(db: Path, node: str) -> dict[str, Any]:
    """What the shared store holds of ``node``: its batch seqs, and samples counted in the
    batches and in the staged rows (a duplicate would add a staged row)."""
    store = Store(db)
    try:
        seqs = [r["seq"] for r in store.query(
            "SELECT seq FROM batches WHERE node = ? ORDER BY seq", (node,))]
        samples = store.scalar("SELECT COALESCE(SUM(samples), 0) FROM batches WHERE node = ?",
                               (node,))
        staged = store.scalar(
            "SELECT COALESCE(SUM(s.samples), 0) FROM staged_samples s JOIN batches b"
            " ON b.agent_id = s.agent_id AND b.seq = s.seq WHERE b.node = ?", (node,))
        rows = store.scalar("SELECT COUNT(*) FROM staged_samples s JOIN batches b"
                            " ON b.agent_id = s.agent_id AND b.seq = s.seq WHERE b.node = ?",
                            (node,))
    finally:
        store.close()
    return {"seqs": seqs, "samples": int(samples), "staged": int(staged),
            "staged_rows": int(rows)}
