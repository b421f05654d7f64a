"""Monitor against a real Unix datagram socket bound by the test (standing in for the agent)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from forewarn import wire
from forewarn.hook import Monitor
from forewarn.hook._identity import identity_from_env
from forewarn.hook._pack import build_step_packer

Msg = wire.StepRecord | wire.Beat | wire.CheckpointReport


class FakeAgent:
    """A bound datagram socket that decodes what the hook sends (the agent's side)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.seen: list[Msg] = []

    def recv(self, timeout: float = 5.0) -> Msg | None:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return None
        msg = wire.decode_hook_message(data)
        self.seen.append(msg)
        return msg

    def wait_for(self, pred: Callable[[Msg], bool], timeout: float = 5.0) -> Msg:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            msg = self.recv(left)
            if msg is not None and pred(msg):
                return msg
        raise AssertionError(f"no matching message within {timeout}s; saw {self.seen[-5:]}")

    def beat(self) -> wire.Beat:
        msg = self.wait_for(lambda m: isinstance(m, wire.Beat))
        assert isinstance(msg, wire.Beat)
        return msg

    def order(self, reply_to: str, job: str, step: int, rid: str) -> None:
        o = wire.CheckpointOrder(request_id=rid, job=job, step=step, reason="test",
                                 issued=time.time())
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(wire.encode(o), reply_to)

    def close(self) -> None:
        self.sock.close()
        os.unlink(self.path)


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="fw-")  # short: AF_UNIX paths are limited to 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def agent(sockdir: str) -> Iterator[FakeAgent]:
    a = FakeAgent(os.path.join(sockdir, "agent.sock"))
    yield a
    a.sock.close()


def _monitor(agent_path: str, **kw: object) -> Monitor:
    kw.setdefault("job", "job-a")
    kw.setdefault("rank", 1)
    kw.setdefault("world_size", 2)
    kw.setdefault("handle_sigterm", False)
    kw.setdefault("beat_interval_s", 0.1)
    return Monitor(socket_path=agent_path, **kw)  # type: ignore[arg-type]


def test_fast_encoding_decodes_to_the_same_record() -> None:
    ident = identity_from_env(job="j" * 200, rank=3, world_size=8, local_rank=3)
    pack = build_step_packer(ident)
    data = pack(2**40, 1_700_000_000.25, 0.125, float("nan"), 1e300)
    got = wire.decode_hook_message(data)
    assert isinstance(got, wire.StepRecord)
    want = wire.StepRecord(job=ident.job, rank=3, local_rank=3, world_size=8, pid=ident.pid,
                           host=ident.host, step=2**40, time=1_700_000_000.25,
                           step_seconds=0.125, loss=float("nan"), grad_norm=1e300)
    assert got.loss != got.loss  # NaN survives msgpack
    assert wire.encode(got) == wire.encode(want)


def test_steps_arrive_with_values_step_time_and_extras(agent: FakeAgent) -> None:
    with _monitor(agent.path) as mon:
        agent.beat()  # the first beat goes out at construction
        mon.step(0, loss=2.0, grad_norm=1.0)
        mon.step(1, loss=1.5, grad_norm=0.5)
        mon.step(2, loss=1, tokens=4096)  # int loss, no grad norm, an extra
        recs = [agent.wait_for(lambda m: isinstance(m, wire.StepRecord)) for _ in range(3)]
    assert [r.step for r in recs] == [0, 1, 2]  # type: ignore[union-attr]
    r0, r1, r2 = recs
    assert isinstance(r0, wire.StepRecord) and isinstance(r1, wire.StepRecord)
    assert isinstance(r2, wire.StepRecord)
    assert (r0.job, r0.rank, r0.world_size, r0.pid) == ("job-a", 1, 2, os.getpid())
    assert r0.step_seconds is None and r1.step_seconds is not None and r1.step_seconds >= 0
    assert (r1.loss, r1.grad_norm) == (1.5, 0.5)
    assert (r2.loss, r2.grad_norm, r2.extras) == (1.0, None, {"tokens": 4096.0})
    assert abs(r1.time - time.time()) < 60


