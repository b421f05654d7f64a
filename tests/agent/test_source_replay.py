"""The ``replay`` source: recordings written from the sim source play back as the same
samples and XIDs (CSV and Parquet), on the recording's time base or re-timed, and bad
files are refused at open with an error naming the column and row."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from forewarn.agent.backend import SourceUnavailable
from forewarn.agent.sources.replay import ReplayBackend, ReplayError, sample_row
from forewarn.agent.sources.scenario import parse_scenario
from forewarn.agent.sources.sim import SimBackend
from forewarn.wire import GpuSample, GpuState, XidEvent

REC0 = 1_650_000_000.0  # recording time base
NOW0 = 1_700_000_000.0  # replay wall clock

SCENARIO = """
gpus = 2
seed = 5
[baseline]
nvlinks = 4
[[faults]]
gpu = 1
kind = "nvlink_crc"
start_s = 2
duration_s = 6
link = 2
[[faults]]
gpu = 0
kind = "pcie_replay"
start_s = 0
duration_s = 8
"""


class StepClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _record(seconds: int = 10) -> tuple[list[GpuSample], list[XidEvent]]:
    sim = SimBackend(parse_scenario(SCENARIO), node="rec-node", clock=StepClock(REC0))
    sim.open()
    samples: list[GpuSample] = []
    xids: list[XidEvent] = []
    for t in range(seconds):
        samples += sim.sample(REC0 + t)
        xids += sim.drain_xids()
    return samples, xids


def _write(samples: list[GpuSample], xids: list[XidEvent], path: Path) -> Path:
    by_key = {(x.gpu, x.time): x for x in xids}
    df = pd.DataFrame([sample_row(s, by_key.get((s.gpu, s.time))) for s in samples])
    if path.suffix == ".parquet":
        df.to_parquet(path)
    else:
        df.to_csv(path, index=False)
    return path


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_replay_reproduces_the_recording(tmp_path: Path, suffix: str) -> None:
    samples, xids = _record()
    path = _write(samples, xids, tmp_path / f"rec{suffix}")
    backend = ReplayBackend(path, retime=False, clock=StepClock(NOW0))
    infos = backend.open()
    assert [i.index for i in infos] == [0, 1]
    assert infos[0].uuid == samples[0].uuid and infos[0].pci_bus_id == samples[0].pci_bus_id
    assert backend.simulated  # the recording came from the simulator and says so
    played: list[GpuSample] = []
    got_xids: list[XidEvent] = []
    for t in range(12):
        played += backend.sample(NOW0 + t)
        got_xids += backend.drain_xids()
    assert backend.finished and backend.skipped == 0
    assert len(played) == len(samples)
    for want, got in zip(samples, played, strict=True):
        assert got.source == "replay"
        assert got.state == want.state and got.time == want.time
        for field in ("temperature_c", "power_w", "pcie_replay_total", "pcie_link_width",
                      "remap_pending", "throttle_reasons", "ecc_corrected_volatile", "uuid"):
            assert getattr(got, field) == getattr(want, field), field
        assert got.nvlink == want.nvlink
    assert [(x.gpu, x.code, x.time) for x in got_xids] == [(x.gpu, x.code, x.time) for x in xids]
    assert {x.code for x in got_xids} == {74, 79}
    lost = [s for s in played if s.state is GpuState.LOST]
    assert lost and all(s.gpu == 0 and s.temperature_c is None for s in lost)


def test_playback_speed_and_retiming(tmp_path: Path) -> None:
    samples, xids = _record()
    path = _write(samples, xids, tmp_path / "rec.csv")
    clock = StepClock(NOW0)
    backend = ReplayBackend(path, speed=2.0, as_node="live-node", clock=clock)
    backend.open()
    first = backend.sample(NOW0)
    assert [s.gpu for s in first] == [0, 1] and first[0].time == NOW0
    assert all(s.node == "live-node" for s in first)
    other = ReplayBackend(path, node="agent-node", clock=clock)  # a one-node recording
    other.open()
    assert {s.node for s in other.sample(NOW0 + 100)} == {"agent-node"}
    assert backend.sample(NOW0 + 0.4) == []  # recording second 1 is due at wall +0.5
    batch = backend.sample(NOW0 + 1.0)  # recording seconds 1 and 2
    assert [s.time for s in batch] == [NOW0 + 0.5] * 2 + [NOW0 + 1.0] * 2
    rest = backend.sample(NOW0 + 100)
    assert len(first) + len(batch) + len(rest) == len(samples)
    assert backend.sample(NOW0 + 200) == [] and backend.finished
    xid79 = next(x for x in backend.drain_xids() if x.code == 79)
    assert xid79.node == "live-node" and xid79.time == pytest.approx(NOW0 + 8 / 2.0)


def test_separate_xid_file_and_node_selection(tmp_path: Path) -> None:
    rows = [
        {"node": n, "gpu": g, "time": REC0 + t, "temperature_c": 50 + t}
        for n in ("a", "b") for g in (0, 1) for t in range(3)
    ]
    pd.DataFrame(rows).to_csv(tmp_path / "two.csv", index=False)
    pd.DataFrame([
        {"node": "a", "gpu": 1, "time": REC0 + 1.5, "xid": 48, "xid_text": "DBE"},
        {"node": "a", "gpu": None, "time": REC0 + 0.5, "xid": 79, "pci_bus_id": "0000:3b:00"},
        {"node": "b", "gpu": 0, "time": REC0 + 1, "xid": 13},
    ]).to_csv(tmp_path / "two.xid.csv", index=False)
    with pytest.raises(ReplayError, match="holds 2 nodes"):
        ReplayBackend(tmp_path / "two.csv").open()
    with pytest.raises(ReplayError, match="node 'c' not in"):
        ReplayBackend(tmp_path / "two.csv", node="c").open()
    backend = ReplayBackend(tmp_path / "two.csv", node="a", xid_path=tmp_path / "two.xid.csv",
                            retime=False, clock=StepClock(NOW0))
    backend.open()
    samples = backend.sample(NOW0 + 10)
    assert len(samples) == 6 and {s.node for s in samples} == {"a"}
    xids = backend.drain_xids()
    assert [(x.code, x.gpu, x.pci_bus_id, x.text) for x in xids] == [
        (79, None, "0000:3b:00", ""), (48, 1, "", "DBE")]
    assert not backend.simulated and xids[0].source == "replay"
    # An events file with no events for this node (or none at all) means no XIDs, not an error.
    pd.DataFrame([{"node": "x", "gpu": 0, "time": REC0, "xid": 13},
                  {"node": "y", "gpu": 0, "time": REC0, "xid": 13}]).to_csv(
        tmp_path / "other.xid.csv", index=False)
    pd.DataFrame(columns=["node", "gpu", "time", "xid"]).to_csv(tmp_path / "empty.xid.csv",
                                                               index=False)
    for events in ("other.xid.csv", "empty.xid.csv"):
        quiet = ReplayBackend(tmp_path / "two.csv", node="b", xid_path=tmp_path / events,
                              retime=False, clock=StepClock(NOW0))
        quiet.open()
        assert len(quiet.sample(NOW0 + 10)) == 6 and quiet.drain_xids() == []


def test_unknown_columns_are_ignored_and_listed(tmp_path: Path) -> None:
    pd.DataFrame([{"node": "a", "gpu": 0, "time": REC0, "label_fails_in_s": 30.0,
                   "source": "nvml", "power_w": 300}]).to_csv(tmp_path / "l.csv", index=False)
    backend = ReplayBackend(tmp_path / "l.csv", clock=StepClock(NOW0))
    backend.open()
    assert backend.ignored_columns == ["label_fails_in_s"]
    (s,) = backend.sample(NOW0)
    assert s.power_w == 300 and s.source == "replay"


def test_iso_and_parquet_timestamps(tmp_path: Path) -> None:
    pd.DataFrame([{"node": "a", "gpu": 0, "time": "2024-01-01T00:00:10Z"},
                  {"node": "a", "gpu": 0, "time": "2024-01-01T00:00:00Z"}]
                 ).to_csv(tmp_path / "iso.csv", index=False)
    b = ReplayBackend(tmp_path / "iso.csv", retime=False, clock=StepClock(NOW0))
    b.open()
    assert [s.time for s in b.sample(NOW0 + 60)] == [1704067200.0, 1704067210.0]
    pd.DataFrame({"node": ["a"], "gpu": [0], "time": pd.to_datetime(["2024-01-01T00:00:00Z"])}
                 ).to_parquet(tmp_path / "ts.parquet")
    b = ReplayBackend(tmp_path / "ts.parquet", retime=False, clock=StepClock(NOW0))
    b.open()
    assert [s.time for s in b.sample(NOW0)] == [1704067200.0]


# ------------------------------------------------------------------ bad recordings


def _refused(tmp_path: Path, rows: list[dict[str, object]], name: str = "bad.csv") -> str:
    path = tmp_path / name
    pd.DataFrame(rows).to_csv(path, index=False)
    with pytest.raises(ReplayError) as info:
        ReplayBackend(path).open()
    assert isinstance(info.value, SourceUnavailable)
    assert str(path) in str(info.value)
    return str(info.value)


OK = {"node": "a", "gpu": 0, "time": REC0}


def test_missing_required_columns_are_named(tmp_path: Path) -> None:
    msg = _refused(tmp_path, [{"node": "a", "temperature_c": 50}])
    assert "missing required column(s) gpu, time" in msg


def test_kelvin_temperature_is_named(tmp_path: Path) -> None:
    msg = _refused(tmp_path, [OK | {"temperature_c": 60}, OK | {"temperature_c": 333.15}])
    assert "'temperature_c'" in msg and "line 3" in msg and "kelvin" in msg


def test_milliwatts_are_named(tmp_path: Path) -> None:
    msg = _refused(tmp_path, [OK | {"power_w": 350_000}])
    assert "'power_w'" in msg and "milliwatts" in msg


def test_negative_counter_is_named(tmp_path: Path) -> None:
    msg = _refused(tmp_path, [OK | {"ecc_corrected_volatile": 3},
                              OK | {"ecc_corrected_volatile": -1}])
    assert "'ecc_corrected_volatile'" in msg and "negative" in msg and "line 3" in msg
    msg = _refused(tmp_path, [OK | {"nvlink2_crc_flit": -4}])
    assert "'nvlink2_crc_flit'" in msg


def test_wrong_types_are_named(tmp_path: Path) -> None:
    assert "a number expected" in _refused(tmp_path, [OK | {"power_w": "lots"}])
    assert "'remap_pending'" in _refused(tmp_path, [OK | {"remap_pending": "maybe"}])
    assert "'state'" in _refused(tmp_path, [OK | {"state": "melted"}])
    assert "'gpu'" in _refused(tmp_path, [OK | {"gpu": 1.5}])
    assert "'xid'" in _refused(tmp_path, [OK | {"xid": "seventy-nine"}])
    assert "an integer expected" in _refused(tmp_path, [OK | {"pcie_replay_total": 2.5}])


def test_bad_times_are_named(tmp_path: Path) -> None:
    assert "milliseconds" in _refused(tmp_path, [OK | {"time": REC0 * 1000}])
    assert "'time'" in _refused(tmp_path, [OK | {"time": "yesterday"}])


def test_unreadable_files_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ReplayError, match="cannot read"):
        ReplayBackend(tmp_path / "junk.parquet").open()
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(ReplayError, match="cannot read"):
        ReplayBackend(tmp_path / "empty.csv").open()
    (tmp_path / "header.csv").write_text("node,gpu,time\n")
    with pytest.raises(ReplayError, match="no rows"):
        ReplayBackend(tmp_path / "header.csv").open()
    (tmp_path / "rec.json").write_text("{}")
    with pytest.raises(ReplayError, match="unknown file type"):
        ReplayBackend(tmp_path / "rec.json").open()
    with pytest.raises(ReplayError, match="cannot read"):
        ReplayBackend(tmp_path / "missing.csv").open()
