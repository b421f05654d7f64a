"""Liveness (/healthz) against readiness (/readyz) for agent and collector, and
``forewarn status``: real agent processes, a real collector on loopback, the real CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from forewarn.collector.cli import ServerThread
from forewarn.collector.config import CollectorConfig
from forewarn.collector.http.app import create_app
from forewarn.collector.http.auth import TokenRegistry
from forewarn.collector.storage.store import Store
from forewarn.spawn.commands import agent_command
from forewarn.wire import AgentBatch, GpuSample, encode

from support.polling import START_TIMEOUT_S, free_port, poll
from support.stack import Processes


def status(url: str) -> tuple[int, str]:
    """``forewarn status URL``: exit status and output."""
    r = subprocess.run([sys.executable, "-m", "forewarn", "status", url], capture_output=True,
                       text=True, timeout=60)
    return r.returncode, r.stdout + r.stderr


def get(url: str) -> tuple[int, Any]:
    try:
        r = httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return 0, None
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


def start_agent(tmp_path: Path, *args: str, env: dict[str, str] | None = None
                ) -> tuple[str, Processes]:
    """``forewarn agent`` of node r1 with ``args`` (its source among them); its URL once
    ``/healthz`` answers, and its process (:meth:`Processes.close` stops it)."""
    address = f"127.0.0.1:{free_port()}"
    procs = Processes(tmp_path)
    procs.spawn("agent", agent_command("r1", source=None, listen=address, interval=0.25,
                                       extra=args),
                env={"FOREWARN_AGENT_WATCHDOG": "0",
                     "FOREWARN_AGENT_SPOOL_DIR": str(tmp_path / "spool"), **(env or {})})
    url = f"http://{address}"
    procs.wait_for("agent /healthz", lambda: get(url + "/healthz")[0] == 200, START_TIMEOUT_S)
    return url, procs


@pytest.mark.timeout(300)
def test_agent_is_alive_but_not_ready_without_rank_socket_source_or_collector(
        tmp_path: Path) -> None:
    taken = tmp_path / "not-a-socket"
    taken.write_text("a file where the rank socket should be")
    token = tmp_path / "token"
    token.write_text("some-token-0123456789\n")
    closed = f"http://127.0.0.1:{free_port()}"
    url, agent = start_agent(
        tmp_path, "--source", "dcgm", "--dcgm-url", f"{closed}/metrics",
        "--socket", str(taken), "--collector", closed, "--token-file", str(token),
        env={"FOREWARN_AGENT_PUSH_INTERVAL_S": "0.3"})
    try:
        # liveness: the loop runs, so systemd must not restart it ...
        assert get(url + "/healthz")[0] == 200
        # ... but it is not ready, and says why, per component
        def uplink_spooled() -> Any:
            code, body = get(url + "/readyz")
            ok = isinstance(body, dict) and body["components"]["uplink"]["spool_batches"] > 0
            return (code, body) if ok else None

        code, body = poll(uplink_spooled, 30, 0.2) or get(url + "/readyz")
        assert code == 503, body
        parts = body["components"]
        assert body["ready"] is False
        assert parts["rank_socket"]["ready"] is False
        assert "not a socket" in parts["rank_socket"]["detail"]
        assert parts["source"]["ready"] is False and "dcgm" in parts["source"]["detail"]
        assert parts["uplink"]["ready"] is False and parts["uplink"]["spool_batches"] > 0
        assert "checks" in parts
        rc, out = status(url)
        assert rc == 1, out
        assert "NOT READY" in out and "rank_socket" in out and "not a socket" in out
    finally:
        agent.close()


@pytest.mark.timeout(300)
def test_agent_ready_when_source_socket_and_checks_work(tmp_path: Path) -> None:
    url, agent = start_agent(tmp_path, "--source", "sim", "--socket",
                            str(tmp_path / "agent.sock"))
    try:
        code, body = poll(lambda: (r := get(url + "/readyz"))[0] == 200 and r, 30, 0.2) or \
            get(url + "/readyz")
        assert code == 200, body
        parts = body["components"]
        assert parts["source"]["ready"] and parts["rank_socket"]["ready"]
        assert parts["checks"]["ready"]
        assert "uplink" not in parts  # standalone: no collector configured
        rc, out = status(url)
        assert rc == 0 and "READY" in out and "rank_socket" in out, out
        r = subprocess.run([sys.executable, "-m", "forewarn", "status", "--json", url],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and json.loads(r.stdout)["ready"] is True, r.stdout
    finally:
        agent.close()


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[tuple[ServerThread, CollectorConfig]]:
    cfg = CollectorConfig(listen="127.0.0.1:0", data_dir=tmp_path / "data",
                          tokens_file=tmp_path / "none.toml", flush_interval_s=0.2,
                          flush_samples=1)
    store = Store(cfg.db_path)
    app = create_app(cfg, store, tokens=TokenRegistry(tokens={"n1": "token-n1-0123456789"}))
    server = ServerThread(app, cfg).start()
    try:
        yield server, cfg
    finally:
        server.stop()
        store.close()


def push_sample(url: str, seq: int) -> None:
    sample = GpuSample(node="n1", gpu=0, time=time.time(), source="test", temperature_c=40.0)
    batch = AgentBatch(node="n1", agent_id="a1", seq=seq, created=time.time(),
                       samples=[sample])
    r = httpx.post(url + "/api/v1/ingest", content=encode(batch), timeout=10, headers={
        "content-type": "application/msgpack", "authorization": "Bearer token-n1-0123456789"})
    assert r.status_code == 200, r.text


@pytest.mark.timeout(300)
def test_collector_not_ready_when_flush_fails_or_storage_is_gone(
        collector: tuple[ServerThread, CollectorConfig]) -> None:
    server, cfg = collector
    url = server.url
    push_sample(url, 0)
    code, body = poll(lambda: (r := get(url + "/readyz"))[0] == 200 and r, 30, 0.1) or \
        get(url + "/readyz")
    assert code == 200, body
    parts = body["components"]
    assert {"storage", "ingest", "telemetry_flush"} <= set(parts)
    assert all(p["ready"] for p in parts.values()), parts
    assert status(url)[0] == 0

    # Parquet cannot be written any more: the last flush failed -> not ready
    shutil.rmtree(cfg.telemetry_dir)
    cfg.telemetry_dir.write_text("not a directory")
    push_sample(url, 1)
    code, body = poll(lambda: (r := get(url + "/readyz"))[0] == 503 and r, 30, 0.1) or \
        get(url + "/readyz")
    assert code == 503, body
    flush = body["components"]["telemetry_flush"]
    assert flush["ready"] is False and flush["detail"], flush
    assert get(url + "/healthz")[0] == 200  # alive all the same
    rc, out = status(url)
    assert rc == 1 and "telemetry_flush" in out, out

    # the data directory is gone (a file in its place): storage is not writable
    cfg.data_dir.rename(cfg.data_dir.with_name("moved"))
    cfg.data_dir.write_text("not a directory")
    code, body = get(url + "/readyz")
    assert code == 503 and body["components"]["storage"]["ready"] is False, body


def test_status_of_an_unreachable_service_exits_2() -> None:
    rc, out = status(f"http://127.0.0.1:{free_port()}")
    assert rc == 2 and "unreachable" in out, out
