"""Alarms with memory: one episode per GPU per incident (hysteresis), a GPU that alarmed
and did not fail raises its own bar, a per-GPU alarm budget, and every alarm explains
itself (which signals, how far from the GPU's own baseline and from its peers)."""

from __future__ import annotations

import numpy as np

from forewarn.models.features import FEATURE_NAMES, GRID_S
from forewarn.models.live import LiveScorer
from forewarn.models.predictor import FailurePredictor
from forewarn.wire import Finding, GpuSample

_T0 = 1.75e9
_ECC = FEATURE_NAMES.index("ecc_d5")


class _ErrorsPerHundred:
    """A classifier at the model seam whose probability is the GPU's correctable-ECC
    errors of the last 5 minutes (beyond its own baseline) / 100: the test sets p."""

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        p = np.clip(np.expm1(x[:, _ECC]) / 100.0, 0.0, 1.0)
        return np.column_stack([1 - p, p])


def _run(bursts: dict[float, int], hours: float, alarm_budget: int = 3
         ) -> tuple[LiveScorer, list[Finding]]:
    """An 8-GPU node sampled every minute for ``hours``; GPU 0 gets ``bursts`` (hour ->
    correctable-ECC errors in that minute). Scored every minute; all findings."""
    scorer = LiveScorer(FailurePredictor(classifier=_ErrorsPerHundred(), threshold=0.85),
                        alarm_budget=alarm_budget)
    ecc = 0
    found: list[Finding] = []
    for m in range(int(hours * 60)):
        t = _T0 + m * GRID_S
        ecc += bursts.get(round(m / 60, 4), 0)
        for g in range(8):
            scorer.observe(GpuSample(
                node="n1", gpu=g, time=t + 1, source="test", temperature_c=60.0 + g * 0.1,
                power_w=500.0, power_limit_w=700.0, ecc_corrected_volatile=ecc if g == 0 else 0,
                pcie_replay_total=0))
        found += scorer.score(t + GRID_S + 2)
    return scorer, found


def test_one_episode_per_incident_with_hysteresis() -> None:
    # 90 errors (p 0.90: alarm), then 20 min later 75 (p 0.75: below the threshold but
    # above 0.8 x it, while the episode is open): one incident, one episode.
    scorer, found = _run({10.0: 90, 10.3333: 75}, 11.0)
    assert found, "no alarm at p 0.90"
    episodes = {f.evidence["episode"] for f in found}
    assert len(episodes) == 1, episodes
    assert any(f.probability is not None and f.probability < 0.85 for f in found), \
        "the open episode did not go on below the threshold"
    assert scorer.shadow().alarms == 1


def test_a_gpu_that_alarmed_and_did_not_fail_raises_its_own_bar() -> None:
    # Alarm at 10 h, no failure: settled false after the 1 h horizon; its bar goes from
    # 0.85 to 0.925. At 14 h p 0.90 no longer alarms; at 15 h p 0.97 does.
    scorer, found = _run({10.0: 90, 14.0: 90, 15.0: 97}, 16.0)
    times = sorted({f.time for f in found})
    assert times[0] < _T0 + 10.5 * 3600 and not any(
        _T0 + 14 * 3600 <= t < _T0 + 15 * 3600 for t in times), times
    late = [f for f in found if f.time >= _T0 + 15 * 3600]
    assert late and late[0].evidence["bar"] == 0.925
    assert len({f.evidence["episode"] for f in found}) == 2
    assert scorer.shadow().false_alarms == 1 and scorer.suppressed >= 1
    # Other GPUs keep the model's bar.
    assert scorer.bar(1, _T0 + 16 * 3600) == 0.85


def test_alarm_budget_per_gpu() -> None:
    # Four incidents 2 h apart, each p 1.0 (above any raised bar): with a budget of two
    # episodes a week, the third and fourth raise nothing.
    _scorer, found = _run({10.0: 200, 12.0: 200, 14.0: 200, 16.0: 200}, 17.0,
                          alarm_budget=2)
    assert len({f.evidence["episode"] for f in found}) == 2


def test_every_alarm_explains_itself() -> None:
    _scorer, found = _run({10.0: 90}, 10.5)
    assert found
    ev = found[0].evidence
    assert ev["signal"] == "correctable ECC"
    assert isinstance(ev["explanation"], str) and ev["explanation"].startswith(
        "correctable ECC +4.51 vs own, +4.51 vs peers")
    assert ev["signal_vs_own"] == ev["signal_vs_peers"] == round(float(np.log1p(90)), 4)
