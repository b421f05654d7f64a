"""Daemon logs as an operator reads them: the uplink's routine requests at DEBUG, no
second timestamp under systemd's journal, and ``--log-format json`` for agent and collector.
Real agent and collector processes; the journal is recognised as systemd marks it, by
``JOURNAL_STREAM`` naming the device and inode of the process's standard error."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from forewarn.collector.cli import ServerThread
from forewarn.collector.config import CollectorConfig
from forewarn.collector.http.app import create_app
from forewarn.collector.http.auth import TokenRegistry
from forewarn.collector.storage.store import Store

from support.polling import START_TIMEOUT_S, free_port, wait_for

TOKEN = "log-test-token-0123456789abcdef"
TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FOREWARN_") and k not in ("NOTIFY_SOCKET", "JOURNAL_STREAM")}
    return {**env, **extra}


def run_until(tmp_path: Path, argv: list[str], ready_url: str, env: dict[str, str],
              until: object = None, name: str = "daemon") -> str:
    """Run ``argv`` with standard error to a file until ``ready_url`` answers (and
    ``until()`` holds), then SIGTERM it; its standard error."""
    err = tmp_path / f"{name}.err"
    with err.open("wb") as f:
        if "JOURNAL_STREAM" in env and env["JOURNAL_STREAM"] == "this-file":
            st = os.fstat(f.fileno())
            env = {**env, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        proc = subprocess.Popen([sys.executable, "-m", "forewarn", *argv], env=env,
                                stdout=subprocess.DEVNULL, stderr=f)
    try:
        def ready() -> bool:
            assert proc.poll() is None, err.read_text()
            try:
                ok = httpx.get(ready_url, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
            return ok and (until is None or bool(until()))  # type: ignore[operator]

        wait_for(ready, START_TIMEOUT_S, f"{name} at {ready_url}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return err.read_text()


def agent_argv(tmp_path: Path, port: int, *extra: str) -> list[str]:
    return ["agent", "--config", "/dev/null", "--source", "sim", "--sim-gpus", "2",
            "--interval", "0.2", "--listen", f"127.0.0.1:{port}", "--no-kmsg",
            "--no-watchdog", "--socket", str(tmp_path / "agent.sock"), "--spool-dir",
            str(tmp_path / "spool"), "--node", "lognode", *extra]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("level", ["info", "debug"])
def test_uplink_requests_are_logged_at_debug_only(tmp_path: Path, level: str) -> None:
    """Each batch the uplink posts used to be an INFO line ("HTTP Request: POST ...")."""
    cfg = CollectorConfig(listen="127.0.0.1:0", data_dir=tmp_path / "c",
                          tokens_file=tmp_path / "none.toml")
    store = Store(cfg.db_path)
    app = create_app(cfg, store, tokens=TokenRegistry(tokens={"lognode": TOKEN}))
    (tmp_path / "token").write_text(TOKEN + "\n")
    port = free_port()
    with ServerThread(app, cfg) as server:
        err = run_until(
            tmp_path, agent_argv(tmp_path, port, "--collector", server.url, "--token-file",
                                 str(tmp_path / "token"), "--push-interval-s", "0.2",
                                 "--log-level", level),
            f"http://127.0.0.1:{port}/healthz", clean_env(),
            until=lambda: (store.scalar("SELECT COUNT(*) FROM batches") or 0) >= 3,
            name="agent")
    store.close()
    requests = [line for line in err.splitlines() if "HTTP Request" in line]
    if level == "info":
        assert not requests, err
    else:
        assert requests and all(" DEBUG httpx: " in line for line in requests), err


def test_under_the_journal_lines_have_a_priority_and_no_time(tmp_path: Path) -> None:
    port = free_port()
    err = run_until(tmp_path, agent_argv(tmp_path, port), f"http://127.0.0.1:{port}/healthz",
                    clean_env(JOURNAL_STREAM="this-file"), name="agent")
    lines = err.splitlines()
    assert any("SIGTERM: stopping" in line for line in lines), err
    for line in lines:
        assert re.match(r"<[0-7]>(DEBUG|INFO|WARNING|ERROR|CRITICAL) ", line), line
        assert not TIMESTAMP.search(line), f"the journal stamps lines itself: {line}"
    # A JOURNAL_STREAM inherited by a process whose output went elsewhere: keep the time.
    err = run_until(tmp_path, agent_argv(tmp_path, port), f"http://127.0.0.1:{port}/healthz",
                    clean_env(JOURNAL_STREAM="1:2"), name="agent")
    stopping = [line for line in err.splitlines() if "SIGTERM: stopping" in line]
    assert stopping and TIMESTAMP.match(stopping[0]), err


def assert_json_lines(err: str) -> list[dict[str, str]]:
    entries = []
    for line in err.splitlines():
        entry = json.loads(line)  # every line, uvicorn's included, is one JSON object
        assert {"ts", "level", "logger", "message"} <= entry.keys(), line
        entries.append(entry)
    return entries


def test_log_format_json_for_agent_and_collector(tmp_path: Path) -> None:
    port = free_port()
    entries = assert_json_lines(run_until(
        tmp_path, agent_argv(tmp_path, port), f"http://127.0.0.1:{port}/healthz",
        clean_env(FOREWARN_AGENT_LOG_FORMAT="json"), name="agent"))
    assert any(e["message"] == "SIGTERM: stopping" and e["level"] == "info" for e in entries)
    port = free_port()
    entries = assert_json_lines(run_until(
        tmp_path, ["collector", "run", "--data-dir", str(tmp_path / "data"), "--tokens-file",
                   str(tmp_path / "tokens.toml"), "--listen", f"127.0.0.1:{port}",
                   "--no-predictor-enabled", "--log-format", "json"],
        f"http://127.0.0.1:{port}/healthz", clean_env(), name="collector"))
    assert any(e["logger"].startswith("uvicorn") for e in entries), entries
