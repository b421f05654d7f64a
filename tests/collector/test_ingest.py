"""The agent socket: creation and permissions, credentials, and every kind of bad datagram
(malformed, oversized, forged, absurd, wrong job, slot taken) counted and dropped on a real
Unix datagram socket, with real sender processes where a second pid is needed."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from forewarn.agent.ingest import DROP_REASONS, MAX_DATAGRAM, RankIngest, SocketError
from forewarn.agent.ranks import RankTable
from forewarn.wire import Beat, StepRecord, decode_order, encode


@pytest.fixture
def sockdir() -> Iterator[Path]:
    # not under pytest's tmp_path (0o700): other users must be able to reach the socket
    d = Path(tempfile.mkdtemp(prefix="fw-ingest-"))
    os.chmod(d, 0o755)
    yield d
    for p in d.rglob("*"):
        if not p.is_dir():
            p.unlink()
    for p in sorted(d.rglob("*"), reverse=True):
        p.rmdir()
    d.rmdir()


def record(**kw: Any) -> StepRecord:
    base: dict[str, Any] = dict(job="j", rank=0, local_rank=0, world_size=2, pid=os.getpid(),
                                host="h", step=1, time=time.time(), step_seconds=0.1, loss=1.0)
    base.update(kw)
    return StepRecord(**base)


class Sender:
    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.path = str(path)

    def send(self, data: bytes) -> None:
        self.sock.sendto(data, self.path)


@pytest.fixture
def ingest(sockdir: Path) -> Iterator[RankIngest]:
    ing = RankIngest(RankTable(), sockdir / "run" / "agent.sock", mode=0o660)
    ing.bind()
    yield ing
    ing.stop()


def dropped(ing: RankIngest) -> dict[str, int]:
    return {k: v for k, v in ing.dropped.items() if v}


def send_from_child(path: Path, records: list[dict[str, Any]]) -> None:
    """Send step records from a separate process (its own pid fills ``pid``)."""
    code = (
        "import os, socket, sys, time, msgspec\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
        "for r in msgspec.json.decode(sys.argv[2]):\n"
        "    r.setdefault('pid', os.getpid()); r['time'] = time.time()\n"
        "    s.sendto(msgspec.msgpack.encode(r), sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", code, str(path), msgspec.json.encode(records)],
                   check=True, timeout=60)


def test_socket_created_safely(sockdir: Path) -> None:
    gid = os.getgid()
    ing = RankIngest(RankTable(), sockdir / "run" / "agent.sock", mode=0o660, group=gid,
                     dir_mode=0o750)
    ing.bind()
    try:
        st = os.stat(ing.path)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == gid
        assert stat.S_IMODE(os.stat(ing.path.parent).st_mode) == 0o750
        assert not st.st_mode & (stat.S_IWOTH | stat.S_IROTH)
        assert list(ing.path.parent.iterdir()) == [ing.path]  # no temporary left behind
    finally:
        ing.stop()
    assert not ing.path.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a sender as another user")
def test_other_users_cannot_write_but_the_group_can(sockdir: Path) -> None:
    ing = RankIngest(RankTable(), sockdir / "agent.sock", mode=0o660, group=54321)
    ing.bind()
    code = ("import socket, sys\ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
            "try:\n    s.sendto(b'x', sys.argv[1])\nexcept PermissionError:\n    sys.exit(13)\n")
    try:
        other = subprocess.run(["/usr/bin/python3", "-c", code, str(ing.path)],
                               user=65534, group=65534, extra_groups=[], timeout=60)
        assert other.returncode == 13
        member = subprocess.run(["/usr/bin/python3", "-c", code, str(ing.path)],
                                user=65534, group=54321, extra_groups=[], timeout=60)
        assert member.returncode == 0
        ing.drain()
        assert ing.dropped["malformed"] == 1  # it got in (and b'x' is no record)
    finally:
        ing.stop()


def test_refuses_unsafe_mode_and_foreign_files(sockdir: Path) -> None:
    with pytest.raises(SocketError, match="other users"):
        RankIngest(RankTable(), sockdir / "a.sock", mode=0o666)
    regular = sockdir / "b.sock"
    regular.write_text("precious")
    with pytest.raises(SocketError, match="not a socket"):
        RankIngest(RankTable(), regular).bind()
    assert regular.read_text() == "precious"
    with pytest.raises(SocketError, match="group"):
        RankIngest(RankTable(), sockdir / "c.sock", group="no-such-group-fw").bind()


def test_stale_socket_replaced_live_one_refused(sockdir: Path) -> None:
    path = sockdir / "agent.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stale.bind(str(path))
    live = RankIngest(RankTable(), path)
    with pytest.raises(SocketError, match="in use"):
        live.bind()
    stale.close()  # the old agent died; its socket file stays behind
    live.bind()
    live.stop()


def test_valid_records_accepted(ingest: RankIngest) -> None:
    s = Sender(ingest.path)
    s.send(encode(record(step=1)))
    s.send(encode(Beat(job="j", rank=0, world_size=2, pid=os.getpid(), host="h",
                       time=time.time(), reply_to="/nonexistent")))
    assert ingest.drain() == 2
    assert ingest.received["step"] == 1 and ingest.received["beat"] == 1
    assert dropped(ingest) == {}
    v = ingest.table.get("j", 0)
    assert v is not None and v.os_pid == os.getpid() and v.uid == os.getuid()


def test_bad_datagrams_counted_and_dropped(ingest: RankIngest) -> None:
    s = Sender(ingest.path)
    now = time.time()
    nan_step = msgspec.msgpack.encode({"type": "step", "job": "j", "rank": 0, "pid": os.getpid(),
                                       "host": "h", "step": float("nan"), "time": now})
    neg_step = msgspec.msgpack.encode({"type": "step", "job": "j", "rank": 0, "pid": os.getpid(),
                                       "host": "h", "step": -5, "time": now})
    cases = [
        (b"\xc1garbage", "malformed"),
        (nan_step, "malformed"),
        (neg_step, "malformed"),
        (msgspec.msgpack.encode({"type": "order", "job": "j"}), "malformed"),
        (b"\x00" * (MAX_DATAGRAM + 100), "oversized"),
        (encode(record(pid=1)), "forged"),  # claims to be init
        (encode(record(rank=5, world_size=2)), "absurd"),
        (encode(record(time=now + 86_400)), "absurd"),
    ]
    for data, _ in cases:
        s.send(data)
    ingest.drain()
    expected: dict[str, int] = {}
    for _, reason in cases:
        expected[reason] = expected.get(reason, 0) + 1
    assert dropped(ingest) == expected
    assert len(ingest.table) == 0
    assert set(ingest.dropped) == set(DROP_REASONS)


def test_wrong_job_slot_taken_and_world_size(ingest: RankIngest) -> None:
    s = Sender(ingest.path)
    # a real second process owns rank 1 of job "j" and stays alive while we check
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import os, socket, sys, time, msgspec\n"
         "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
         "r = dict(type='step', job='j', rank=1, local_rank=1, world_size=2, pid=os.getpid(),"
         " host='h', step=3, time=time.time())\n"
         "s.sendto(msgspec.msgpack.encode(r), sys.argv[1])\n"
         "sys.stdout.write('sent\\n'); sys.stdout.flush(); sys.stdin.read()\n",
         str(ingest.path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "sent\n"
        s.send(encode(record(job="j", rank=1)))  # rank 1 belongs to the live child
        s.send(encode(record(job="j", rank=0)))
        s.send(encode(record(job="other", rank=0)))  # the same process, another job
        s.send(encode(record(job="k", rank=0, world_size=2)))
        ingest.drain()
        assert ingest.received["step"] == 2
        assert dropped(ingest) == {"wrong_job": 2, "slot_taken": 1}
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
    # the owner is gone: rank 1 may be taken over (a restart), with a matching world size
    table = RankTable()
    ing2 = RankIngest(table, ingest.path.parent / "b.sock")
    ing2.bind()
    try:
        send_from_child(ing2.path, [dict(type="step", job="w", rank=0, world_size=2,
                                         host="h", step=1)])
        Sender(ing2.path).send(encode(record(job="w", rank=1, world_size=4)))
        ing2.drain()
        assert dropped(ing2) == {}  # the first sender exited: its world size no longer binds
    finally:
        ing2.stop()


def test_thread_survives_errors_and_stops(ingest: RankIngest) -> None:
    def boom(view: Any, rec: StepRecord) -> None:
        raise RuntimeError("listener bug")  # listeners run on a rank's first step

    ingest.table.on_step(boom)
    ingest.start()
    s = Sender(ingest.path)
    for n in (1, 2, 3):
        s.send(encode(record(step=n)))
    deadline = time.monotonic() + 20
    while ingest.received["step"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ingest.dropped["internal"] == 1 and ingest.received["step"] == 2
    v = ingest.table.get("j", 0)
    assert v is not None and v.last_step == 3
    ingest.stop()
    with pytest.raises(OSError):
        s.send(encode(record(step=4)))


def test_send_to_reply_socket(ingest: RankIngest, sockdir: Path) -> None:
    reply = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    reply.bind(str(sockdir / "reply.sock"))
    reply.settimeout(10)
    from forewarn.wire import CheckpointOrder

    order = CheckpointOrder(request_id="r1", job="j", step=42, issued=time.time())
    assert ingest.send(str(sockdir / "reply.sock"), encode(order))
    assert decode_order(reply.recv(4096)).step == 42
    assert not ingest.send(str(sockdir / "missing.sock"), b"x")
    assert ingest.sent == 1 and ingest.send_errors == 1
    reply.close()
