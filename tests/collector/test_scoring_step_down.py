"""A leader that steps down while its scoring pass is under way drops the pass's findings
(a follower does not decide), and decides them when it leads again: the findings it did
not pass on are not held back as if passed on (``predict_refresh_s``). A real collector on
shared PostgreSQL state, the leader's lock session ended by the test; the model's
classifier is the test's, at the scikit-learn seam."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from forewarn.wire import AgentBatch, GpuSample, encode

from support.collector import NODE, NODE_TOKENS, Clock, first_row_alarmed, serve_predictor
from support.handover import LockHolder, end_leader_session
from support.polling import wait_for

T0 = 1_700_000_000.0 - 1_700_000_000.0 % 60 + 5.0  # five seconds into a minute


class StepDownOnPredict:
    """A classifier that, the first time it is asked, ends the leader's lock session and
    waits until the leader noticed (the test's session holds the lock until released):
    the pass goes on as a follower's. It scores GPU 0 over any threshold, the rest 0."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.holder: LockHolder | None = None
        self.leads: Any = None
        self.asked = 0

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        self.asked += 1
        if self.asked == 1:
            self.holder = LockHolder(self.dsn)
            end_leader_session(self.dsn)
            assert self.holder.held.wait(30), "the test's session did not get the lock"
            wait_for(lambda: not self.leads(), 30, "the leader to notice it lost the lock")
        return first_row_alarmed(len(x))


@pytest.mark.system
def test_findings_dropped_by_a_step_down_mid_pass_are_decided_when_leading_again(
        tmp_path: Path, services: tuple[str, list[Any]]) -> None:
    dsn, _ = services
    clock = Clock(T0 + 120.0)
    probe = StepDownOnPredict(dsn)
    server, store, predictor, ctx = serve_predictor(
        tmp_path, probe, clock, state="postgresql", postgres_dsn=dsn, advise_hooks=False)
    probe.leads = lambda: ctx.leader.is_leader
    seq = iter(range(100))

    def push(**kw: Any) -> None:
        batch = AgentBatch(node=NODE, agent_id="agent-0", seq=next(seq), created=clock(), **kw)
        r = httpx.post(server.url + "/api/v1/ingest", content=encode(batch), timeout=30,
                       headers={"content-type": "application/msgpack",
                                "authorization": f"Bearer {NODE_TOKENS[NODE]}"})
        assert r.status_code == 200, r.text

    try:
        wait_for(lambda: ctx.leader.is_leader, 60, "the collector to lead")
        push(samples=[GpuSample(node=NODE, gpu=g, time=T0 + dt, source="test", power_w=300.0)
                      for dt in (0.0, 60.0) for g in range(4)])
        wait_for(lambda: predictor.last_score == clock(), 60, "the first scoring")
        ctx.submit_bulk(lambda: None).result(60)  # its decision part ran (as a follower)
        assert predictor_decisions(store) == 0  # a follower does not decide
        assert probe.holder is not None
        probe.holder.release()
        wait_for(lambda: ctx.leader.is_leader, 60, "the collector to lead again")
        clock.t = T0 + 125.0
        predictor.interval_s = 1.0  # the next batch finds the next scoring due
        push(samples=[GpuSample(node=NODE, gpu=g, time=T0 + 124.0, source="test",
                                power_w=300.0) for g in range(4)])
        wait_for(lambda: predictor.last_score == clock(), 60, "the second scoring")
        ctx.submit_bulk(lambda: None).result(60)
        decided = predictor_decisions(store)
    finally:
        if probe.holder is not None:
            probe.holder.release()
        server.stop()
        store.close()
    assert decided, "GPU 0's alarm, dropped while following, was never decided"


def predictor_decisions(store: Any) -> int:
    """How many stored decisions came from the predictor."""
    return sum(json.loads(r["inputs"])["source"] == "predictor"
               for r in store.query("SELECT inputs FROM decisions"))
