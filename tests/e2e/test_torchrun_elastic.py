"""Elastic membership changes under real torchrun (``--nnodes=1:2``, c10d rendezvous, two
torchrun "nodes" on this machine, one real agent each, a real collector): after a shrink,
a grow and a restart round, the agents' and the collector's rank tables show the job's
current ranks at once, with nothing of the previous round left to be reported gone."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from forewarn.chaos.daemons import LabAgent, LabCollector
from forewarn.chaos.lab import Lab
from forewarn.demo.launch import Node, TorchrunJob
from forewarn.spawn.procs import wait_until

JOB = "elastic-job"
NODES = ("el-node-1", "el-node-2")


class Rig:
    """The collector, one agent per node and the elastic job, all real processes."""

    def __init__(self, workdir: Path, nnodes: str = "1:2", addrs: tuple[str, ...] = ("", "")
                 ) -> None:
        self.lab = Lab(workdir)
        self.collector = LabCollector(self.lab, "collector", list(NODES))
        self.agents = {n: LabAgent(self.lab, f"agent-{n}", n, self.collector.url,
                                   self.collector.tokens[n],
                                   f'name = "{n}"\ndescription = "quiet"\ngpus = 2\nseed = 1\n',
                                   interval_s=0.25, push_s=0.25) for n in NODES}
        control = workdir / "control"
        control.mkdir()
        args = ["torch", "--job", JOB, "--checkpoint-dir", str(workdir / "ckpt"),
                "--control-dir", str(control), "--step-seconds", "0.05",
                "--checkpoint-every", "20"]
        self.job = TorchrunJob("forewarn.spawn.workload", args,
                               [Node(n, self.agents[n].socket, addr=a)
                                for n, a in zip(NODES, addrs, strict=True)], job=JOB,
                               log_dir=workdir, max_restarts=10, nnodes=nnodes,
                               rdzv_conf="last_call_timeout=3")
        self.lab.launchers.append(self.job)
        self.events: list[dict[str, Any]] = []

    def take(self) -> None:
        while not self.job.events.empty():
            self.events.append(self.job.events.get())

    def round_of(self, world_size: int, after: int) -> dict[int, dict[str, Any]] | None:
        """The start events of a round after attempt ``after`` in which every rank of
        ``world_size`` started and stepped."""
        self.take()
        starts = {int(e["rank"]): e for e in self.events
                  if e.get("event") in ("started", "resumed") and e["attempt"] > after
                  and e.get("world_size") == world_size}
        if set(starts) != set(range(world_size)):
            return None
        attempts = {e["attempt"] for e in starts.values()}
        stepped = {int(e["rank"]) for e in self.events if e.get("event") == "step"
                   and e["attempt"] in attempts}
        return starts if stepped == set(range(world_size)) else None

    def wait_round(self, world_size: int, after: int) -> int:
        got = wait_until(lambda: self.round_of(world_size, after), 180, step=0.2)
        assert got is not None, f"no round of world size {world_size} after attempt {after}; " \
            f"events: {[e for e in self.events if e.get('event') != 'step'][-20:]}"
        return max(int(e["attempt"]) for e in got.values())

    def collector_ranks(self) -> list[dict[str, Any]]:
        detail = self.collector.get(f"/api/v1/jobs/{JOB}")
        return list(detail["ranks"])

    def collector_shows(self, ranks: dict[int, str], world_size: int, pids: set[int]
                        ) -> bool:
        """The collector's job has exactly ``ranks`` (rank -> node), of ``world_size``,
        alive, run by ``pids``."""
        rows = self.collector_ranks()
        detail = self.collector.get(f"/api/v1/jobs/{JOB}")
        return ({int(r["rank"]): r["node"] for r in rows} == ranks
                and all(int(r["world_size"]) == world_size and r["alive"] for r in rows)
                and {int(r["pid"]) for r in rows} == pids
                and int(detail["world_size"]) == world_size)

    def agent_ranks(self, node: str) -> dict[int, float]:
        """rank -> forewarn_rank_alive on ``node``'s agent, for the job."""
        from forewarn.chaos.exposition import scrape

        out = {}
        for rank in range(4):
            v = scrape(self.agents[node].url + "/metrics", "forewarn_rank_alive",
                       {"training_job": JOB, "rank": str(rank)})
            if v is not None:
                out[rank] = v
        return out

    def close(self) -> None:
        self.lab.close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    try:
        yield r
    finally:
        r.close()


def _pids(starts: dict[int, dict[str, Any]]) -> set[int]:
    return {int(e["pid"]) for e in starts.values()}


def _settled(rig: Rig, what: str, cond: Any, timeout: float = 6.0) -> None:
    """``cond`` holds within ``timeout``: a few agent pushes, not an eviction timeout."""
    ok = wait_until(cond, timeout, step=0.2)
    assert ok, f"{what}: collector {rig.collector_ranks()}, agents " \
        f"{ {n: rig.agent_ranks(n) for n in NODES} }"


