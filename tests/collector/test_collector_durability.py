"""Nothing lost: kill -9 the collector during ingest and restart it, kill -9 the agent's
uplink and restart it, cut the agent off for a while — every batch the agent produced is
stored exactly once (counted by seq), and so is every GPU sample in it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from forewarn.collector.http.auth import add_token
from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.staging import StagingLog
from forewarn.collector.storage.store import Store
from forewarn.collector.storage.telemetry import TelemetryWriter
from forewarn.spawn.commands import collector_command

from support.polling import START_TIMEOUT_S, free_port, wait_for

PRODUCER = r'''
import sys, time
from pathlib import Path
from prometheus_client import CollectorRegistry
from forewarn.agent.config import AgentConfig
from forewarn.agent.uplink import Uplink
from forewarn.wire import GpuSample

url, spool, token, target = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
cfg = AgentConfig(node="n1", collector_url=url, token=token, spool_dir=spool,
                  push_interval_s=0.05)
up = Uplink(cfg, registry=CollectorRegistry(), retry_s=0.05, poll_wait_s=1.0)
up.start()
while up.spool.next_seq < target:
    t = time.time()
    up.add(samples=[GpuSample(node="n1", gpu=g, time=t, source="sim", simulated=True,
                              temperature_c=40.0 + g) for g in range(8)])
    time.sleep(0.01)
up.stop()  # seals what is buffered, sends what it can
while len(up.spool):  # cut off at the end? keep trying until the collector took it all
    up.start()
    time.sleep(0.5)
    up.stop()
print("done", up.spool.next_seq, flush=True)
'''


@pytest.mark.timeout(240)
def test_kill_9_collector_and_agent_lose_nothing_and_store_nothing_twice(
        tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data = tmp_path / "data"
    tokens = tmp_path / "tokens.toml"
    token = add_token(tokens, "n1")
    config = tmp_path / "collector.toml"
    config.write_text(
        f'listen = "127.0.0.1:{port}"\ndata_dir = "{data}"\ntokens_file = "{tokens}"\n'
        'flush_interval_s = 0.3\nflush_samples = 400\nlog_level = "warning"\n')
    producer = tmp_path / "producer.py"
    producer.write_text(PRODUCER)
    spool = tmp_path / "spool"
    target = 160
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def start_collector() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(collector_command(config), env=env)

        def up() -> bool:
            assert proc.poll() is None, "collector exited"
            try:
                return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_for(up, START_TIMEOUT_S, "collector start")
        except BaseException:
            proc.kill()  # never leave a collector behind when its start fails
            proc.wait()
            raise
        return proc

    def start_producer() -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, str(producer), url, str(spool), token,
                                 str(target)], env=env, stdout=subprocess.PIPE)

    def stored() -> int:
        try:
            nodes = httpx.get(f"{url}/api/v1/nodes", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return 0
        return int(nodes[0]["batches"]) if nodes else 0

    kills = []
    collector = start_collector()
    agent = start_producer()
    try:
        wait_for(lambda: stored() >= 20, what="20 batches")
        collector.send_signal(signal.SIGKILL)  # kill -9 during ingest
        collector.wait()
        kills.append(("collector", stored()))
        time.sleep(1.5)  # the agent is cut off: it spools
        collector = start_collector()
        wait_for(lambda: stored() >= 60, what="60 batches")
        agent.send_signal(signal.SIGKILL)  # kill -9 the agent mid-stream
        agent.wait()
        kills.append(("agent", stored()))
        agent = start_producer()  # same spool dir: same agent_id, seq goes on
        wait_for(lambda: stored() >= 100, what="100 batches")
        collector.send_signal(signal.SIGKILL)
        collector.wait()
        kills.append(("collector", 0))
        collector = start_collector()
        out, _ = agent.communicate(timeout=150)
        assert agent.returncode == 0, out
        collector.send_signal(signal.SIGKILL)  # and once more, with Parquet flushes going on
        collector.wait()
    finally:
        for proc in (collector, agent):
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    state = json.loads((spool / "state.json").read_text())
    produced, agent_id = int(state["next_seq"]), state["agent_id"]
    assert produced >= target
    assert not list(spool.glob("*.msgpack")), "spool not empty"

    store = Store(data / "collector.db")
    try:
        # Opened as the collector opens it: staged batches may still sit in the staging log
        # (the collector was killed before its next Parquet flush).
        telemetry = TelemetryWriter(store, data / "telemetry", CollectorMetrics(),
                                    staging=StagingLog(data / "staging"))
        telemetry.recover()  # what a restart does: drop files a crash left unrecorded
        seqs = [r["seq"] for r in store.query(
            "SELECT seq FROM batches WHERE agent_id = ? ORDER BY seq", (agent_id,))]
        assert seqs == list(range(produced)), "every batch exactly once"
        per_batch = {r["seq"]: r["samples"] for r in store.query(
            "SELECT seq, samples FROM batches WHERE agent_id = ?", (agent_id,))}
        history = telemetry.read()
        assert not history.duplicated(["agent_id", "seq", "gpu", "time"]).any()
        counts = history.groupby("seq").size().to_dict()
        assert {s: n for s, n in per_batch.items() if n} == counts
        assert len(history) == sum(per_batch.values()) > 0
        files = store.scalar("SELECT COUNT(*) FROM telemetry_files")
        assert files >= 1, "some samples went through Parquet"
    finally:
        store.close()
    print("kills at stored batches:", kills, "produced", produced)
