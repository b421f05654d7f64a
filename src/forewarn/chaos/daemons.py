"""The chaos lab's daemons: one ``forewarn collector run`` or one ``forewarn agent --source
sim`` process each, with its config, tokens, spool and the probes scenarios read
(metrics, findings, spool state). The rigs (:mod:`forewarn.chaos.lab`) are built of them."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forewarn.chaos.exposition import scrape
from forewarn.demo.launch import free_port
from forewarn.spawn.commands import agent_command, collector_command
from forewarn.spawn.procs import get_json

if TYPE_CHECKING:
    from forewarn.chaos.lab import Lab

__all__ = ["LabAgent", "LabCollector"]


class _Daemon:
    """A process of the lab's :class:`~forewarn.spawn.procs.Procs` named ``name``, with a
    folder of its own and an HTTP port on loopback (``/healthz``, ``/metrics``)."""

    def __init__(self, lab: Lab, name: str) -> None:
        self.lab = lab
        self.name = name
        self.dir = lab.dir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.lab.procs.procs[self.name].pid

    def metric(self, name: str, **labels: str) -> float | None:
        return scrape(self.url + "/metrics", name, labels)

    def kill9(self) -> float:
        return self.lab.procs.kill9(self.name)

    def stop(self) -> int | None:
        return self.lab.procs.stop(self.name)


class LabCollector(_Daemon):
    """One ``forewarn collector run`` process with its config, tokens and data."""

    def __init__(self, lab: Lab, name: str, nodes: list[str], extra: str = "",
                 data: Path | None = None) -> None:
        super().__init__(lab, name)
        self.data = data or self.dir / "data"
        self.log = self.dir / "collector.log"
        self.config = self.dir / "collector.toml"
        self.config.write_text(
            "# forewarn chaos collector: short cooldowns so each scenario can act; the\n"
            "# circuit breaker is opened wide because the lab is 6 GPUs with several faults\n"
            "# at once (the breaker itself is tested in tests/collector/test_policy.py)\n"
            f'listen = "127.0.0.1:{self.port}"\n'
            f'data_dir = "{self.data}"\n'
            f'tokens_file = "{self.dir / "tokens.toml"}"\n'
            "policy_cooldown_checkpoint_s = 3.0\n"
            "policy_dedup_s = 3.0\n"
            "policy_breaker_checkpoint_share = 1.0\n"
            "command_redeliver_s = 2.0\n"
            "flush_interval_s = 0.5\n"
            'log_level = "warning"\n' + extra)
        from forewarn.collector.http.auth import enroll

        self.tokens: dict[str, Path] = {}
        for node in nodes:
            self.tokens[node] = self.dir / f"{node}.token"
            enroll(self.dir / "tokens.toml", node, self.tokens[node])
        self.start()

    def start(self) -> None:
        self.lab.procs.start(self.name, collector_command(self.config), self.log,
                             self.url + "/healthz")

    def get(self, path: str) -> Any:
        return get_json(self.url + path)

    def findings(self, node: str, check: str, since: float = 0.0) -> list[dict[str, Any]]:
        """Stored finding transitions of ``check`` on ``node`` at or after ``since``,
        oldest first (the collector's history, ``/api/v1/findings``)."""
        rows = self.get(f"/api/v1/findings?node={node}&check_name={check}&limit=1000")
        return sorted((r for r in rows if float(r.get("time", 0)) >= since),
                      key=lambda r: float(r["time"]))


class LabAgent(_Daemon):
    """One ``forewarn agent --source sim`` process."""

    def __init__(self, lab: Lab, name: str, node: str, collector_url: str, token: Path,
                 scenario: str, *, interval_s: float, push_s: float, sim_speed: float = 1.0,
                 env: dict[str, str] | None = None, spool: Path | None = None) -> None:
        super().__init__(lab, name)
        self.node = node
        self.socket = str(self.dir / "agent.sock")
        self.spool = spool or self.dir / "spool"
        (self.dir / "scenario.toml").write_text(scenario)
        self.argv = agent_command(
            node, scenario=self.dir / "scenario.toml", socket=self.socket,
            listen=f"127.0.0.1:{self.port}", interval=interval_s, collector=collector_url,
            token_file=token, sim_speed=sim_speed, extra=("--log-level", "warning"))
        self.env = dict(os.environ)
        self.env.update(FOREWARN_AGENT_SPOOL_DIR=str(self.spool),
                        FOREWARN_AGENT_PUSH_INTERVAL_S=str(push_s), **(env or {}))
        self.started = 0.0
        self.start()

    def start(self) -> None:
        self.started = time.time()
        self.lab.procs.start(self.name, self.argv, self.dir / "agent.log",
                             self.url + "/healthz", env=self.env)

    def findings(self) -> list[dict[str, Any]]:
        data = get_json(self.url + "/api/v1/findings")
        items = data.get("findings", data) if isinstance(data, dict) else data
        return [f for f in items if isinstance(f, dict)]

    def spool_state(self) -> dict[str, Any]:
        state: dict[str, Any] = json.loads((self.spool / "state.json").read_text())
        return state
