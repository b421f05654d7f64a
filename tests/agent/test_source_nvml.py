"""The nvml source against a FAKE libnvidia-ml.so.1 compiled from C (tests/fake_nvml/).

The real nvidia-ml-py code runs: only the shared library under it is the fake. pynvml
loads one library per process, so every test here shares the fake built once per session
and scripts it through its config file (FAKE_NVML_CONFIG), re-read when it changes.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

from forewarn import wire
from forewarn.agent.backend import SourceUnavailable
from forewarn.agent.sources.nvml import NvmlBackend
from forewarn.agent.sources.nvml import fields as nvml_fields
from forewarn.wire import GpuSample, GpuState, NvlinkCounters

from support.paths import TESTS

FAKE_DIR = TESTS / "fake_nvml"


def _load_builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fake_nvml_build", FAKE_DIR / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


builder = _load_builder()

Script = Callable[[str], None]


@pytest.fixture(scope="session")
def fake_lib(
    tmp_path_factory: pytest.TempPathFactory, require_binary: Callable[[str], str]
) -> Path:
    require_binary("gcc")
    lib: Path = builder.build_fake_nvml(tmp_path_factory.mktemp("fake_nvml"))
    return lib


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Script:
    """Write the fake's config (atomically); the fake re-reads it when it changes."""
    path = tmp_path / "fake_nvml.conf"
    monkeypatch.setenv("FAKE_NVML_CONFIG", str(path))

    def write(text: str) -> None:
        builder.write_config(path, text)

    write("count 1\n")
    return write


@pytest.fixture
def opened(fake_lib: Path) -> Iterator[Callable[..., NvmlBackend]]:
    backends: list[NvmlBackend] = []

    def make(**kwargs: object) -> NvmlBackend:
        backend = NvmlBackend(
            "node1", library_path=fake_lib, xid_wait_ms=100, **kwargs  # type: ignore[arg-type]
        )
        backend.open()
        backends.append(backend)
        return backend

    yield make
    for backend in backends:
        backend.close()


def fake_calls(lib: Path, key: str) -> int:
    """The fake's count of getter calls for ``key`` (a test-only symbol of the fake)."""
    fn = ctypes.CDLL(str(lib)).fake_nvml_calls
    fn.restype = ctypes.c_ulonglong
    fn.argtypes = [ctypes.c_char_p]
    return int(fn(key.encode()))


FULL = """
count 2
0.name NVIDIA H100 80GB HBM3
0.uuid GPU-11111111-2222-3333-4444-555555555555
0.busid 00000000:1B:00.0
*.temp 61
*.memtemp 70
*.margin 23
*.power_mw 312456
*.power_limit_mw 700000
*.sm_clock 1755
*.mem_clock 2619
*.util_gpu 97
*.util_mem 41
*.mem_total 85899345920
*.mem_used 42949672960
*.throttle 0x44
*.pstate 2
*.ecc_sbe_vol 7
*.ecc_dbe_vol 1
*.ecc_sbe_agg 120
*.ecc_dbe_agg 3
*.retired_sbe 4
*.retired_dbe 2
*.retired_pending 1
*.remap_cor 5
*.remap_unc 1
*.remap_pending 1
*.remap_failure 0
*.pcie_replay 33
*.energy_mj 987654321012
*.link_gen 4
*.link_gen_max 5
*.link_width 8
*.link_width_max 16
*.nvlinks 4
*.nvlink_crc_flit 10
*.nvlink_crc_data 11
*.nvlink_replay 12
*.nvlink_recovery 13
0.nvlink_crc_flit.2 99
1.temp 55
"""


