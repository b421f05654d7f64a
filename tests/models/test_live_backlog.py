"""The live scorer after a backlog: samples read after a scoring that should have come
before it (a paused or new leader reading the stream's backlog, agents replaying their
spool after an outage) fill their own minutes of the grid, so the features are the batch
features real time would have given, not ten minutes collapsed into one. The grid follows
the data's clock; whether a GPU is scored stays on the wall clock."""

from __future__ import annotations

import msgspec
import numpy as np
import pandas as pd
import pytest

from forewarn.models.features import FEATURE_NAMES, GRID_S, LEGACY_NAMES, gpu_features
from forewarn.models.live import LiveScorer
from forewarn.models.live_state import restore, snapshot
from forewarn.models.persist import load_model
from forewarn.models.predictor import FailurePredictor
from forewarn.wire import GpuSample, XidEvent

from support.collector import NODE
from support.precursor import Case, make_case, samples

_BACKLOG_S = 600.0


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return make_case(tmp_path_factory.mktemp("backlog"))


@pytest.fixture(scope="module")
def model(case: Case) -> FailurePredictor:
    return load_model(case.model_path)


def _sent(case: Case, shift_s: float = 0.0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The case's samples and XIDs (times ``shift_s`` later: a clock ahead), in time order."""
    d = case.data
    s = d.samples[(d.samples.node == NODE) & d.samples.gpu.isin(case.gpus)
                  & (d.samples.time >= case.start)].sort_values("time", kind="stable").copy()
    x = d.xids[(d.xids.node == NODE) & d.xids.gpu.isin(case.gpus)
               & (d.xids.time >= case.start)].copy()
    s["time"] += shift_s
    x["time"] += shift_s
    return s, x


def _feed(scorer: LiveScorer, s: pd.DataFrame, x: pd.DataFrame, a: float, b: float) -> None:
    """The samples and XIDs timed in [a, b), in time order."""
    for r in samples(s[(s.time >= a) & (s.time < b)]):
        scorer.observe(r)
    for xr in x[(x.time >= a) & (x.time < b)].itertuples():
        scorer.observe_xid(XidEvent(node=NODE, gpu=int(xr.gpu), code=int(xr.xid),
                                    time=float(xr.time), source="sim", simulated=True))


def _assert_batch(scorer: LiveScorer, batch: pd.DataFrame, now: float) -> float:
    """The features of the minute scored at ``now`` (every GPU of the case fresh) are the
    batch features of that minute; returns the feature time."""
    scorer.score(now)
    c = scorer.computed
    assert c is not None
    ft = (c.minute + 1) * GRID_S
    gpus = [scorer._gpus[i] for i in c.slots]
    b = batch[batch.time == ft].set_index("gpu")
    assert sorted(gpus) == sorted(b.index), f"GPUs scored at {now}: {gpus}"
    for name in FEATURE_NAMES + LEGACY_NAMES:
        np.testing.assert_allclose(c.feats[name], b.loc[gpus, name].to_numpy(), atol=1e-6,
                                   err_msg=f"{name} at {ft}")
    return ft


def test_a_backlog_read_after_a_scoring_gives_the_batch_features(
        case: Case, model: FailurePredictor) -> None:
    """The leader scores every few seconds while ten minutes of telemetry are still in the
    stream (CI, test_bus_leader: it scored the precursor GPU 0.013 for a minute, batch
    0.966): the scorings after it has read them see the batch features, and the precursor
    GPU alarms at once."""
    s, x = _sent(case)
    batch = gpu_features(s, x)
    t = case.first_alarm  # the end of a minute the batch features alarm at
    scorer = LiveScorer(model)
    _feed(scorer, s, x, -np.inf, t - _BACKLOG_S)
    for now in (t - _BACKLOG_S + 5, t - 300, t - 5):  # scorings while the backlog waits
        scorer.score(now)
    _feed(scorer, s, x, t - _BACKLOG_S, t + 1)  # the backlog, and the samples at t
    assert _assert_batch(scorer, batch, t + 5) == t
    alarmed = [f.subject.gpu for f in scorer.score(t + 6)]
    assert alarmed == [case.gpu]
    for k in (1, 2):  # and on, in real time
        _feed(scorer, s, x, t + (k - 1) * GRID_S + 1, t + k * GRID_S + 1)
        assert _assert_batch(scorer, batch, t + k * GRID_S + 5) == t + k * GRID_S
    assert scorer.late == 0


def test_a_leader_restored_from_a_snapshot_fills_the_backlog_after_it(
        case: Case, model: FailurePredictor) -> None:
    """A replica takes over from the stored state of ten minutes ago and scores before it
    has read the stream's backlog from there: its features are those of a replica that read
    the backlog first."""
    s, x = _sent(case)
    t = case.first_alarm
    old = LiveScorer(model)
    _feed(old, s, x, -np.inf, t - _BACKLOG_S)
    blob = snapshot(old, t - _BACKLOG_S + 5)
    hurried, patient = LiveScorer(model), LiveScorer(model)
    for scorer in (hurried, patient):
        restore(scorer, blob, t)
    hurried.score(t + 1)
    for scorer in (hurried, patient):
        _feed(scorer, s, x, t - _BACKLOG_S, t + 1)
        scorer.score(t + 5)
    a, b = hurried.computed, patient.computed
    assert a is not None and b is not None and a.minute == b.minute == t // GRID_S - 1
    for name in FEATURE_NAMES:
        np.testing.assert_allclose(a.feats[name], b.feats[name], atol=1e-9, err_msg=name)
    assert hurried.late == 0


def test_agents_whose_clock_is_ahead_are_scored_on_their_own_minutes(
        case: Case, model: FailurePredictor) -> None:
    """Every agent's clock 90 s ahead of the collector's (ingest takes up to 300 s): the
    grid does not run ahead of the collector's clock, the minute scored is the wall
    clock's last complete one, with that minute's latest values, as in batch."""
    ahead = 90.0
    s, x = _sent(case, ahead)
    batch = gpu_features(s, x)
    t = case.first_alarm
    scorer = LiveScorer(model)
    scorer.score(float(s.time.min()) - ahead)  # the collector runs before the data comes
    _feed(scorer, s, x, -np.inf, t - 300 + ahead)
    for k in range(5):  # the collector's clock: a sample arrives as it is taken
        now = t - 300 + k * GRID_S
        _feed(scorer, s, x, now + ahead, now + GRID_S + ahead)
        assert _assert_batch(scorer, batch, now + 5) == now
    assert scorer.late == 0


def test_no_gpu_is_scored_once_the_data_stops_and_the_data_after_a_long_silence_is_taken(
        case: Case, model: FailurePredictor) -> None:
    """The bus down: the grid stays at the data's newest minute, and no GPU is scored once
    ``stale_s`` passed without a sample; eight days later (longer than the grid waits for a
    backlog, and than the jump it takes in one step) the fleet's samples are taken again."""
    s, x = _sent(case)
    t = case.first_alarm
    scorer = LiveScorer(model)
    _feed(scorer, s, x, -np.inf, t + 1)
    slots, _feats, ft = scorer.features(t + 5)
    assert len(slots) == len(case.gpus) and ft == t
    slots, _feats, ft = scorer.features(t + scorer.stale_s + 5)
    assert len(slots) == 0 and ft == t + GRID_S  # the minute of the last samples, no later
    assert scorer.score(t + scorer.stale_s + 5) == []
    later = t + 8 * 86400
    scorer.score(later - 60)
    rows = s[s.time == t].copy()
    rows["time"] = later
    for r in samples(rows):
        scorer.observe(r)
    assert scorer.skipped == 0
    slots, _feats, ft = scorer.features(later + 5)
    assert ft == later and len(slots) == len(case.gpus)


@pytest.mark.parametrize("silence", [70, 300, 1000])
def test_a_silence_rolled_at_once_is_the_silence_rolled_minute_by_minute(
        case: Case, model: FailurePredictor, silence: int) -> None:
    """The grid rolls a long silence (no sample comes in between) in one step: every state
    array as rolling it one minute after another gives, across baseline block boundaries,
    with a GPU met in the silence's first minute."""
    s, x = _sent(case)
    t = case.first_alarm
    fast, slow = LiveScorer(model), LiveScorer(model)
    for scorer in (fast, slow):
        _feed(scorer, s, x, -np.inf, t + 1)
        scorer.observe(GpuSample(node="node0001", gpu=0, time=t + 30, source="test",
                                 temperature_c=60.0, power_w=500.0, ecc_corrected_volatile=3))
    start = slow._minute
    assert start is not None
    for m in range(start + 1, start + silence + 1):
        slow._roll(m)
    fast._roll(start + silence)
    assert fast._minute == slow._minute
    for name, a in vars(slow).items():
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(vars(fast)[name], a, err_msg=name)


def test_one_node_whose_clock_is_ahead_does_not_move_the_grid_for_the_others(
        case: Case, model: FailurePredictor) -> None:
    """One node's agent stamps its samples 3 minutes ahead (ingest takes up to 300 s); the
    case's node is on time. Each sample arrives as it is taken, the collector scores a few
    seconds into every minute. The on-time GPUs' features are the batch features of their
    own data (none of their samples late). The fast node is scored sanely: every scoring
    holds it (fresh, never dropped) at the same minute as the others, with the batch
    features of its own data (its stamped times) at that minute -- its samples wait for
    the fleet's minute instead of closing minutes for everyone."""
    ahead = 180.0
    s, x = _sent(case)
    fast = s[s.gpu.isin(case.gpus[:2])].copy()
    fast["time"] += ahead
    own, fast_own = gpu_features(s, x), gpu_features(fast)
    t = case.first_alarm
    sent = [(r.time, r) for r in samples(s[s.time < t + 5 * GRID_S])]
    sent += [(r.time - ahead, msgspec.structs.replace(r, node="fast"))
             for r in samples(fast[fast.time < t + 5 * GRID_S + ahead])]
    sent.sort(key=lambda a: a[0])
    scorer = LiveScorer(model)
    scorer.score(sent[0][0])  # the collector runs before the first sample arrives
    k = 0
    for now in np.arange(t - 300 + 5, t + 5 * GRID_S, GRID_S):
        while k < len(sent) and sent[k][0] < now:
            scorer.observe(sent[k][1])
            k += 1
        scorer.score(now)
        c = scorer.computed
        assert c is not None
        ft = (c.minute + 1) * GRID_S
        assert ft == now - 5, f"minute scored at {now}: {ft}"
        for node, batch in ((NODE, own), ("fast", fast_own)):
            got = [j for j, i in enumerate(c.slots) if scorer._nodes[i] == node]
            gpus = [scorer._gpus[c.slots[j]] for j in got]
            b = batch[batch.time == ft].set_index("gpu")
            assert sorted(gpus) == sorted(b.index), f"{node} scored at {now}: {gpus}"
            for name in FEATURE_NAMES:
                np.testing.assert_allclose(c.feats[name][got], b.loc[gpus, name].to_numpy(),
                                           atol=1e-6, err_msg=f"{node} {name} at {ft}")
    assert scorer.late == 0


def test_a_leader_restored_from_a_snapshot_counts_a_sample_it_reads_again_once(
        case: Case, model: FailurePredictor) -> None:
    """The snapshot was taken in the middle of a minute, and the new leader reads the
    stream again from before it (batches the old leader had fed but not acknowledged):
    the samples the snapshot already holds are not counted twice into the open minute;
    its features are those of a leader restored alike that read every sample once."""
    s, x = _sent(case)
    t = case.first_alarm
    cut = t - 30  # the middle of the minute before t
    old = LiveScorer(model)
    _feed(old, s, x, -np.inf, cut)
    blob = snapshot(old, cut + 1)
    restored, once = LiveScorer(model), LiveScorer(model)
    for scorer in (restored, once):
        restore(scorer, blob, cut + 2)
    _feed(restored, s, x[x.time >= cut], t - GRID_S, t + 1)  # samples again from t - 60
    _feed(once, s, x, cut, t + 1)
    for scorer in (restored, once):
        scorer.score(t + 5)
    a, b = restored.computed, once.computed
    assert a is not None and b is not None and a.minute == b.minute == t // GRID_S - 1
    for name in FEATURE_NAMES:
        np.testing.assert_allclose(a.feats[name], b.feats[name], atol=1e-9, err_msg=name)
    assert restored.repeated == int(((s.time >= t - GRID_S) & (s.time < cut)).sum())
