"""The chaos lab's telemetry rigs: a collector and an agent of their own per scenario,
the uplink through a cuttable proxy (:class:`TelemetryRig`) or a nats-server of its own
(:class:`BusRig`); see :mod:`forewarn.chaos.lab`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from forewarn.chaos.daemons import LabAgent, LabCollector
from forewarn.chaos.proxy import TcpProxy
from forewarn.demo import servers
from forewarn.spawn.procs import wait_until

if TYPE_CHECKING:
    from forewarn.chaos.lab import Lab


@dataclasses.dataclass
class TelemetryRig:
    """A collector and an agent of their own, the uplink through a cuttable proxy.

    ``others``: more nodes with tokens on that collector, for a scenario's own client
    (an impostor, a poisoned or skewed agent) beside the real agent. ``disk``: a folder
    (a small file system) that holds the collector's data dir and the agent's spool.
    ``collector_extra``: more collector config lines."""

    lab: Lab
    name: str
    spool_max_bytes: int | None = None
    others: tuple[str, ...] = ()
    disk: Path | None = None
    collector_extra: str = ""
    collector: LabCollector = dataclasses.field(init=False)
    agent: LabAgent = dataclasses.field(init=False)
    proxy: TcpProxy = dataclasses.field(init=False)

    @property
    def node(self) -> str:
        return f"chaos-{self.name}"

    def __post_init__(self) -> None:
        node = self.node
        o = self.lab.options
        self.collector = LabCollector(self.lab, f"{self.name}-collector", [node, *self.others],
                                       self.collector_extra,
                                       data=self.disk / "data" if self.disk else None)
        self.proxy = TcpProxy(("127.0.0.1", self.collector.port))
        self.lab.proxies.append(self.proxy)
        env = {}
        if self.spool_max_bytes is not None:
            env["FOREWARN_AGENT_SPOOL_MAX_BYTES"] = str(self.spool_max_bytes)
        self.agent = LabAgent(
            self.lab, f"{self.name}-agent", node, self.proxy.url, self.collector.tokens[node],
            f'name = "{node}"\ndescription = "quiet"\ngpus = 4\nseed = 2\n',
            interval_s=o.telemetry_interval_s, push_s=o.push_interval_s, env=env,
            spool=self.disk / "spool" if self.disk else None)

    def token(self, node: str) -> str:
        """The bearer token of ``node`` on this rig's collector."""
        return self.collector.tokens[node].read_text().strip()

    @property
    def gpus(self) -> int:
        return 4

    def stored_batches(self) -> int:
        nodes = self.collector.get("/api/v1/nodes")
        return int(nodes[0]["batches"]) if nodes else 0

    def storing(self, batches: int = 5, timeout: float = 30.0) -> None:
        """Wait (at most ``timeout``) until the collector stored ``batches`` of the agent's:
        the rig runs, a scenario can start its fault."""
        wait_until(lambda: self.stored_batches() >= batches, timeout)

    def spool_empty(self) -> bool:
        return self.agent.metric("forewarn_uplink_spool_batches") == 0


@dataclasses.dataclass
class BusRig(TelemetryRig):
    """A :class:`TelemetryRig` whose agent and collector talk through a nats-server of
    its own (``uplink = "nats"``, ``bus_url``) instead of the proxy; the server
    (``nats_server``) can be stopped and started again on the same port and JetStream
    store."""

    nats: str = "nats-server"

    def __post_init__(self) -> None:
        o = self.lab.options
        self.dir = self.lab.dir / self.name
        self.nats_server = servers.start_nats(self.dir, binary=self.nats)
        self.lab.closers.append(self.nats_server.stop)
        self.nats_url = self.nats_server.url
        node = self.node
        self.collector = LabCollector(self.lab, f"{self.name}-collector", [node],
                                       f'bus_url = "{self.nats_url}"\nbus_ack_wait_s = 2.0\n')
        self.agent = LabAgent(
            self.lab, f"{self.name}-agent", node, self.collector.url,
            self.collector.tokens[node],
            f'name = "{node}"\ndescription = "quiet"\ngpus = 4\nseed = 2\n',
            interval_s=o.telemetry_interval_s, push_s=o.push_interval_s,
            env={"FOREWARN_AGENT_UPLINK": "nats", "FOREWARN_AGENT_NATS_URL": self.nats_url})
