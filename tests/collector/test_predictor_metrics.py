"""A metric named probability holds a probability (``collector/decide/predict.py``): the
shipped ``rules_forest`` alarms on a score (threshold 0.5) that is not a probability, and its
findings carry the calibrated P (``models/calibration.py``). A real collector (uvicorn on
loopback, SQLite) loads the shipped model, is sent an hour of a GPU as usual and then two
hardware XIDs on it (the rules alarm on a second one within the hour, at score 0.5), and
exports and answers both numbers under their own names."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from forewarn.models.persist import default_model_path, load_default_model, save_model
from forewarn.wire import GpuSample, XidEvent

from support.browser import chromium_page
from support.collector import NODE, Clock, ClockedService, start_clocked, stop_service
from support.polling import poll
from support.precursor import JOB, ranks

pytestmark = [pytest.mark.system, pytest.mark.timeout(300),
              pytest.mark.skipif(not default_model_path().exists(),
                                 reason="no shipped default model")]

START = 1_790_000_040.0
"""A whole minute (the features' grid)."""
GPUS = [0, 1, 2, 3]
SICK = 1


@pytest.fixture
def running(tmp_path: Path) -> Iterator[ClockedService]:
    svc = start_clocked(tmp_path, Clock(START), model_path=default_model_path(),
                        predict_interval_s=60.0)
    yield svc
    stop_service(svc)


@pytest.fixture
def uncalibrated(tmp_path: Path) -> Iterator[ClockedService]:
    """A collector on the shipped model with its calibration taken out (a model file saved
    before models had one): scores, and no probability."""
    bare = copy.deepcopy(load_default_model())
    bare.classifier.calibration = np.zeros((2, 0))
    path = save_model(bare, tmp_path / "bare.skops")
    svc = start_clocked(tmp_path, Clock(START), model_path=path, predict_interval_s=60.0)
    yield svc
    stop_service(svc)


def _sample(gpu: int, t: float, minute: int) -> GpuSample:
    """A GPU as usual: steady temperature and power, no errors."""
    return GpuSample(node=NODE, gpu=gpu, uuid=f"GPU-{gpu}", time=t, source="sim",
                     simulated=True, temperature_c=60.0 + gpu, slowdown_margin_c=25.0,
                     power_w=500.0 + (minute % 3), power_limit_w=700.0, throttle_reasons=0,
                     ecc_corrected_volatile=0, ecc_uncorrected_volatile=0,
                     remapped_rows_correctable=0, remapped_rows_uncorrectable=0,
                     remap_pending=False, remap_failure=False, retired_pages_sbe=0,
                     retired_pages_dbe=0, pcie_replay_total=0, pcie_link_width=16,
                     pcie_link_width_max=16)


def _send(svc: ClockedService, minutes: int, xids_at: dict[int, int]) -> dict[str, object]:
    """Minute by minute, every GPU's sample and the XIDs due (minute -> code, on
    :data:`SICK`); each batch scored. Returns the last risk answer."""
    risk: dict[str, object] = {}
    for m in range(minutes):
        t = START + 60 * m
        svc.clock.t = t + 61.0
        xids = ([XidEvent(node=NODE, gpu=SICK, code=xids_at[m], time=t + 30, source="sim",
                          simulated=True)] if m in xids_at else [])
        svc.push(samples=[_sample(g, t, m) for g in GPUS], xids=xids,
                 ranks=ranks(GPUS, svc.clock.t))
        risk = poll(lambda: (r := svc.get("/api/v1/risk"))["time"] == svc.clock.t and r,
                    interval=0.02)
        assert risk, f"batch of minute {m} not scored"
    return risk


def test_probability_metric_holds_the_calibrated_p_and_the_score_has_its_own(
        running: ClockedService) -> None:
    svc = running
    risk = _send(svc, 70, {66: 92, 67: 63})
    findings = [f for f in svc.get("/api/v1/findings", check_name="models.failure_predictor")
                if f["gpu"] == SICK]
    assert findings, "the second hardware XID within the hour raised no alarm"
    found = findings[0]["finding"]
    p, score = found["probability"], found["evidence"]["score"]
    assert score >= 0.5 and p is not None and p < score / 10, found  # a score is not P

    labels = {"node": NODE, "gpu": str(SICK)}
    assert svc.metric("forewarn_gpu_failure_probability", **labels) == pytest.approx(p, rel=1e-4)
    assert svc.metric("forewarn_gpu_failure_score", **labels) == pytest.approx(score, abs=1e-4)
    assert svc.metric("forewarn_collector_predictor_threshold") == 0.5
    for g in GPUS:  # every GPU scored has both series
        assert svc.metric("forewarn_gpu_failure_score", node=NODE, gpu=str(g)) is not None
        assert svc.metric("forewarn_gpu_failure_probability", node=NODE, gpu=str(g)) is not None

    # /api/v1/risk: per GPU and per job, P as the probability, the score beside it
    mine = next(g for g in risk["gpus"] if g["gpu"] == SICK)  # type: ignore[attr-defined]
    assert mine["probability"] == pytest.approx(p, abs=1e-6)  # rounded to 6 places
    assert mine["score"] == pytest.approx(score, abs=1e-4)
    job = next(j for j in risk["jobs"] if j["job"] == JOB)  # type: ignore[attr-defined]
    assert job["gpu"] == f"{NODE}/{SICK}" and job["risk"] == pytest.approx(p, abs=1e-6)
    assert job["score"] == pytest.approx(score, abs=1e-4) and job["alarm"] is True
    # goodput advice reads the job's P, not its score
    advice = svc.get("/api/v1/goodput", job=JOB)[0]["advice"]
    assert advice["risk"] == pytest.approx(p, abs=1e-6)


def test_an_unknown_probability_is_null_and_the_status_page_says_so(
        uncalibrated: ClockedService, require_binary: Callable[[str], str]) -> None:
    svc = uncalibrated
    risk = _send(svc, 70, {66: 92, 67: 63})
    job = next(j for j in risk["jobs"] if j["job"] == JOB)  # type: ignore[attr-defined]
    assert job["alarm"] is True and job["score"] >= 0.5, job
    assert job["risk"] is None, job  # unknown, not 0
    assert all(g["probability"] is None for g in risk["gpus"])  # type: ignore[attr-defined]
    labels = {"node": NODE, "gpu": str(SICK)}
    assert svc.metric("forewarn_gpu_failure_score", **labels) == pytest.approx(
        job["score"], abs=1e-4)
    assert svc.metric("forewarn_gpu_failure_probability", **labels) is None  # no series

    with chromium_page(require_binary("chromium"), svc.server.url + "/") as (page, errors):
        badge = page.locator(f'#jobs tr[data-job="{JOB}"] td.risk .badge')
        badge.wait_for(timeout=30_000)
        assert badge.inner_text() == f"score {job['score']:.2f}, P n/a", badge.inner_text()
        assert not errors, errors


def test_a_risk_floor_that_is_no_probability_is_refused_naming_it(
        running: ClockedService) -> None:
    svc = running
    for bad in ("nan", "inf", "-inf", "-1", "1.5", "x"):
        r = svc.client.get("/api/v1/risk", params={"min": bad})
        assert r.status_code == 400 and "query parameter min" in r.text, (bad, r.text)
    for good in ("0", "0.25", "1"):
        assert svc.client.get("/api/v1/risk", params={"min": good}).status_code == 200
    # a time that is no number is refused as well (NaN compared with no row)
    r = svc.client.get("/api/v1/findings", params={"since": "nan"})
    assert r.status_code == 400 and "query parameter since" in r.text, r.text
