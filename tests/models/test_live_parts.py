"""A live scoring computed in parts (:meth:`LiveScorer.prepare`: the collector runs urgent
work between them) is the same scoring as one computed whole: every GPU's features at one
minute, the shipped model's probabilities chunk by chunk, and samples that arrive between
the parts do not change it."""

from __future__ import annotations

import numpy as np
import pytest

from forewarn.models.live import LiveScorer
from forewarn.models.persist import load_default_model
from forewarn.wire import GpuSample

T0 = 1_700_000_000.0 - 1_700_000_000.0 % 60
NODES, GPUS = 3, 8


def fed(minutes: int) -> LiveScorer:
    """A scorer with ``minutes`` of one sample a minute from every GPU (seeded powers)."""
    scorer = LiveScorer(load_default_model())
    rng = np.random.default_rng(7)
    for m in range(minutes):
        for n in range(NODES):
            for g in range(GPUS):
                scorer.observe(GpuSample(node=f"n{n}", gpu=g, time=T0 + 60 * m + 1,
                                         source="test", power_w=float(rng.uniform(200, 700)),
                                         temperature_c=float(rng.uniform(40, 85))))
    return scorer


@pytest.mark.parametrize("minutes, between", [
    (20, 60 * 20 + 4),  # a sample of the open minute
    (18, 60 * 18 + 1),  # a backlog being read: a minute the scoring could have read
])
def test_a_scoring_in_parts_equals_one_computed_whole(minutes: int, between: float) -> None:
    """Samples that arrive between the parts are not in this scoring's features, nor do
    they move the minute it began with."""
    now = T0 + 60 * 20 + 5
    whole, parted = fed(minutes), fed(minutes)
    expected = whole.score(now)
    parts = 0
    for _ in parted.prepare(now, chunk=5):
        parts += 1
        parted.observe(GpuSample(node="n0", gpu=0, time=T0 + between, source="test",
                                 power_w=9999.0))
    assert parts == -(-NODES * GPUS // 5)  # one part per chunk of GPUs
    computed = parted.computed
    assert computed is not None
    got = parted.score(now)
    assert parted.computed is computed  # score used the parts' probabilities
    reference = whole.computed
    assert reference is not None
    np.testing.assert_array_equal(computed.slots, reference.slots)
    np.testing.assert_allclose(computed.probs, reference.probs)
    assert [(f.subject.node, f.subject.gpu) for f in got] == \
        [(f.subject.node, f.subject.gpu) for f in expected]
