"""The live scorer's learned state as a snapshot (:mod:`forewarn.models.live_state`): every
array the scorer holds is in it, whatever its name; a snapshot that does not fit is refused
with its reason and changes nothing; a restored scorer computes the features of one that
never stopped."""

from __future__ import annotations

import io
import json
import tracemalloc
import zipfile
from typing import Any

import numpy as np
import pytest

from forewarn.models.features import FEATURE_NAMES, GRID_S, LEGACY_NAMES
from forewarn.models.live import LiveScorer
from forewarn.models.live_state import (
    MAX_GPUS,
    NOT_SAVED,
    SAVED,
    SnapshotError,
    restore,
    snapshot,
)
from forewarn.models.predictor import FailurePredictor
from forewarn.wire import GpuSample

_T0 = 1.75e9


class _Zero:
    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        return np.column_stack([np.ones(len(x)), np.zeros(len(x))])


def _scorer() -> LiveScorer:
    return LiveScorer(FailurePredictor(classifier=_Zero()))


def _feed(scorer: LiveScorer, minutes: range, gpus: int = 20) -> None:
    """``gpus`` GPUs on nodes of 8, one sample a minute: a chronic ECC trickle on every
    third GPU, temperatures that differ by GPU and move with the minute."""
    rng = np.random.default_rng(minutes.start)
    for m in minutes:
        for g in range(gpus):
            scorer.observe(GpuSample(
                node=f"n{g // 8}", gpu=g % 8, time=_T0 + m * GRID_S + 1, source="test",
                temperature_c=55.0 + g + 5 * np.sin(m / 30) + rng.normal(0, 0.3),
                power_w=400.0 + g, power_limit_w=700.0,
                ecc_corrected_volatile=m // 2 if g % 3 == 0 else 0, pcie_replay_total=0))


def _features(scorer: LiveScorer, minute: int) -> dict[str, np.ndarray]:
    _slots, feats, _t = scorer.features(_T0 + minute * GRID_S + 2)
    return feats


def test_every_attribute_of_the_scorer_is_saved_or_left_out_on_purpose() -> None:
    s = _scorer()
    arrays = {k for k, v in vars(s).items() if isinstance(v, np.ndarray)}
    unknown = set(vars(s)) - arrays - SAVED - set(NOT_SAVED)
    assert not unknown, (f"LiveScorer state {sorted(unknown)} is neither saved nor left out "
                         "on purpose: classify it in forewarn.models.live_state")


class _WithFan(LiveScorer):
    """A scorer that keeps one more per-GPU array, as a new feature would add one."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._fan = np.zeros(self._last_seen.shape[-1])


def test_an_array_added_to_the_scorer_is_snapshotted_or_the_snapshot_is_refused() -> None:
    old = _scorer()
    _feed(old, range(30))
    s = _WithFan(old.model)
    _feed(s, range(30))
    s._fan[:20] = np.arange(20)
    back = _WithFan(old.model)
    restore(back, snapshot(s, _T0 + 30 * GRID_S), _T0 + 30 * GRID_S)
    np.testing.assert_array_equal(back._fan[:20], np.arange(20))
    # a snapshot written before the array existed does not fit a scorer that has it
    with pytest.raises(SnapshotError, match=r"state arrays differ: missing \['_fan'\]"):
        restore(back, snapshot(old, _T0 + 30 * GRID_S), _T0 + 30 * GRID_S)


def test_a_restored_scorer_computes_the_features_of_one_that_never_stopped() -> None:
    """Ten hours learned (the own baseline in use), a snapshot, a new scorer from it: the
    baseline features at once, every feature once the hour after the restart is on its
    own grid."""
    steady, before = _scorer(), _scorer()
    _feed(steady, range(600))
    _feed(before, range(600))
    back = _scorer()
    assert restore(back, snapshot(before, _T0 + 600 * GRID_S), _T0 + 600 * GRID_S) == 20
    _feed(steady, range(600, 700))
    _feed(back, range(600, 700))
    for minute, names in ((602, ("baseline_hours", "temp_vs_own", "power_vs_own")),
                          (699, FEATURE_NAMES + LEGACY_NAMES)):
        a, b = _features(steady, minute), _features(back, minute)
        assert a["baseline_hours"].min() > 0
        for c in names:
            np.testing.assert_allclose(b[c], a[c], atol=1e-9, err_msg=f"{c} at {minute}")


def test_alarm_memory_and_shadow_counts_come_back() -> None:
    s = _scorer()
    _feed(s, range(10))
    s.memory.alarm(3, _T0)
    s.memory.settle(_T0 + 2 * 3600)  # false: GPU slot 3's bar goes up
    s._failures, s._caught = 2, 1
    back = _scorer()
    restore(back, snapshot(s, _T0 + 10 * GRID_S), _T0 + 10 * GRID_S)
    now = _T0 + 3 * 3600
    assert back.bar(3, now) == s.bar(3, now) > back.model.threshold
    assert back.shadow() == s.shadow()


def _rewrite(blob: bytes, **change: object) -> bytes:
    """``blob`` with entries of its meta document (or arrays) replaced."""
    with np.load(io.BytesIO(blob), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays["meta"].tobytes())
    for k, v in change.items():
        if isinstance(v, np.ndarray):
            arrays[k] = v
        else:
            meta[k] = v
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    buf = io.BytesIO()
    np.savez(buf, allow_pickle=False, **arrays)
    return buf.getvalue()


def _refusals() -> dict[str, tuple[bytes, str]]:
    s = _scorer()
    _feed(s, range(30))
    good = snapshot(s, _T0 + 30 * GRID_S)
    with np.load(io.BytesIO(good), allow_pickle=False) as z:
        layout = json.loads(z["meta"].tobytes())["layout"]
        cur = z["_cur"]
    return {
        "corrupt": (good[: len(good) // 2], "not a readable snapshot"),
        "not npz": (b"\x80\x04K\x01.", "not a readable snapshot"),  # a pickle: never loaded
        "feature grid": (_rewrite(good, layout={**layout, "cum": [*layout["cum"], "fan"]}),
                         r"another feature grid: columns only in the snapshot \['fan'\]"),
        "lags": (_rewrite(good, layout={**layout, "lags": [5, 30, 60]}), "lags"),
        "format": (_rewrite(good, format=99), "format 99"),
        "dtype": (_rewrite(good, _cur=cur.astype(np.float32)), "array _cur: float32"),
        "shape": (_rewrite(good, _cur=cur[:, :5]), "array _cur"),
        "keys": (_rewrite(good, gpus=[0] * 20), "a GPU appears twice"),
        "too old": (good, "days old"),
        # a recent time but a last minute long past: the restored scorer would refuse
        # every sample as a clock jump and walk every minute since at its first scoring
        "minute long past": (_rewrite(good, minute=int(_T0 // GRID_S) - 8 * 1440),
                             "minute .* days old"),
        # a corrupt time: the scorer would hold samples as late until that minute came
        "from the future": (_rewrite(good, time=_T0 + 2 * 86400,
                                     minute=int((_T0 + 2 * 86400) // GRID_S)), "ahead"),
    }


@pytest.mark.parametrize("case", list(_refusals()))
def test_a_snapshot_that_does_not_fit_is_refused_and_changes_nothing(case: str) -> None:
    blob, reason = _refusals()[case]
    s = _scorer()
    _feed(s, range(5), gpus=3)
    before = {k: v.copy() for k, v in vars(s).items() if isinstance(v, np.ndarray)}
    now = _T0 + (30 * GRID_S if case != "too old" else 8 * 86400)
    with pytest.raises(SnapshotError, match=reason):
        restore(s, blob, now)
    assert s.gpus == 3
    for k, v in before.items():
        np.testing.assert_array_equal(getattr(s, k), v, err_msg=k)


def _thinning_node(hours: float, seed: int = 1) -> list[GpuSample]:
    """An 8-GPU node at 60 s for ``hours``, busy with workload changes; GPU 5 loses ever
    more samples over the last hour (up to 90 %), then falls off the bus."""
    rng = np.random.default_rng(seed)
    out = []
    end = hours * 3600
    for t in np.arange(0.0, end, GRID_S):
        load = 0.1 if (t // 5400) % 4 == 3 else 0.9
        for g in range(8):
            if g == 5 and rng.random() < 0.9 * max(0.0, (t - (end - 3600)) / 3600):
                continue
            temp = 35 + 40 * load + rng.normal(0, 0.8)
            out.append(GpuSample(
                node="n1", gpu=g, time=_T0 + t, source="test", temperature_c=temp,
                slowdown_margin_c=87.0 - temp,
                power_w=700 * (0.1 + 0.85 * load) + rng.normal(0, 15), power_limit_w=700.0,
                throttle_reasons=0, ecc_corrected_volatile=0, ecc_uncorrected_volatile=0,
                remapped_rows_correctable=0, remapped_rows_uncorrectable=0, remap_pending=False,
                pcie_replay_total=0, pcie_link_width=16, pcie_link_width_max=16))
    return out


def test_the_shipped_model_alarms_after_a_restart_as_without_one() -> None:
    """A GPU going quiet before it falls off the bus (its samples against its own long-run
    rate), the collector restarted 48 minutes before the end: the restored scorer alarms
    at the same scorings as one that never stopped (a fresh one has no own rate to miss
    samples against)."""
    from forewarn.models.persist import load_default_model

    model = load_default_model()
    samples = _thinning_node(14.0)
    restart = _T0 + 13.2 * 3600
    steady, back = LiveScorer(model), LiveScorer(model)
    found: dict[str, set[tuple[int, float]]] = {"steady": set(), "back": set()}
    next_score, restored = _T0 + 13 * 3600, False
    for s in samples:
        while s.time >= next_score:
            if next_score >= restart:
                for name, sc in (("steady", steady), ("back", back)):
                    found[name] |= {(int(f.subject.gpu or 0), f.time)
                                    for f in sc.score(next_score)}
            next_score += GRID_S
        if not restored and s.time >= restart:
            restore(back, snapshot(steady, restart), restart)
            restored = True
        steady.observe(s)
        if restored:
            back.observe(s)
    assert {g for g, _t in found["steady"]} == {5}
    assert found["back"] == found["steady"]


def _bomb(blob: bytes, member: str, nbytes: int) -> bytes:
    """``blob`` with ``member`` replaced by ``nbytes`` of zeros (a few hundred KiB
    compressed), written in chunks so the test itself never holds them."""
    src = zipfile.ZipFile(io.BytesIO(blob))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename != f"{member}.npy":
                dst.writestr(info.filename, src.read(info))
                continue
            dtype = np.dtype(np.uint8 if member == "meta" else np.float64)
            shape = (nbytes,) if member == "meta" else (4, nbytes // 32)
            with dst.open(info.filename, "w", force_zip64=True) as f:
                np.lib.format.write_array_header_1_0(
                    f, {"descr": dtype.str, "fortran_order": False, "shape": shape})
                chunk = bytes(1 << 20)
                for _ in range(nbytes // len(chunk)):
                    f.write(chunk)
    return out.getvalue()


@pytest.mark.parametrize("member", ["_cur", "meta"])
def test_a_decompression_bomb_is_refused_before_it_is_inflated(member: str) -> None:
    """A hostile or corrupt row: one archive member that inflates to 128 MiB. It is refused
    from its header, never decompressed into the collector's memory."""
    s = _scorer()
    _feed(s, range(30))
    blob = _bomb(snapshot(s, _T0 + 30 * GRID_S), member, 128 << 20)
    assert len(blob) < 2 << 20
    back = _scorer()
    tracemalloc.start()
    try:
        with pytest.raises(SnapshotError, match=member):
            restore(back, blob, _T0 + 30 * GRID_S)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak / 2**20:.0f} MiB taken to refuse it"


def test_a_snapshot_of_more_gpus_than_a_collector_holds_is_refused_unread() -> None:
    """Members consistent with each other can still declare a fleet that inflates to
    gigabytes: the GPU count is bounded before any array is read."""
    s = _scorer()
    _feed(s, range(5), gpus=3)
    n = MAX_GPUS + 1
    blob = _rewrite(snapshot(s, _T0 + 5 * GRID_S), nodes=["n"] * n, gpus=list(range(n)))
    with pytest.raises(SnapshotError, match=f"{n} GPUs"):
        restore(_scorer(), blob, _T0 + 5 * GRID_S)
