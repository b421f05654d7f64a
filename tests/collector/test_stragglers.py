"""Stragglers across nodes, live in the collector: the pace of every rank of a job is
compared across all its nodes (models/peers.py), and a slow rank is named with what its
GPU's telemetry shows.

A real collector over real HTTP on loopback (tests/support/collector); two agents' batches
(rank summaries and GPU samples) are posted as the agents post them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from forewarn.wire import GpuSample, RankSummary

from support.collector import Service, start_service, stop_service

BUCKET_S = 0.5
JOB = "train-2"
SLOW = ("node2", 1)
"""(node, GPU) of rank 3, the one that slows down."""


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[Service]:
    s = start_service(tmp_path, straggler_bucket_s=BUCKET_S)
    yield s
    stop_service(s)


def _rank(node: str, gpu: int, rank: int, pace: float, now: float) -> RankSummary:
    # synchronous data parallelism: every rank's wall step time is the slowest rank's;
    # the compute time per step tells who is slow
    return RankSummary(job=JOB, rank=rank, world_size=4, node=node, gpu=gpu, pid=100 + rank,
                       last_step=int(now * 4), last_step_time=now, step_seconds_p50=0.3,
                       compute_seconds_p50=pace)


def _gpu(node: str, gpu: int, now: float, throttled: bool) -> GpuSample:
    return GpuSample(node=node, gpu=gpu, time=now, source="sim", temperature_c=91.0 if throttled
                     else 62.0 + gpu, sm_clock_mhz=1110.0 if throttled else 1980.0,
                     power_w=420.0, power_limit_w=700.0,
                     throttle_reasons=0x40 if throttled else 0x0, pcie_replay_total=3)


def _play(svc: Service, seconds: float, pace: dict[int, float], throttled: bool) -> None:
    """Both agents post their ranks and GPUs every 0.1 s for ``seconds``."""
    end = time.time() + seconds
    while (now := time.time()) < end:
        for node, first in (("node1", 0), ("node2", 2)):
            svc.push(node, ranks=[_rank(node, g, first + g, pace[first + g], now)
                                  for g in (0, 1)],
                     samples=[_gpu(node, g, now, throttled and (node, g) == SLOW)
                              for g in (0, 1)])
        time.sleep(0.1)


def _stragglers(svc: Service) -> list[dict[str, Any]]:
    rows = svc.client.get("/api/v1/findings", params={"check_name": "job_straggler"}).json()
    return [r["finding"] for r in rows]


def test_a_thermally_throttled_rank_on_another_node_is_named_with_its_cause(
        svc: Service) -> None:
    _play(svc, 3.0, {0: 0.2, 1: 0.2, 2: 0.2, 3: 0.2}, throttled=False)
    assert _stragglers(svc) == []
    _play(svc, 4.0, {0: 0.2, 1: 0.2, 2: 0.2, 3: 0.29}, throttled=True)
    time.sleep(1.0)  # the policy thread stores what the last batches found
    found = _stragglers(svc)
    assert len(found) == 1, found
    f = found[0]
    assert f["subject"] == {"kind": "rank", "node": "node2", "gpu": 1, "job": JOB, "rank": 3}
    assert f["health"] == "degraded"
    assert "thermal" in f["reason"] and "thermal" in f["evidence"]["causes"].split(",")
    assert "clocks" in f["evidence"]["causes"].split(",")
    assert f["evidence"]["ratio"] == pytest.approx(1.45, abs=0.01)
    assert f["evidence"]["nodes"] == 2
    print("\n" + f["reason"])


def test_a_uniformly_slow_job_has_no_straggler(svc: Service) -> None:
    _play(svc, 2.0, {0: 0.2, 1: 0.2, 2: 0.2, 3: 0.2}, throttled=False)
    _play(svc, 4.0, {0: 0.35, 1: 0.35, 2: 0.35, 3: 0.35}, throttled=False)
    time.sleep(1.0)
    assert _stragglers(svc) == []


def _samples(n: int, **kw: Any) -> list[GpuSample]:
    base = {"node": "n", "gpu": 0, "source": "sim", "temperature_c": 60.0,
            "sm_clock_mhz": 1980.0, "throttle_reasons": 0, "pcie_replay_total": 5}
    return [GpuSample(**{**base, **{k: (v(i) if callable(v) else v) for k, v in kw.items()}},
                      time=1_700_000_000.0 + i) for i in range(n)]


def test_explain_names_power_pcie_and_nvlink_and_nothing_for_a_healthy_gpu() -> None:
    from forewarn.models.peers import explain
    from forewarn.wire import NvlinkCounters

    peers = [_samples(10), _samples(10, temperature_c=63.0)]
    assert explain(_samples(10), peers) == []
    braked = _samples(10, throttle_reasons=0x80, pcie_replay_total=lambda i: 5 + 40 * i,
                      nvlink=lambda i: (NvlinkCounters(link=0, crc_flit=3 * i),))
    assert [c.kind for c in explain(braked, peers)] == ["power", "pcie", "nvlink"]
    downtrained = _samples(10, pcie_link_width=8, pcie_link_width_max=16, pcie_link_gen=4,
                           pcie_link_gen_max=4)
    (cause,) = explain(downtrained, peers)
    assert cause.kind == "pcie" and "x8" in cause.text
