"""The live scorer's samples out of time order are visible to an operator
(``forewarn_collector_predictor_grid_samples_total{result}``): a sample late for its minute
(counted into the open one), one too far ahead and one repeated (both refused). Before, the
scorer counted them and nothing exported the counts."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from forewarn.collector.decide.predict import PredictorService
from forewarn.models.persist import default_model_path, load_default_model
from forewarn.wire import AgentBatch, GpuSample

pytestmark = pytest.mark.skipif(not default_model_path().exists(),
                                reason="no shipped default model")

NODE = "node0000"
T0 = 1_790_000_040.0
"""A whole minute."""
NAME = "forewarn_collector_predictor_grid_samples_total"


def _sample(gpu: int, t: float) -> GpuSample:
    return GpuSample(node=NODE, gpu=gpu, uuid=f"GPU-{gpu}", time=t, source="sim",
                     simulated=True, temperature_c=60.0, power_w=500.0, power_limit_w=700.0)


def _batch(seq: int, *samples: GpuSample) -> AgentBatch:
    return AgentBatch(node=NODE, agent_id="agent-0", seq=seq, created=T0, samples=list(samples))


def test_samples_out_of_time_order_are_counted_by_result() -> None:
    svc = PredictorService(load_default_model(), sample_s=0.0)  # every sample to the scorer
    registry = CollectorRegistry()
    svc.register(registry)

    def value(result: str) -> float | None:
        return registry.get_sample_value(NAME, {"result": result})

    assert (value("late"), value("too_far_ahead"), value("repeated")) == (0, 0, 0)
    svc.observe([_batch(0, _sample(0, T0 + 65), _sample(1, T0 + 5))])  # GPU 1 a minute late
    svc.observe([_batch(1, _sample(0, T0 + 65))])  # GPU 0's sample again
    svc.observe([_batch(2, _sample(1, T0 + 8 * 24 * 3600))])  # eight days ahead
    assert (value("late"), value("too_far_ahead"), value("repeated")) == (1, 1, 1)
    # every one of them was handed to the scorer: "fed" says so, this metric says which
    assert registry.get_sample_value("forewarn_collector_predictor_samples_total",
                                     {"result": "fed"}) == 4
