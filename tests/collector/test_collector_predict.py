"""The live failure predictor inside a real collector (uvicorn on loopback, SQLite): agent
batches carrying a GPU's precursor become a probability finding that is stored, exported
as ``forewarn_gpu_failure_probability``, weighed by the cost-aware policy and shown per job
in ``/api/v1/risk``; the later failure is counted as caught by shadow scoring.

The model is a real skops file loaded through ``model_path`` (a user's retrained model):
a small gradient-boosting classifier fitted here on a simulated fleet in about a second.
Which GPU and when it should alarm is decided offline by scoring the batch features of the
same telemetry (:func:`gpu_features`), so the test checks that the collector's live path
reproduces the batch path; the shipped default model, when present, gets the same check.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from forewarn.collector.config import CollectorConfig
from forewarn.collector.decide.policy_service import PolicyService
from forewarn.config import ConfigError
from forewarn.models.persist import default_model_path, load_model
from forewarn.wire import XidEvent

from support.collector import NODE, Clock, ClockedService, start_clocked, stop_service
from support.polling import poll
from support.precursor import JOB, Case, comparable, make_case, ranks, samples

CHECK = "models.failure_predictor"


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return make_case(tmp_path_factory.mktemp("model"))


@pytest.fixture
def running(tmp_path: Path, case: Case) -> Iterator[ClockedService]:
    # Batches are a minute of telemetry apart, so each one is due for scoring; the real-time
    # timer (same period) would score between a clock move and its batch: 60 s keeps it out.
    svc = start_clocked(tmp_path, Clock(case.start), model_path=case.model_path,
                        predict_interval_s=60.0)
    yield svc
    stop_service(svc)


def replay(svc: ClockedService, c: Case, until: float,
           highest: dict[int, float] | None = None) -> dict[str, Any]:
    """Send the chosen GPUs' telemetry minute by minute up to ``until``; after each batch
    the collector's clock is one second past the minute and the batch is scored. Returns
    the first risk answer in which the failing GPU's score was at or above threshold;
    ``highest`` collects each GPU's highest score."""
    d = c.data
    s = d.samples[(d.samples.node == NODE) & d.samples.gpu.isin(c.gpus)]
    x = d.xids[(d.xids.node == NODE) & d.xids.gpu.isin(c.gpus)]
    first: dict[str, Any] = {}
    minute = math.floor(c.start / 60) * 60
    while minute <= until:
        rows = s[(s.time >= minute) & (s.time < minute + 60) & (s.time <= until)]
        xr = x[(x.time >= minute) & (x.time < minute + 60) & (x.time <= until)]
        svc.clock.t = minute + 61.0
        xids = [XidEvent(node=NODE, gpu=int(r.gpu), code=int(r.xid), time=float(r.time),
                         source="sim", simulated=True) for r in xr.itertuples()]
        svc.push(samples=samples(rows), xids=xids, ranks=ranks(c.gpus[:2], svc.clock.t))
        risk = poll(lambda: (r := svc.get("/api/v1/risk"))["time"] == svc.clock.t and r,
                    interval=0.02)
        assert risk, f"batch of minute {minute} not scored"
        mine = [g for g in risk["gpus"] if g["gpu"] == c.gpu]
        for g in risk["gpus"]:
            if highest is not None:
                highest[g["gpu"]] = max(highest.get(g["gpu"], 0.0), g["score"])
        settled = svc.clock.t - 1 >= comparable(c.start, d)
        if not first and settled and mine and mine[0]["score"] >= c.threshold:
            first = risk
        minute += 60
    return first