def test_cpu_tensor_values_are_read(agent: FakeAgent) -> None:
    torch = pytest.importorskip("torch")
    with _monitor(agent.path) as mon:
        mon.step(0, loss=torch.tensor(0.5), grad_norm=torch.tensor(3.0, dtype=torch.float64))
        rec = agent.wait_for(lambda m: isinstance(m, wire.StepRecord))
    assert isinstance(rec, wire.StepRecord)
    assert (rec.loss, rec.grad_norm) == (0.5, 3.0)


def test_beats_carry_last_step_dropped_and_a_private_reply_socket(agent: FakeAgent) -> None:
    with _monitor(agent.path) as mon:
        first = agent.beat()
        assert first.last_step is None
        mon.step(7, loss=1.0, grad_norm=1.0)
        beat = agent.wait_for(lambda m: isinstance(m, wire.Beat) and m.last_step == 7)
        assert isinstance(beat, wire.Beat)
        assert beat.reply_to == mon.reply_path and beat.dropped == 0
        st = os.stat(beat.reply_to)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(beat.reply_to)).st_mode) == 0o700
        reply = beat.reply_to
    assert not os.path.exists(reply)  # close() removes it


def test_order_makes_should_checkpoint_true_at_that_step(agent: FakeAgent) -> None:
    with _monitor(agent.path) as mon:
        beat = agent.beat()
        mon.step(0, loss=1.0, grad_norm=1.0)
        agent.order(beat.reply_to, "job-a", 3, "req-1")
        _wait(lambda: mon.stats.orders == 1)
        hits = []
        for s in range(1, 6):
            mon.step(s, loss=1.0, grad_norm=1.0)
            if mon.should_checkpoint(s):
                hits.append(s)
                mon.checkpoint_done(s, 0.25, 1234, "/ckpt/step-3")
        assert hits == [3]
        started = agent.wait_for(lambda m: isinstance(m, wire.CheckpointReport))
        done = agent.wait_for(lambda m: isinstance(m, wire.CheckpointReport))
    assert isinstance(started, wire.CheckpointReport) and isinstance(done, wire.CheckpointReport)
    assert (started.phase, started.step, started.request_id) == ("started", 3, "req-1")
    assert (done.phase, done.step, done.request_id) == ("done", 3, "req-1")
    assert (done.seconds, done.bytes, done.path) == (0.25, 1234, "/ckpt/step-3")


def test_pending_orders_are_each_obeyed_and_one_save_serves_a_shared_step(
        agent: FakeAgent) -> None:
    """The agent's fast path and the collector may both order the job: a later order
    never replaces a nearer one; every order's step gets its save, reported under each
    request id; a step a rank passed without asking is reported missed."""
    with _monitor(agent.path) as mon:
        beat = agent.beat()
        mon.step(0, loss=1.0, grad_norm=1.0)
        for step, rid in ((8, "collector"), (4, "fast-path"), (8, "alert"), (6, "skipped")):
            agent.order(beat.reply_to, "job-a", step, rid)
        _wait(lambda: mon.stats.orders == 4)
        hits = []
        for s in range(1, 11):
            mon.step(s, loss=1.0, grad_norm=1.0)
            if s != 6 and mon.should_checkpoint(s):  # the loop does not ask at step 6
                hits.append(s)
                mon.checkpoint_done(s, 0.5, 99)
        assert hits == [4, 8]
        reports = [agent.wait_for(lambda m: isinstance(m, wire.CheckpointReport))
                   for _ in range(7)]
    got = [(r.phase, r.step, r.request_id) for r in reports
           if isinstance(r, wire.CheckpointReport)]
    assert got == [("started", 4, "fast-path"), ("done", 4, "fast-path"),
                   ("missed", 7, "skipped"),
                   ("started", 8, "collector"), ("started", 8, "alert"),
                   ("done", 8, "collector"), ("done", 8, "alert")]
    assert mon.stats.checkpoints == 2 and mon.stats.missed == 1


