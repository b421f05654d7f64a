"""A real collector service for tests: the Starlette app under uvicorn on loopback
(:class:`~forewarn.collector.cli.ServerThread`) with a real SQLite store, and a client that
posts agent batches with a node's token.

Two flavours: :class:`Service` (several nodes, wall clock, alert token set) and
:class:`ClockedService` (one node, :data:`NODE`, on a :class:`Clock` moved by the test, for
replaying simulated telemetry from the past)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from forewarn.chaos.exposition import sample
from forewarn.collector.cli import ServerThread
from forewarn.collector.config import CollectorConfig
from forewarn.collector.decide.policy_service import PolicyService
from forewarn.collector.decide.predict import PredictorService
from forewarn.collector.http.app import create_app
from forewarn.collector.http.auth import TokenRegistry
from forewarn.collector.storage.state import StateStore, open_state
from forewarn.models.predictor import FailurePredictor
from forewarn.wire import AgentBatch, RankSummary, encode

__all__ = ["ALERT_TOKEN", "NODE", "NODE_TOKENS", "STATE", "TOKENS", "Clock", "ClockedService",
           "Service", "first_row_alarmed", "poll_commands", "ranks_on", "serve", "serve_predictor",
           "start_clocked",
           "start_job_service", "start_service", "stop_service"]

ALERT_TOKEN = "alert-token-0123456789"
TOKENS = {"node1": "token-one-0123456789", "node2": "token-two-0123456789",
          "node3": "token-three-0123456789"}
"""Agent tokens of :class:`Service`'s nodes."""
NODE = "node0000"
NODE_TOKENS = {NODE: "token-node0000-0123456789"}
"""The agent token of :class:`ClockedService`'s one node."""
STATE: dict[str, Any] = {}
"""Config keys choosing the state backend for every collector started here; the
parametrized fixture ``state_backend`` (tests/conftest.py) sets them per test."""


def serve(tmp_path: Path, tokens: Mapping[str, str], clock: Callable[[], float] = time.time,
          *, policy: Any = None, **overrides: Any
          ) -> tuple[ServerThread, StateStore, httpx.Client]:
    """The collector (data under ``tmp_path/data``, no periodic flush) with its policy (or
    ``policy``), started on a free loopback port, and a client for it."""
    cfg = CollectorConfig(listen="127.0.0.1:0", data_dir=tmp_path / "data",
                          tokens_file=tmp_path / "none.toml", flush_interval_s=3600,
                          **{**STATE, **overrides})
    store = open_state(cfg)
    app = create_app(cfg, store,
                     policy=PolicyService.from_config(cfg) if policy is None else policy,
                     tokens=TokenRegistry(tokens=dict(tokens)), clock=clock)
    server = ServerThread(app, cfg).start()
    return server, store, httpx.Client(base_url=server.url, timeout=30)


def serve_predictor(tmp_path: Path, classifier: Any, clock: Clock, **overrides: Any
                    ) -> tuple[ServerThread, StateStore, PredictorService, Any]:
    """The collector of :func:`serve` for :data:`NODE` with a failure predictor whose
    model's classifier is the test's (the scikit-learn seam); its timer stays out (an
    hour): telemetry batches find the scorings due. Also returns the app's context."""
    cfg = CollectorConfig(listen="127.0.0.1:0", data_dir=tmp_path / "data",
                          tokens_file=tmp_path / "none.toml", flush_interval_s=3600,
                          predictor_enabled=False, **{**STATE, **overrides})
    policy = PolicyService.from_config(cfg)
    predictor = PredictorService(FailurePredictor(classifier=classifier), interval_s=3600.0)
    policy.advisors.predictor = predictor
    store = open_state(cfg)
    app = create_app(cfg, store, policy=policy, tokens=TokenRegistry(tokens=dict(NODE_TOKENS)),
                     clock=clock)
    return ServerThread(app, cfg).start(), store, predictor, app.state.ctx


