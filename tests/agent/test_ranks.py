"""RankTable: per-rank state from hook records and the admission rules against bad input.

``/proc`` is a fixture tree read by the real :class:`ProcView` parser (the seam the table
uses to tell a live rank from a reused pid)."""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from forewarn.agent.procview import Credentials, ProcView
from forewarn.agent.rank_state import quantile
from forewarn.agent.ranks import RankLimits, RankTable
from forewarn.wire import Beat, CheckpointReport, StepRecord

T0 = 1_700_000_000.0


class FakeProcTree:
    """A ``/proc`` lookalike: ``<pid>/stat``, ``<pid>/status``, ``<pid>/ns/pid``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "self" / "ns").mkdir(parents=True)
        os.symlink("pid:[4026531836]", root / "self" / "ns" / "pid")

    def add(self, pid: int, start: int = 1000, uid: int = 0, ns: str = "pid:[4026531836]"
            ) -> None:
        d = self.root / str(pid)
        (d / "ns").mkdir(parents=True, exist_ok=True)
        fields = ["S"] + ["0"] * 18 + [str(start)] + ["0"] * 5
        (d / "stat").write_text(f"{pid} (py thon) {' '.join(fields)}\n")
        (d / "status").write_text(f"Name:\tpython\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
        link = d / "ns" / "pid"
        if link.is_symlink():
            link.unlink()
        os.symlink(ns, link)

    def remove(self, pid: int) -> None:
        d = self.root / str(pid)
        for p in sorted(d.rglob("*"), reverse=True):
            p.unlink() if p.is_file() or p.is_symlink() else p.rmdir()
        d.rmdir()


@pytest.fixture
def proc(tmp_path: Path) -> FakeProcTree:
    return FakeProcTree(tmp_path / "proc")


def table_for(proc: FakeProcTree, **limits: Any) -> RankTable:
    return RankTable(RankLimits(**limits), proc=ProcView(proc.root))


def step(pid: int, n: int, *, job: str = "j", rank: int = 0, world: int = 2, t: float = T0,
         **kw: Any) -> StepRecord:
    return StepRecord(job=job, rank=rank, local_rank=rank, world_size=world, pid=pid,
                      host="h", step=n, time=t, **kw)


def beat(pid: int, *, job: str = "j", rank: int = 0, world: int = 2, t: float = T0,
         **kw: Any) -> Beat:
    return Beat(job=job, rank=rank, local_rank=rank, world_size=world, pid=pid, host="h",
                time=t, **kw)


def cred(pid: int, uid: int = 0) -> Credentials:
    return Credentials(pid=pid, uid=uid, gid=0)


def test_proc_view_parses_stat_with_odd_comm(proc: FakeProcTree) -> None:
    proc.add(42, start=777, uid=1234)
    view = ProcView(proc.root)
    assert view.start_time(42) == 777
    assert view.uid(42) == 1234
    assert view.alive(42, 777) and not view.alive(42, 778) and not view.alive(43, None)
    assert view.same_pid_namespace(42)


def test_real_proc_view_knows_this_process() -> None:
    view = ProcView()
    assert view.start_time(os.getpid()) is not None
    assert view.uid(os.getpid()) == os.getuid()
    assert view.same_pid_namespace(os.getpid())


def bound_socket(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    return s


def test_steps_and_beats_build_rank_state(proc: FakeProcTree, tmp_path: Path) -> None:
    proc.add(100)
    table = table_for(proc)
    reply = bound_socket(tmp_path / "x.sock")
    for i in range(10):
        assert table.admit(step(100, i, t=T0 + i * 0.1, step_seconds=0.1 + i * 0.01,
                                loss=2.0 - i * 0.1, grad_norm=1.0), cred(100), T0 + i * 0.1) is None
    assert table.admit(beat(100, t=T0 + 1, reply_to=str(tmp_path / "x.sock"), dropped=3),
                       cred(100, uid=os.getuid()),
                       T0 + 1.0) is None
    v = table.get("j", 0)
    assert v is not None
    assert v.last_step == 9 and v.steps_total == 10 and v.beats_total == 1
    assert v.step_p50() == pytest.approx(0.14) and v.step_p99() == pytest.approx(0.19)
    assert v.loss == pytest.approx(1.1) and v.hook_dropped == 3
    assert v.reply_to == str(tmp_path / "x.sock")
    reply.close()
    assert v.start_time == 1000 and v.os_pid == 100
    assert v.step_seconds_count == 10 and v.step_seconds_sum == pytest.approx(1.45)


def test_step_time_derived_from_record_times_when_not_sent(proc: FakeProcTree) -> None:
    proc.add(100)
    table = table_for(proc)
    table.admit(step(100, 10, t=T0), cred(100), T0)
    table.admit(step(100, 12, t=T0 + 1.0), cred(100), T0 + 1.0)
    v = table.get("j", 0)
    assert v is not None and v.step_seconds == (0.5,)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown a socket")
def test_reply_to_must_be_a_socket_of_the_ranks_own_user(proc: FakeProcTree, tmp_path: Path
                                                         ) -> None:
    proc.add(100)
    table = table_for(proc)
    theirs = bound_socket(tmp_path / "theirs.sock")  # owned by root, not by uid 1000
    mine = bound_socket(tmp_path / "mine.sock")
    os.chown(tmp_path / "mine.sock", 1000, 1000)
    (tmp_path / "file").write_text("")
    for bad in ("relative.sock", str(tmp_path / "file"), str(tmp_path / "theirs.sock"),
                str(tmp_path / "missing.sock")):
        table.admit(beat(100, reply_to=bad), cred(100, uid=1000), T0)
        v = table.get("j", 0)
        assert v is not None and v.reply_to == "", bad
    table.admit(beat(100, reply_to=str(tmp_path / "mine.sock")), cred(100, uid=1000), T0)
    v = table.get("j", 0)
    assert v is not None and v.reply_to == str(tmp_path / "mine.sock")
    theirs.close()
    mine.close()


def test_beat_last_step_counts_as_progress(proc: FakeProcTree) -> None:
    proc.add(100)
    table = table_for(proc)
    table.admit(step(100, 5), cred(100), T0)
    table.admit(beat(100, last_step=7), cred(100), T0 + 3)
    v = table.get("j", 0)
    assert v is not None and v.last_step == 7 and v.last_progress == T0 + 3


def test_forged_pid_dropped_but_container_pid_mapped(proc: FakeProcTree) -> None:
    proc.add(100)
    proc.add(200, ns="pid:[4026532000]")  # a rank in its own pid namespace (container)
    table = table_for(proc)
    assert table.admit(step(555, 1), cred(100), T0) == "forged"
    assert len(table) == 0
    assert table.admit(step(7, 1, rank=1), cred(200), T0) is None
    v = table.get("j", 1)
    assert v is not None and v.pid == 7 and v.os_pid == 200


def test_slot_taken_while_owner_lives_then_restart(proc: FakeProcTree) -> None:
    proc.add(100)
    proc.add(101)
    table = table_for(proc)
    table.admit(step(100, 50, grad_norm=1.0), cred(100), T0)
    assert table.admit(step(101, 1), cred(101), T0 + 0.1) == "slot_taken"
    proc.remove(100)  # the owner died: a new process for the slot is a restart
    assert table.admit(step(101, 40), cred(101), T0 + 0.2) is None
    v = table.get("j", 0)
    assert v is not None and v.os_pid == 101 and v.restarts == 1 and v.last_step == 40
    assert v.steps_total == 1  # history starts afresh


def test_a_rank_the_checks_call_gone_gives_up_its_slot(proc: FakeProcTree) -> None:
    """One rule says whether a rank is live. A rank silent past its gone timeout (fast
    beats: 1.5 s) while its process still exists is not alive to the checks; a new process
    for its slot is then a restart, not ``slot_taken`` (admission had a timeout of its own,
    at least ``hang_floor_s``, so the two disagreed between 1.5 and 2 s of silence)."""
    proc.add(100)
    proc.add(101)
    table = table_for(proc)
    t = T0
    for _ in range(6):  # beats every 0.2 s: gone after max(gone_floor_s, 3 x 0.2 s)
        t += 0.2
        assert table.admit(beat(100, t=t), cred(100), t) is None
    v = table.get("j", 0)
    assert v is not None and table.gone_after(v.beat_interval_s) < 1.8
    now = t + 1.8
    assert not table.alive(v, now)
    assert table.admit(step(101, 1, t=now), cred(101), now) is None
    v = table.get("j", 0)
    assert v is not None and v.os_pid == 101 and v.restarts == 1


def test_reused_pid_is_not_the_owner(proc: FakeProcTree) -> None:
    proc.add(100, start=1000)
    proc.add(101)
    table = table_for(proc)
    table.admit(step(100, 5), cred(100), T0)
    proc.add(100, start=2000)  # pid 100 now belongs to another process
    assert table.admit(step(101, 1), cred(101), T0 + 0.1) is None


def test_wrong_job_and_world_size_mismatch(proc: FakeProcTree) -> None:
    proc.add(100)
    proc.add(101)
    table = table_for(proc)
    table.admit(step(100, 1, job="a"), cred(100), T0)
    assert table.admit(step(100, 1, job="b"), cred(100), T0) == "wrong_job"
    assert table.admit(step(101, 1, job="a", rank=1, world=4), cred(101), T0) == (
        "world_size_mismatch")
    assert table.admit(step(101, 1, job="a", rank=1, world=2), cred(101), T0) is None


def test_early_beats_of_phase_changes_do_not_shrink_the_learned_beat_interval(
    proc: FakeProcTree,
) -> None:
    proc.add(100)
    table = table_for(proc)
    t = T0
    for _ in range(5):  # the hook's regular 1 s beats
        t += 1.0
        assert table.admit(beat(100, t=t), cred(100), t) is None
    for i in range(20):  # a data phase entered every 30 ms step: one early beat each
        t += 0.03
        assert table.admit(beat(100, t=t, phase="data" if i % 2 else ""), cred(100), t) is None
    v = table.get("j", 0)
    assert v is not None and v.beat_interval_s is not None and v.beat_interval_s > 0.9
    assert table.gone_after(v.beat_interval_s) > 2.7


def test_new_rendezvous_round_with_another_world_size_replaces_the_job_at_once(
    proc: FakeProcTree, tmp_path: Path
) -> None:
    from forewarn.agent.checks.rank_gone import RankGoneCheck
    from forewarn.agent.state import AgentState

    table = table_for(proc)
    for r in range(4):
        proc.add(200 + r)
        assert table.admit(step(200 + r, 30, rank=r, world=4), cred(200 + r), T0) is None
    proc.add(9)
    assert table.admit(step(9, 5, job="other", world=1), cred(9), T0) is None
    for r in range(4):
        proc.remove(200 + r)  # torchrun ends the round: every worker of it exits
    # elastic shrink: the next round has two workers
    for r in range(2):
        proc.add(300 + r)
        assert table.admit(step(300 + r, 31, rank=r, world=2), cred(300 + r), T0 + 5) is None
    assert [(v.rank, v.world_size, v.os_pid) for v in table.job_views("j")] == [
        (0, 2, 300), (1, 2, 301)]
    assert table.rounds["j"] == 1 and table.get("other", 0) is not None
    state = AgentState(node="n", ranks=table)
    gone = [f for f in RankGoneCheck(grace_s=0.0).run(state, T0 + 5.1)
            if f.subject.job == "j" and f.health != "healthy"]
    assert gone == []


def test_restart_round_that_gives_this_node_other_ranks_drops_the_old_ones(
    proc: FakeProcTree,
) -> None:
    """A restart round of the same world size in which torchrun assigns this node other
    ranks (it sorts the nodes anew when a replacement node joins): the previous round's
    ranks here are gone with it, not 'gone while peers run: will hang'."""
    from forewarn.agent.checks.rank_gone import RankGoneCheck
    from forewarn.agent.state import AgentState

    table = table_for(proc)
    for r in (0, 1):
        proc.add(200 + r)
        assert table.admit(step(200 + r, 30, rank=r, world=4), cred(200 + r), T0) is None
    for r in (0, 1):
        proc.remove(200 + r)  # torchrun stops every local worker before the next round
    for r in (2, 3):
        proc.add(300 + r)
        assert table.admit(step(300 + r, 31, rank=r, world=4), cred(300 + r), T0 + 5) is None
    assert [(v.rank, v.os_pid) for v in table.job_views("j")] == [(2, 302), (3, 303)]
    state = AgentState(node="n", ranks=table)
    gone = [f for f in RankGoneCheck(grace_s=0.0).run(state, T0 + 5.1)
            if f.subject.job == "j" and f.health != "healthy"]
    assert gone == []


def test_a_rank_restarted_beside_a_live_peer_keeps_its_slot_history(
    proc: FakeProcTree,
) -> None:
    """Not a new round: one rank's process is replaced while its peer on this node still
    runs (a launcher that restarts one process): the peer stays, the slot counts a restart."""
    table = table_for(proc)
    for r in (0, 1):
        proc.add(200 + r)
        assert table.admit(step(200 + r, 30, rank=r, world=2), cred(200 + r), T0) is None
    proc.remove(201)
    proc.add(301)
    assert table.admit(step(301, 31, rank=1, world=2), cred(301), T0 + 1) is None
    views = table.job_views("j")
    assert [(v.rank, v.os_pid) for v in views] == [(0, 200), (1, 301)]
    assert views[1].restarts == 1


@pytest.mark.parametrize(
    ("record", "now"),
    [
        (step(100, 1, rank=2, world=2), T0),  # rank outside the world
        (step(100, 1), T0 + 7200),  # record time two hours off
        (step(100, 1, step_seconds=1e9), T0),  # a step of 30 years
    ],
)
def test_absurd_values_dropped(proc: FakeProcTree, record: StepRecord, now: float) -> None:
    proc.add(100)
    assert table_for(proc).admit(record, cred(100), now) == "absurd"


def test_huge_step_jump_dropped(proc: FakeProcTree) -> None:
    proc.add(100)
    table = table_for(proc, max_step_jump=1000)
    table.admit(step(100, 10), cred(100), T0)
    assert table.admit(step(100, 5000), cred(100), T0) == "absurd"
    assert table.admit(step(100, 900), cred(100), T0) is None


def test_checkpoint_reports_only_from_the_owner(proc: FakeProcTree) -> None:
    proc.add(100)
    proc.add(101)
    table = table_for(proc)
    rep = CheckpointReport(job="j", rank=0, request_id="r1", step=10, phase="done",
                           seconds=1.5, bytes=1024, time=T0)
    assert table.admit(rep, cred(100), T0) == "unknown_rank"
    table.admit(step(100, 9), cred(100), T0)
    assert table.admit(rep, cred(101), T0) == "unknown_rank"
    assert table.admit(rep, cred(100), T0) is None
    v = table.get("j", 0)
    assert v is not None and v.last_checkpoint_step == 10 and v.checkpoint_bytes == 1024
    assert [r.request_id for r in table.drain_reports()] == ["r1"]
    assert table.drain_reports() == []


def test_table_is_bounded(proc: FakeProcTree) -> None:
    for pid in (100, 101, 102):
        proc.add(pid)
    table = table_for(proc, max_ranks=2)
    assert table.admit(step(100, 1, job="a"), cred(100), T0) is None
    assert table.admit(step(101, 1, job="b"), cred(101), T0) is None
    assert table.admit(step(102, 1, job="c"), cred(102), T0) == "table_full"
    # once the others fall silent past evict_after_s there is room again
    assert table.admit(step(102, 1, job="c", t=T0 + 1000), cred(102), T0 + 1000) is None


def test_nonfinite_marks_first_bad_step_and_clear(proc: FakeProcTree) -> None:
    proc.add(100)
    table = table_for(proc)
    table.admit(step(100, 1, loss=1.0), cred(100), T0)
    table.admit(step(100, 2, loss=math.nan), cred(100), T0)
    table.admit(step(100, 3, loss=math.inf), cred(100), T0)
    v = table.get("j", 0)
    assert v is not None and v.nonfinite_loss_step == 2
    table.admit(step(100, 4, loss=0.5), cred(100), T0)
    v = table.get("j", 0)
    assert v is not None and v.nonfinite_loss_step is None


def test_grad_spike_marked_and_kept_out_of_baseline(proc: FakeProcTree) -> None:
    proc.add(100)
    table = table_for(proc)
    for i in range(10):
        table.admit(step(100, i, grad_norm=1.0 + 0.01 * i), cred(100), T0)
    table.admit(step(100, 10, grad_norm=50.0), cred(100), T0)
    v = table.get("j", 0)
    assert v is not None and v.spike_step == 10 and v.spike_value == 50.0
    assert v.grad_norm_samples == 10 and v.grad_norm_median == pytest.approx(1.04)
    table.admit(step(100, 11, grad_norm=5.0), cred(100), T0)  # 5x: not a spike
    v = table.get("j", 0)
    assert v is not None and v.spike_step == 10


def test_listeners_and_summaries(proc: FakeProcTree) -> None:
    proc.add(100)
    table = table_for(proc)
    seen: list[int] = []
    table.on_step(lambda view, rec: seen.append(rec.step))
    table.admit(step(100, 3, step_seconds=0.2, loss=1.0), cred(100), T0)
    table.admit(beat(100), cred(100), T0)
    assert seen == [3]
    (s,) = table.summaries("node1", T0)
    assert s.node == "node1" and s.gpu == 0 and s.last_step == 3 and s.alive
    assert s.step_seconds_p50 == pytest.approx(0.2)
    assert s.compute_seconds_p50 is None  # the hook sent no compute time


def test_summaries_carry_the_recent_compute_pace(proc: FakeProcTree) -> None:
    """The collector compares ranks across nodes by it (in synchronous data parallelism
    every rank's wall step time is the slowest rank's)."""
    proc.add(100)
    table = table_for(proc)
    for n, compute in enumerate([0.1] * 10 + [0.3] * 5):
        table.admit(step(100, n, step_seconds=0.3, extras={"compute_seconds": compute}),
                    cred(100), T0)
    (s,) = table.summaries("node1", T0)
    assert s.compute_seconds_p50 == pytest.approx(0.3)  # the last 8: recent, not all-time


def test_quantile() -> None:
    assert quantile([], 0.5) is None
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile(range(1, 101), 0.99) == 99


def test_rank_metrics_exposition(proc: FakeProcTree) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from forewarn.agent.rank_metrics import RankCollector

    proc.add(100)
    table = table_for(proc)
    for i in range(4):
        table.admit(step(100, i, step_seconds=0.5, loss=math.nan if i == 3 else 1.0,
                         grad_norm=2.0), cred(100), T0)
    table.admit(beat(100), cred(100), T0)
    table.note_finding("j", 0, "nan_loss", 3, T0 + 0.001)
    reg = CollectorRegistry()
    reg.register(RankCollector("n1", table, clock=lambda: T0 + 5.0))
    text = generate_latest(reg).decode()
    labels = 'node="n1",rank="0",training_job="j"'
    for line in (
        f"forewarn_rank_step{{{labels}}} 3.0",
        'forewarn_rank_step_seconds{node="n1",quantile="0.99",rank="0",training_job="j"} 0.5',
        f"forewarn_rank_step_seconds_count{{{labels}}} 4.0",
        f"forewarn_rank_loss{{{labels}}} NaN",
        f"forewarn_rank_grad_norm{{{labels}}} 2.0",
        f"forewarn_rank_heartbeat_age_seconds{{{labels}}} 5.0",
        f"forewarn_rank_alive{{{labels}}} 0.0",  # silent for 5 s > 3 beat intervals
        f'forewarn_rank_findings_total{{check="nan_loss",{labels}}} 1.0',
        f'forewarn_rank_finding_step{{check="nan_loss",{labels}}} 3.0',
        "# TYPE forewarn_rank_step_seconds summary",
    ):
        assert line in text, line