def _send_advice(reply_to: str, job: str, every: int, start: int) -> None:
    advice = wire.IntervalAdvice(job=job, every_steps=every, from_step=start,
                                 interval_s=every * 0.5, reason="young", issued=time.time())
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(wire.encode(advice), reply_to)


def test_advised_interval_is_followed_only_when_asked(agent: FakeAgent) -> None:
    for follow in (True, False):
        with _monitor(agent.path, follow_advice=follow) as mon:
            beat = agent.beat()
            _send_advice(beat.reply_to, "other-job", 2, 0)  # not ours: ignored
            _send_advice(beat.reply_to, "job-a", 4, 6)
            _wait(lambda: mon.advice is not None)
            assert mon.advice is not None and mon.advice.every_steps == 4
            hits = []
            for s in range(1, 16):
                mon.step(s, loss=1.0, grad_norm=1.0)
                if mon.should_checkpoint(s):
                    hits.append(s)
                    mon.checkpoint_done(s, 0.1, 10)
            # every rank counts the same steps: from_step, then every `every_steps`
            assert hits == ([6, 10, 14] if follow else [])


def test_order_for_a_passed_step_is_reported_missed(agent: FakeAgent) -> None:
    with _monitor(agent.path) as mon:
        beat = agent.beat()
        for s in range(10):
            mon.step(s, loss=1.0, grad_norm=1.0)
        agent.order(beat.reply_to, "job-a", 5, "late")
        missed = agent.wait_for(lambda m: isinstance(m, wire.CheckpointReport))
        assert isinstance(missed, wire.CheckpointReport)
        assert (missed.phase, missed.step, missed.request_id) == ("missed", 9, "late")
        assert not any(mon.should_checkpoint(s) for s in range(10, 20))
        # the agent's new order is obeyed
        agent.order(beat.reply_to, "job-a", 12, "again")
        _wait(lambda: mon.stats.orders == 1)
        assert [s for s in range(10, 20) if mon.should_checkpoint(s)] == [12]
        assert mon.stats.missed == 1


def test_values_reported_late_do_not_move_the_last_step_back(agent: FakeAgent) -> None:
    """report_values() for an older step sends its values; the rank is still at its last
    step: an order for a step between is missed, beats say the last step."""
    with _monitor(agent.path) as mon:
        beat = agent.beat()
        for s in range(10):
            mon.step(s, loss=1.0, grad_norm=1.0)
        mon.report_values(3, loss=0.5, tokens=4096)
        late = agent.wait_for(lambda m: isinstance(m, wire.StepRecord) and m.step == 3
                              and m.step_seconds is None)
        assert isinstance(late, wire.StepRecord) and late.loss == 0.5
        after = agent.wait_for(lambda m: isinstance(m, wire.Beat) and m.time > late.time)
        assert isinstance(after, wire.Beat) and after.last_step == 9
        agent.order(beat.reply_to, "job-a", 5, "late")
        missed = agent.wait_for(lambda m: isinstance(m, wire.CheckpointReport))
        assert isinstance(missed, wire.CheckpointReport)
        assert (missed.phase, missed.step, missed.request_id) == ("missed", 9, "late")
        assert not any(mon.should_checkpoint(s) for s in range(10, 12))


def test_orders_for_other_jobs_duplicates_and_junk_are_ignored(agent: FakeAgent) -> None:
    with _monitor(agent.path) as mon:
        beat = agent.beat()
        agent.order(beat.reply_to, "job-b", 5, "x")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(b"\xc1 not msgpack", beat.reply_to)
            s.sendto(wire.encode({"request_id": "r", "job": "job-a"}), beat.reply_to)
        agent.order(beat.reply_to, "job-a", 5, "dup")
        agent.order(beat.reply_to, "job-a", 6, "dup")  # same request id: ignored
        _wait(lambda: mon.stats.orders_invalid == 2 and mon.stats.orders_ignored == 2)
        assert mon.stats.orders == 1
        assert [s for s in range(10) if mon.should_checkpoint(s)] == [5]


