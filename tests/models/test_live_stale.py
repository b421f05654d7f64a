"""The live scorer with a ``stale_s`` longer than the peer window (PEER_MINUTES plus two
minutes): a GPU silent for longer than that window but within ``stale_s`` is still scored,
and the scoring does not fail."""

from __future__ import annotations

import pytest

from forewarn.models.features import GRID_S, PEER_MINUTES
from forewarn.models.live import LiveScorer
from forewarn.models.persist import load_model
from forewarn.wire import GpuSample

from support.precursor import Case, make_case


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return make_case(tmp_path_factory.mktemp("stale"))


def test_a_gpu_silent_past_the_peer_window_but_within_stale_s_is_scored(
        case: Case) -> None:
    """Two GPUs; one goes silent for 20 minutes (past the 17-minute peer window), the
    other keeps sending; with ``stale_s`` of 30 minutes both are scored."""
    scorer = LiveScorer(load_model(case.model_path), stale_s=30 * 60.0)
    t0 = 1_000 * GRID_S
    silence = (PEER_MINUTES + 5) * GRID_S
    for k in range(int(silence // 10) + 1):
        t = t0 + 10 * k
        for gpu in (0, 1):
            if gpu == 0 or k == 0:
                scorer.observe(GpuSample(node="n1", gpu=gpu, time=t, source="test",
                                         temperature_c=60.0, power_w=500.0))
    now = t0 + silence + 5
    slots, _feats, _ft = scorer.features(now)
    assert sorted(scorer._gpus[i] for i in slots) == [0, 1]
    scorer.score(now)  # no AssertionError: the fresh GPUs are among the candidates
    c = scorer.computed
    assert c is not None and sorted(scorer._gpus[i] for i in c.slots) == [0, 1]
