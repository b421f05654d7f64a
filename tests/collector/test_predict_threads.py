"""The collector's failure predictor scores under a thread limit (``predict_threads``,
default 1): scikit-learn's OpenMP threads spin-wait for work, and on a busy host a scoring
with one thread per core took minutes instead of seconds. The limit is read inside the
classifier's ``predict_proba`` (threadpoolctl), never inferred from timing; the process
around it is set to more threads than that, so a missing limit shows."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits  # type: ignore[import-untyped]

from forewarn.collector.config import CollectorConfig
from forewarn.collector.decide.predict import PredictorService
from forewarn.wire import AgentBatch

from support.collector import NODE
from support.precursor import Case, make_case, samples

OUTSIDE = 3
"""OpenMP threads the scoring thread has outside the limit."""


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return make_case(tmp_path_factory.mktemp("model"))


class ThreadsSeen:
    """The fitted classifier, noting the OpenMP and BLAS thread counts inside each call."""

    def __init__(self, classifier: Any) -> None:
        self.classifier = classifier
        self.seen: list[set[int]] = []

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        self.seen.append({int(i["num_threads"]) for i in threadpool_info()
                          if i["user_api"] in ("openmp", "blas")})
        out: np.ndarray = self.classifier.predict_proba(x)
        return out


def _scored(case: Case, tmp_path: Path, **config: Any) -> ThreadsSeen:
    """A predictor (from the collector's config) fed an hour of the case's telemetry and
    scored once; what its classifier saw."""
    svc = PredictorService.from_config(CollectorConfig(
        data_dir=tmp_path, model_path=case.model_path, **config))
    assert svc is not None and svc.model is not None
    spy = ThreadsSeen(svc.model.classifier)
    svc.model.classifier = spy
    d = case.data.samples
    minute = math.floor(case.start / 60) * 60
    rows = d[(d.node == NODE) & d.gpu.isin(case.gpus) & (d.time >= minute)
             & (d.time < minute + 3600)]
    svc.observe([AgentBatch(node=NODE, agent_id="a", seq=0, created=minute + 3600,
                            samples=samples(rows))])
    with threadpool_limits(limits=OUTSIDE, user_api="openmp"):
        svc.score(minute + 3601.0)
    assert spy.seen, "the scoring did not call the classifier"
    return spy


def test_scoring_runs_on_one_thread_by_default(case: Case, tmp_path: Path) -> None:
    seen = _scored(case, tmp_path).seen
    assert all(threads == {1} for threads in seen), seen


def test_predict_threads_sets_the_limit(case: Case, tmp_path: Path) -> None:
    seen = _scored(case, tmp_path, predict_threads=2).seen
    assert all(threads == {2} for threads in seen), seen