def test_no_agent_counts_drops_and_training_runs(sockdir: str) -> None:
    mon = _monitor(os.path.join(sockdir, "nobody.sock"))
    for s in range(100):
        mon.step(s, loss=1.0, grad_norm=1.0)
        assert mon.should_checkpoint(s) is False
    mon.checkpoint_done(99, 1.0, 10)
    assert mon.dropped >= 101 and not mon.connected
    assert mon.stats.failures == 0
    mon.close()


def test_a_checkpoint_report_outlasts_an_agent_that_stalls(agent: FakeAgent) -> None:
    """CI at 7b6f0b8: an agent that stops reading for a moment fills its socket (the kernel
    queues ``net.unix.max_dgram_qlen`` datagrams, 10 by default), and the hook dropped all
    it had queued once a send timed out, checkpoint reports too. A ``missed`` report lost
    that way leaves the agent's hold on a step a rank already passed. Checkpoint reports
    wait for the agent; step records and beats are still dropped and counted."""
    with _monitor(agent.path, beat_interval_s=0.02) as mon:
        _wait(lambda: mon.dropped > 0)  # the socket is full: beats are being dropped
        mon.checkpoint_failed(7, "disk full")
        time.sleep(0.3)  # the stall outlasts the hook's send timeout
        rep = agent.wait_for(lambda m: isinstance(m, wire.CheckpointReport) and m.step == 7)
        assert isinstance(rep, wire.CheckpointReport) and rep.phase == "failed"


def test_junk_arguments_never_raise(agent: FakeAgent) -> None:
    with _monitor(agent.path) as mon:
        mon.step(-1)
        mon.step("seven")  # type: ignore[arg-type]
        mon.step(1, loss=object())
        mon.step(2, loss="nan?", grad_norm=[1, 2])
        mon.step(3, **{"x" * 500: 1.0, "bad": object()})
        mon.step(2**70, loss=1.0, grad_norm=1.0)
        mon.checkpoint_done("x", "y", "z")  # type: ignore[arg-type]
        assert mon.should_checkpoint(None) is False  # type: ignore[arg-type]
        mon.step(4, loss=1.0, grad_norm=1.0)
        rec = agent.wait_for(lambda m: isinstance(m, wire.StepRecord) and m.step == 4)
        assert rec is not None
        assert mon.stats.failures >= 5


def test_a_step_number_no_record_can_carry_is_left_out_alone(agent: FakeAgent) -> None:
    """The fast path queues the values and the background thread packs them: a step the
    record cannot carry (over 2**64) is counted as a failure there, and the steps queued
    around it still arrive."""
    with _monitor(agent.path) as mon:
        for s in (0, 1, 2**64, 3):
            mon.step(s, loss=1.0, grad_norm=1.0)
        steps: list[int] = []
        agent.wait_for(lambda m: isinstance(m, wire.StepRecord)
                       and steps.append(m.step) is None and m.step == 3)
        assert steps == [0, 1, 3]
        _wait(lambda: mon.stats.failures == 1)


def test_reconnects_when_the_agent_comes_back(sockdir: str) -> None:
    path = os.path.join(sockdir, "agent.sock")
    first = FakeAgent(path)
    mon = _monitor(path)
    try:
        mon.step(0, loss=1.0, grad_norm=1.0)
        first.wait_for(lambda m: isinstance(m, wire.StepRecord))
        first.close()  # the agent dies
        for s in range(1, 50):
            mon.step(s, loss=1.0, grad_norm=1.0)
            time.sleep(0.005)
        assert mon.dropped > 0
        second = FakeAgent(path)  # and comes back
        _wait(lambda: mon.connected, timeout=5.0)
        mon.step(100, loss=1.0, grad_norm=1.0)
        rec = second.wait_for(lambda m: isinstance(m, wire.StepRecord))
        assert isinstance(rec, wire.StepRecord) and rec.step == 100
        beat = second.beat()
        assert beat.dropped == mon.dropped > 0
        second.close()
    finally:
        mon.close()


