"""Collector replicas as real ``forewarn collector`` processes sharing one PostgreSQL
database (the scale-out state), with an agent-like client per replica."""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from forewarn.chaos.exposition import sample
from forewarn.spawn.commands import collector_command, write_config
from forewarn.spawn.procs import Procs
from forewarn.wire import AgentBatch, encode

from support.collector import TOKENS, poll_commands
from support.polling import START_TIMEOUT_S, free_port, wait_for

__all__ = ["Replica", "write_tokens"]


def write_tokens(path: Path) -> Path:
    """The tokens file enrolling :data:`~support.collector.TOKENS`' nodes."""
    path.write_text("".join(f'{node} = "sha256:{hashlib.sha256(t.encode()).hexdigest()}"\n'
                            for node, t in TOKENS.items()))
    return path


class Replica:
    """One collector process on ``dsn``; :meth:`push` sends a batch as an agent would."""

    def __init__(self, root: Path, name: str, dsn: str, tokens: Path, **keys: Any) -> None:
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dsn = dsn
        settings = {"listen": f"127.0.0.1:{self.port}", "data_dir": str(self.dir / "data"),
                    "tokens_file": str(tokens), "state": "postgresql", "postgres_dsn": dsn,
                    "log_level": "warning", "advise_hooks": False, "predictor_enabled": False,
                    **keys}
        self.config = self.dir / "collector.toml"
        write_config(self.config, **settings)
        self.group = Procs()
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = httpx.Client(base_url=self.url, timeout=30)
        self.seq: dict[str, int] = {}

    def start(self) -> Replica:
        self.proc = self.group.spawn("collector", collector_command(self.config),
                                     self.dir / "log", {**os.environ, "PYTHONUNBUFFERED": "1"})
        wait_for(self._up, START_TIMEOUT_S, f"collector {self.url} start")
        return self

    def _up(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, \
            f"collector exited: {(self.dir / 'log').read_text()[-2000:]}"
        try:
            return self.client.get("/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def role(self) -> str:
        """``leader`` or ``follower`` (from /readyz), ``down`` when it does not answer
        within the client's 30 s (on a loaded machine a live replica can take seconds)."""
        try:
            report = self.client.get("/readyz").json()
        except (httpx.HTTPError, ValueError):
            return "down"
        return str(report["components"]["leader"]["role"])

    def ready(self) -> bool:
        """Whether /readyz answers ready."""
        try:
            return self.client.get("/readyz", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def metric(self, name: str, **labels: str) -> float:
        """The sample of /metrics with exactly these labels (0 when absent)."""
        return sample(self.client.get("/metrics").text, name, **labels) or 0.0

    def push(self, node: str, **kw: Any) -> httpx.Response:
        seq = self.seq.get(node, 0)
        self.seq[node] = seq + 1
        b = AgentBatch(node=node, agent_id=f"agent-{node}", seq=seq, created=time.time(), **kw)
        return self.client.post("/api/v1/ingest", content=encode(b), headers={
            "content-type": "application/msgpack", "authorization": f"Bearer {TOKENS[node]}"})

    def commands(self, node: str, wait: float = 0.0) -> list[dict[str, Any]]:
        return poll_commands(self.client, node, wait)

    def kill(self) -> None:
        """SIGKILL: no shutdown, the process's sessions just end."""
        if self.proc is not None and self.proc.poll() is None:
            self.group.kill9("collector")

    def stop(self) -> None:
        if self.proc is not None:
            self.group.stop("collector")
        self.client.close()
