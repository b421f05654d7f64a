"""The leader sees every batch on the bus, with real processes: nats-server, PostgreSQL and
two ``forewarn collector`` replicas sharing the ``collectors`` consumer, so each batch is
stored by one of them. The batches of a GPU's precursor and the checkpoint reports of an
order are split between the replicas (the leader is stopped, SIGSTOP, while part of them
arrives: the follower stores those), and still the leader predicts and orders, and sees
every rank's report."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import nats
import pandas as pd
import pytest

from forewarn import bus
from forewarn.demo.servers import PostgresServer
from forewarn.models.features import gpu_features
from forewarn.models.persist import load_model
from forewarn.wire import AgentBatch, CheckpointReport, XidEvent, encode

from support.bus_stack import COLLECTOR_PASSWORD, auth_block
from support.collector import NODE, ranks_on
from support.nats_server import NatsServer, start_server
from support.polling import wait_for
from support.precursor import Case, make_case, ranks, samples
from support.replicas import Replica, write_tokens

CHECK = "models.failure_predictor"
OPERATOR = "operator-token-0123456789"


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return make_case(tmp_path_factory.mktemp("model"))


class Bus:
    """nats-server, two replicas on one PostgreSQL database (``a`` leads), a publisher."""

    def __init__(self, tmp: Path, dsn: str, **keys: Any) -> None:
        self.server: NatsServer = start_server(tmp / "nats", authorization=auth_block())
        tokens = write_tokens(tmp / "tokens.toml")
        keys = {"bus_url": self.server.url, "bus_password": COLLECTOR_PASSWORD,
                "bus_ack_wait_s": 2.0, "operator_token": OPERATOR, **keys}
        self.a = Replica(tmp, "a", dsn, tokens, **keys)
        self.b = Replica(tmp, "b", dsn, tokens, **keys)
        self.dsn = dsn
        self.seq: dict[str, int] = {}

    def start(self) -> Bus:
        self.a.start()
        wait_for(lambda: self.a.role() == "leader", what="a leads")
        self.b.start()
        return self

    def publish(self, node: str, bodies: list[dict[str, Any]]) -> None:
        """One batch per body, published as the node's agent does (``Nats-Msg-Id``)."""
        batches = []
        for kw in bodies:
            seq = self.seq.get(node, 0)
            self.seq[node] = seq + 1
            batches.append(AgentBatch(node=node, agent_id=f"agent-{node}", seq=seq,
                                      created=time.time(), **kw))

        async def send() -> None:
            nc = await nats.connect(self.server.url, user=bus.COLLECTOR_USER,
                                    password=COLLECTOR_PASSWORD)
            js = nc.jetstream()
            for b in batches:
                await js.publish(bus.subject(bus.BATCH_PREFIX, node), encode(b),
                                 headers={"Nats-Msg-Id": f"{b.agent_id}:{b.seq}"})
            await nc.close()

        asyncio.run(send())

    def stored(self) -> int:
        """Batches stored by either replica."""
        import psycopg

        with psycopg.connect(self.dsn) as conn:
            row = conn.execute("SELECT COUNT(*) FROM batches").fetchone()
        return int(row[0]) if row else 0

    def wait_stored(self) -> None:
        total = sum(self.seq.values())
        wait_for(lambda: self.stored() == total, 30, f"{total} batches stored")

    def stop(self) -> None:
        for r in (self.a, self.b):
            if r.proc is not None and r.proc.poll() is None:
                os.kill(r.proc.pid, signal.SIGCONT)
            r.stop()
        self.server.stop()


@pytest.fixture
def stack(tmp_path: Path, postgres_server: PostgresServer) -> Iterator[Callable[..., Bus]]:
    """Start a :class:`Bus` with these collector config keys."""
    started: list[Bus] = []

    def start(**keys: Any) -> Bus:
        started.append(Bus(tmp_path, postgres_server.database(), **keys))
        return started[-1].start()

    try:
        yield start
    finally:
        for s in started:
            s.stop()


def _alarm_run(c: Case) -> float:
    """A feature time T at which the model alarms on the GPU at T, T+60 and T+120 (before
    the failure): a scoring anywhere in those three minutes alarms."""
    d, model = c.data, load_model(c.model_path)
    s = d.samples[(d.samples.node == NODE) & d.samples.gpu.isin(c.gpus)
                  & (d.samples.time >= c.start)]
    x = d.xids[(d.xids.node == NODE) & d.xids.gpu.isin(c.gpus) & (d.xids.time >= c.start)]
    scored = model.score(gpu_features(s, x))
    mine = scored[(scored.gpu == c.gpu) & (scored.time >= c.first_alarm)
                  & (scored.time <= c.fail_time - 240)]
    alarm = set(mine[mine.p >= model.threshold].time.astype(float))
    return float(min(t for t in alarm if t + 60 in alarm and t + 120 in alarm))


def _minutes(c: Case, until: float, shift: float) -> pd.DataFrame:
    d = c.data
    s = d.samples[(d.samples.node == NODE) & d.samples.gpu.isin(c.gpus)
                  & (d.samples.time >= c.start) & (d.samples.time < until)].copy()
    s["time"] += shift
    return s


