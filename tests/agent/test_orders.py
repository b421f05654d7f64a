"""Checkpoint orders (step choice, delivery, reports, reissue), the local fast path, and
the hang terminator against real child processes (real signals, real pidfds)."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from forewarn.agent.hang import HangTerminator
from forewarn.agent.ingest import RankIngest
from forewarn.agent.orders import CheckpointOrders, choose_step
from forewarn.agent.procview import Credentials, ProcView
from forewarn.agent.ranks import RankTable
from forewarn.hook import Monitor
from forewarn.wire import (
    Beat,
    CheckpointOrder,
    CheckpointReport,
    Finding,
    Health,
    IntervalAdvice,
    SaveHold,
    StepRecord,
    Subject,
    SuggestedAction,
    decode_agent_message,
    decode_hook_message,
    decode_order,
    encode,
)

from support.polling import wait_for


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Ranks:
    """Ranks of jobs backed by real reply sockets; credentials are this test's pid for
    the table (the table's admission logic is tested elsewhere)."""

    def __init__(self, tmp: Path, clock: Clock) -> None:
        self.tmp = tmp
        self.clock = clock
        self.table = RankTable(proc=_AlwaysAlive())
        self.sockets: dict[tuple[str, int], socket.socket] = {}
        self.sent: list[tuple[str, bytes]] = []
        self.fail_sends = False
        self.local: dict[tuple[str, int], int] = {}
        self.world: dict[str, int] = {}

    def send(self, path: str, data: bytes) -> bool:
        if self.fail_sends:
            return False
        self.sent.append((path, data))
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            try:
                s.sendto(data, path)
            except OSError:
                return False
        return True

    def add(self, job: str, rank: int, pid: int, local_rank: int | None = None,
            world: int = 2, reply_to: str = "") -> None:
        """A rank with a reply socket of this test's (or ``reply_to``: a real Monitor's)."""
        self.world[job] = world
        if not reply_to:
            path = self.tmp / f"{job}-{rank}-{pid}.sock"
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            s.bind(str(path))
            s.setblocking(False)
            self.sockets[(job, rank)] = s
            reply_to = str(path)
        lr = rank if local_rank is None else local_rank
        self.local[(job, rank)] = lr
        b = Beat(job=job, rank=rank, local_rank=lr, world_size=world, pid=pid, host="h",
                 time=self.clock(), reply_to=reply_to)
        assert self.table.admit(b, Credentials(pid, os.getuid(), 0), self.clock()) is None

    def step(self, job: str, rank: int, pid: int, n: int, seconds: float = 0.1) -> None:
        r = StepRecord(job=job, rank=rank, local_rank=self.local[(job, rank)],
                       world_size=self.world[job],
                       pid=pid, host="h", step=n, time=self.clock(), step_seconds=seconds)
        assert self.table.admit(r, Credentials(pid, os.getuid(), 0), self.clock()) is None

    def report(self, job: str, rank: int, pid: int, rid: str, step: int, phase: str) -> None:
        rep = CheckpointReport(job=job, rank=rank, request_id=rid, step=step, phase=phase,
                               seconds=0.5 if phase == "done" else None, time=self.clock())
        assert self.table.admit(rep, Credentials(pid, os.getuid(), 0), self.clock()) is None

    def received(self, job: str, rank: int) -> list[CheckpointOrder]:
        out = []
        while True:
            try:
                out.append(decode_order(self.sockets[(job, rank)].recv(4096)))
            except BlockingIOError:
                return out


class _AlwaysAlive(ProcView):
    """Every pid is alive with start time 1 (these tests are about orders, not pids)."""

    def start_time(self, pid: int) -> int | None:
        return 1

    def same_pid_namespace(self, pid: int) -> bool:
        return True


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[Ranks]:
    r = Ranks(tmp_path, Clock(1_700_000_000.0))
    yield r
    for s in r.sockets.values():
        s.close()


def make_orders(r: Ranks, **kw: Any) -> CheckpointOrders:
    return CheckpointOrders(r.table, r.send, clock=r.clock, **kw)


def nan_finding() -> Finding:
    """A NaN loss of rank 1 of job ``a`` since step 38 (the fast path holds its saves)."""
    return Finding(check="nan_loss", health=Health.UNHEALTHY,
                   subject=Subject(kind="rank", node="n", job="a", rank=1, gpu=1),
                   reason="loss nan", action=SuggestedAction.RESTART_JOB,
                   evidence={"bad_step": 38}, time=0.0)


def test_step_formula(ranks: Ranks) -> None:
    ranks.add("j", 0, 100)
    ranks.add("j", 1, 101)
    for n in range(1, 21):
        ranks.step("j", 0, 100, n)
        ranks.step("j", 1, 101, n - 2)  # rank 1 lags two steps
    views = ranks.table.job_views("j")
    now = ranks.clock()
    # margin = ceil((0.05 + 0.25) / 0.1) = 3 -> S = 20 + 3 + 1
    assert choose_step(views, now) == 24
    # 0.35 s later the fastest rank is ~3 steps further
    assert choose_step(views, now + 0.35) == 27
    assert choose_step(views, now, margin_scale=2.0) == 27
    # no step times yet: fallback margin of 10 steps
    assert choose_step([], now) == 11


def _two_ranks_at_step_10(ranks: Ranks) -> CheckpointOrders:
    """Job ``j``: ranks 0 and 1 (pids 100, 101) at step 10, 0.1 s steps; its orders."""
    for rank in (0, 1):
        ranks.add("j", rank, 100 + rank)
        for n in range(1, 11):
            ranks.step("j", rank, 100 + rank, n)
    return make_orders(ranks)


def test_order_reaches_every_rank_and_completes(ranks: Ranks) -> None:
    orders = _two_ranks_at_step_10(ranks)
    order = orders.order_job("j", reason="manual test")
    assert order is not None and order.step == 14
    (o0,), (o1,) = ranks.received("j", 0), ranks.received("j", 1)
    assert o0 == o1 == order
    for rank in (0, 1):
        ranks.report("j", rank, 100 + rank, order.request_id, order.step, "started")
    assert orders.open_orders()
    ranks.report("j", 0, 100, order.request_id, order.step, "done")
    assert orders.open_orders()
    ranks.report("j", 1, 101, order.request_id, order.step, "done")
    assert not orders.open_orders()
    assert orders.outcomes_total["done"] == 1 and "j" in orders.last_duration
    assert orders.orders_total[("j", "manual")] == 1
    assert orders.order_job("nobody-here") is None


def _notice(ranks: Ranks, job: str, rank: int, pid: int) -> None:
    b = Beat(job=job, rank=rank, local_rank=rank, world_size=ranks.world[job], pid=pid,
             host="h", time=ranks.clock(), preempted=True)
    assert ranks.table.admit(b, Credentials(pid, os.getuid(), 0), ranks.clock()) is None


def test_preemption_notice_orders_the_whole_job_once_per_round(ranks: Ranks) -> None:
    orders = _two_ranks_at_step_10(ranks)
    ranks.table.on_preempt(orders.preempt_job)
    _notice(ranks, "j", 0, 100)  # SIGTERM on rank 0 ...
    _notice(ranks, "j", 0, 100)  # ... again (Slurm: SIGTERM, SIGCONT, SIGTERM)
    _notice(ranks, "j", 1, 101)  # ... and rank 1's own signal
    (o0,), (o1,) = ranks.received("j", 0), ranks.received("j", 1)
    # both ranks reported step 10 just now and steps take 0.1 s: the order (delivered in
    # well under a step) lands while they run step 11, which is the step they save
    assert o0 == o1 and o0.step == 11 and o0.reason.startswith("preempted:")
    assert orders.orders_total[("j", "preempted")] == 1


def _paced_job(ranks: Ranks, reports: list[tuple[int, float]], step_s: float,
               beat_late_s: float = 0.0) -> CheckpointOrders:
    """Job ``j`` whose rank r last reported step ``reports[r][0]`` ``reports[r][1]`` seconds
    ago, at ``step_s`` a step; its beats arrive ``beat_late_s`` after they were made."""
    now = ranks.clock.t
    for rank, (last, ago) in enumerate(reports):
        ranks.add("j", rank, 100 + rank, world=len(reports))
        for n in range(last - 19, last + 1):
            ranks.clock.t = now - ago - (last - n) * step_s
            ranks.step("j", rank, 100 + rank, n, seconds=step_s)
    ranks.clock.t = now
    for rank in range(len(reports)):
        b = Beat(job="j", rank=rank, local_rank=rank, world_size=len(reports), pid=100 + rank,
                 host="h", time=now - beat_late_s, last_step=reports[rank][0])
        assert ranks.table.admit(b, Credentials(100 + rank, os.getuid(), 0), now) is None
    orders = make_orders(ranks)
    ranks.table.on_preempt(orders.preempt_job)
    return orders


@pytest.mark.parametrize(("reports", "beat_late_s", "expected"), [
    # 50 ms steps, the fastest rank reported step 40 10 ms ago: 40 ms of step 41 are left,
    # far more than the delivery (sub-ms datagram + the hook's GIL switch): save step 41
    ([(40, 0.010), (39, 0.001)], 0.0, 41),
    # the fastest rank is 1 ms from ending step 41: it may report it before the order
    # lands, so step 42 (the next step no rank can have reached by then)
    ([(40, 0.049), (40, 0.049)], 0.0, 42),
    # beats measured 30 ms late: the order needs ~35 ms, step 41 ends in 20 ms -> 42
    ([(40, 0.030), (40, 0.030)], 0.030, 42),
])
def test_preemption_order_is_for_the_first_step_no_rank_can_reach_before_it_lands(
    ranks: Ranks, reports: list[tuple[int, float]], beat_late_s: float, expected: int
) -> None:
    """The local preemption order's lead is the measured delivery and the ranks' own
    phase and pace, not the fixed 0.3 s (which put S 7 steps ahead at 50 ms a step)."""
    _paced_job(ranks, reports, 0.05, beat_late_s)
    _notice(ranks, "j", 0, 100)
    (o0,), (o1,) = ranks.received("j", 0), ranks.received("j", 1)
    assert o0 == o1 and o0.step == expected
    # a fast-path order keeps its configured margin (delivery 0.05 s + safety 0.25 s)
    assert choose_step(ranks.table.job_views("j"), ranks.clock()) >= 40 + 6


def test_missed_preemption_order_is_reissued_further_ahead_for_every_rank(
    ranks: Ranks
) -> None:
    """A rank already past S says ``missed``; the agent reissues the preemption order to
    the whole job with twice the steps of margin each time, under the same chain."""
    orders = _paced_job(ranks, [(40, 0.010), (40, 0.010)], 0.05)
    _notice(ranks, "j", 0, 100)
    (first,) = ranks.received("j", 0)
    ranks.received("j", 1)
    assert first.step == 41
    # rank 1 ran faster than its pace: it had reported step 41 when the order came
    ranks.step("j", 1, 101, 41, seconds=0.04)
    ranks.report("j", 1, 101, first.request_id, 41, "missed")
    (again,) = ranks.received("j", 0)
    assert ranks.received("j", 1) == [again]
    assert again.request_id == f"{first.request_id}-r1"
    assert again.reason == first.reason and again.step == 41 + 2
    ranks.report("j", 0, 100, again.request_id, 44, "missed")  # past the rank's own step
    (third,) = ranks.received("j", 0)
    assert third.request_id == f"{first.request_id}-r2" and third.step == 44 + 4
    (st,) = orders.open_orders()
    assert st.order == third and st.reissues == 2
    for rank in (0, 1):
        ranks.report("j", rank, 100 + rank, third.request_id, third.step, "done")
    assert not orders.open_orders() and orders.outcomes_total["done"] == 1


def test_preemption_of_a_job_spanning_nodes_is_not_ordered_locally(ranks: Ranks) -> None:
    ranks.add("wide", 0, 100, world=4)
    orders = make_orders(ranks)
    ranks.table.on_preempt(orders.preempt_job)
    _notice(ranks, "wide", 0, 100)
    assert ranks.received("wide", 0) == [] and orders.deferred_total["wide"] == 1


def test_missed_reissues_for_the_whole_job(ranks: Ranks) -> None:
    for rank in (0, 1):
        ranks.add("j", rank, 100 + rank)
        ranks.step("j", rank, 100 + rank, 10)
        ranks.step("j", rank, 100 + rank, 11)
    orders = make_orders(ranks)
    first = orders.order_job("j", reason="test", origin="local")
    assert first is not None
    ranks.received("j", 0), ranks.received("j", 1)
    ranks.report("j", 1, 101, first.request_id, first.step + 2, "missed")
    (again,) = ranks.received("j", 0)
    assert ranks.received("j", 1) == [again]
    assert again.request_id == f"{first.request_id}-r1"
    assert again.step > first.step
    # the margin doubled: 2 x ceil(0.3 / 0.1) = 6 (+1) past the step rank 1 said it was at
    assert again.step == first.step + 2 + 6 + 1
    (st,) = orders.open_orders()
    assert st.order == again and st.reissues == 1
    assert orders.outcomes_total["superseded"] == 1


@pytest.mark.parametrize("preempt", [False, True])
def test_a_reissue_is_past_the_step_the_missing_rank_reported(
    ranks: Ranks, preempt: bool
) -> None:
    """The ``missed`` report names the rank's step; the table may not have seen that step
    yet (its records lost or still on the way): the reissue is past it all the same."""
    orders = _paced_job(ranks, [(40, 0.010), (40, 0.010)], 0.05)
    if preempt:
        _notice(ranks, "j", 0, 100)
    first = orders.open_orders()[0].order if preempt else orders.order_job(
        "j", reason="test", origin="local")
    assert first is not None
    ranks.received("j", 0)
    ranks.received("j", 1)
    ranks.report("j", 1, 101, first.request_id, 60, "missed")
    (again,) = ranks.received("j", 0)
    assert again.request_id == f"{first.request_id}-r1" and again.step > 60


def test_collector_step_is_not_reissued_locally(ranks: Ranks) -> None:
    ranks.add("j", 0, 100)
    ranks.step("j", 0, 100, 50)
    orders = make_orders(ranks)
    order = orders.order_job("j", step=40, reason="collector", request_id="c-1")
    assert order is not None and order.request_id == "c-1" and order.step == 40
    ranks.report("j", 0, 100, "c-1", 50, "missed")
    assert not orders.open_orders() and orders.outcomes_total["failed"] == 1
    assert len(ranks.received("j", 0)) == 1  # only the original


def test_an_order_to_a_round_that_ended_never_reaches_the_next_round(ranks: Ranks) -> None:
    """torchrun restarts the whole job when a rank dies: it SIGTERMs the survivor, whose
    notice orders a preemption save that the exiting ranks never take (their sockets are
    closed). That order was for those processes: it must not reach the next round's ranks,
    which resumed from an earlier checkpoint and would take it (one rank saving alone waits
    in the collective save for a peer that steps on: the job wedges; CI's chaos lab hung at
    the order's step after a rank kill). It ends, so the new round's own notice orders."""
    orders = _two_ranks_at_step_10(ranks)
    ranks.table.on_preempt(orders.preempt_job)
    for rank in (0, 1):
        ranks.sockets.pop(("j", rank)).close()  # the old round's processes are exiting
    _notice(ranks, "j", 0, 100)
    (old,) = orders.open_orders()
    assert old.delivery.unsent == {0, 1}
    ranks.clock.t += 5  # the restart: new processes resume from the checkpoint of step 5
    for rank in (0, 1):
        ranks.add("j", rank, 200 + rank)
        for n in range(6, 9):
            ranks.step("j", rank, 200 + rank, n)
    orders.tick(ranks.clock())
    assert ranks.received("j", 0) == ranks.received("j", 1) == []
    assert orders.open_orders() == [] and orders.outcomes_total["ended"] == 1
    _notice(ranks, "j", 1, 201)  # this round's own notice orders this round
    (o0,), (o1,) = ranks.received("j", 0), ranks.received("j", 1)
    assert o0 == o1 and o0.reason.startswith("preempted:") and o0.step > 8


def test_lost_order_detected_and_undelivered_retried(ranks: Ranks) -> None:
    ranks.add("j", 0, 100)
    ranks.step("j", 0, 100, 5)
    orders = make_orders(ranks)
    ranks.fail_sends = True
    order = orders.order_job("j", reason="t", origin="local")
    assert order is not None
    (st,) = orders.open_orders()
    assert st.delivery.unsent == {0}
    ranks.fail_sends = False
    orders.tick(ranks.clock())
    assert ranks.received("j", 0) == [order] and not st.delivery.unsent
    # the rank went past S without a word about this order: treated as missed
    ranks.step("j", 0, 100, order.step + 1)
    orders.tick(ranks.clock())
    (st2,) = orders.open_orders()
    assert st2.order.request_id.endswith("-r1") and st2.order.step > order.step + 1


def gpu_finding(gpu: int, action: SuggestedAction, health: Health = Health.UNHEALTHY
                ) -> Finding:
    return Finding(check="xid", health=health, subject=Subject(kind="gpu", node="n", gpu=gpu),
                   reason="XID 79", action=action, time=0.0)


def rank_finding(check: str, job: str, rank: int) -> Finding:
    return Finding(check=check, health=Health.UNHEALTHY,
                   subject=Subject(kind="rank", node="n", job=job, rank=rank, gpu=rank),
                   reason="r", action=SuggestedAction.CHECKPOINT, time=0.0)


def test_fast_path_orders_jobs_on_the_gpu_once(ranks: Ranks) -> None:
    ranks.add("a", 0, 100, local_rank=0, world=1)
    ranks.add("b", 0, 200, local_rank=1, world=1)
    ranks.step("a", 0, 100, 7)
    ranks.step("b", 0, 200, 9)
    mono = Clock(0.0)
    orders = CheckpointOrders(ranks.table, ranks.send, clock=ranks.clock, monotonic=mono,
                              cooldown_s=60)
    assert orders.fast_path([gpu_finding(1, SuggestedAction.WATCH)]) == []
    assert orders.fast_path([gpu_finding(1, SuggestedAction.RESET_GPU, Health.DEGRADED)]) == []
    (order,) = orders.fast_path([gpu_finding(1, SuggestedAction.RESET_GPU)])
    assert order.job == "b" and order.reason.startswith("xid:")
    assert ranks.received("a", 0) == []
    mono.t = 30.0
    assert orders.fast_path([gpu_finding(1, SuggestedAction.RESET_GPU)]) == []  # cooldown
    mono.t = 61.0
    assert len(orders.fast_path([gpu_finding(1, SuggestedAction.RESET_GPU)])) == 1
    node = Finding(check="ecc", health=Health.UNHEALTHY, subject=Subject(kind="node", node="n"),
                   reason="r", action=SuggestedAction.DRAIN, time=0.0)
    assert sorted(o.job for o in orders.fast_path([node])) == ["a", "b"]


def test_fast_path_leaves_multi_node_jobs_to_the_collector(ranks: Ranks) -> None:
    ranks.add("big", 0, 100, local_rank=0, world=16)  # 15 more ranks on other nodes
    ranks.step("big", 0, 100, 7)
    orders = make_orders(ranks)
    assert orders.fast_path([gpu_finding(0, SuggestedAction.DRAIN)]) == []
    assert orders.deferred_total["big"] == 1 and ranks.received("big", 0) == []
    # the collector, which reaches every node, still can
    assert orders.order_job("big", step=20, reason="collector", request_id="c-9") is not None


def test_fast_path_spike_orders_nan_and_hang_do_not(ranks: Ranks) -> None:
    ranks.add("a", 0, 100, world=1)
    ranks.step("a", 0, 100, 7)
    ranks.add("b", 0, 200, world=1)
    ranks.step("b", 0, 200, 7)
    orders = make_orders(ranks)
    assert orders.fast_path([rank_finding("nan_loss", "a", 0)]) == []
    # not an order: a hold (see the next test)
    assert isinstance(decode_agent_message(ranks.sockets[("a", 0)].recv(4096)), SaveHold)
    assert orders.fast_path([rank_finding("rank_hang", "a", 0)]) == []
    # a spike after the NaN joins that incident: the saves are held, nothing to order
    assert orders.fast_path([rank_finding("grad_spike", "a", 0)]) == []
    (order,) = orders.fast_path([rank_finding("grad_spike", "b", 0)])
    assert order.job == "b"


def test_fast_path_nan_holds_the_saves_of_a_local_job_only(ranks: Ranks) -> None:
    """Even with the collector down: every local rank hears the onset and one step where
    saving stops, ahead of the fastest rank; a job spanning nodes is the collector's."""
    for rank in (0, 1):
        ranks.add("a", rank, 100 + rank, world=2)
        ranks.step("a", rank, 100 + rank, 40 + rank)
    ranks.add("big", 0, 300, local_rank=2, world=16)
    ranks.step("big", 0, 300, 40)
    orders = make_orders(ranks)
    nan = nan_finding()
    assert orders.fast_path([nan]) == []  # no checkpoint order
    holds = [decode_agent_message(ranks.sockets[("a", r)].recv(4096)) for r in (0, 1)]
    assert holds[0] == holds[1] and isinstance(holds[0], SaveHold)
    assert holds[0].onset_step == 38 and holds[0].step > 41
    big = msgspec.structs.replace(nan, subject=Subject(kind="rank", node="n", job="big", rank=0))
    orders.fast_path([big])
    assert orders.deferred_total["big"] == 1
    with pytest.raises(BlockingIOError):
        ranks.sockets[("big", 0)].recv(4096)


# -- hang terminator: real processes -------------------------------------------------------

def spawn(ignore_term: bool = False) -> subprocess.Popen[bytes]:
    code = "import signal, time\n"
    if ignore_term:
        code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    code += "print('ready', flush=True)\ntime.sleep(120)\n"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    return p


def admit_real(table: RankTable, job: str, rank: int, pid: int, now: float) -> None:
    b = Beat(job=job, rank=rank, local_rank=rank, world_size=2, pid=pid, host="h", time=now)
    assert table.admit(b, Credentials(pid, os.getuid(), os.getgid()), now) is None


def hang(job: str, rank: int, health: Health = Health.UNHEALTHY) -> Finding:
    return Finding(check="rank_hang", health=health,
                   subject=Subject(kind="rank", node="n", job=job, rank=rank),
                   reason="hung", action=SuggestedAction.RESTART_JOB, time=0.0)


def test_terminate_confirmed_hang_with_sigterm_then_sigkill() -> None:
    now = time.time()
    table = RankTable()
    polite, stubborn = spawn(), spawn(ignore_term=True)
    mono = Clock(0.0)
    term = HangTerminator(table, action="terminate", grace_s=5.0, monotonic=mono)
    try:
        admit_real(table, "j", 0, polite.pid, now)
        admit_real(table, "j", 1, stubborn.pid, now)
        assert term.on_findings([hang("j", 0), hang("j", 1)], now) == []  # not confirmed yet
        assert polite.poll() is None
        assert term.on_findings([hang("j", 0), hang("j", 1)], now) == ["j"]
        assert polite.wait(timeout=30) == -signal.SIGTERM
        assert stubborn.poll() is None
        mono.t = 6.0
        term.tick()
        assert stubborn.wait(timeout=30) == -signal.SIGKILL
        assert term.signals_total[("j", "SIGTERM")] == 2
        assert term.signals_total[("j", "SIGKILL")] == 1
        # the same episode is handled once
        assert term.on_findings([hang("j", 0)], now) == []
    finally:
        for p in (polite, stubborn):
            p.kill()
            p.wait()
        term.close()


def test_a_rank_that_ends_on_sigterm_leaves_its_stuck_peer_one_signal() -> None:
    """CI at 64a6e2f: the polite rank exited on SIGTERM, the stuck one stayed hung, and the
    next confirmation saw ranks {stuck} where it had handled {polite, stuck}: "a new
    episode", a second SIGTERM. A rank leaving is the same episode; a new pid is a new one."""
    now = time.time()
    table = RankTable()
    polite, stubborn = spawn(), spawn(ignore_term=True)
    term = HangTerminator(table, action="terminate", grace_s=5.0, monotonic=Clock(0.0))
    try:
        admit_real(table, "j", 0, polite.pid, now)
        admit_real(table, "j", 1, stubborn.pid, now)
        for _ in range(2):
            term.on_findings([hang("j", 0), hang("j", 1)], now)
        assert polite.wait(timeout=30) == -signal.SIGTERM
        for _ in range(3):  # the stuck rank is still hung, poll after poll
            assert term.on_findings([hang("j", 1)], now) == []
        assert term.signals_total[("j", "SIGTERM")] == 2
    finally:
        for p in (polite, stubborn):
            p.kill()
            p.wait()
        term.close()


def test_shadow_and_unverified_pids_are_not_signalled() -> None:
    now = time.time()
    p = spawn()
    try:
        table = RankTable()
        admit_real(table, "j", 0, p.pid, now)
        shadow = HangTerminator(table, action="shadow", confirm_polls=1)
        assert shadow.on_findings([hang("j", 0)], now) == ["j"]
        assert p.poll() is None and not shadow.signals_total

        class Reused(ProcView):  # the pid now belongs to a process started later
            def start_time(self, pid: int) -> int | None:
                real = super().start_time(pid)
                return None if real is None else real + 1

        table2 = RankTable()
        admit_real(table2, "j", 0, p.pid, now)
        table2.proc = Reused()
        term = HangTerminator(table2, action="terminate", confirm_polls=1)
        # the table no longer sees the rank as alive: nothing confirmed, nothing signalled
        assert term.on_findings([hang("j", 0)], now) == []
        v = table2.get("j", 0)
        assert v is not None
        term._terminate(v)  # even when asked directly: refused
        assert term.signals_total[("j", "refused")] == 1
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()


def test_healthy_finding_resets_confirmation() -> None:
    now = time.time()
    p = spawn()
    try:
        table = RankTable()
        admit_real(table, "j", 0, p.pid, now)
        term = HangTerminator(table, action="shadow", confirm_polls=2)
        assert term.on_findings([hang("j", 0)], now) == []
        assert term.on_findings([hang("j", 0, Health.HEALTHY)], now) == []
        assert term.on_findings([hang("j", 0)], now) == []
        assert term.on_findings([hang("j", 0)], now) == ["j"]
    finally:
        p.kill()
        p.wait()
    assert math.isfinite(now)


# -- the component inside a real Agent: hardware finding -> local checkpoint order ---------

@contextlib.contextmanager
def agent_with_a_rank(tmp_path: Path, backend: Any) -> Iterator[tuple[Any, Any, socket.socket]]:
    """A real Agent with the rank component and ``backend``; job "j" has its one rank on
    local GPU 1 and has stepped to 4. Yields (agent, component, the rank's reply socket)."""
    from forewarn.agent.checks import default_checks
    from forewarn.agent.config import AgentConfig
    from forewarn.agent.daemon import Agent
    from forewarn.agent.rank_component import RankComponent
    from forewarn.wire import encode

    config = AgentConfig(node="n0", listen="127.0.0.1:0", kmsg=False,
                         socket_path=tmp_path / "run" / "agent.sock")
    agent = Agent(config, backend, checks=default_checks())
    comp = RankComponent(config)
    agent.add_component(comp)
    agent.start(serve=False)
    reply = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    reply.bind(str(tmp_path / "reply.sock"))
    reply.settimeout(20)
    out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        out.sendto(encode(Beat(job="j", rank=0, local_rank=1, world_size=1, pid=os.getpid(),
                               host="h", time=time.time(),
                               reply_to=str(tmp_path / "reply.sock"))),
                   str(config.socket_path))
        for n in range(5):
            out.sendto(encode(StepRecord(job="j", rank=0, local_rank=1, world_size=1,
                                         pid=os.getpid(), host="h", step=n, time=time.time(),
                                         step_seconds=0.1, loss=1.0, grad_norm=1.0)),
                       str(config.socket_path))
        deadline = time.monotonic() + 20
        while (v := comp.table.get("j", 0)) is None or v.last_step != 4 or not v.reply_to:
            assert time.monotonic() < deadline, "the ingest thread did not apply the records"
            time.sleep(0.01)
        yield agent, comp, reply
    finally:
        agent.stop()
        reply.close()
        out.close()
    assert not config.socket_path.exists()


def test_component_orders_a_checkpoint_for_the_job_on_a_failing_gpu(tmp_path: Path) -> None:
    from forewarn.agent.testing import ScriptedBackend

    backend = ScriptedBackend(lambda gpu, t: {"temperature_c": 40.0}, gpus=2)
    with agent_with_a_rank(tmp_path, backend) as (agent, comp, reply):
        agent.poll_once()
        assert comp.orders.orders_total == {}
        backend.queue_xid(79, gpu=0, time=time.time())  # another GPU: not this job's
        agent.poll_once()
        assert comp.orders.orders_total == {}
        backend.queue_xid(79, gpu=1, time=time.time())
        agent.poll_once()
        order = decode_order(reply.recv(4096))
        assert order.job == "j" and order.step > 4 and order.reason.startswith("xid:")
        assert comp.orders.orders_total == {("j", "xid"): 1}


def test_reason_labels_are_bounded() -> None:
    from forewarn.agent.orders import reason_label

    assert reason_label("xid: XID 79 on GPU 3", "local") == "xid"
    assert reason_label("grad_spike: rank 1 ...", "local") == "grad_spike"
    assert reason_label("P(fail)=0.93 within 1h", "collector") == "pfail093"
    assert reason_label("", "collector") == "collector"
    assert reason_label("💥{}", "manual") == "manual"
    assert len(reason_label("a" * 500, "x")) == 32


def test_interval_advice_reaches_every_live_rank_of_the_job(ranks: Ranks) -> None:
    ranks.add("j", 0, 100)
    ranks.add("j", 1, 101)
    ranks.add("other", 0, 200)
    advice = IntervalAdvice(job="j", every_steps=50, from_step=120, interval_s=10.0,
                            issued=ranks.clock())
    assert make_orders(ranks).advise_job(advice) == 2
    for rank in (0, 1):
        got = decode_agent_message(ranks.sockets[("j", rank)].recv(4096))
        assert got == advice
    with pytest.raises(BlockingIOError):
        ranks.sockets[("other", 0)].recv(4096)


def test_one_double_bit_error_orders_one_local_checkpoint(tmp_path: Path) -> None:
    """Issue 13.5: one DBE gives two unhealthy findings on one GPU in the same poll (XID 48
    and the uncorrectable-ECC counter): one incident, so one order and one save, not two."""
    from forewarn.agent.testing import ScriptedBackend

    dbe = {"n": 0}
    backend = ScriptedBackend(lambda gpu, t: {
        "temperature_c": 40.0, "ecc_uncorrected_volatile": dbe["n"] if gpu == 1 else 0},
        gpus=2)
    with agent_with_a_rank(tmp_path, backend) as (agent, comp, reply):
        agent.poll_once()
        dbe["n"] = 1
        backend.queue_xid(48, gpu=1, time=time.time())
        poll = agent.poll_once()
        unhealthy = {t.finding.check for t in poll.transitions
                     if t.finding.health == Health.UNHEALTHY}
        assert {"xid", "ecc"} <= unhealthy, unhealthy
        agent.poll_once()
        reply.settimeout(0.5)
        orders = []
        with contextlib.suppress(TimeoutError):
            while True:
                orders.append(decode_order(reply.recv(4096)))
        assert len(orders) == 1, [o.reason for o in orders]
        assert sum(comp.orders.orders_total.values()) == 1, comp.orders.orders_total


def test_a_local_hold_missed_by_a_rank_goes_again_to_every_rank_past_its_step(
        ranks: Ranks) -> None:
    """The agent's own hold (a job on its node) is placed by the ordering rule as its orders
    are: a rank that had passed its step reports ``missed`` and every local rank gets the
    hold again, from the step after the one that rank reported, replacing the missed one.
    A collector's hold passed through is left to the collector."""
    for rank in (0, 1):
        ranks.add("a", rank, 100 + rank, world=2)
        ranks.step("a", rank, 100 + rank, 40 + rank)
    orders = make_orders(ranks)
    nan = nan_finding()
    assert orders.fast_path([nan]) == []
    first = [decode_agent_message(ranks.sockets[("a", r)].recv(4096)) for r in (0, 1)]
    assert isinstance(first[0], SaveHold) and first[0] == first[1]
    ranks.report("a", 1, 101, first[0].request_id, first[0].step + 30, "missed")
    again = [decode_agent_message(ranks.sockets[("a", r)].recv(4096)) for r in (0, 1)]
    assert again[0] == again[1] and isinstance(again[0], SaveHold)
    assert again[0].replaces == first[0].request_id
    assert again[0].step == first[0].step + 31 and again[0].onset_step == 38

    collector = SaveHold(request_id="c-1", job="a", onset_step=38, step=45, issued=0.0)
    assert orders.hold_job(collector) == 2
    for r in (0, 1):
        ranks.sockets[("a", r)].recv(4096)
    ranks.report("a", 0, 100, "c-1", 60, "missed")
    for r in (0, 1):
        with pytest.raises(BlockingIOError):
            ranks.sockets[("a", r)].recv(4096)


def test_a_miss_reported_by_another_jobs_rank_does_not_move_a_local_hold(
        ranks: Ranks) -> None:
    """A ``missed`` report counts only from a rank of the hold's own job (as at the
    collector, :func:`forewarn.ordering.IssuedHolds.missed`): another job's rank naming the
    hold's id neither re-issues it nor moves its step."""
    for rank in (0, 1):
        ranks.add("a", rank, 100 + rank, world=2)
        ranks.step("a", rank, 100 + rank, 40 + rank)
    ranks.add("b", 0, 200, world=1)
    ranks.step("b", 0, 200, 5000)
    orders = make_orders(ranks)
    nan = nan_finding()
    orders.fast_path([nan])
    first = decode_agent_message(ranks.sockets[("a", 0)].recv(4096))
    ranks.sockets[("a", 1)].recv(4096)
    assert isinstance(first, SaveHold)
    ranks.report("b", 0, 200, first.request_id, 5000, "missed")
    for r in (0, 1):
        with pytest.raises(BlockingIOError):
            ranks.sockets[("a", r)].recv(4096)
    # the hold's own rank still moves it
    ranks.report("a", 1, 101, first.request_id, first.step + 3, "missed")
    again = decode_agent_message(ranks.sockets[("a", 0)].recv(4096))
    assert isinstance(again, SaveHold) and again.replaces == first.request_id


class _AgentSocket:
    """The Monitors' agent socket, read on a thread from the start: a datagram socket holds
    only ``net.unix.max_dgram_qlen`` (10 here) unread messages, and the hook drops what it
    cannot send within its timeout, so a test that reads late loses reports."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.reports: list[CheckpointReport] = []
        self.beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                msg = decode_hook_message(self.sock.recv(65536))
            except TimeoutError:
                continue
            if isinstance(msg, CheckpointReport):
                self.reports.append(msg)
            elif isinstance(msg, Beat):
                self.beats += 1

    def missed(self) -> list[CheckpointReport]:
        return [r for r in self.reports if r.phase == "missed"]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@contextlib.contextmanager
def _two_monitors(ranks: Ranks, tmp_path: Path) -> Iterator[tuple[_AgentSocket, list[Monitor]]]:
    """Ranks 0 and 1 of job ``a``: real Monitors, at step 40 in the table (the Monitors are
    stepped by the test); their agent socket is read throughout."""
    agent = _AgentSocket(tmp_path / "agent.sock")
    mons = [Monitor(job="a", rank=r, world_size=2, local_rank=r, handle_sigterm=False,
                    socket_path=str(tmp_path / "agent.sock"), beat_interval_s=0.1)
            for r in (0, 1)]
    try:
        for r, mon in enumerate(mons):
            ranks.add("a", r, 100 + r, reply_to=mon.reply_path)
            ranks.step("a", r, 100 + r, 40)
        yield agent, mons
    finally:
        for mon in mons:
            mon.close()
        agent.close()


def test_a_reissued_hold_changes_no_decision_on_a_step_no_rank_has_reached(
        ranks: Ranks, tmp_path: Path) -> None:
    """Issue 15: two real Monitors, the agent's own hold. Rank 1 is far ahead when the hold
    lands: it holds from its next step and reports ``missed``. The re-issued hold reaches
    rank 0 first. Whether or not it has reached rank 1 yet, both ranks must make the same
    decision at every step neither has reached (else a rank refuses a collective save its
    peer makes), and rank 0 saves what rank 1 passed unheld."""
    with _two_monitors(ranks, tmp_path) as (agent, mons):
        for step in range(41):
            mons[0].step(step, loss=1.0, grad_norm=1.0)
        for step in range(201):  # rank 1 ran on after its last report the agent saw
            mons[1].step(step, loss=1.0, grad_norm=1.0)
        held_back: list[bytes] = []
        sent = ranks.send

        def send(path: str, data: bytes) -> bool:  # the re-issue reaches rank 1 late
            msg = decode_agent_message(data)
            if path == mons[1].reply_path and isinstance(msg, SaveHold) and msg.replaces:
                held_back.append(data)
                return True
            return sent(path, data)

        orders = CheckpointOrders(ranks.table, send, clock=ranks.clock)
        nan = Finding(check="nan_loss", health=Health.UNHEALTHY,
                      subject=Subject(kind="rank", node="n", job="a", rank=0, gpu=0),
                      reason="loss nan", action=SuggestedAction.RESTART_JOB,
                      evidence={"bad_step": 38}, time=0.0)
        orders.fast_path([nan])
        wait_for(lambda: mons[0].saves_held(200), 5, "the hold at rank 0")
        missed = wait_for(lambda: agent.missed(), 10, "rank 1's missed report")
        assert [(m.rank, m.step) for m in missed] == [(1, 200)]
        missed = missed[0]
        ranks.report("a", 1, 101, missed.request_id, missed.step, "missed")
        assert held_back, "no re-issue"
        # rank 1 passed step 200 unheld: rank 0 may save it too
        wait_for(lambda: not mons[0].saves_held(200), 5, "the re-issue at rank 0")
        for step in range(201, 300):
            assert mons[0].saves_held(step) == mons[1].saves_held(step), step

        for step in range(201, 211):  # rank 1 holds on meanwhile
            mons[1].step(step, loss=1.0, grad_norm=1.0)
        ranks.send(mons[1].reply_path, held_back[0])  # the re-issue reaches rank 1 at last
        advice = IntervalAdvice(job="a", every_steps=1000, from_step=10_000, interval_s=60.0,
                                issued=ranks.clock())
        ranks.send(mons[1].reply_path, encode(advice))  # taken after the re-issue
        wait_for(lambda: mons[1].advice == advice, 5, "the re-issue at rank 1")
        for step in range(201, 300):
            assert mons[0].saves_held(step) == mons[1].saves_held(step), step
        # rank 1 was holding there already: it has not missed the re-issue (no chain)
        beats = agent.beats
        wait_for(lambda: agent.beats >= beats + 4, 10, "beats after the re-issue")
        assert len(agent.missed()) == 1, agent.missed()


def _beat(ranks: Ranks, job: str, rank: int, pid: int, reply_to: str) -> None:
    b = Beat(job=job, rank=rank, local_rank=ranks.local[(job, rank)],
             world_size=ranks.world[job], pid=pid, host="h", time=ranks.clock(),
             reply_to=reply_to)
    assert ranks.table.admit(b, Credentials(pid, os.getuid(), 0), ranks.clock()) is None


def _mark_gone_and_back(ranks: Ranks, orders: CheckpointOrders, job: str, rank: int,
                        pid: int, reply_to: str, between: Any) -> None:
    """The rank falls silent past the gone timeout (the agent was stopped: its beats wait
    unread), ``between()`` runs while it is marked gone, then the same process beats again
    and the agent polls."""
    ranks.clock.t += 5
    assert not ranks.table.alive(ranks.table.get(job, rank), ranks.clock())  # type: ignore[arg-type]
    between()
    _beat(ranks, job, rank, pid, reply_to)  # the same process: back
    assert ranks.table.alive(ranks.table.get(job, rank), ranks.clock())  # type: ignore[arg-type]
    orders.tick(ranks.clock())


def _saves(mon: Monitor, steps: range) -> list[int]:
    """Run ``mon`` through ``steps``; the steps it saved at."""
    out = []
    for n in steps:
        mon.step(n, loss=1.0, grad_norm=1.0)
        if mon.should_checkpoint(n):
            out.append(n)
            mon.checkpoint_done(n, 0.1, 1)
    return out


def test_an_order_that_arrives_while_the_rank_is_marked_gone_reaches_it_when_it_is_back(
        ranks: Ranks, tmp_path: Path) -> None:
    """Chaos run (scale-out, the agent SIGSTOPped 4 s during a takeover): rank 0 was marked
    gone and back alive 70 ms later; the collector's order that came in between was acked
    "no live rank" and never reached it, and the rank never reported ``missed`` either: the
    collector counted it delivered, and the job did not checkpoint. The order is for the
    job's ranks this node knows: the same process gets it once it is back, and saves at S
    exactly once; the ack says which ranks were not live."""
    from forewarn.agent.commands import carry_out
    from forewarn.wire import Command

    agent = _AgentSocket(tmp_path / "agent.sock")
    mon = Monitor(job="g", rank=0, world_size=1, local_rank=0, handle_sigterm=False,
                  socket_path=str(tmp_path / "agent.sock"), beat_interval_s=0.1)
    try:
        ranks.add("g", 0, 100, world=1, reply_to=mon.reply_path)
        for n in range(1, 11):
            ranks.step("g", 0, 100, n)
        assert _saves(mon, range(1, 11)) == []
        orders = make_orders(ranks)
        order = CheckpointOrder(request_id="c-1", job="g", step=20, reason="xid: 79",
                                issued=ranks.clock())
        acks: list[tuple[bool, str]] = []

        def arrives() -> None:
            acks.append(carry_out(Command(id="c-1", kind="checkpoint", order=order,
                                          issued=ranks.clock()), orders))

        _mark_gone_and_back(ranks, orders, "g", 0, 100, mon.reply_path, arrives)
        ((ok, detail),) = acks
        assert ok and "ordered step 20" in detail and "not live" in detail, detail
        wait_for(lambda: mon.stats.orders == 1, 5, "the order at the rank")
        assert _saves(mon, range(11, 30)) == [20]
        orders.tick(ranks.clock())  # a retry or a later poll adds no second save
        assert _saves(mon, range(30, 40)) == [] and agent.missed() == []
    finally:
        mon.close()
        agent.close()


def test_an_order_for_a_rank_marked_gone_before_delivery_reaches_it_when_it_is_back(
        ranks: Ranks) -> None:
    """The variant: the order arrives while the rank is alive, its datagram does not go out
    (the rank's socket queue is full), and the rank is marked gone before the retry; the
    same process beats again, and takes the order. A peer that stayed live got it at once."""
    for rank in (0, 1):
        ranks.add("j", rank, 100 + rank)
        ranks.step("j", rank, 100 + rank, 10)
    orders = make_orders(ranks)
    ranks.fail_sends = True
    order = orders.order_job("j", step=20, reason="collector", request_id="c-2")
    assert order is not None

    def silent() -> None:
        ranks.fail_sends = False
        _beat(ranks, "j", 1, 101, ranks.sockets[("j", 1)].getsockname())  # rank 1 beats on
        orders.tick(ranks.clock())

    _mark_gone_and_back(ranks, orders, "j", 0, 100, ranks.sockets[("j", 0)].getsockname(),
                        silent)
    assert ranks.received("j", 0) == [order] and ranks.received("j", 1) == [order]
    (st,) = orders.open_orders()
    assert st.expected == {0, 1} and not st.delivery.unsent


def test_an_order_for_a_job_with_a_gone_rank_still_reaches_it_when_it_is_back(
        ranks: Ranks) -> None:
    """Rank 0 is marked gone when the order arrives, rank 1 is live: the order is for both,
    and rank 0 gets it when it is back (today only rank 1 was ordered: rank 0 never saved,
    and the order was "done" when rank 1 alone had)."""
    for rank in (0, 1):
        ranks.add("j", rank, 100 + rank)
        ranks.step("j", rank, 100 + rank, 10)
    orders = make_orders(ranks)
    sent: list[CheckpointOrder] = []

    def arrives() -> None:
        _beat(ranks, "j", 1, 101, ranks.sockets[("j", 1)].getsockname())  # rank 1 beats on
        order = orders.order_job("j", step=20, reason="collector", request_id="c-3")
        assert order is not None
        sent.append(order)

    _mark_gone_and_back(ranks, orders, "j", 0, 100, ranks.sockets[("j", 0)].getsockname(),
                        arrives)
    (order,) = sent
    assert ranks.received("j", 0)[-1:] == [order] and ranks.received("j", 1) == [order]
    ranks.report("j", 1, 101, "c-3", 20, "done")
    assert orders.open_orders(), "done before rank 0 saved"
    ranks.report("j", 0, 100, "c-3", 20, "done")
    assert not orders.open_orders() and orders.outcomes_total["done"] == 1


def test_an_order_for_a_gone_rank_ends_when_a_new_process_takes_its_place(
        ranks: Ranks) -> None:
    """The rank that was gone does not come back: a new process (the job restarted) takes
    its slot. The order was for the old process: it ends, the new one never gets it."""
    ranks.add("j", 0, 100, world=1)
    ranks.step("j", 0, 100, 10)
    orders = make_orders(ranks)
    ranks.sockets.pop(("j", 0)).close()  # the old process is gone
    ranks.clock.t += 5
    assert orders.order_job("j", step=20, reason="collector", request_id="c-4") is not None
    ranks.add("j", 0, 200, world=1)
    orders.tick(ranks.clock())
    assert ranks.received("j", 0) == [] and not orders.open_orders()
    assert orders.outcomes_total["ended"] == 1


def test_a_save_hold_that_arrives_while_a_rank_is_marked_gone_reaches_it(
        ranks: Ranks) -> None:
    """The same path for a collector's save hold: rank 0 is marked gone when it comes (the
    agent was stopped) and back a moment later. It must hold too, or it saves the suspect
    state its peer refuses to save."""
    for rank in (0, 1):
        ranks.add("j", rank, 100 + rank)
        ranks.step("j", rank, 100 + rank, 10)
    orders = make_orders(ranks)
    hold = SaveHold(request_id="c-h", job="j", onset_step=8, step=20, reason="nan_loss",
                    issued=ranks.clock())
    reached: list[int] = []

    def arrives() -> None:
        _beat(ranks, "j", 1, 101, ranks.sockets[("j", 1)].getsockname())  # rank 1 beats on
        reached.append(orders.hold_job(hold))

    _mark_gone_and_back(ranks, orders, "j", 0, 100, ranks.sockets[("j", 0)].getsockname(),
                        arrives)
    assert reached == [2]
    for rank in (0, 1):
        assert decode_agent_message(ranks.sockets[("j", rank)].recv(4096)) == hold


def test_an_undelivered_order_is_not_given_up_when_its_rank_comes_back_past_its_step(
        ranks: Ranks) -> None:
    """The collector's order could not reach rank 0 (its socket full), the rank was marked
    gone, and it comes back past S with its socket still full at the next poll. The rank
    has not seen the order, so passing S is no sign the order was lost: closing it then
    ("left to the collector") lost it, as the collector only reissues on ``missed``. It is
    delivered when the socket drains, and the hook reports ``missed`` itself."""
    ranks.add("j", 0, 100, world=1)
    ranks.step("j", 0, 100, 10)
    orders = make_orders(ranks)
    ranks.fail_sends = True
    order = orders.order_job("j", step=20, reason="collector", request_id="c-5")
    assert order is not None
    _mark_gone_and_back(ranks, orders, "j", 0, 100, ranks.sockets[("j", 0)].getsockname(),
                        lambda: None)
    ranks.step("j", 0, 100, 25)
    orders.tick(ranks.clock())
    assert orders.outcomes_total["failed"] == 0 and orders.open_orders()
    ranks.fail_sends = False
    orders.tick(ranks.clock())
    assert ranks.received("j", 0) == [order]
    ranks.report("j", 0, 100, "c-5", 25, "missed")  # goes up: the collector reissues
    assert not orders.open_orders()


def _holds(ranks: Ranks, job: str, rank: int) -> list[SaveHold]:
    """Every message waiting in the rank's socket, which must all be holds."""
    out: list[SaveHold] = []
    while True:
        try:
            msg = decode_agent_message(ranks.sockets[(job, rank)].recv(4096))
        except BlockingIOError:
            return out
        assert isinstance(msg, SaveHold), msg
        out.append(msg)


@contextlib.contextmanager
def _away(path: str) -> Iterator[None]:
    """A rank's reply socket is not at its ``path`` for a while (a datagram to it fails
    with ENOENT), then back: the same socket, so what reaches it afterwards is read."""
    os.rename(path, path + ".away")
    try:
        yield
    finally:
        os.rename(path + ".away", path)


@pytest.mark.parametrize("issuer", ["agent", "collector"])
def test_a_save_hold_that_could_not_reach_a_rank_reaches_it_at_a_later_poll(
        ranks: Ranks, issuer: str) -> None:
    """A hold's datagram to rank 0 cannot go out (its socket is not there for a moment; a
    full queue fails the same way). The hold was sent once and forgotten: rank 0 never held
    and went on saving the NaN-poisoned state, marking it good. Its copy is retried every
    poll as an order's is: rank 0 gets the hold exactly once when it is reachable again,
    rank 1 (reached at once) never twice."""
    for rank in (0, 1):
        ranks.add("a", rank, 100 + rank, world=2)
        ranks.step("a", rank, 100 + rank, 40 + rank)
    orders = make_orders(ranks)
    with _away(ranks.sockets[("a", 0)].getsockname()):
        if issuer == "agent":
            orders.fast_path([nan_finding()])
        else:
            assert orders.hold_job(SaveHold(request_id="c-h", job="a", onset_step=38,
                                            step=60, issued=ranks.clock())) == 1
        orders.tick(ranks.clock())  # still not there: still waiting
    (hold,) = _holds(ranks, "a", 1)
    assert _holds(ranks, "a", 0) == []
    orders.tick(ranks.clock())
    assert _holds(ranks, "a", 0) == [hold]
    orders.tick(ranks.clock())
    assert _holds(ranks, "a", 0) == [] and _holds(ranks, "a", 1) == []


def test_a_save_hold_that_meets_a_full_queue_reaches_the_rank_once_it_drains(
        ranks: Ranks, tmp_path: Path) -> None:
    """The agent's own send (the ingest socket's, which never blocks) to a rank whose queue
    already holds ``net.unix.max_dgram_qlen`` unread datagrams fails (EAGAIN): that rank
    gets the hold at the first poll after it has read its queue, once."""
    for rank in (0, 1):
        ranks.add("a", rank, 100 + rank, world=2)
        ranks.step("a", rank, 100 + rank, 40 + rank)
    ingest = RankIngest(ranks.table, tmp_path / "agent.sock")
    ingest.bind()
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rank0 = ranks.sockets[("a", 0)]
    try:
        orders = CheckpointOrders(ranks.table, ingest.send, clock=ranks.clock)
        queued = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                filler.sendto(b"x", socket.MSG_DONTWAIT, rank0.getsockname())
                queued += 1
        orders.fast_path([nan_finding()])
        assert ingest.send_errors == 1
        (hold,) = _holds(ranks, "a", 1)
        assert [rank0.recv(4096) for _ in range(queued)] == [b"x"] * queued
        assert _holds(ranks, "a", 0) == []  # the rank has read its queue: no hold in it
        orders.tick(ranks.clock())
        orders.tick(ranks.clock())
        assert _holds(ranks, "a", 0) == [hold] and _holds(ranks, "a", 1) == []
    finally:
        filler.close()
        ingest.stop()


def test_a_reissued_hold_ends_the_undelivered_copies_of_the_one_it_replaces(
        ranks: Ranks) -> None:
    """Rank 0 cannot take the agent's hold yet; rank 1 reports it ``missed`` and the hold
    goes again, replacing it, before rank 0 is reachable. Rank 0 then gets the replacement
    only: a late copy of the old hold after it would move rank 0's stop back to the old
    step (an earlier step only brings a hold nearer), a step its peer saves."""
    for rank in (0, 1):
        ranks.add("a", rank, 100 + rank, world=2)
        ranks.step("a", rank, 100 + rank, 40 + rank)
    orders = make_orders(ranks)
    with _away(ranks.sockets[("a", 0)].getsockname()):
        orders.fast_path([nan_finding()])
        (first,) = _holds(ranks, "a", 1)
        ranks.report("a", 1, 101, first.request_id, first.step + 30, "missed")
    (again,) = _holds(ranks, "a", 1)
    assert again.replaces == first.request_id
    orders.tick(ranks.clock())
    orders.tick(ranks.clock())
    assert _holds(ranks, "a", 0) == [again] and _holds(ranks, "a", 1) == []


def test_an_undelivered_hold_ends_when_a_new_process_takes_the_rank(ranks: Ranks) -> None:
    """The hold is for the processes it was sent to, as an order is: the job restarted from
    a checkpoint taken before the onset, and its new process never gets the old hold (it
    would refuse every save of a sound state)."""
    ranks.add("j", 0, 100, world=1)
    ranks.step("j", 0, 100, 10)
    orders = make_orders(ranks)
    with _away(ranks.sockets[("j", 0)].getsockname()):
        assert orders.hold_job(SaveHold(request_id="c-h", job="j", onset_step=8, step=20,
                                        issued=ranks.clock())) == 0
    ranks.clock.t += 5
    ranks.add("j", 0, 200, world=1)  # the new process, with a socket of its own
    orders.tick(ranks.clock())
    orders.tick(ranks.clock())
    assert _holds(ranks, "j", 0) == []


def test_an_undelivered_hold_ends_with_the_orders_time_to_live(ranks: Ranks) -> None:
    """A copy that could not go out for longer than an order lives is dropped, not retried
    for ever."""
    ranks.add("j", 0, 100, world=1)
    ranks.step("j", 0, 100, 10)
    mono = Clock(50.0)
    orders = make_orders(ranks, ttl_s=900.0, monotonic=mono)
    with _away(ranks.sockets[("j", 0)].getsockname()):
        orders.hold_job(SaveHold(request_id="c-h", job="j", onset_step=8, step=20,
                                 issued=ranks.clock()))
        mono.t += 899.0
        orders.tick(ranks.clock())  # still within its time: still waiting
        mono.t += 2.0
        orders.tick(ranks.clock())
    orders.tick(ranks.clock())
    assert _holds(ranks, "j", 0) == []


def test_a_rank_whose_socket_was_away_holds_from_the_same_step_as_its_peer(
        ranks: Ranks, tmp_path: Path) -> None:
    """Two real Monitors, the agent's own hold after a NaN: rank 0's order socket is not at
    its path when the hold goes out. Once it is back, the next poll brings rank 0 the hold,
    and both ranks refuse the same saves (none of them missed it: no ``missed`` report)."""
    with _two_monitors(ranks, tmp_path) as (agent, mons):
        for mon in mons:
            for step in range(41):
                mon.step(step, loss=1.0, grad_norm=1.0)
        orders = make_orders(ranks)
        with _away(mons[0].reply_path):
            orders.fast_path([nan_finding()])
            stop = wait_for(lambda: next((s for s in range(41, 200) if mons[1].saves_held(s)),
                                         None), 5, "the hold at rank 1")
        assert not any(mons[0].saves_held(s) for s in range(41, 200))
        orders.tick(ranks.clock())
        wait_for(lambda: mons[0].saves_held(stop), 5, "the hold at rank 0")
        for step in range(41, 200):
            assert mons[0].saves_held(step) == mons[1].saves_held(step) == (step >= stop)
        assert agent.missed() == []


def _given_up(ranks: Ranks, orders: CheckpointOrders) -> dict[str, float | None]:
    """``forewarn_save_holds_given_up_total`` by ``why``, as the agent's scrape shows it."""
    from prometheus_client import CollectorRegistry

    from forewarn.agent.rank_metrics import RankCollector

    reg = CollectorRegistry()
    reg.register(RankCollector("n", ranks.table, orders=orders, clock=ranks.clock))
    return {why: reg.get_sample_value("forewarn_save_holds_given_up_total",
                                      {"node": "n", "why": why})
            for why in ("expired", "restarted", "crowded", "reissues")}


def _hold_given_up(ranks: Ranks, why: str) -> CheckpointOrders:
    """Ranks ``a`` 0 and 1; a hold the agent gives up on for ``why``."""
    for rank in (0, 1):
        ranks.add("a", rank, 100 + rank, world=2)
        ranks.step("a", rank, 100 + rank, 40 + rank)
    mono = Clock(50.0)
    orders = make_orders(ranks, ttl_s=900.0, monotonic=mono, max_reissues=0)

    def hold(rid: str) -> None:
        orders.hold_job(SaveHold(request_id=rid, job="a", onset_step=38, step=60,
                                 issued=ranks.clock()))

    if why == "reissues":  # its own hold missed with no reissue left
        orders.fast_path([nan_finding()])
        (first,) = _holds(ranks, "a", 1)
        ranks.report("a", 1, 101, first.request_id, first.step + 30, "missed")
        return orders
    with _away(ranks.sockets[("a", 0)].getsockname()):
        if why == "crowded":  # more holds wait than it keeps: the oldest is given up
            ranks.fail_sends = True  # rank 1's queue would fill (a blocking send)
            for n in range(65):
                hold(f"c-h{n}")
        else:
            hold("c-h")
        if why == "expired":
            mono.t += 901.0
        elif why == "restarted":
            ranks.clock.t += 5
            ranks.add("a", 0, 200, world=2)  # the new process, with a socket of its own
        orders.tick(ranks.clock())
    return orders


@pytest.mark.parametrize("why", ["expired", "restarted", "crowded", "reissues"])
def test_a_save_hold_given_up_is_counted_by_why(ranks: Ranks, why: str) -> None:
    """A hold the agent gives up on (a rank never reached within its time to live, the
    rank's process replaced, more holds waiting than it keeps, its own hold missed after
    its last reissue) was only in the log: an operator could not see it, and a rank that
    never held saves the poisoned state and marks it good. Each is counted by ``why``,
    every ``why`` exported from the start (0), so an alert's ``increase`` sees the first."""
    assert set(_given_up(ranks, make_orders(ranks)).values()) == {0.0}
    orders = _hold_given_up(ranks, why)
    assert _given_up(ranks, orders) == {
        w: 1.0 if w == why else 0.0 for w in ("expired", "restarted", "crowded", "reissues")}


def test_a_save_holds_ack_says_which_ranks_it_has_not_reached_yet(ranks: Ranks) -> None:
    """Rank 0's socket is away when the collector's hold comes: the ack said "passed to 1
    rank(s)", as if the job had one rank here that held, while rank 0 is still to get it
    from a retry. It says how many of the job's ranks it reached and which wait."""
    from forewarn.agent.commands import carry_out
    from forewarn.wire import Command

    for rank in (0, 1):
        ranks.add("a", rank, 100 + rank, world=2)
        ranks.step("a", rank, 100 + rank, 40 + rank)
    orders = make_orders(ranks)
    hold = SaveHold(request_id="c-h", job="a", onset_step=38, step=60, issued=ranks.clock())
    with _away(ranks.sockets[("a", 0)].getsockname()):
        ok, detail = carry_out(Command(id="c-h@n", kind="hold", hold=hold,
                                       issued=ranks.clock()), orders)
    assert ok and "passed to 1 of 2 rank(s) of 'a'" in detail, detail
    assert "rank(s) 0 not reached yet" in detail, detail
    orders.tick(ranks.clock())
    assert _holds(ranks, "a", 0) == [hold]
    ok, detail = carry_out(Command(id="c-h2@n", kind="hold", issued=ranks.clock(),
                                   hold=msgspec.structs.replace(hold, request_id="c-h2")),
                           orders)
    assert detail == "save hold passed to 2 of 2 rank(s) of 'a'", detail


def test_a_checkpoint_orders_ack_says_which_ranks_it_has_not_reached_yet(
        ranks: Ranks) -> None:
    """Rank 0's socket is away when the collector's order comes (both ranks live): the ack
    said "ordered step 60" as if every rank had it, while rank 0 waits for a retry. It says
    which ranks the order has not reached yet, as a hold's ack does."""
    from forewarn.agent.commands import carry_out
    from forewarn.wire import Command

    for rank in (0, 1):
        ranks.add("a", rank, 100 + rank, world=2)
        ranks.step("a", rank, 100 + rank, 40 + rank)
    orders = make_orders(ranks)
    order = CheckpointOrder(request_id="c-o", job="a", step=60, issued=ranks.clock())
    with _away(ranks.sockets[("a", 0)].getsockname()):
        ok, detail = carry_out(Command(id="c-o@n", kind="checkpoint", order=order,
                                       issued=ranks.clock()), orders)
    assert ok and "ordered step 60" in detail and "not live" not in detail, detail
    assert "rank(s) 0 not reached yet" in detail, detail
    orders.tick(ranks.clock())
    ok, detail = carry_out(Command(id="c-o2@n", kind="checkpoint", issued=ranks.clock(),
                                   order=msgspec.structs.replace(order, request_id="c-o2")),
                           orders)
    assert ok and detail == "ordered step 60", detail


def test_a_superseded_orders_copies_still_reach_the_ranks_it_missed(ranks: Ranks) -> None:
    """Rank 0's socket is away when order c-1 (step 60) comes; rank 1 gets it. Order c-2
    (step 70) supersedes c-1 before rank 0 is back. Superseding ended c-1's undelivered
    copy: rank 1 saved at 60 and rank 0 never did nor reported it missed. Every rank gets
    every order (the hook keeps each order's step), so both save at 60 and 70."""
    for rank in (0, 1):
        ranks.add("a", rank, 100 + rank, world=2)
        ranks.step("a", rank, 100 + rank, 40 + rank)
    orders = make_orders(ranks)
    with _away(ranks.sockets[("a", 0)].getsockname()):
        c1 = orders.order_job("a", 60, request_id="c-1")
        c2 = orders.order_job("a", 70, request_id="c-2")
    assert ranks.received("a", 1) == [c1, c2]
    orders.tick(ranks.clock())
    assert sorted(o.request_id for o in ranks.received("a", 0)) == ["c-1", "c-2"]
    orders.tick(ranks.clock())
    assert ranks.received("a", 0) == []  # each copy once