def test_precursor_becomes_a_stored_exported_probability_finding(running: ClockedService,
                                                                 case: Case) -> None:
    svc, c = running, case
    highest: dict[int, float] = {}
    first = replay(svc, c, c.fail_time - 60, highest)
    assert first, "the collector never rated the failing GPU at or above threshold"
    # the live path alarms when the batch features do (same minute, give or take one)
    assert abs(first["time"] - 1 - c.first_alarm) <= 120, (first["time"], c.first_alarm)
    assert first["model"]["source"] == str(c.model_path)

    # stored as a finding from the predictor, with probability and horizon
    rows = svc.get("/api/v1/findings", check_name=CHECK)
    mine = [f for f in rows if f["subject_key"] == f"gpu:{NODE}/{c.gpu}"]
    assert mine, rows
    assert all(f["origin"] == "predictor" and f["probability"] >= c.threshold
               and f["horizon_s"] == 3600.0 for f in mine)
    # only GPUs at or above the threshold become findings
    quiet = {g for g, p in highest.items() if p < c.threshold}
    assert not [f for f in rows if f["gpu"] in quiet], (highest, rows)
    # re-submitted at most every predict_refresh_s (300 s) while it stays alarmed
    assert len(mine) <= (c.fail_time - c.first_alarm) / 300 + 2

    # exported per GPU; every GPU scored has a series
    p = svc.metric("forewarn_gpu_failure_probability", node=NODE, gpu=str(c.gpu))
    assert p is not None and p >= c.threshold
    for g in c.gpus:
        assert svc.metric("forewarn_gpu_failure_probability", node=NODE, gpu=str(g)) is not None

    # the cost-aware policy used P: a checkpoint decision for the job on that GPU
    decisions = [{**d, "inputs": json.loads(d["inputs"])}
                 for d in svc.get("/api/v1/decisions", job=JOB)
                 if d["decision"].startswith("checkpoint:")]
    decisions = [d for d in decisions if d["inputs"]["check"] == CHECK]
    assert decisions, "no checkpoint decision on the prediction"
    assert all(d["inputs"]["source"] == "predictor" for d in decisions)
    assert all(d["inputs"]["probability_source"] == "finding" for d in decisions)
    assert all(d["inputs"]["probability"] >= c.threshold for d in decisions)
    assert "checkpoint:act" in {d["decision"] for d in decisions}
    orders = svc.get("/api/v1/commands/log", node=NODE)
    assert any(o["kind"] == "checkpoint" for o in orders)

    # job risk: the highest over the job's GPUs (the failing GPU is rank 0's)
    risk = svc.get("/api/v1/risk")
    job = next(j for j in risk["jobs"] if j["job"] == JOB)
    assert job["gpu"] == f"{NODE}/{c.gpu}" and job["score"] >= c.threshold and job["alarm"]
    assert job["risk"] == job["score"]  # a calibrated classifier: its score is its P

    # goodput advice shortens with that risk
    goodput = svc.get("/api/v1/goodput", job=JOB)
    assert goodput and goodput[0]["advice"]["risk"] >= c.threshold
    assert goodput[0]["advice"]["gpus"] == 2

    # then the GPU fails: shadow scoring counts it as caught, with the lead time
    assert svc.metric("forewarn_collector_prediction_failures_total") == 0
    replay_from = dataclasses.replace(c, start=c.fail_time - 60)
    replay(svc, replay_from, c.fail_time)
    # The shadow counts are published by a scoring. The fixture's real-time timer can score
    # at the failure's minute after the clock moved but before its batch is fed (CI at
    # c53a2a1 read 0 here): the next minute's scoring has counted the failure in any case.
    svc.clock.t += 60
    svc.push(ranks=ranks(c.gpus[:2], svc.clock.t))
    assert poll(lambda: svc.get("/api/v1/risk")["time"] == svc.clock.t, interval=0.02)
    assert svc.metric("forewarn_collector_prediction_failures_total") == 1
    assert svc.metric("forewarn_collector_prediction_caught_total") == 1
    assert svc.metric("forewarn_collector_prediction_recall") == 1.0
    lead = svc.metric("forewarn_collector_prediction_lead_seconds")
    assert lead is not None and abs(lead - (c.fail_time - (first["time"]))) <= 120, lead
    assert svc.metric("forewarn_collector_predictor_up") == 1.0
    assert svc.metric("forewarn_collector_predictor_gpus") == len(c.gpus)
    assert svc.metric("forewarn_collector_predictor_samples_total", result="error") == 0


def test_bad_model_path_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "model.skops"
    bad.write_bytes(b"not a skops file")
    with pytest.raises(ConfigError, match=r"model_path: .*not a readable skops model"):
        PolicyService.from_config(CollectorConfig(data_dir=tmp_path, model_path=bad))
    with pytest.raises(ConfigError, match="predict_interval_s: must be positive"):
        CollectorConfig(predict_interval_s=0)


def test_predictor_can_be_turned_off(tmp_path: Path) -> None:
    svc = PolicyService.from_config(CollectorConfig(data_dir=tmp_path, predictor_enabled=False))
    assert svc.advisors.predictor is None and svc.advisors.goodput is not None


@pytest.mark.skipif(not default_model_path().exists(), reason="no shipped default model yet")
def test_shipped_model_loads_by_default(tmp_path: Path) -> None:
    svc = PolicyService.from_config(CollectorConfig(data_dir=tmp_path))
    predictor = svc.advisors.predictor
    assert predictor is not None
    # it loads in the background; readiness says when it is in
    assert poll(lambda: predictor.readiness()["ready"], 240, 0.1), predictor.readiness()
    assert predictor.model is not None and not predictor.loading
    assert predictor.source == "default"
    shipped = load_model(default_model_path())
    assert svc.advisors.predictor.model.threshold == shipped.threshold
    probs = svc.advisors.predictor.model.predict_proba(np.zeros((1, len(shipped.feature_names))))
    assert probs.shape == (1,)
