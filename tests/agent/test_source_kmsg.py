"""The ``kmsg`` XID source: real driver line formats, /dev/kmsg record framing, reading a
regular file and a FIFO without blocking, EPIPE, and garbage counted, never raised."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from forewarn.agent.backend import GpuInfo, SourceUnavailable
from forewarn.agent.sources.kmsg import KmsgXidSource, ParsedXid, parse_line
from forewarn.agent.state import AgentState

BOOT = 1_700_000_000.0


@pytest.mark.parametrize(
    ("line", "bus", "code", "text", "uptime"),
    [
        ("4,1234,5678901,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, "
         "GPU has fallen off the bus.", "0000:3b:00", 79,
         "pid=1234, name=python, GPU has fallen off the bus.", 5.678901),
        ("3,991,12000000,-,caller=T1234;NVRM: Xid (PCI:0000:b3:00): 48, pid='<unknown>', "
         "name=<unknown>, An uncorrectable double bit error (DBE) has been detected on GPU "
         "in the framebuffer at partition 5, subpartition 0.", "0000:b3:00", 48,
         "pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) has been "
         "detected on GPU in the framebuffer at partition 5, subpartition 0.", 12.0),
        ("[ 1234.567890] NVRM: Xid (PCI:0000:3b:00): 13, Graphics SM Warp Exception on "
         "(GPC 0, TPC 0): Out Of Range Address", "0000:3b:00", 13,
         "Graphics SM Warp Exception on (GPC 0, TPC 0): Out Of Range Address", 1234.56789),
        ("[   42.000001] NVRM: Xid (0000:03:00): 79, GPU has fallen off the bus.",
         "0000:03:00", 79, "GPU has fallen off the bus.", 42.000001),
        ("NVRM: Xid (PCI:0000:17:00): 119, pid=99, name=torchrun, Timeout waiting for RPC "
         "from GSP! Expected function 76 (GSP_RM_CONTROL).", "0000:17:00", 119,
         "pid=99, name=torchrun, Timeout waiting for RPC from GSP! Expected function 76 "
         "(GSP_RM_CONTROL).", None),
        ("Jan 12 10:11:12 gpu-node-7 kernel: NVRM: Xid (PCI:0000:5d:00): 74, pid=7, "
         "name=python3, NVLink: fatal error detected on link 3", "0000:5d:00", 74,
         "pid=7, name=python3, NVLink: fatal error detected on link 3", None),
        ("2024-03-01T10:11:12.123456+00:00 gpu-node-7 kernel: [ 99.5] NVRM: Xid "
         "(PCI:00000000:DB:00.0): 92, High single-bit ECC error rate", "00000000:DB:00.0", 92,
         "High single-bit ECC error rate", None),
        ("[Mon Jan 12 10:11:12 2024] NVRM: Xid (PCI:0000:9a:00): 31, pid=2135, Ch 00000008, "
         "intr 00000000. MMU Fault: ENGINE GRAPHICS", "0000:9a:00", 31,
         "pid=2135, Ch 00000008, intr 00000000. MMU Fault: ENGINE GRAPHICS", None),
        ("6,100,200,-;NVRM: Xid (PCI:0000:3b:00): 45", "0000:3b:00", 45, "", 0.0002),
    ],
)
def test_parses_real_driver_formats(line: str, bus: str, code: int, text: str,
                                    uptime: float | None) -> None:
    parsed = parse_line(line)
    assert isinstance(parsed, ParsedXid)
    assert (parsed.bus_id, parsed.code, parsed.text) == (bus, code, text)
    if uptime is None:
        assert parsed.uptime_s is None
    else:
        assert parsed.uptime_s == pytest.approx(uptime)


@pytest.mark.parametrize("line", [
    "6,339,5140900,-;NET: Registered protocol family 10",
    "[    3.123456] nvidia-nvlink: Nvlink Core is being initialized",
    "NVRM: GPU at PCI:0000:3b:00: GPU-5a4f0e3c-8b1b-11ee-b9d1-0242ac120002",
    "Jan 12 10:11:12 host kernel: usb 1-1: new high-speed USB device",
    "",
])
def test_other_kernel_messages_are_not_xids_and_not_garbage(line: str) -> None:
    assert parse_line(line) is None


@pytest.mark.parametrize("line", [
    "complete garbage",
    "4,12;",  # truncated record header
    "NVRM: Xid (PCI:0000:3b:00): seventy-nine, GPU has fallen off the bus.",
    "6,1,2,-;NVRM: Xid (PCI:zz:3b): 79, x",
    "[ 1.0] NVRM: Xid (PCI:0000:3b:00): 9999999, too big",
    "\x00\x01\x02 binary",
])
def test_garbage_is_flagged(line: str) -> None:
    assert parse_line(line) is False


@given(st.text(max_size=300))
def test_parse_line_never_raises(line: str) -> None:
    parse_line(line)


def _source(path: Path, **kw: object) -> KmsgXidSource:
    return KmsgXidSource(path, node="node-1", boot_time=BOOT, clock=lambda: BOOT + 500.0,
                         **kw)  # type: ignore[arg-type]


FIXTURE = (
    "6,339,5140900,-;NET: Registered protocol family 10\n"
    " SUBSYSTEM=pci\n"
    " DEVICE=+pci:0000:3b:00.0\n"
    "4,1234,5678901,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, "
    "GPU has fallen off the bus.\n"
    "this is not a kernel record\n"
    "4,1240,6000000,-;NVRM: Xid (PCI:0000:3b:00): oops\n"
    "[  100.250000] NVRM: Xid (PCI:0000:5d:00): 48, DBE\n"
    "NVRM: Xid (PCI:0000:18:00): 13, Graphics Exception: ESR 0x504648=0x101\n"
)


def test_reads_a_file_from_start_counting_garbage(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_bytes(FIXTURE.encode() + b"\xff\xfe\x80 invalid utf8\n")
    src = _source(path, from_start=True)
    events = src.drain()
    assert [(e.code, e.pci_bus_id) for e in events] == [
        (79, "0000:3b:00"), (48, "0000:5d:00"), (13, "0000:18:00")]
    assert events[0].time == pytest.approx(BOOT + 5.678901)
    assert events[1].time == pytest.approx(BOOT + 100.25)
    assert events[2].time == BOOT + 500.0  # no timestamp: the injected clock
    assert all(e.node == "node-1" and e.source == "kmsg" and e.gpu is None
               and not e.simulated for e in events)
    assert src.skipped == 3
    assert src.drain() == []
    src.close()
    src.close()  # idempotent
    assert src.drain() == []


def test_starts_at_the_end_and_follows_appends_and_split_lines(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_text(FIXTURE)
    src = _source(path)
    assert src.drain() == [] and src.skipped == 0  # old messages are not re-reported
    with path.open("a") as f:
        f.write("4,2000,7000000,-;NVRM: Xid (PCI:0000:3b:00): 7")
        f.flush()
        assert src.drain() == []  # half a line: wait for the rest
        f.write("4, pid=1, name=x, NVLink error\n")
    (event,) = src.drain()
    assert event.code == 74 and event.text == "pid=1, name=x, NVLink error"


def test_bus_id_maps_to_gpu_through_agent_state(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_text(FIXTURE)
    (event, *_) = _source(path, from_start=True).drain()
    state = AgentState(node="node-1")
    state.add_inventory([GpuInfo(index=0, pci_bus_id="00000000:18:00.0"),
                         GpuInfo(index=3, pci_bus_id="00000000:3B:00.0")])
    assert state.gpu_for_bus_id(event.pci_bus_id) == 3


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "kmsg.fifo"
    os.mkfifo(path)
    yield path


def test_fifo_is_read_without_blocking(fifo: Path) -> None:
    src = _source(fifo)  # opening a FIFO non-blocking needs no writer
    assert src.drain() == []  # no writer yet: end of file, not a hang
    wfd = os.open(fifo, os.O_WRONLY)
    try:
        assert src.drain() == []  # writer, no data: EAGAIN
        os.write(wfd, b"3,5,9000000,-;NVRM: Xid (PCI:0000:9a:00): 79, GPU has fallen off the "
                      b"bus.\ngarbage\n")
        events = src.drain()
        assert [e.code for e in events] == [79] and src.skipped == 1
        assert src.drain() == []
    finally:
        os.close(wfd)
    assert src.drain() == []
    src.close()


class FakeKmsgDevice:
    """Stands in for the kernel's /dev/kmsg read(): one record per call, EPIPE once the
    ring buffer overwrote unread records, EAGAIN when there is nothing more."""

    def __init__(self, script: list[bytes | type[OSError]]) -> None:
        self.script = script

    def __call__(self, fd: int, n: int) -> bytes:
        if not self.script:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        item = self.script.pop(0)
        if isinstance(item, bytes):
            assert len(item) <= n
            return item
        raise item(32, "Broken pipe")


def test_epipe_is_counted_and_reading_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_text("")
    device = FakeKmsgDevice([
        b"4,1,1000000,-;NVRM: Xid (PCI:0000:3b:00): 48, DBE\n",
        BrokenPipeError,
        b"4,90,2000000,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n",
    ])
    src = _source(path, reader=device)
    events = src.drain()
    assert [e.code for e in events] == [48, 79] and src.lost == 1
    assert src.drain() == []


def test_read_errors_are_counted_not_raised(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_text("")
    device = FakeKmsgDevice([PermissionError])
    src = _source(path, reader=device)
    assert src.drain() == [] and src.errors == 1


def test_unreadable_path_is_source_unavailable(tmp_path: Path) -> None:
    with pytest.raises(SourceUnavailable, match="cannot open"):
        _source(tmp_path / "nope")


def test_garbage_flood_is_bounded_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_bytes(b"junk line\n" * 5000 + b"x" * 40_000)  # and a line with no end
    src = _source(path, from_start=True)
    assert src.drain() == []
    assert src.skipped == 5001
