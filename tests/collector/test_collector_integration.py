"""A real ``forewarn agent --source sim`` process feeding a real collector; TLS end to end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from forewarn.agent.config import AgentConfig
from forewarn.agent.uplink import Uplink
from forewarn.collector.cli import ServerThread
from forewarn.collector.config import CollectorConfig
from forewarn.collector.http.app import create_app
from forewarn.collector.http.auth import TokenRegistry
from forewarn.collector.storage.store import Store
from forewarn.spawn.commands import agent_command
from forewarn.wire import CheckpointOrder, GpuSample

from support.polling import wait_for

TOKEN = "sim-node-token-0123456789"


@pytest.mark.timeout(180)
def test_sim_agent_process_reports_to_the_collector_and_acks_orders(tmp_path: Path) -> None:
    cfg = CollectorConfig(listen="127.0.0.1:0", data_dir=tmp_path / "c",
                          tokens_file=tmp_path / "none.toml")
    store = Store(cfg.db_path)
    app = create_app(cfg, store, tokens=TokenRegistry(tokens={"simnode": TOKEN}))
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with ServerThread(app, cfg) as server:
        env = {**os.environ, "FOREWARN_AGENT_SPOOL_DIR": str(tmp_path / "spool"),
               "FOREWARN_AGENT_PUSH_INTERVAL_S": "0.5", "FOREWARN_AGENT_WATCHDOG": "false"}
        env.pop("NOTIFY_SOCKET", None)
        agent = subprocess.Popen(
            agent_command("simnode", socket=tmp_path / "agent.sock", interval=0.2,
                          config=Path("/dev/null"), collector=server.url,
                          token_file=token_file, extra=("--sim-gpus", "4")),
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: (store.scalar("SELECT COUNT(*) FROM gpus") or 0) >= 4
                     or agent.poll() is not None, what="4 simulated GPUs at the collector")
            assert agent.poll() is None, agent.stdout.read().decode()  # type: ignore[union-attr]
            gpus = store.query("SELECT node, gpu, simulated, source FROM gpus ORDER BY gpu")
            # The embedded scenario sets its own GPU count; every one is marked simulated.
            assert [(g["node"], g["gpu"], g["simulated"]) for g in gpus] == [
                ("simnode", i, 1) for i in range(len(gpus))]
            order = CheckpointOrder(request_id="req-sim", job="nojob", step=10,
                                    issued=time.time())
            app.state.ctx.commands.order_checkpoint(["simnode"], order)
            wait_for(lambda: store.scalar("SELECT acked_at FROM commands") is not None,
                     what="the agent's ack")
            row = store.query("SELECT ok, detail FROM commands")[0]
            assert row["ok"] == 1 and "no live rank of job 'nojob'" in row["detail"]
        finally:
            agent.terminate()
            out = agent.communicate(timeout=60)[0].decode()
        assert agent.returncode == 0, out
        # SIGTERM: the uplink sealed and sent what it had; the spool is empty.
        assert not list((tmp_path / "spool").glob("*.msgpack"))
        produced = json.loads((tmp_path / "spool" / "state.json").read_text())["next_seq"]
        seqs = [r["seq"] for r in store.query("SELECT seq FROM batches ORDER BY seq")]
        assert seqs == list(range(produced)) and produced >= 1
    store.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_when_a_certificate_is_configured(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    cfg = CollectorConfig(listen="127.0.0.1:0", data_dir=tmp_path / "c", certfile=cert,
                          keyfile=key, tokens_file=tmp_path / "none.toml")
    store = Store(cfg.db_path)
    app = create_app(cfg, store, tokens=TokenRegistry(tokens={"a": TOKEN}))
    with ServerThread(app, cfg) as server:
        assert server.url.startswith("https://")
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
            httpx.get(server.url.replace("https://", "http://") + "/healthz", timeout=5)
        with pytest.raises(httpx.ConnectError):  # an unknown CA is refused by the client
            httpx.get(server.url + "/healthz", timeout=5)
        reg = CollectorRegistry()
        up = Uplink(AgentConfig(node="a", collector_url=server.url, token=TOKEN,
                                collector_ca_file=cert, spool_dir=tmp_path / "spool",
                                push_interval_s=0.2), registry=reg, poll_wait_s=1.0)
        up.start()
        try:
            up.add(samples=[GpuSample(node="a", gpu=0, time=time.time(), source="sim")],
                   urgent=True)
            wait_for(lambda: store.scalar("SELECT COUNT(*) FROM batches") >= 1,
                     what="a batch over TLS")
        finally:
            up.stop()
        assert reg.get_sample_value("forewarn_uplink_push_errors_total") == 0
    store.close()


@pytest.mark.timeout(120)
def test_stopping_answers_open_long_polls_instead_of_waiting_them_out(tmp_path: Path) -> None:
    cfg = CollectorConfig(listen="127.0.0.1:0", data_dir=tmp_path / "c",
                          tokens_file=tmp_path / "none.toml", long_poll_max_s=300.0)
    store = Store(cfg.db_path)
    app = create_app(cfg, store, tokens=TokenRegistry(tokens={"a": TOKEN}))
    server = ServerThread(app, cfg).start()
    answers: list[httpx.Response | BaseException] = []

    def long_poll() -> None:
        try:
            answers.append(httpx.get(server.url + "/api/v1/commands",
                                     params={"wait": 300},
                                     headers={"Authorization": f"Bearer {TOKEN}"},
                                     timeout=300))
        except BaseException as exc:
            answers.append(exc)

    poller = threading.Thread(target=long_poll)
    poller.start()
    registry = app.state.ctx.metrics.registry
    wait_for(lambda: (registry.get_sample_value("forewarn_collector_long_polls") or 0) >= 1,
             what="the long poll open at the collector")
    server.stop(timeout=60)
    poller.join(timeout=60)
    store.close()
    # The server stopped well inside the poll's 300 s, and the poll got its (empty) answer.
    assert not server._thread.is_alive()
    assert len(answers) == 1 and isinstance(answers[0], httpx.Response), answers
    assert answers[0].status_code == 200 and answers[0].json() == []
