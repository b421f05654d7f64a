"""The ``dcgm`` source against a real loopback HTTP server serving recorded dcgm-exporter
exposition text (tests/data/dcgm/): mapping, XID changes, lost GPUs, and an endpoint that
is down, serves junk, errors or hangs: a clear error, never a crash."""

from __future__ import annotations

import http.server
import re
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from forewarn.agent.backend import SourceUnavailable
from forewarn.agent.sources.dcgm import DcgmBackend, DcgmError
from forewarn.wire import GpuState

from support.paths import TESTS

DATA = TESTS / "data" / "dcgm"
HEALTHY = (DATA / "h100-healthy.prom").read_text()
FAULTY = (DATA / "h100-faulty.prom").read_text()
MIB = 1024 * 1024
NOW = 1_700_000_000.0


class Exporter:
    """A stand-in dcgm-exporter: a real HTTP server whose answer the test sets."""

    def __init__(self) -> None:
        self.body = HEALTHY
        self.status = 200
        self.hang = threading.Event()  # set: the handler stalls until released
        self.release = threading.Event()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if owner.hang.is_set():
                    owner.release.wait(10)
                    return
                data = owner.body.encode()
                self.send_response(owner.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                       daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def exporter() -> Iterator[Exporter]:
    ex = Exporter()
    yield ex
    ex.stop()


def _backend(exporter: Exporter, timeout_s: float = 2.0) -> DcgmBackend:
    return DcgmBackend(exporter.url, node="gpu-node-07", timeout_s=timeout_s)


def test_inventory_and_values_from_recorded_exposition(exporter: Exporter) -> None:
    b = _backend(exporter)
    infos = b.open()
    assert [i.index for i in infos] == [0, 1]
    assert infos[0].uuid == "GPU-3f6c1a02-58e1-2b7d-9a41-0c8e5d7b1f20"
    assert infos[1].pci_bus_id == "00000000:2A:00.0"
    assert infos[0].name == "NVIDIA H100 80GB HBM3"
    assert infos[0].memory_total_bytes == (69448 + 11523 + 588) * MIB
    s0, s1 = b.sample(NOW)
    assert s0.source == "dcgm" and not s0.simulated and s0.node == "gpu-node-07"
    assert s0.time == NOW and s0.state is GpuState.OK
    assert (s0.temperature_c, s0.memory_temperature_c, s0.slowdown_margin_c) == (63, 71, 24)
    assert (s0.power_w, s0.power_limit_w) == (512.347, 700)
    assert (s0.sm_clock_mhz, s0.mem_clock_mhz, s0.gpu_util_pct, s0.mem_util_pct) == (
        1980, 2619, 97, 41)
    assert s0.memory_used_bytes == 69448 * MIB
    assert (s1.ecc_corrected_volatile, s1.ecc_corrected_aggregate) == (12, 97)
    assert s1.ecc_uncorrected_volatile == 0 and s1.retired_pages_pending is False
    assert s1.remapped_rows_correctable == 2 and s1.remap_failure is False
    assert (s1.pcie_replay_total, s1.pcie_link_gen, s1.pcie_link_width_max) == (3, 5, 16)
    assert s1.throttle_reasons == 4 and s1.pstate == 0
    assert len(s1.nvlink) == 1 and s1.nvlink[0].crc_flit == 17 and s1.nvlink[0].replay == 9
    # Energy (mJ, as NVML) and the profiling fields the recording has.
    assert (s0.energy_mj, s1.energy_mj) == (193848119245, 190112274901)
    assert (s0.tensor_active, s0.dram_active) == (0.512876, 0.398114)
    assert s0.sm_active is None and s0.pcie_tx_bytes_per_s is None  # not in the recording
    assert b.drain_xids() == []  # XID 13 was already there at open: not news
    assert b.skipped == 0
    b.close()


PROFILING = """\
DCGM_FI_PROF_SM_ACTIVE{gpu="0",UUID="GPU-3f6c1a02-58e1-2b7d-9a41-0c8e5d7b1f20"} 0.87
DCGM_FI_PROF_PCIE_TX_BYTES{gpu="0",UUID="GPU-3f6c1a02-58e1-2b7d-9a41-0c8e5d7b1f20"} 1.5e+09
DCGM_FI_PROF_PCIE_RX_BYTES{gpu="0",UUID="GPU-3f6c1a02-58e1-2b7d-9a41-0c8e5d7b1f20"} 2.5e+09
DCGM_FI_PROF_NVLINK_TX_BYTES{gpu="0",UUID="GPU-3f6c1a02-58e1-2b7d-9a41-0c8e5d7b1f20"} 1.2e+11
DCGM_FI_PROF_NVLINK_RX_BYTES{gpu="0",UUID="GPU-3f6c1a02-58e1-2b7d-9a41-0c8e5d7b1f20"} 1.1e+11
DCGM_FI_PROF_SM_ACTIVE{gpu="1",UUID="GPU-8b02e7d4-c91a-4f3e-7d55-2a6b9e0c4d18"} 1.7
DCGM_FI_PROF_PCIE_TX_BYTES{gpu="1",UUID="GPU-8b02e7d4-c91a-4f3e-7d55-2a6b9e0c4d18"} -5
"""


def test_profiling_fields_of_dcgm_exporter_are_mapped(exporter: Exporter) -> None:
    """The DCGM_FI_PROF_* fields of dcgm-exporter's profiling counters (a DCGM 3 exporter
    with the DCP metrics enabled); a ratio above 1 or a negative rate is dropped."""
    exporter.body = HEALTHY + PROFILING
    b = _backend(exporter)
    b.open()
    s0, s1 = b.sample(NOW)
    assert s0.sm_active == 0.87
    assert (s0.pcie_tx_bytes_per_s, s0.pcie_rx_bytes_per_s) == (1.5e9, 2.5e9)
    assert (s0.nvlink_tx_bytes_per_s, s0.nvlink_rx_bytes_per_s) == (1.2e11, 1.1e11)
    assert s1.sm_active is None and s1.pcie_tx_bytes_per_s is None
    assert s1.tensor_active == 0.487221  # the rest of the GPU's sample stands
    b.close()


def test_fault_scrape_maps_errors_and_xid_change(exporter: Exporter) -> None:
    b = _backend(exporter)
    b.open()
    b.sample(NOW)
    exporter.body = FAULTY
    _, s1 = b.sample(NOW + 1)
    assert s1.ecc_uncorrected_volatile == 1 and s1.ecc_corrected_volatile == 4213
    assert s1.remapped_rows_uncorrectable == 1 and s1.remap_failure is True
    assert s1.pcie_replay_total == 1877 and s1.pcie_link_width == 8
    assert s1.slowdown_margin_c == -2 and s1.throttle_reasons == 0x68
    assert s1.nvlink[0].crc_flit == 5120
    (xid,) = b.drain_xids()
    assert (xid.gpu, xid.code, xid.source, xid.time) == (1, 79, "dcgm", NOW + 1)
    assert xid.pci_bus_id == "00000000:2A:00.0"
    b.sample(NOW + 2)
    assert b.drain_xids() == []  # same value again: no new event
    b.close()


def test_gpu_missing_from_scrape_is_lost(exporter: Exporter) -> None:
    b = _backend(exporter)
    b.open()
    exporter.body = "".join(ln + "\n" for ln in HEALTHY.splitlines() if 'gpu="1"' not in ln)
    s0, s1 = b.sample(NOW)
    assert s0.state is GpuState.OK
    assert s1.state is GpuState.LOST and s1.temperature_c is None and s1.errors
    assert s1.uuid == "GPU-8b02e7d4-c91a-4f3e-7d55-2a6b9e0c4d18"
    b.close()


def test_mig_instances_and_per_link_nvlink(exporter: Exporter) -> None:
    exporter.body = (
        '# TYPE DCGM_FI_DEV_GPU_TEMP gauge\n'
        'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-a",GPU_I_PROFILE="3g.40gb",GPU_I_ID="1"} 50\n'
        'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-a",GPU_I_PROFILE="3g.40gb",GPU_I_ID="2"} 51\n'
        'DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-a"} 300\n'
        'DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_L0{gpu="0",UUID="GPU-a"} 1\n'
        'DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_L5{gpu="0",UUID="GPU-a"} 40\n'
        'DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_L5{gpu="0",UUID="GPU-a"} 3\n'
        'DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL{gpu="0",UUID="GPU-a"} 41\n'
    )
    b = _backend(exporter)
    (info,) = b.open()
    assert info.uuid == "GPU-a"
    (s,) = b.sample(NOW)
    assert s.temperature_c == 50 and s.power_w == 300
    assert [(c.link, c.crc_flit, c.crc_data) for c in s.nvlink] == [(0, 1, None), (5, 40, 3)]
    b.close()


def test_partly_broken_exposition_skips_bad_lines(exporter: Exporter) -> None:
    exporter.body = HEALTHY + 'DCGM_FI_DEV_GPU_TEMP{gpu="0" 5\nthis is not prometheus\n' + (
        'DCGM_FI_DEV_GPU_TEMP{gpu="x"} 5\n')
    b = _backend(exporter)
    b.open()
    s0, _ = b.sample(NOW)
    assert s0.temperature_c == 63
    assert b.skipped >= 3
    b.close()


@pytest.mark.parametrize("body", [
    "<html><body>502 Bad Gateway</body></html>",
    "",
    "# HELP node_load1 1m load average.\n# TYPE node_load1 gauge\nnode_load1 0.5\n",
    "\x00\x01\x02 binary junk \xff",
])
def test_junk_is_a_clear_error(exporter: Exporter, body: str) -> None:
    exporter.body = body
    b = _backend(exporter)
    with pytest.raises(SourceUnavailable, match="no DCGM_FI_DEV_"):
        b.open()
    exporter.body = HEALTHY
    b.open()
    exporter.body = body
    with pytest.raises(DcgmError, match=re.escape(exporter.url)):
        b.sample(NOW)
    exporter.body = HEALTHY  # the exporter recovers: so does the source
    assert len(b.sample(NOW + 1)) == 2
    b.close()


def test_http_error_status_is_named(exporter: Exporter) -> None:
    exporter.status = 503
    with pytest.raises(DcgmError, match="HTTP 503"):
        _backend(exporter).open()


def test_hanging_endpoint_times_out(exporter: Exporter) -> None:
    b = _backend(exporter, timeout_s=0.3)
    b.open()
    exporter.hang.set()
    start = time.monotonic()
    with pytest.raises(DcgmError, match=r"timed out after 0\.3s"):
        b.sample(NOW)
    assert time.monotonic() - start < 5.0
    exporter.hang.clear()
    exporter.release.set()
    assert len(b.sample(NOW + 1)) == 2
    b.close()


def test_endpoint_down_at_open_is_source_unavailable() -> None:
    with socket.socket() as s:  # a port that was free a moment ago and has no listener
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    b = DcgmBackend(f"http://127.0.0.1:{port}/metrics", node="n", timeout_s=1.0)
    with pytest.raises(SourceUnavailable, match=re.escape(f"127.0.0.1:{port}")):
        b.open()
    b.close()
