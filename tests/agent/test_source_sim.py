"""The ``sim`` source: scenario loading and validation, and every fault kind driving the
right signals at the right simulated times (a fake clock steps time; nothing sleeps)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from forewarn.agent.backend import SourceUnavailable
from forewarn.agent.sources.scenario import (
    ScenarioError,
    default_scenario,
    load_scenario,
    parse_scenario,
)
from forewarn.agent.sources.sim import SimBackend
from forewarn.gpu import (
    HW_POWER_BRAKE_SLOWDOWN,
    HW_SLOWDOWN,
    HW_THERMAL_SLOWDOWN,
    SW_THERMAL_SLOWDOWN,
)
from forewarn.wire import GpuSample, GpuState

T0 = 1_700_000_000.0


class StepClock:
    """A clock the test moves by hand."""

    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _backend(toml: str, speed: float = 1.0, gpus: int = 2) -> SimBackend:
    backend = SimBackend(parse_scenario(toml), node="sim-node", speed=speed, gpus=gpus,
                         clock=StepClock())
    backend.open()
    return backend


def _at(backend: SimBackend, t: float, gpu: int = 0) -> GpuSample:
    """Sample of ``gpu`` at simulated second ``t`` (speed 1: wall = T0 + t)."""
    return backend.sample(backend.wall_time(t))[gpu]


def _fault(kind: str, **kw: object) -> str:
    body = "\n".join(f"{k} = {v!r}".replace("'", '"').replace("True", "true").replace(
        "False", "false") for k, v in kw.items())
    return f'gpus = 2\nseed = 1\n[[faults]]\nkind = "{kind}"\n{body}\n'


# ------------------------------------------------------------------ normal values


def test_healthy_gpus_have_plausible_marked_values() -> None:
    backend = _backend("gpus = 4\nseed = 3\n")
    infos = backend.open()
    assert [i.index for i in infos] == [0, 1, 2, 3]
    assert len({i.uuid for i in infos}) == 4 and len({i.pci_bus_id for i in infos}) == 4
    for t in range(0, 600, 7):
        for s in backend.sample(backend.wall_time(t)):
            assert s.simulated and s.source == "sim" and s.state is GpuState.OK
            assert s.node == "sim-node"
            assert s.temperature_c is not None and 50 < s.temperature_c < 75
            assert s.slowdown_margin_c is not None and s.slowdown_margin_c > 10
            assert s.power_w is not None and s.power_limit_w is not None
            assert 0 < s.power_w <= s.power_limit_w
            assert s.gpu_util_pct is not None and 0 <= s.gpu_util_pct <= 100
            assert s.throttle_reasons == 0
            assert s.ecc_corrected_volatile == 0 and s.ecc_uncorrected_volatile == 0
            assert s.pcie_link_width == s.pcie_link_width_max == 16
            assert len(s.nvlink) == 18 and all(link.crc_flit == 0 for link in s.nvlink)
            assert not s.remap_pending and not s.remap_failure
    assert backend.drain_xids() == []


def test_same_seed_same_values_whatever_the_poll_cadence() -> None:
    toml = "gpus = 2\nseed = 7\n"
    a, b = _backend(toml), _backend(toml)
    for t in (0.0, 0.5, 13.25, 100.0):
        sa = _at(a, t)
        for _ in range(3):  # extra polls in between change nothing
            b.sample(b.wall_time(t / 2))
        assert _at(b, t) == sa
    c = _backend("gpus = 2\nseed = 8\n")
    assert _at(c, 13.25).temperature_c != _at(a, 13.25).temperature_c


def test_speed_scales_scenario_time_and_xid_wall_time() -> None:
    toml = _fault("sudden", gpu=0, start_s=100.0, xid=79)
    clock = StepClock()
    backend = SimBackend(parse_scenario(toml), node="n", speed=10.0, clock=clock)
    backend.open()
    backend.sample(T0 + 9.9)
    assert backend.drain_xids() == []
    samples = backend.sample(T0 + 10.0)
    assert samples[0].state is GpuState.LOST and samples[0].time == T0 + 10.0
    (xid,) = backend.drain_xids()
    assert xid.code == 79 and xid.time == pytest.approx(T0 + 10.0)
    assert backend.sim_time(T0 + 10.0) == pytest.approx(100.0)


def test_offset_skips_xids_that_happened_before() -> None:
    toml = _fault("sudden", gpu=0, start_s=5.0, xid=48)
    backend = SimBackend(parse_scenario(toml), node="n", offset_s=10.0, clock=StepClock())
    backend.open()
    s = backend.sample(T0)[0]
    assert s.ecc_uncorrected_volatile == 1  # the state shows it happened
    assert backend.drain_xids() == []  # but it is not reported as new



def test_start_file_holds_the_clock_until_it_exists(tmp_path: Path) -> None:
    """With ``start_file`` the faults play from when the file appears, not from open():
    a demo starts them once its job trains, whenever that is."""
    start = tmp_path / "go"
    toml = f'start_file = "{start}"\n' + _fault("sudden", gpu=0, start_s=5.0, xid=48)
    backend = SimBackend(parse_scenario(toml), node="n", clock=StepClock())
    backend.open()
    assert backend.sample(T0 + 100.0)[0].ecc_uncorrected_volatile == 0
    assert backend.drain_xids() == []
    assert backend.sim_time(T0 + 100.0) == 0.0
    start.touch()
    backend.sample(T0 + 200.0)  # the clock starts at the first sample that sees the file
    assert backend.sample(T0 + 204.9)[0].ecc_uncorrected_volatile == 0
    assert backend.sample(T0 + 205.0)[0].ecc_uncorrected_volatile == 1
    (xid,) = backend.drain_xids()
    assert xid.code == 48 and xid.time == pytest.approx(T0 + 205.0)

# ------------------------------------------------------------------ fault kinds


def test_ecc_storm_grows_then_double_bit_error_and_xid48() -> None:
    b = _backend(_fault("ecc_storm", gpu=1, start_s=10.0, duration_s=60.0))
    assert _at(b, 9.0, gpu=1).ecc_corrected_volatile == 0
    counts = [_at(b, t, gpu=1).ecc_corrected_volatile or 0 for t in range(10, 70, 10)]
    assert counts == sorted(counts) and counts[-1] > 250
    rates = [b2 - a for a, b2 in itertools.pairwise(counts)]
    assert rates[-1] > 5 * max(rates[0], 1)  # accelerating
    before = _at(b, 69.9, gpu=1)
    assert before.ecc_uncorrected_volatile == 0
    xids = b.drain_xids()
    assert [(x.code, x.gpu) for x in xids] == [(92, 1)]  # high SBE rate, half way
    after = _at(b, 70.0, gpu=1)
    assert after.ecc_uncorrected_volatile == 1 and after.ecc_uncorrected_aggregate == 1
    assert after.remap_pending and after.remapped_rows_uncorrectable == 1
    (xid,) = b.drain_xids()
    assert xid.code == 48 and xid.gpu == 1 and xid.simulated and xid.source == "sim"
    assert xid.pci_bus_id == after.pci_bus_id and xid.time == pytest.approx(T0 + 70.0)
    assert _at(b, 70.0, gpu=0).ecc_corrected_volatile == 0  # the other GPU is untouched


def test_remap_growth_pending_then_failure_and_xid64() -> None:
    b = _backend(_fault("remap_growth", gpu=0, start_s=0.0, duration_s=80.0, rows=8))
    first = _at(b, 5.0)
    assert first.remapped_rows_correctable == 0 and not first.remap_pending
    mid = _at(b, 40.0)
    assert mid.remapped_rows_correctable == 4 and mid.remap_pending and not mid.remap_failure
    assert [x.code for x in b.drain_xids()] == [63]
    end = _at(b, 80.0)
    assert end.remapped_rows_correctable == 8 and end.remap_failure
    assert [x.code for x in b.drain_xids()] == [64]


def test_retired_pages_grow_with_pending() -> None:
    b = _backend(_fault("retired_pages", gpu=0, start_s=0.0, duration_s=40.0, pages=4))
    assert _at(b, 5.0).retired_pages_sbe == 0
    s = _at(b, 20.0)
    assert s.retired_pages_sbe == 2 and s.retired_pages_pending
    assert _at(b, 100.0).retired_pages_sbe == 4


def test_thermal_runaway_margin_zero_throttles_and_drops_clocks() -> None:
    b = _backend(_fault("thermal_runaway", gpu=0, start_s=10.0, duration_s=100.0))
    base = _at(b, 5.0)
    assert base.throttle_reasons == 0 and base.sm_clock_mhz == 1980
    temps = [_at(b, t).temperature_c or 0.0 for t in range(10, 80, 10)]
    assert temps[-1] > temps[0] + 20
    hot = _at(b, 90.0)
    assert hot.slowdown_margin_c == 0.0
    bits = hot.throttle_reasons or 0
    assert bits & SW_THERMAL_SLOWDOWN and bits & HW_THERMAL_SLOWDOWN and bits & HW_SLOWDOWN
    assert hot.sm_clock_mhz is not None and hot.sm_clock_mhz < 0.6 * 1980
    assert base.power_w is not None and hot.power_w is not None and hot.power_w < base.power_w
    cooled = _at(b, 115.0)  # recover = true by default
    assert cooled.throttle_reasons == 0 and (cooled.slowdown_margin_c or 0) > 10


def test_power_brake_sets_bits_for_its_duration() -> None:
    b = _backend(_fault("power_brake", gpu=0, start_s=10.0, duration_s=20.0))
    on = _at(b, 15.0)
    assert (on.throttle_reasons or 0) & HW_POWER_BRAKE_SLOWDOWN
    assert on.sm_clock_mhz is not None and on.sm_clock_mhz < 1000
    assert _at(b, 31.0).throttle_reasons == 0


def test_pcie_replay_grows_link_downgrades_then_lost_with_xid79() -> None:
    b = _backend(_fault("pcie_replay", gpu=0, start_s=0.0, duration_s=100.0,
                        degraded_width=4, degraded_gen=3))
    early = _at(b, 40.0)
    assert early.pcie_link_width == 16 and early.pcie_link_gen == 5
    late = _at(b, 60.0)
    assert late.pcie_link_width == 4 and late.pcie_link_gen == 3
    assert late.pcie_link_width_max == 16 and late.pcie_link_gen_max == 5
    assert (late.pcie_replay_total or 0) > (early.pcie_replay_total or 0) > 0
    assert _at(b, 99.0).state is GpuState.OK
    assert b.drain_xids() == []
    lost = _at(b, 100.0)
    assert lost.state is GpuState.LOST and lost.temperature_c is None and lost.errors
    (xid,) = b.drain_xids()
    assert xid.code == 79 and xid.gpu == 0
    assert _at(b, 500.0).state is GpuState.LOST  # it stays lost


def test_nvlink_crc_grows_on_one_link_then_xid74() -> None:
    b = _backend(_fault("nvlink_crc", gpu=0, start_s=0.0, duration_s=60.0, link=3))
    s = _at(b, 50.0)
    by_link = {c.link: c for c in s.nvlink}
    assert (by_link[3].crc_flit or 0) > 100 and (by_link[3].crc_data or 0) > 0
    assert all(c.crc_flit == 0 for c in s.nvlink if c.link != 3)
    assert b.drain_xids() == []
    end = {c.link: c for c in _at(b, 60.0).nvlink}
    assert end[3].recovery == 1
    assert [x.code for x in b.drain_xids()] == [74]


@pytest.mark.parametrize(
    ("xid", "state", "dbe"),
    [(79, GpuState.LOST, None), (48, GpuState.OK, 1), (95, GpuState.RESET_REQUIRED, None),
     (119, GpuState.OK, 0)],
)
def test_sudden_failure_has_no_precursor(xid: int, state: GpuState, dbe: int | None) -> None:
    b = _backend(_fault("sudden", gpu=0, start_s=30.0, xid=xid))
    before = [_at(b, t) for t in range(0, 30)]
    assert all(s.state is GpuState.OK and s.ecc_corrected_volatile == 0 for s in before)
    assert b.drain_xids() == []
    s = _at(b, 30.0)
    assert s.state is state and s.ecc_uncorrected_volatile == dbe
    assert [x.code for x in b.drain_xids()] == [xid]


def test_ecc_burst_is_benign() -> None:
    b = _backend(_fault("ecc_burst", gpu=0, start_s=10.0, duration_s=5.0, errors=40))
    assert _at(b, 20.0).ecc_corrected_volatile == 40
    assert _at(b, 200.0).ecc_corrected_volatile == 40
    assert _at(b, 200.0).ecc_uncorrected_volatile == 0
    assert b.drain_xids() == []


# ------------------------------------------------------------------ the default scenario


def test_default_scenario_plays_several_faults_within_three_minutes() -> None:
    sc = default_scenario()
    assert sc.gpus == 8
    assert {type(f).__name__ for f in sc.faults} >= {
        "EccStorm", "RemapGrowth", "ThermalRunaway", "PcieReplay", "NvlinkCrc", "Sudden"}
    clock = StepClock()
    b = SimBackend(node="n", clock=clock)  # no scenario: the embedded default
    b.open()
    xids = []
    for t in range(0, 181, 1):
        b.sample(T0 + t)
        xids += b.drain_xids()
    codes = {(x.gpu, x.code) for x in xids}
    assert {(1, 48), (3, 79), (4, 64), (5, 74), (6, 79)} <= codes
    final = b.sample(T0 + 180)
    assert final[3].state is GpuState.LOST and final[6].state is GpuState.LOST
    assert final[0].state is GpuState.OK and final[0].throttle_reasons == 0
    assert all(x.time <= T0 + 180 for x in xids)


# ------------------------------------------------------------------ bad scenario files


def _error(tmp_path: Path, text: str) -> str:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    assert isinstance(info.value, SourceUnavailable)  # the daemon handles it as one
    msg = str(info.value)
    assert str(path) in msg
    return msg


def test_corrupt_toml_names_the_line(tmp_path: Path) -> None:
    msg = _error(tmp_path, "gpus = 8\nseed = \n")
    assert "not valid TOML" in msg and "line 2" in msg


def test_unknown_kind_is_named(tmp_path: Path) -> None:
    msg = _error(tmp_path, 'gpus = 2\n\n[[faults]]\ngpu = 0\nkind = "meltdown"\nstart_s = 1\n')
    assert "faults[0].kind" in msg and "meltdown" in msg and "ecc_storm" in msg
    assert "line 5" in msg


def test_wrong_type_names_key_and_line(tmp_path: Path) -> None:
    text = ('gpus = 2\n[[faults]]\ngpu = 0\nkind = "sudden"\nstart_s = 1\n'
            '[[faults]]\ngpu = "one"\nkind = "sudden"\nstart_s = 1\n')
    msg = _error(tmp_path, text)
    assert "faults[1].gpu" in msg and "line 7" in msg and "int" in msg


def test_unknown_key_is_named(tmp_path: Path) -> None:
    msg = _error(tmp_path, "gpus = 2\n[baseline]\ntemperature_c = 60\ntempertaure_c = 61\n")
    assert "baseline.tempertaure_c" in msg and "line 4" in msg


def test_unknown_fault_parameter_is_named(tmp_path: Path) -> None:
    msg = _error(tmp_path, '[[faults]]\ngpu = 0\nkind = "ecc_storm"\nstart_s = 1\npeak = 3\n')
    assert "faults[0].peak" in msg and "line 5" in msg


def test_missing_field_and_bad_range_are_named(tmp_path: Path) -> None:
    msg = _error(tmp_path, '[[faults]]\ngpu = 0\nkind = "ecc_storm"\n')
    assert "faults[0]" in msg and "start_s" in msg
    msg = _error(tmp_path, '[[faults]]\ngpu = 0\nkind = "ecc_storm"\nstart_s = -5\n')
    assert "faults[0].start_s" in msg and ">= 0" in msg and "line 4" in msg


def test_fault_on_missing_gpu_or_link_is_named(tmp_path: Path) -> None:
    msg = _error(tmp_path, 'gpus = 2\n[[faults]]\ngpu = 5\nkind = "sudden"\nstart_s = 1\n')
    assert "faults[0].gpu" in msg and "does not exist" in msg and "line 3" in msg
    msg = _error(tmp_path, '[baseline]\nnvlinks = 4\n[[faults]]\ngpu = 0\nkind = "nvlink_crc"\n'
                           'start_s = 1\nlink = 9\n')
    assert "faults[0].link" in msg and "line 7" in msg


def test_unreadable_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path / "missing.toml")
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ScenarioError, match=r"bin\.toml"):
        load_scenario(tmp_path / "bin.toml")


def test_fault_beyond_runtime_gpu_count_is_refused() -> None:
    sc = parse_scenario('[[faults]]\ngpu = 6\nkind = "sudden"\nstart_s = 1\n')
    with pytest.raises(ScenarioError, match=r"faults\[0\]\.gpu"):
        SimBackend(sc, node="n", gpus=4)
    assert SimBackend(sc, node="n", gpus=8).gpus == 8


# ------------------------------------------------------------------ with the agent's checks


def test_default_scenario_fires_the_agent_checks_before_each_failure() -> None:
    """The simulated precursors are realistic enough for the real checks: each faulty GPU
    is flagged by the check for its fault (before the terminal event where there is a
    precursor), and the healthy GPU 0 is never flagged."""
    from forewarn.agent.checks import default_checks
    from forewarn.agent.checks.base import run_checks
    from forewarn.agent.state import AgentState

    backend = SimBackend(node="n", clock=StepClock())
    state = AgentState(node="n")
    state.add_inventory(backend.open())
    checks = default_checks()
    first: dict[tuple[int | None, str, str], float] = {}
    for t in range(0, 181):
        now = T0 + t
        state.add_samples(backend.sample(now))
        state.add_xids(backend.drain_xids(), now)
        for run in run_checks(checks, state, now):
            for f in run.findings:
                if f.health.value != "healthy":
                    first.setdefault((f.subject.gpu, f.check, f.health.value), t)
    assert not [k for k in first if k[0] == 0], first
    expect_before = {  # (gpu, check, health): flagged no later than (terminal event)
        (1, "ecc", "degraded"): 110,  # correctable storm before the DBE at 110 s
        (1, "ecc", "unhealthy"): 110,
        (2, "thermal", "unhealthy"): 100,
        (3, "pcie", "degraded"): 119,  # replays before the GPU falls off the bus at 120 s
        (3, "gpu_lost", "unhealthy"): 120,
        (4, "remap", "degraded"): 124,  # pending remaps before the failure at 125 s
        (4, "remap", "unhealthy"): 125,
        (5, "nvlink", "degraded"): 74,  # CRC growth before XID 74 at 75 s
        (5, "xid", "unhealthy"): 75,
        (6, "gpu_lost", "unhealthy"): 150,
        (7, "power_brake", "degraded"): 110,
    }
    for key, deadline in expect_before.items():
        assert key in first, f"{key} never fired: {sorted(first)}"
        assert first[key] <= deadline, (key, first[key])
    assert first[(6, "gpu_lost", "unhealthy")] == 150  # sudden: no warning before
    assert not [k for k in first if k[0] == 6 and first[k] < 150]


def test_energy_counter_and_profiling_fields_follow_the_scenario() -> None:
    """The sim GPU reports what the energy and DCGM profiling panels show: an energy
    counter (baseline watts times simulated seconds, in mJ) and activity ratios."""
    from forewarn.agent.sources.sim import SimBackend

    clock = iter([0.0]).__next__
    backend = SimBackend(node="n", gpus=2, speed=1.0, clock=clock)
    backend.open()
    b = backend.scenario.baseline
    first, later = backend.sample(10.0)[0], backend.sample(20.0)[0]
    assert first.energy_mj == int(1000 * b.power_w * 10) and later.energy_mj is not None
    assert later.energy_mj - first.energy_mj == int(1000 * b.power_w * 10)
    for s in (first, later):
        assert s.sm_active is not None and 0 < s.sm_active <= 1
        assert s.tensor_active is not None and s.dram_active is not None
        assert s.pcie_tx_bytes_per_s and s.nvlink_rx_bytes_per_s
