"""A real ``forewarn agent --source sim`` subprocess on a Unix socket, for end-to-end tests
of training ranks (tests/e2e/test_training_e2e.py, tests/hook/test_preemption.py): the
agent of :mod:`support.stack` (its command line: :mod:`forewarn.spawn.commands`) as one
object with its metrics and findings, its settings as ``FOREWARN_AGENT_*`` variables."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from pathlib import Path
from typing import Any

from forewarn.chaos.exposition import total
from forewarn.spawn.commands import agent_command
from forewarn.spawn.procs import Procs

from support.polling import START_TIMEOUT_S, free_port, wait_for

__all__ = ["AgentProc"]

QUIET_SCENARIO = 'name = "quiet"\ngpus = 2\nseed = 1\n'


class AgentProc:
    """A real ``forewarn agent --source sim`` subprocess."""

    def __init__(self, workdir: Path, sock: Path, name: str, node: str = "e2e", **env: str
                 ) -> None:
        self.port = free_port()
        scenario = workdir / "quiet.toml"
        scenario.write_text(QUIET_SCENARIO)
        config = workdir / "none.toml"
        config.touch()
        self.log = workdir / f"agent-{name}.log"
        full_env = {**os.environ, **{f"FOREWARN_AGENT_{k.upper()}": v for k, v in env.items()}}
        self.group = Procs()
        self.proc = self.group.spawn(
            "agent", agent_command(node, scenario=scenario, socket=sock,
                                   listen=f"127.0.0.1:{self.port}", interval=0.2, config=config),
            self.log, full_env)
        try:
            wait_for(self._ready, START_TIMEOUT_S, f"agent {name} to serve (see {self.log})")
            wait_for(sock.exists, START_TIMEOUT_S, "the agent socket")
        except BaseException:
            self.group.kill9("agent")  # never leave an agent behind when its start fails
            raise

    def _get(self, path: str) -> bytes | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return bytes(r.read())
        except OSError:
            assert self.proc.poll() is None, f"agent died: {self.log.read_text()[-3000:]}"
            return None

    def _ready(self) -> bool:
        return self._get("/healthz") is not None

    def metric(self, name: str, **labels: str) -> float | None:
        """The sum of the samples ``name`` carrying ``labels`` (None: none, or no answer)."""
        body = self._get("/metrics")
        return None if body is None else total(body.decode(), name, **labels)

    def findings(self) -> list[dict[str, Any]]:
        body = self._get("/api/v1/findings")
        return [] if body is None else list(json.loads(body))

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """SIGTERM (SIGKILL after 30 s) or, given ``signal.SIGKILL``, kill -9."""
        if sig == signal.SIGKILL:
            self.group.kill9("agent")
        else:
            self.group.stop("agent")