@pytest.mark.timeout(600)
def test_shrink_grow_and_restart_update_both_rank_tables(rig: Rig) -> None:
    rig.job.start()
    a = rig.wait_round(2, -1)
    starts = rig.round_of(2, a - 1)
    assert starts is not None
    _settled(rig, "two ranks on two nodes", lambda: rig.collector_shows(
        {0: NODES[0], 1: NODES[1]}, 2, _pids(starts)))

    # Shrink: node 2 is lost (its torchrun and worker die); node 1 goes on alone.
    rig.job.kill_node(NODES[1])
    a = rig.wait_round(1, a)
    starts = rig.round_of(1, a - 1)
    assert starts is not None
    t0 = time.monotonic()
    _settled(rig, "after the shrink, the collector shows the one remaining rank",
             lambda: rig.collector_shows({0: NODES[0]}, 1, _pids(starts)))
    _settled(rig, "after the shrink, node 1's agent holds only its new rank",
             lambda: rig.agent_ranks(NODES[0]) == {0: 1.0})
    shrink_s = time.monotonic() - t0

    # Grow: node 2 comes back; the job re-forms with both.
    rig.job.start_node(1)
    a = rig.wait_round(2, a)
    starts = rig.round_of(2, a - 1)
    assert starts is not None
    _settled(rig, "after the grow", lambda: rig.collector_shows(
        {0: NODES[0], 1: NODES[1]}, 2, _pids(starts)))
    _settled(rig, "after the grow, each agent holds its rank",
             lambda: rig.agent_ranks(NODES[0]) == {0: 1.0}
             and rig.agent_ranks(NODES[1]) == {1: 1.0})

    # A restart round (same world size): rank 1's worker dies, torchrun restarts both.
    assert rig.job.signal_rank(1, signal.SIGKILL)
    a = rig.wait_round(2, a)
    starts = rig.round_of(2, a - 1)
    assert starts is not None
    _settled(rig, "after the restart round", lambda: rig.collector_shows(
        {0: NODES[0], 1: NODES[1]}, 2, _pids(starts)))
    print(f"shrink reflected {shrink_s:.1f} s after the new round stepped")


def _summary(rank: int, world_size: int, node: str, t: float, **kw: Any) -> Any:
    from forewarn.wire import RankSummary

    return RankSummary(job=JOB, rank=rank, world_size=world_size, node=node, pid=100 + rank,
                       last_step=10, last_step_time=t, last_beat=t, **kw)


def test_job_map_keeps_the_current_round_and_a_rank_clean_end(tmp_path: Path) -> None:
    """The collector's half without processes: a live report of a new world size replaces
    the previous round's rows; a late report from a departed rank of that round is not
    stored; ``finished`` and ``phase`` are kept."""
    from forewarn.collector.jobs.jobmap import StoreJobView, apply_ranks
    from forewarn.collector.storage.store import Store

    store = Store(tmp_path / "c.db")
    view = StoreJobView(store)
    t = 1_700_000_000.0
    with store.write() as conn:
        apply_ranks(conn, [_summary(0, 2, NODES[0], t), _summary(1, 2, NODES[1], t)], t)
    with store.write() as conn:  # shrink: node 1's rank re-forms alone
        apply_ranks(conn, [_summary(0, 1, NODES[0], t + 5, phase="eval")], t + 5)
    with store.write() as conn:  # node 2's agent still holds its departed rank
        apply_ranks(conn, [_summary(1, 2, NODES[1], t + 1, alive=False)], t + 6)
    job = view.job(JOB)
    assert job is not None
    assert [(r.rank, r.world_size, r.phase) for r in job.ranks] == [(0, 1, "eval")]
    assert store.query("SELECT world_size FROM jobs WHERE job = ?", (JOB,))[0]["world_size"] == 1
    with store.write() as conn:  # the rank ends cleanly
        apply_ranks(conn, [_summary(0, 1, NODES[0], t + 9, alive=False, finished=True)], t + 9)
    job = view.job(JOB)
    assert job is not None and job.ranks[0].finished and not job.ranks[0].alive


@pytest.mark.timeout(600)
def test_restart_round_that_swaps_ranks_between_nodes(tmp_path: Path) -> None:
    """torchrun ranks nodes by address in every round: node 2's replacement sorts first,
    so node 1 runs rank 1 now. Node 1's agent drops its rank 0 of the previous round at
    once instead of reporting it gone beside the new rank ("the job will hang")."""
    from forewarn.demo.launch import Node

    rig = Rig(tmp_path, nnodes="2", addrs=("127.0.0.5", "127.0.0.6"))
    try:
        rig.job.start()
        a = rig.wait_round(2, -1)
        rig.job.kill_node(NODES[1])
        rig.job.nodes[1] = Node(NODES[1], rig.agents[NODES[1]].socket, addr="127.0.0.4")
        rig.job.start_node(1)
        a = rig.wait_round(2, a)
        starts = rig.round_of(2, a - 1)
        assert starts is not None
        assert {int(e["rank"]): e["node"] for e in starts.values()} == {0: NODES[1], 1: NODES[0]}
        _settled(rig, "node 1's agent holds only its new rank",
                 lambda: rig.agent_ranks(NODES[0]) == {1: 1.0})
        _settled(rig, "the collector shows the swapped ranks", lambda: rig.collector_shows(
            {0: NODES[1], 1: NODES[0]}, 2, _pids(starts)))
        time.sleep(3.5)  # past rank_gone's grace: nothing of the old round is reported
        bad = [f for f in rig.agents[NODES[0]].findings()
               if f.get("check") == "rank_gone" and f.get("health") == "unhealthy"]
        assert bad == []
    finally:
        rig.close()