def test_values_are_read_and_converted(script: Script, opened: Callable[..., NvmlBackend]) -> None:
    script(FULL)
    backend = opened()
    samples = backend.sample(1000.0)
    assert [s.gpu for s in samples] == [0, 1]
    s = samples[0]
    assert s.state is GpuState.OK
    assert (s.node, s.source, s.simulated, s.time) == ("node1", "nvml", False, 1000.0)
    assert s.name == "NVIDIA H100 80GB HBM3"
    assert s.pci_bus_id == "00000000:1B:00.0"
    assert s.temperature_c == 61.0
    assert s.memory_temperature_c == 70.0
    assert s.slowdown_margin_c == 23.0
    assert s.power_w == pytest.approx(312.456)  # milliwatts -> watts
    assert s.power_limit_w == pytest.approx(700.0)
    assert (s.sm_clock_mhz, s.mem_clock_mhz) == (1755.0, 2619.0)
    assert (s.gpu_util_pct, s.mem_util_pct) == (97.0, 41.0)
    assert (s.memory_used_bytes, s.memory_total_bytes) == (42949672960, 85899345920)
    assert s.throttle_reasons == 0x44
    assert s.pstate == 2
    assert (s.ecc_corrected_volatile, s.ecc_uncorrected_volatile) == (7, 1)
    assert (s.ecc_corrected_aggregate, s.ecc_uncorrected_aggregate) == (120, 3)
    assert (s.retired_pages_sbe, s.retired_pages_dbe, s.retired_pages_pending) == (4, 2, True)
    assert (s.remapped_rows_correctable, s.remapped_rows_uncorrectable) == (5, 1)
    assert (s.remap_pending, s.remap_failure) == (True, False)
    assert s.pcie_replay_total == 33
    assert s.energy_mj == 987654321012  # nvmlDeviceGetTotalEnergyConsumption, mJ
    assert (s.pcie_link_gen, s.pcie_link_gen_max) == (4, 5)
    assert (s.pcie_link_width, s.pcie_link_width_max) == (8, 16)
    assert s.nvlink == (
        NvlinkCounters(link=0, crc_flit=10, crc_data=11, replay=12, recovery=13),
        NvlinkCounters(link=1, crc_flit=10, crc_data=11, replay=12, recovery=13),
        NvlinkCounters(link=2, crc_flit=99, crc_data=11, replay=12, recovery=13),
        NvlinkCounters(link=3, crc_flit=10, crc_data=11, replay=12, recovery=13),
    )
    assert s.unsupported == ()
    assert s.errors == ()
    assert samples[1].temperature_c == 55.0
    # the sample is a valid wire record
    assert wire.decode(wire.encode(s), GpuSample) == s


def test_not_available_sentinels_become_missing_values(
        script: Script, opened: Callable[..., NvmlBackend]) -> None:
    """NVML answers NVML_VALUE_NOT_AVAILABLE (all bits set) where it has no value; passed
    on as 2**64-1 it wedged the collector's Parquet flush. It must arrive as missing."""
    script(FULL + """
0.ecc_sbe_vol -1
0.pcie_replay -1
0.remap_pending -1
0.memtemp -1
0.temp -1
0.power_mw -1
0.sm_clock -1
0.throttle -1
0.pstate 32
0.link_width -1
0.energy_mj -1
0.nvlink_replay.1 0xFFFFFFFFFFFFFFFF
""")
    s = opened().sample(1000.0)[0]
    assert s.ecc_corrected_volatile is None and s.pcie_replay_total is None
    assert s.remap_pending is None and s.memory_temperature_c is None
    assert s.temperature_c is None and s.power_w is None and s.sm_clock_mhz is None
    assert s.throttle_reasons is None and s.pstate is None and s.pcie_link_width is None
    assert s.energy_mj is None
    assert s.slowdown_margin_c == 23.0 and s.mem_clock_mhz == 2619.0  # the others stay
    assert s.ecc_uncorrected_volatile == 1
    assert s.nvlink[1] == NvlinkCounters(link=1, crc_flit=10, crc_data=11, recovery=13)
    assert wire.decode(wire.encode(s), GpuSample) == s


