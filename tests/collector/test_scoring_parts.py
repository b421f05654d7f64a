"""The failure predictor's scoring pass yields to urgent work: it does not run inside the
telemetry batch that found it due, and an urgent batch stored while the pass is under way
is decided before the scoring's own findings (a real collector on loopback, real SQLite;
the model's classifier is the test's, at the scikit-learn seam)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from forewarn.wire import AgentBatch, Finding, GpuSample, Health, Subject, encode

from support.collector import NODE, NODE_TOKENS, Clock, first_row_alarmed, serve_predictor
from support.polling import poll

T0 = 1_700_000_000.0 - 1_700_000_000.0 % 60 + 5.0  # five seconds into a minute
GPUS = 64


def post(url: str, batch: AgentBatch) -> None:
    r = httpx.post(url + "/api/v1/ingest", content=encode(batch), timeout=30, headers={
        "content-type": "application/msgpack",
        "authorization": f"Bearer {NODE_TOKENS[NODE]}"})
    assert r.status_code == 200, r.text


class UrgentOnPredict:
    """A classifier that, the first time it is asked, has an agent's urgent batch (a fatal
    XID finding) stored, so that it is queued while the scoring pass is under way; it
    scores GPU row 0 over any threshold (a predictor finding to decide) and the rest 0."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.url = ""
        self.asked = 0

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        self.asked += 1
        if self.asked == 1:
            finding = Finding(check="xid", health=Health.UNHEALTHY, reason="fatal XID 79",
                              subject=Subject(kind="gpu", node=NODE, gpu=GPUS - 1),
                              time=self.clock())
            post(self.url, AgentBatch(node=NODE, agent_id="agent-0", seq=1, urgent=True,
                                      created=self.clock(), findings=[finding]))
        return first_row_alarmed(len(x))


@pytest.mark.system
def test_an_urgent_batch_stored_during_a_scoring_is_decided_before_its_findings(
        tmp_path: Path) -> None:
    clock = Clock(T0 + 120.0)
    probe = UrgentOnPredict(clock)
    server, store, predictor, _ = serve_predictor(tmp_path, probe, clock)
    probe.url = server.url
    try:
        post(server.url, AgentBatch(node=NODE, agent_id="agent-0", seq=0, created=clock(),
                                    samples=[GpuSample(node=NODE, gpu=g, time=T0 + dt,
                                                       source="test", power_w=300.0)
                                             for dt in (0.0, 60.0) for g in range(GPUS)]))
        assert poll(lambda: predictor.last_score == clock() and probe.asked, timeout=60)
        decided = poll(lambda: {"agent", "predictor"} <= set(rows := sources(store)) and rows,
                       timeout=60)
    finally:
        server.stop()
        store.close()
    assert decided, "the urgent finding and the scoring's were not both decided"
    # the agent's fatal finding first, then the scoring's: it did not wait for the pass
    assert "agent" not in decided[decided.index("predictor"):], decided


def sources(store: Any) -> list[str]:
    """The source of each stored decision, in the order they were taken."""
    return [json.loads(r["inputs"])["source"]
            for r in store.query("SELECT inputs FROM decisions ORDER BY id")]



class Broken:
    """A classifier that cannot score (raises), counting how often it is asked."""

    def __init__(self) -> None:
        self.asked = 0

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        self.asked += 1
        raise ValueError("a model that cannot score")


@pytest.mark.system
def test_a_failing_scoring_waits_the_interval_before_it_runs_again(tmp_path: Path) -> None:
    """Every telemetry batch asks whether a scoring is due: after a pass that failed, the
    next one waits ``predict_interval_s`` as after one that scored (each failure counted)."""
    clock = Clock(T0 + 120.0)
    broken = Broken()
    server, store, predictor, ctx = serve_predictor(tmp_path, broken, clock)
    predictor.interval_s = 60.0

    def batch(seq: int) -> None:
        post(server.url, AgentBatch(node=NODE, agent_id="agent-0", seq=seq, created=clock(),
                                    samples=[GpuSample(node=NODE, gpu=g, time=clock() - dt,
                                                       source="test", power_w=300.0)
                                             for dt in (65.0, 5.0) for g in range(4)]))
        # the policy observed the batch (then asked whether a scoring is due), and the
        # parts of a pass it started ran: bulk work waits for the decision lane
        assert poll(lambda: sum(predictor.samples.values()) == 8 * (seq + 1), timeout=60)
        ctx.submit_bulk(lambda: None).result(60)

    try:
        for seq in range(4):  # four batches within one interval
            batch(seq)
            clock.t += 10
        passes_within_one_interval = broken.asked
        clock.t += 60
        batch(4)
        errors = ctx.metrics.policy_errors._value.get()
    finally:
        server.stop()
        store.close()
    assert passes_within_one_interval == 1
    assert broken.asked == 2 and errors == 2  # the next interval's pass, failing again
