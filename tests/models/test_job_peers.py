"""Job peers (models/job_peers.py): each GPU against the other GPUs of its job at the same
minute, for every signal, with the alarm memory the failure predictor's alarms use.

The case node peers miss: a whole node of a 4-node x 8-GPU job starts replaying PCIe
packets together (its host's root complex, a riser), so each of its GPUs reads zero
against its node peers -- but stands out from the job's other 24 GPUs."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from forewarn.models.features import GRID_S
from forewarn.models.live import LiveScorer
from forewarn.models.predictor import FailurePredictor
from forewarn.wire import Finding, GpuSample

_T0 = 1.75e9
Gpu = tuple[str, int]


class _Quiet:
    """A classifier at the model seam that never alarms: only job peers speak here."""

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        return np.column_stack([np.ones(len(x)), np.zeros(len(x))])


def _grid(nodes: Iterable[str], gpus: int) -> list[Gpu]:
    return [(n, g) for n in nodes for g in range(gpus)]


def _run(jobs: dict[str, list[Gpu]], rising: set[Gpu], minutes: int = 25,
         per_minute: int = 40) -> tuple[LiveScorer, list[Finding]]:
    """Every GPU of ``jobs`` sampled each minute; the ``rising`` ones replay ``per_minute``
    PCIe packets a minute from minute 5. Scored each minute; every job-peer finding."""
    scorer = LiveScorer(FailurePredictor(classifier=_Quiet(), threshold=0.85))
    replays = dict.fromkeys((g for members in jobs.values() for g in members), 0)
    found: list[Finding] = []
    for m in range(minutes):
        t = _T0 + m * GRID_S
        for job, members in jobs.items():
            for node, gpu in members:
                if m >= 5 and (node, gpu) in rising:
                    replays[node, gpu] += per_minute
                scorer.observe(GpuSample(
                    node=node, gpu=gpu, time=t + 1, source="test",
                    temperature_c=60.0 + gpu * 0.1, power_w=500.0, power_limit_w=700.0,
                    ecc_corrected_volatile=0, pcie_replay_total=replays[node, gpu]))
                scorer.assign_job(node, gpu, job, t + 1)
        found += scorer.job_findings(t + GRID_S + 2)
    return scorer, found


def _named(found: list[Finding]) -> set[Gpu]:
    return {(f.subject.node or "", f.subject.gpu or 0) for f in found}


def test_job_peers_name_a_node_that_drifts_as_a_whole() -> None:
    job = _grid(("n1", "n2", "n3", "n4"), 8)
    bad = set(_grid(("n2",), 8))
    scorer, found = _run({"train-7": job}, bad)
    assert _named(found) == bad
    # Node peers miss it: each of n2's GPUs reads zero against its node.
    slots, feats, _t = scorer.features(_T0 + 25 * GRID_S + 2)
    names = {(scorer._nodes[i], scorer._gpus[i]): k for k, i in enumerate(slots)}
    assert all(feats["pcie_vs_peers"][names[g]] == 0.0 for g in bad)
    assert all(feats["pcie_d15"][names[g]] > 5 for g in bad)
    f = found[0]
    assert f.check == "models.job_peers" and f.subject.job == "train-7"
    assert f.evidence["signal"] == "PCIe replays" and f.evidence["job_gpus"] == 32
    assert "stands out from the 32 GPUs of job train-7: PCIe replays" in f.reason
    assert "vs its node peers +0.00" in f.reason
    # One episode per GPU for the incident, though it alarms at every scoring.
    assert len(found) > len(bad)
    assert len({x.evidence["episode"] for x in found}) == len(bad)
    assert scorer.peers.memory.opened == len(bad)


def test_a_job_that_changes_together_names_no_one() -> None:
    job = _grid(("n1", "n2", "n3", "n4"), 8)
    _scorer, found = _run({"train-7": job}, set(job))
    assert found == []


def test_two_gpus_are_not_compared_three_are() -> None:
    """With two GPUs the median is their midpoint: either reads |z| <= 0.67 whichever moved,
    so a 2-GPU job names no one (its GPUs' own baselines judge them); from three the one
    that moved stands out."""
    pair = [("n5", 0), ("n5", 1)]
    trio = [("n6", 0), ("n7", 0), ("n8", 0)]  # one GPU per node
    _scorer, found = _run({"pair": pair, "trio": trio}, {("n5", 0), ("n6", 0)})
    assert _named(found) == {("n6", 0)}
    assert {f.subject.job for f in found} == {"trio"}