def test_reused_field_request_reads_fresh_values_like_the_public_call(
        script: Script, opened: Callable[..., NvmlBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The per-GPU field-value request is built once and reused: every poll still reads
    the current values, the same as nvidia-ml-py's own nvmlDeviceGetFieldValues."""
    script(FULL)
    backend = opened()
    first = backend.sample(1000.0)[0]
    script(FULL.replace("*.ecc_sbe_vol 7", "*.ecc_sbe_vol 8").replace(
        "0.nvlink_crc_flit.2 99", "0.nvlink_crc_flit.2 100"))
    reused = backend.sample(1001.0)[0]
    assert (first.ecc_corrected_volatile, reused.ecc_corrected_volatile) == (7, 8)
    assert (first.nvlink[2].crc_flit, reused.nvlink[2].crc_flit) == (99, 100)
    monkeypatch.setattr(nvml_fields, "_DIRECT_FIELDS", False)
    public = backend.sample(1001.0)[0]
    assert public == reused


def test_unchanged_nvlink_counters_share_the_previous_records(
        script: Script, opened: Callable[..., NvmlBackend]) -> None:
    """15 minutes of samples are kept: unchanged link records are stored once."""
    script(FULL)
    backend = opened()
    a = backend.sample(1.0)[0].nvlink
    b = backend.sample(2.0)[0].nvlink
    assert b is a
    script(FULL.replace("0.nvlink_crc_flit.2 99", "0.nvlink_crc_flit.2 100"))
    c = backend.sample(3.0)[0].nvlink
    assert c is not a and c[2].crc_flit == 100 and c[:2] == a[:2]


def test_inventory(script: Script, fake_lib: Path) -> None:
    script(FULL)
    backend = NvmlBackend("node1", library_path=fake_lib)
    try:
        infos = backend.open()
    finally:
        backend.close()
    assert [i.index for i in infos] == [0, 1]
    assert infos[0].uuid == "GPU-11111111-2222-3333-4444-555555555555"
    assert infos[0].pci_bus_id == "00000000:1B:00.0"
    assert infos[0].memory_total_bytes == 85899345920
    assert infos[1].serial == "FAKE00000001"
    assert backend.driver_version == "fake-nvml-0.1"


def test_links_beyond_the_field_ids_use_the_error_counter_call(
    script: Script, opened: Callable[..., NvmlBackend]
) -> None:
    script("count 1\n0.nvlinks 18\n0.nvlink_replay 1\n0.nvlink_replay.15 42\n")
    (s,) = opened().sample(1.0)
    assert len(s.nvlink) == 18
    assert s.nvlink[15].replay == 42
    assert s.nvlink[11].replay == 1
    assert s.nvlink[17] == NvlinkCounters(link=17, crc_flit=0, crc_data=0, replay=1, recovery=0)


def test_not_supported_fields_are_listed_and_not_asked_again(
    script: Script, opened: Callable[..., NvmlBackend], fake_lib: Path
) -> None:
    script(
        "count 1\n0.temp 50\n0.slowdown 87\n0.nvlinks 2\n"
        "0.unsupported ecc,memtemp,margin,util,remap,nvlink_crc_data,link_width_max,"
        "energy_mj\n"
    )
    backend = opened()
    for t in range(3):
        (s,) = backend.sample(float(t))
    assert s.state is GpuState.OK
    assert s.errors == ()
    assert s.ecc_corrected_volatile is None and s.ecc_uncorrected_aggregate is None
    assert s.memory_temperature_c is None
    assert s.gpu_util_pct is None and s.mem_util_pct is None
    assert s.remap_pending is None
    assert s.pcie_link_width_max is None
    assert s.nvlink[0].crc_data is None and s.nvlink[0].crc_flit == 0
    # margin API missing: slowdown threshold (87) - temperature (50)
    assert s.slowdown_margin_c == 37.0
    assert set(s.unsupported) == {
        "ecc_corrected_volatile", "ecc_uncorrected_volatile", "ecc_corrected_aggregate",
        "ecc_uncorrected_aggregate", "memory_temperature_c", "gpu_util_pct", "mem_util_pct",
        "remapped_rows_correctable", "remapped_rows_uncorrectable", "remap_pending",
        "remap_failure", "nvlink.crc_data", "pcie_link_width_max", "energy_mj",
    }
    # asked once, on the first poll only; supported fields every poll
    for key in ("ecc_sbe_vol", "memtemp", "margin", "util_gpu", "remap_cor", "nvlink_crc_data",
                "energy_mj"):
        assert fake_calls(fake_lib, key) == {"nvlink_crc_data": 2}.get(key, 1), key
    assert fake_calls(fake_lib, "temp") == 3
    assert fake_calls(fake_lib, "pcie_replay") == 3


def test_other_field_errors_are_reported_per_field(
    script: Script, opened: Callable[..., NvmlBackend]
) -> None:
    script("count 1\n0.power_mw 250000\n0.fail power_mw,remap_cor\n")
    backend = opened()
    (s,) = backend.sample(1.0)
    assert s.state is GpuState.OK
    assert s.power_w is None and s.remapped_rows_correctable is None
    assert s.power_limit_w == 700.0 and s.remapped_rows_uncorrectable == 0
    assert any(e.startswith("power_w: ") for e in s.errors), s.errors
    assert any(e.startswith("remapped_rows_correctable: ") for e in s.errors), s.errors
    assert s.unsupported == ()
    # a transient error is retried next poll
    script("count 1\n0.power_mw 250000\n")
    (s,) = backend.sample(2.0)
    assert s.power_w == 250.0 and s.errors == ()


def test_gpu_lost_and_reset_required_while_others_keep_sampling(
    script: Script, opened: Callable[..., NvmlBackend]
) -> None:
    script("count 3\n*.temp 40\n")
    backend = opened()
    assert [s.state for s in backend.sample(1.0)] == [GpuState.OK] * 3
    script("count 3\n*.temp 41\n1.lost 1\n")
    s0, s1, s2 = backend.sample(2.0)
    assert s1.state is GpuState.LOST
    assert s1.temperature_c is None
    assert s1.uuid and s1.pci_bus_id  # identity kept for the finding
    assert s1.errors and "lost" in s1.errors[0].lower()
    assert (s0.state, s0.temperature_c) == (GpuState.OK, 41.0)
    assert (s2.state, s2.temperature_c) == (GpuState.OK, 41.0)
    script("count 3\n*.temp 42\n2.reset_required 1\n")
    s0, s1, s2 = backend.sample(3.0)
    assert (s1.state, s1.temperature_c) == (GpuState.OK, 42.0)
    assert s2.state is GpuState.RESET_REQUIRED
    assert s0.temperature_c == 42.0


def test_gpu_lost_at_start_is_sampled_as_lost(
    script: Script, opened: Callable[..., NvmlBackend]
) -> None:
    script("count 2\n0.lost 1\n")
    backend = opened()
    s0, s1 = backend.sample(1.0)
    assert s0.state is GpuState.LOST
    assert s1.state is GpuState.OK and s1.temperature_c == 40.0
    script("count 2\n")  # it came back (after a reset)
    s0, _ = backend.sample(2.0)
    assert s0.state is GpuState.OK and s0.uuid.startswith("GPU-fake")


@pytest.mark.parametrize("lost", ["0", "*"])
def test_gpu_back_after_start_is_registered_for_xid_events(
    script: Script, opened: Callable[..., NvmlBackend], lost: str
) -> None:
    """A GPU that did not answer at open() and comes back reports its XIDs (with every
    GPU lost at start, the event thread starts when the first one answers)."""
    script(f"count 2\n{lost}.lost 1\n")
    backend = opened()
    assert backend.sample(1.0)[0].state is GpuState.LOST
    script("count 2\n")
    assert [s.state for s in backend.sample(2.0)] == [GpuState.OK, GpuState.OK]
    script("count 2\nxid 0 79\n")
    got: list[wire.XidEvent] = []

    def one_event() -> bool:
        got.extend(backend.drain_xids())
        return bool(got)

    assert _wait_for(one_event)
    assert [(e.gpu, e.code) for e in got] == [(0, 79)]


def test_driver_not_loaded_is_source_unavailable(script: Script, fake_lib: Path) -> None:
    script("init_error 9\n")
    backend = NvmlBackend("node1", library_path=fake_lib)
    with pytest.raises(SourceUnavailable, match="kernel driver is not loaded"):
        backend.open()
    backend.close()


def test_missing_library_file_is_source_unavailable(tmp_path: Path) -> None:
    backend = NvmlBackend("node1", library_path=tmp_path / "libnvidia-ml.so.1")
    with pytest.raises(SourceUnavailable, match="cannot load NVML library"):
        backend.open()


def test_no_driver_library_is_source_unavailable(tmp_path: Path) -> None:
    """pynvml's own lookup of libnvidia-ml.so.1 fails: a clear error, not a traceback.

    Runs in a child process: this process has the fake loaded already."""
    code = (
        "from forewarn.agent.backend import SourceUnavailable\n"
        "from forewarn.agent.sources.nvml import NvmlBackend\n"
        "try:\n"
        "    NvmlBackend('n').open()\n"
        "except SourceUnavailable as exc:\n"
        "    print('UNAVAILABLE', exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["LD_LIBRARY_PATH"] = str(tmp_path)  # an empty directory
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    if "UNAVAILABLE" not in out:
        pytest.skip("a real libnvidia-ml.so.1 is installed here")
    assert "libnvidia-ml.so.1 not found" in out


def _wait_for(predicate: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while time.monotonic() < deadline:
        if predicate():
            return True
        pause.wait(0.02)
    return predicate()


def test_xid_events_are_delivered_by_drain_xids(
    script: Script, opened: Callable[..., NvmlBackend]
) -> None:
    base = "count 2\n1.busid 00000000:2A:00.0\n"
    script(base)
    backend = opened(clock=lambda: 1234.5)
    assert backend.drain_xids() == []
    script(base + "xid 1 79\nxid 0 48\n")
    got: list[wire.XidEvent] = []

    def two_events() -> bool:
        got.extend(backend.drain_xids())
        return len(got) >= 2

    assert _wait_for(two_events), got
    first, second = got
    assert (first.gpu, first.code, first.pci_bus_id) == (1, 79, "00000000:2A:00.0")
    assert (first.node, first.source, first.time) == ("node1", "nvml", 1234.5)
    assert (second.gpu, second.code) == (0, 48)
    assert backend.drain_xids() == []  # drained once
    backend.close()
    assert not any(t.name == "nvml-xid" for t in threading.enumerate())


def test_sample_after_close_is_source_unavailable(
    script: Script, opened: Callable[..., NvmlBackend]
) -> None:
    backend = opened()
    backend.close()
    backend.close()  # twice is fine
    with pytest.raises(SourceUnavailable):
        backend.sample(1.0)


def test_reopen_after_close_starts_afresh(script: Script, fake_lib: Path) -> None:
    script("count 2\n*.temp 50\n")
    backend = NvmlBackend("node1", library_path=fake_lib, xid_wait_ms=100)
    assert len(backend.open()) == 2
    backend.close()
    script("count 3\n*.temp 51\n")
    try:
        assert len(backend.open()) == 3
        assert [s.temperature_c for s in backend.sample(1.0)] == [51.0] * 3
    finally:
        backend.close()