def _bodies(c: Case, rows: pd.DataFrame, shift: float) -> list[dict[str, Any]]:
    """One batch per minute of telemetry (samples, XIDs, the job's ranks)."""
    d = c.data
    xids = d.xids[(d.xids.node == NODE) & d.xids.gpu.isin(c.gpus)]
    out = []
    for minute, group in rows.groupby((rows.time // 60) * 60):
        xr = xids[(xids.time + shift >= minute) & (xids.time + shift < minute + 60)]
        out.append({"samples": samples(group), "ranks": ranks(c.gpus[:2], time.time()),
                    "xids": [XidEvent(node=NODE, gpu=int(r.gpu), code=int(r.xid),
                                      time=float(r.time) + shift, source="sim",
                                      simulated=True) for r in xr.itertuples()]})
    return out


@pytest.mark.timeout(360)
def test_the_leader_predicts_from_a_precursor_the_follower_stored(
        stack: Callable[..., Bus], case: Case) -> None:
    c = case
    alarm = _alarm_run(c)
    # Shift the telemetry by whole minutes (the features' grid) so that the alarm run
    # covers the next two minutes of the wall clock: samples up to 3 minutes ahead.
    now = time.time()
    shift = math.floor(now / 60) * 60 - alarm
    rows = _minutes(c, alarm + 180, shift)
    bodies = _bodies(c, rows, shift)
    s = stack(predictor_enabled=True, predict_interval_s=1.0, model_path=str(c.model_path))
    split = sum(1 for b in bodies if b["samples"][0].time < now - 600)
    s.publish(NODE, bodies[:split])  # both replicas store these
    s.wait_stored()
    os.kill(s.a.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
    s.publish(NODE, bodies[split:])  # the last ten minutes: the follower stores them
    s.wait_stored()
    os.kill(s.a.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]

    def ordered() -> list[dict[str, Any]]:
        log = s.a.client.get("/api/v1/commands/log", params={"node": NODE}).json()
        return [row for row in log if row["kind"] == "checkpoint"]

    # The leader scores as soon as it continues, before it has read the backlog the
    # follower stored; the backlog then fills its own minutes (the grid follows the data's
    # clock: tests/models/test_live_backlog.py), so the alarm comes once it is read. On a
    # loaded machine that can take a while: wait while the alarm run lasts.
    window = math.floor(now / 60) * 60 + 180 - time.time()
    orders = wait_for(ordered, max(window, 60), "the leader's checkpoint order on the prediction")
    assert s.a.role() == "leader"
    found = s.a.client.get("/api/v1/findings", params={"check_name": CHECK}).json()
    assert [f for f in found if f["subject_key"] == f"gpu:{NODE}/{c.gpu}"
            and f["origin"] == "predictor"], found
    assert orders[0]["command"]["order"]["job"] == "train-p"
    risk = s.a.client.get("/api/v1/risk").json()
    assert [g for g in risk["gpus"] if g["gpu"] == c.gpu and g["score"] >= c.threshold]


@pytest.mark.timeout(180)
def test_every_checkpoint_report_reaches_the_leader_whichever_replica_stored_it(
        stack: Callable[..., Bus]) -> None:
    s = stack()
    nodes = {"node0000": 0, "node0001": 2}
    for node, first in nodes.items():
        s.publish(node, [{"ranks": ranks_on(node, first, time.time())}])
    s.wait_stored()
    answer = s.a.client.post("/api/v1/orders", json={"job": "train-1", "reason": "test"},
                                 headers={"authorization": f"Bearer {OPERATOR}"})
    assert answer.status_code == 200, answer.text
    log = s.a.client.get("/api/v1/commands/log", params={"node": "node0000"}).json()
    order = next(r["command"]["order"] for r in log if r["kind"] == "checkpoint")
    # Another node's report about the job: ingest refuses the batch (not its job), so it
    # must not reach the leader's order book either (it would fail the order).
    s.publish("node0002", [{"checkpoints": [CheckpointReport(
        job="train-1", rank=0, request_id=order["request_id"], step=order["step"],
        phase="failed", time=time.time())]}])
    os.kill(s.a.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
    for node, first in nodes.items():  # every rank's report: the follower stores them
        s.publish(node, [{"checkpoints": [CheckpointReport(
            job="train-1", rank=first + g, request_id=order["request_id"],
            step=order["step"], phase="done", seconds=12.0, time=time.time())
            for g in range(2)]}])
    wait_for(lambda: s.stored() == sum(s.seq.values()) - 1, 30, "the reports stored")
    os.kill(s.a.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
    wait_for(lambda: s.a.metric("forewarn_collector_checkpoint_orders_total",
                                event="done") == 1, 20,
             "the leader's order done (every rank's report seen)")
    assert s.a.metric("forewarn_collector_decide_batches_total", result="fed") >= 4
    assert s.a.metric("forewarn_collector_checkpoint_orders_total", event="failed") == 0
    wait_for(lambda: sum(r.metric("forewarn_collector_ingest_rejected_total",
                                  reason="not_your_job") for r in (s.a, s.b)) == 1, 20,
             "the other node's report refused by ingest")
