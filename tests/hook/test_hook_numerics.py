"""Bad numerics in the hook: a NaN/Inf loss or the collector's save hold makes the state
suspect; checkpoints from the onset on are marked, ``load_latest`` skips them unless told,
saves are refused from the hold's step on, and pruning keeps the last good checkpoint.

The agent's side of the rank socket is a real Unix datagram socket bound by the test."""

from __future__ import annotations

import math
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from forewarn import wire  # noqa: E402
from forewarn.hook import CheckpointWriter, Monitor  # noqa: E402
from forewarn.hook.checkpoint import SUSPECT  # noqa: E402


class AgentSocket:
    """The agent's end: receives the hook's datagrams, sends it orders and holds."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)

    def reports(self, timeout: float = 3.0) -> list[wire.CheckpointReport]:
        out = []
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                msg = wire.decode_hook_message(self.sock.recv(65536))
            except TimeoutError:
                break
            if isinstance(msg, wire.CheckpointReport):
                out.append(msg)
                if msg.phase == "failed":
                    break
        return out

    @staticmethod
    def send(reply_to: str, msg: wire.CheckpointOrder | wire.SaveHold) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(wire.encode(msg), reply_to)


@pytest.fixture
def agent() -> Iterator[AgentSocket]:
    d = tempfile.mkdtemp(prefix="fw-")  # short: AF_UNIX paths are limited to 108 bytes
    a = AgentSocket(os.path.join(d, "agent.sock"))
    yield a
    a.sock.close()
    shutil.rmtree(d, ignore_errors=True)


def _wait(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((3,), float(step)), "step": step}


def _monitor(socket_path: str, world_size: int) -> Monitor:
    return Monitor(job="j", rank=0, world_size=world_size, local_rank=0,
                   socket_path=socket_path, handle_sigterm=False, beat_interval_s=0.1)


def test_nan_loss_of_a_lone_rank_holds_saves_and_marks_what_is_saved_anyway(
        tmp_path: Path) -> None:
    mon = _monitor(str(tmp_path / "no-agent.sock"), world_size=1)
    w = CheckpointWriter(tmp_path / "fast", keep_last=2, durable=tmp_path / "durable",
                         monitor=mon)
    try:
        for step in range(3):
            mon.step(step, loss=1.0, grad_norm=1.0)
        assert not w.save(2, _state(2)).suspect
        mon.step(3, loss=math.nan, grad_norm=1.0)
        assert mon.suspect_since == 3 and mon.saves_held(3)

        refused = w.save(3, _state(3))
        assert refused.refused and "suspect since step 3" in refused.refused
        assert not (tmp_path / "fast" / "step-000000003").exists()

        for step in (4, 5, 6):  # told to save anyway: saved, marked suspect
            mon.step(step, loss=math.nan, grad_norm=1.0)
            res = w.save(step, _state(step), allow_suspect=True)
            assert res.suspect and (Path(res.path) / SUSPECT).is_file()
        w.flush()
        # keep_last=2 poisoned saves do not rotate the last good one out, in either tier
        for tier in ("fast", "durable"):
            steps = sorted(int(p.name[5:]) for p in (tmp_path / tier).glob("step-*"))
            assert steps == [2, 5, 6], (tier, steps)
            assert (tmp_path / tier / "step-000000006" / SUSPECT).is_file()

        loaded = w.load_latest()
        assert loaded is not None and loaded.step == 2 and not loaded.suspect
        assert [why.startswith("suspect") for _, why in loaded.skipped] == [True] * 4
        told = w.load_latest(allow_suspect=True)
        assert told is not None and told.step == 6 and told.suspect
    finally:
        w.close()
        mon.close()


def test_collector_hold_refuses_orders_from_its_step_and_marks_saves_since_the_onset(
        tmp_path: Path, agent: AgentSocket) -> None:
    mon = _monitor(agent.path, world_size=4)
    w = CheckpointWriter(tmp_path / "ck", keep_last=5, monitor=mon)
    try:
        for step in range(7):
            mon.step(step, loss=1.0, grad_norm=1.0)
            if step in (4, 6):
                w.save(step, _state(step))
        _wait(lambda: bool(mon.reply_path) and mon.connected)
        hold = wire.SaveHold(request_id="h1", job="j", onset_step=5, step=9,
                             reason="nan_loss on rank 2", issued=time.time())
        for rid, at in (("o8", 8), ("o9", 9)):
            agent.send(mon.reply_path, wire.CheckpointOrder(
                request_id=rid, job="j", step=at, reason="test", issued=time.time()))
        agent.send(mon.reply_path, hold)
        _wait(lambda: mon.suspect_since == 5 and mon.stats.orders == 2)
        # the checkpoint of step 6, committed before the hold came, is marked now (by the
        # hook's thread, right after it took the hold)
        _wait((tmp_path / "ck" / "step-000000006" / SUSPECT).is_file)
        assert not (tmp_path / "ck" / "step-000000004" / SUSPECT).exists()

        mon.step(7, loss=1.0, grad_norm=1.0)
        assert not mon.should_checkpoint(7)
        mon.step(8, loss=1.0, grad_norm=1.0)
        assert mon.should_checkpoint(8)  # before the hold's step: every rank still saves
        assert w.save(8, _state(8)).suspect
        mon.step(9, loss=1.0, grad_norm=1.0)
        assert not mon.should_checkpoint(9)  # held from step 9 on
        failed = [r for r in agent.reports() if r.phase == "failed"]
        assert [(r.request_id, r.step) for r in failed] == [("o9", 9)]
        assert "suspect since step 5" in failed[0].path
        assert w.save(9, _state(9)).refused

        loaded = w.load_latest()
        assert loaded is not None and loaded.step == 4
    finally:
        w.close()
        mon.close()


def test_nan_on_one_rank_of_a_job_marks_but_does_not_hold_alone(tmp_path: Path) -> None:
    """A rank refusing a collective save its peers entered would hang them: only the
    job-wide hold (one step for every rank) stops saves."""
    mon = _monitor(str(tmp_path / "no-agent.sock"), world_size=2)
    w = CheckpointWriter(tmp_path / "ck", monitor=mon)
    try:
        mon.step(3, loss=math.inf, grad_norm=1.0)
        assert mon.suspect_since == 3 and not mon.saves_held(3)
        res = w.save(3, _state(3))
        assert res.suspect and not res.refused
        assert w.load_latest() is None
    finally:
        w.close()
        mon.close()


def test_release_hold_lets_saves_through_unmarked(tmp_path: Path) -> None:
    mon = _monitor(str(tmp_path / "no-agent.sock"), world_size=1)
    w = CheckpointWriter(tmp_path / "ck", monitor=mon)
    try:
        mon.step(1, loss=math.nan, grad_norm=1.0)
        assert w.save(1, _state(1)).refused
        mon.release_hold()
        mon.step(2, loss=1.0, grad_norm=1.0)
        res = w.save(2, _state(2))
        assert not res.refused and not res.suspect
        loaded = w.load_latest()
        assert loaded is not None and loaded.step == 2
    finally:
        w.close()
        mon.close()


def test_a_hold_whose_step_has_passed_is_reported_missed_and_its_reissue_replaces_it(
        tmp_path: Path, agent: AgentSocket) -> None:
    """A hold reaching a rank that has already reported the step it names: the rank holds
    from its next step, reports ``missed`` with its current step under the hold's request
    id, and the re-issued hold (``replaces`` naming it) moves the step every rank holds
    from to one it can still meet."""
    mon = _monitor(agent.path, world_size=2)
    try:
        for step in range(13):
            mon.step(step, loss=1.0, grad_norm=1.0)
        _wait(lambda: bool(mon.reply_path) and mon.connected)
        agent.send(mon.reply_path, wire.SaveHold(
            request_id="h1", job="j", onset_step=5, step=10, reason="nan_loss on rank 1",
            issued=time.time()))
        missed = [r for r in agent.reports() if r.phase == "missed"]
        assert [(r.request_id, r.step) for r in missed] == [("h1", 12)]
        assert mon.suspect_since == 5
        # meanwhile it holds from the first step it can still meet, as the other ranks do
        assert not mon.saves_held(12) and mon.saves_held(13)

        agent.send(mon.reply_path, wire.SaveHold(
            request_id="h1-r1", job="j", onset_step=5, step=20, reason="nan_loss on rank 1",
            issued=time.time(), replaces="h1"))
        _wait(lambda: not mon.saves_held(13))
        assert not mon.saves_held(19) and mon.saves_held(20)
        assert not [r for r in agent.reports(timeout=0.3) if r.phase == "missed"]
    finally:
        mon.close()



def _saves_of(messages: list[wire.CheckpointOrder | wire.SaveHold], orders: int) -> list[int]:
    """The steps 5..19 at which a rank of a 2-rank job saves, given ``messages`` at step 4
    (the last one an order: the hook's one receiving thread takes them in turn)."""
    d = tempfile.mkdtemp(prefix="fw-")
    agent = AgentSocket(os.path.join(d, "agent.sock"))
    mon = _monitor(agent.path, world_size=2)
    try:
        for step in range(5):
            mon.step(step, loss=1.0, grad_norm=1.0)
        _wait(lambda: bool(mon.reply_path) and mon.connected)
        for msg in messages:
            AgentSocket.send(mon.reply_path, msg)
        _wait(lambda: mon.stats.orders == orders)
        steps = []
        for step in range(5, 20):
            mon.step(step, loss=1.0, grad_norm=1.0)
            if mon.should_checkpoint(step):
                steps.append(step)
                mon.checkpoint_done(step, 0.1, 1)
        return steps
    finally:
        mon.close()
        agent.sock.close()
        shutil.rmtree(d, ignore_errors=True)


def test_ranks_save_at_the_same_steps_whatever_order_orders_and_holds_arrive_in() -> None:
    """Two ranks get the same checkpoint orders and holds (a hold, its re-issue, a
    duplicate order) in different orders: both save at the same steps and refuse the same
    (saves are held from the re-issue's step 14, not the replaced hold's 12)."""
    def order(rid: str, step: int) -> wire.CheckpointOrder:
        return wire.CheckpointOrder(request_id=rid, job="j", step=step, issued=time.time())

    def hold(rid: str, step: int, replaces: str = "") -> wire.SaveHold:
        return wire.SaveHold(request_id=rid, job="j", onset_step=4, step=step,
                             reason="nan_loss on rank 1", issued=time.time(), replaces=replaces)

    o10, o13, o16 = order("o10", 10), order("o13", 13), order("o16", 16)
    a, a1 = hold("a", 12), hold("a-r1", 14, "a")
    saved = [_saves_of(seq, orders=3)
             for seq in ([o10, a, a1, o10, o16, o13], [a1, o16, o10, a, o10, o13])]
    assert saved == [[10, 13], [10, 13]]