def test_environment_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "abc"}
    i = identity_from_env(env=env)
    assert (i.job, i.rank, i.world_size, i.local_rank) == ("abc", 3, 4, 1)
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_JOB_ID": "77"}
    i = identity_from_env(env=slurm)
    assert (i.job, i.rank, i.world_size, i.local_rank) == ("slurm-77", 5, 8, 2)
    i = identity_from_env(env={"RANK": "zero", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert (i.rank, i.job) == (0, "torchrun-h-1")
    with pytest.raises(ValueError, match="rank"):
        identity_from_env(rank=4, world_size=4, env={})


def _wait(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


# ---------------------------------------------------------------------- preemption

_SIGTERM_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    from forewarn.hook import Monitor
    mode, notice = sys.argv[2], sys.argv[3]
    if mode == "callable":
        def user_handler(signum, frame):
            print("user handler", signum, flush=True)
            sys.exit(7)
        signal.signal(signal.SIGTERM, user_handler)
    kw = {"preempt_order_wait_s": 0.0}  # the fake agent never orders: save at once
    if mode == "usr1":
        kw["preempt_signals"] = "TERM,USR1"
    if mode == "notice-file":
        kw["preempt_notice_file"] = notice
    mon = Monitor(job="pre", rank=0, world_size=1, socket_path=sys.argv[1], beat_interval_s=0.1,
                  **kw)
    for step in range(100):
        mon.step(step, loss=1.0, grad_norm=1.0)
        if step == 3:
            if mode == "double":  # Slurm 22.05 preemption: SIGTERM, SIGCONT, SIGTERM
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGCONT)
                time.sleep(0.005)
                os.kill(os.getpid(), signal.SIGTERM)
            elif mode == "usr1":
                os.kill(os.getpid(), signal.SIGUSR1)
            elif mode == "notice-file":
                open(notice, "w").close()
            else:
                os.kill(os.getpid(), signal.SIGTERM)
        if mode == "notice-file":
            time.sleep(0.05)  # the file is looked for once per beat (0.1 s)
        if mode != "never-checks" and mon.should_checkpoint(step):
            print("checkpoint", step, mon.preempted, flush=True)
            if mode == "double":  # the second SIGTERM lands during the save
                os.kill(os.getpid(), signal.SIGTERM)
            mon.checkpoint_done(step, 0.5, 10)
            print("still running after checkpoint_done", flush=True)
    print("finished", flush=True)
    """
)


def _run_sigterm(tmp_path: Path, agent: FakeAgent, mode: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "pre.py"
    script.write_text(_SIGTERM_SCRIPT)
    return subprocess.run([sys.executable, str(script), agent.path, mode,
                           str(tmp_path / "maintenance")], capture_output=True, text=True,
                          timeout=60)


def test_sigterm_checkpoints_at_the_next_step_then_exits_128_plus_signal(
    tmp_path: Path, agent: FakeAgent
) -> None:
    proc = _run_sigterm(tmp_path, agent, "default")
    assert proc.stdout.splitlines() == ["checkpoint 3 True"], proc.stderr
    assert proc.returncode == 128 + signal.SIGTERM
    started = agent.wait_for(lambda m: isinstance(m, wire.CheckpointReport))
    done = agent.wait_for(lambda m: isinstance(m, wire.CheckpointReport))
    assert isinstance(started, wire.CheckpointReport) and isinstance(done, wire.CheckpointReport)
    assert (started.phase, started.request_id, done.phase) == ("started", "preempted", "done")
    agent.wait_for(lambda m: isinstance(m, wire.Beat) and m.finished)
    assert any(isinstance(m, wire.Beat) and m.preempted for m in agent.seen)  # told the agent


def test_repeated_sigterm_within_the_grace_does_not_abort_the_save(
    tmp_path: Path, agent: FakeAgent
) -> None:
    proc = _run_sigterm(tmp_path, agent, "double")
    assert proc.stdout.splitlines() == ["checkpoint 3 True"], proc.stderr
    assert proc.returncode == 128 + signal.SIGTERM
    agent.wait_for(lambda m: isinstance(m, wire.CheckpointReport) and m.phase == "done")


def test_configured_usr1_is_a_preemption_notice(tmp_path: Path, agent: FakeAgent) -> None:
    proc = _run_sigterm(tmp_path, agent, "usr1")
    assert proc.stdout.splitlines() == ["checkpoint 3 True"], proc.stderr
    assert proc.returncode == 128 + signal.SIGUSR1


def test_maintenance_notice_file_is_a_preemption_notice(tmp_path: Path, agent: FakeAgent
                                                        ) -> None:
    proc = _run_sigterm(tmp_path, agent, "notice-file")
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("checkpoint ") and lines[0].endswith(" True")
    assert 3 <= int(lines[0].split()[1]) <= 8, lines  # within a beat or two of the file
    assert proc.returncode == 128 + signal.SIGTERM


def test_sigterm_calls_the_users_previous_handler_after_the_checkpoint(
    tmp_path: Path, agent: FakeAgent
) -> None:
    proc = _run_sigterm(tmp_path, agent, "callable")
    assert proc.stdout.splitlines() == ["checkpoint 3 True", "user handler 15"], proc.stderr
    assert proc.returncode == 7


def test_sigterm_without_checkpoint_support_behaves_as_before(
    tmp_path: Path, agent: FakeAgent
) -> None:
    proc = _run_sigterm(tmp_path, agent, "never-checks")
    assert proc.stdout == "" and proc.returncode == -signal.SIGTERM


_ORDERED_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    from forewarn.hook import Monitor
    mon = Monitor(job="pre", rank=1, world_size=2, socket_path=sys.argv[1], beat_interval_s=0.1)
    for step in range(200):
        time.sleep(0.02)
        mon.step(step, loss=1.0, grad_norm=1.0)
        if mon.should_checkpoint(step):
            print("checkpoint", step, mon.preempted, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)  # this rank's own notice, during the save
            time.sleep(0.05)
            mon.checkpoint_done(step, 0.5, 10)
            print("still running after checkpoint_done", flush=True)
    print("finished", flush=True)
    """
)


def _ordered_rank(tmp_path: Path, agent: FakeAgent) -> subprocess.Popen[str]:
    script = tmp_path / "ordered.py"
    script.write_text(_ORDERED_SCRIPT)
    return subprocess.Popen([sys.executable, str(script), agent.path], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _read_until_exit(proc: subprocess.Popen[str], agent: FakeAgent) -> tuple[str, str]:
    """Keep reading the agent socket (it queues only a few datagrams) until ``proc`` exits;
    its stdout and stderr."""
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        agent.recv(0.1)
    while agent.recv(0.2) is not None:
        pass
    return proc.communicate(timeout=10)


def test_a_rank_saving_on_the_jobs_preemption_order_survives_its_own_signal_in_the_save(
    tmp_path: Path, agent: FakeAgent
) -> None:
    """A rank not signalled itself saves on the agent's job-wide preemption order; its own
    SIGTERM arriving during that save is a repeated notice, not a reason to die mid-save
    (it did: the grace was counted from a notice it never had, and the peer's collective
    save failed)."""
    proc = _ordered_rank(tmp_path, agent)
    try:
        beat = agent.wait_for(lambda m: isinstance(m, wire.Beat) and m.last_step is not None
                              and m.last_step >= 2, 30)
        assert isinstance(beat, wire.Beat) and beat.last_step is not None
        o = wire.CheckpointOrder(request_id="fw-1", job="pre", step=beat.last_step + 10,
                                 reason="preempted: rank 0 got a notice", issued=time.time())
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(wire.encode(o), beat.reply_to)
        out, err = _read_until_exit(proc, agent)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert out.splitlines() == [f"checkpoint {o.step} True"], err
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert any(isinstance(m, wire.CheckpointReport) and m.phase == "done"
               and m.request_id == "fw-1" for m in agent.seen)


def test_a_missed_preemption_order_is_reported_and_the_reissue_is_saved(
    tmp_path: Path, agent: FakeAgent
) -> None:
    """The miss path on the rank's side: a preemption order for a step this rank passed
    is reported ``missed`` with its current step (it neither saves nor exits); the
    agent's reissue, further ahead, is saved and the process exits 128 + SIGTERM."""
    proc = _ordered_rank(tmp_path, agent)

    def order(rid: str, step: int, reply_to: str) -> None:
        o = wire.CheckpointOrder(request_id=rid, job="pre", step=step, issued=time.time(),
                                 reason="preempted: rank 0 got a notice")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(wire.encode(o), reply_to)

    try:
        beat = agent.wait_for(lambda m: isinstance(m, wire.Beat) and m.last_step is not None
                              and m.last_step >= 3, 30)
        assert isinstance(beat, wire.Beat) and beat.last_step is not None
        order("fw-2", beat.last_step - 1, beat.reply_to)
        missed = agent.wait_for(lambda m: isinstance(m, wire.CheckpointReport), 10)
        assert isinstance(missed, wire.CheckpointReport)
        assert (missed.phase, missed.request_id) == ("missed", "fw-2")
        assert missed.step >= beat.last_step and proc.poll() is None
        again = missed.step + 10
        order("fw-2-r1", again, beat.reply_to)
        out, err = _read_until_exit(proc, agent)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert out.splitlines() == [f"checkpoint {again} True"], err
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert any(isinstance(m, wire.CheckpointReport) and m.phase == "done"
               and m.request_id == "fw-2-r1" and m.step == again for m in agent.seen)


def test_bad_preempt_signal_name_is_an_error_naming_it(agent: FakeAgent) -> None:
    with pytest.raises(ValueError, match="SIGNOPE"):
        _monitor(agent.path, preempt_signals="TERM,SIGNOPE")


# ---------------------------------------------------------------------- phases, clean end


def test_a_phase_is_announced_at_once_and_left_out_of_the_step_time(agent: FakeAgent) -> None:
    with _monitor(agent.path, beat_interval_s=30.0) as mon:
        agent.beat()
        mon.step(0, loss=1.0, grad_norm=1.0)
        began = time.monotonic()
        with mon.phase("eval"):
            beat = agent.wait_for(lambda m: isinstance(m, wire.Beat))
            assert isinstance(beat, wire.Beat)
            assert time.monotonic() - began < 1.0  # not at the next 30 s beat
            assert beat.phase == "eval" and beat.phase_started is not None
            time.sleep(0.4)
        mon.step(1, loss=1.0, grad_norm=1.0)
        rec = agent.wait_for(lambda m: isinstance(m, wire.StepRecord) and m.step == 1)
        assert isinstance(rec, wire.StepRecord) and rec.step_seconds is not None
        assert rec.step_seconds < 0.2  # the 0.4 s evaluation is not a slow step
    last = agent.wait_for(lambda m: isinstance(m, wire.Beat))
    assert isinstance(last, wire.Beat) and last.phase == ""
    assert 0.4 <= last.phase_longest["eval"] < 1.0


def test_close_reports_the_rank_finished(agent: FakeAgent) -> None:
    mon = _monitor(agent.path)
    agent.beat()
    mon.close()
    last = agent.wait_for(lambda m: isinstance(m, wire.Beat) and m.finished)
    assert isinstance(last, wire.Beat)


_EXIT_SCRIPT = textwrap.dedent(
    """
    import sys
    from forewarn.hook import Monitor
    mon = Monitor(job="end", rank=0, world_size=1, socket_path=sys.argv[1])
    mon.step(0, loss=1.0, grad_norm=1.0)
    if sys.argv[2] == "crash":
        raise RuntimeError("boom")
    if sys.argv[2] == "with-crash":
        with mon:
            raise RuntimeError("boom")
    """
)


@pytest.mark.parametrize(("mode", "finished"), [("normal", True), ("crash", False),
                                                ("with-crash", False)])
def test_normal_interpreter_exit_is_finished_a_crash_is_not(
    tmp_path: Path, agent: FakeAgent, mode: str, finished: bool
) -> None:
    script = tmp_path / "end.py"
    script.write_text(_EXIT_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), agent.path, mode], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == (0 if finished else 1), proc.stderr
    beats = []
    while (msg := agent.recv(0.5)) is not None:
        if isinstance(msg, wire.Beat):
            beats.append(msg)
    assert beats and any(b.finished for b in beats) is finished


def test_importing_and_stepping_with_floats_loads_no_third_party_framework(sockdir: str) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        from forewarn.hook import Monitor, CheckpointWriter
        m = Monitor(job="j", socket_path={os.path.join(sockdir, "none")!r})
        m.step(0, loss=1.0, grad_norm=2.0); m.should_checkpoint(0); m.close()
        heavy = [n for n in ("torch", "pytorch_lightning", "lightning", "transformers", "numpy")
                 if n in sys.modules]
        print(heavy)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_signal_repeated_while_the_preemption_exit_closes_still_exits_128_plus_signal(
        tmp_path: Path) -> None:
    """Slurm's second SIGTERM can land in the milliseconds between the end of the save and
    the exit, while the Monitor closes (and puts back the default handlers): the process
    still ends with 128 + the signal, not killed by it."""
    script = tmp_path / "exit.py"
    script.write_text(
        "import os, signal\n"
        "from forewarn.hook._preempt import SignalExit\n"
        "def close(finished):\n"
        "    if callable(signal.getsignal(signal.SIGTERM)):  # restore(), where ours is set\n"
        "        signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)  # the repeated notice, right then\n"
        "ex = SignalExit((signal.SIGTERM,), None, close)\n"
        "ex.install(lambda s, f: None)\n"
        "ex.after_save(signal.SIGTERM)\n")
    r = subprocess.run([sys.executable, str(script)], timeout=60, capture_output=True)
    assert r.returncode == 128 + signal.SIGTERM, (r.returncode, r.stderr[-2000:])


def test_numpy_integer_steps_keep_beats_records_and_missed_reports_going(
        agent: FakeAgent) -> None:
    # `for step in np.arange(n)` is a common loop: every step is a numpy.int64, which the
    # wire's msgpack cannot encode as it is. A beat carrying it would never go out, and the
    # agent would call a training rank hung.
    np = pytest.importorskip("numpy")
    with _monitor(agent.path) as mon:
        beat = agent.beat()
        for s in np.arange(10):
            mon.step(s, loss=1.0, grad_norm=1.0)
        last = agent.wait_for(lambda m: isinstance(m, wire.Beat) and m.last_step == 9)
        assert isinstance(last, wire.Beat) and type(last.last_step) is int
        agent.order(beat.reply_to, "job-a", 5, "late")
        missed = agent.wait_for(lambda m: isinstance(m, wire.CheckpointReport))
        assert isinstance(missed, wire.CheckpointReport)
        assert (missed.phase, missed.step) == ("missed", 9)
        mon.close()
        assert mon.stats.dropped == 0