@dataclasses.dataclass
class Service:
    server: ServerThread
    store: StateStore
    client: httpx.Client
    seq: dict[str, int]

    def push(self, node: str, **kw: Any) -> None:
        seq = self.seq.get(node, 0)
        self.seq[node] = seq + 1
        b = AgentBatch(node=node, agent_id=f"agent-{node}", seq=seq, created=time.time(), **kw)
        r = self.client.post("/api/v1/ingest", content=encode(b), headers={
            "content-type": "application/msgpack", "authorization": f"Bearer {TOKENS[node]}"})
        assert r.status_code == 200, r.text

    def commands(self, node: str, wait: float = 0.0) -> list[dict[str, Any]]:
        return poll_commands(self.client, node, wait)

    def metric(self, name: str, **labels: str) -> float:
        """The sample of /metrics with exactly these labels (0 when absent: a labelled
        counter has no sample before its first increment)."""
        return sample(self.client.get("/metrics").text, name, **labels) or 0.0

    def alert(self, path: str = "alertmanager", token: str | None = ALERT_TOKEN,
              **kw: Any) -> httpx.Response:
        headers = {} if token is None else {"authorization": f"Bearer {token}"}
        return self.client.post(f"/api/v1/alerts/{path}", headers=headers, **kw)


def poll_commands(client: httpx.Client, node: str, wait: float) -> list[dict[str, Any]]:
    """Long-poll ``node``'s commands with its token (as its agent does)."""
    r = client.get("/api/v1/commands", params={"node": node, "wait": wait},
                   headers={"authorization": f"Bearer {TOKENS[node]}"})
    assert r.status_code == 200, r.text
    result: list[dict[str, Any]] = r.json()
    return result


def start_service(tmp_path: Path, **overrides: Any) -> Service:
    """A collector service on a tmp data dir. Interval advice (on by default in the product)
    is off unless asked for, so that tests of orders read only orders
    (tests/collector/test_interval_advice.py covers the advice)."""
    server, store, client = serve(tmp_path, TOKENS, **{
        "alert_token": ALERT_TOKEN, "advise_hooks": False, **overrides})
    return Service(server, store, client, {})


def start_job_service(tmp_path: Path) -> Service:
    """:func:`start_service` with job train-1 on node1 and node2 (ranks 0-3, see
    :func:`ranks_on`) and node3 known without a job."""
    s = start_service(tmp_path)
    now = time.time()
    s.push("node1", ranks=ranks_on("node1", 0, now))
    s.push("node2", ranks=ranks_on("node2", 2, now))
    s.push("node3")
    return s


def stop_service(svc: Service | ClockedService) -> None:
    svc.client.close()
    svc.server.stop()
    svc.store.close()


def ranks_on(node: str, first_rank: int, now: float) -> list[RankSummary]:
    """Two ranks of job train-1 on ``node``, last checkpointed an hour ago."""
    return [RankSummary(job="train-1", rank=first_rank + g, world_size=4, node=node, gpu=g,
                        pid=100 + first_rank + g, last_step=500, last_step_time=now,
                        step_seconds_p50=0.2, last_checkpoint_step=100,
                        last_checkpoint_time=now - 3600, checkpoint_seconds=30.0)
            for g in range(2)]


class Clock:
    """The collector's clock, moved by the test (simulated telemetry is in the past)."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclasses.dataclass
class ClockedService:
    server: ServerThread
    store: StateStore
    client: httpx.Client
    clock: Clock
    seq: int = 0

    def push(self, **kw: Any) -> None:
        b = AgentBatch(node=NODE, agent_id="agent-0", seq=self.seq, created=self.clock(), **kw)
        self.seq += 1
        r = self.client.post("/api/v1/ingest", content=encode(b), headers={
            "content-type": "application/msgpack",
            "authorization": f"Bearer {NODE_TOKENS[NODE]}"})
        assert r.status_code == 200, r.text

    def get(self, path: str, **params: Any) -> Any:
        r = self.client.get(path, params=params)
        assert r.status_code == 200, r.text
        return r.json()

    def metric(self, name: str, **labels: str) -> float | None:
        """One sample of the exposition (labels matched exactly, in any order)."""
        return sample(self.client.get("/metrics").text, name, **labels)


def start_clocked(tmp_path: Path, clock: Clock, **overrides: Any) -> ClockedService:
    return ClockedService(*serve(tmp_path, NODE_TOKENS, clock, **overrides), clock)


def first_row_alarmed(rows: int) -> np.ndarray:
    """``predict_proba``'s answer for ``rows`` GPUs of a test's classifier: the first over
    any threshold (a predictor finding to decide), the rest 0."""
    p = np.zeros((rows, 2))
    p[:, 0] = 1.0
    p[:1] = (0.0, 1.0)
    return p
