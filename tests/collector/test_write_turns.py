"""Short transactions get their turn at the embedded store's one write lock while the
ingest writer commits one group after another (issue 16: order latency under fleet load).
A real SQLite store, the real ingest writer and command queue; order of events only."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

from forewarn.collector.ingest.batch import IngestWriter
from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.commands import CommandQueue
from forewarn.collector.storage.store import Store
from forewarn.wire import AgentBatch, CheckpointOrder, GpuSample, encode

from support.polling import wait_for

NODES = [f"n{i}" for i in range(8)]


def order(request_id: str = "r1") -> CheckpointOrder:
    return CheckpointOrder(request_id=request_id, job="job1", step=10, issued=time.time())


def telemetry(groups: int, per_group: int) -> list[AgentBatch]:
    now = time.time()
    return [AgentBatch(node=f"t{i % 64}", agent_id=f"t{i % 64}", seq=i, created=now,
                       samples=[GpuSample(node=f"t{i % 64}", gpu=g, time=now, source="sim",
                                          simulated=True, temperature_c=50.0)
                                for g in range(8)])
            for i in range(groups * per_group)]


def test_waiting_transactions_go_in_before_the_holders_next_one(tmp_path: Path) -> None:
    """One thread writing back to back (the ingest writer under load) does not take the
    lock again ahead of transactions already waiting for it: they go in first, in the
    order they came."""
    store = Store(tmp_path / "collector.db")
    events: list[str] = []
    holding, waiting = threading.Event(), threading.Event()

    def back_to_back() -> None:
        for i in range(50):
            with store.write() as conn:
                conn.execute("INSERT INTO actions (time, kind, subject, job, node, status,"
                             " shadow, detail) VALUES (?, 'w', '', '', '', 'ok', 0, '')", (i,))
                events.append(f"writer {i}")
                if i == 0:
                    holding.set()
                    waiting.wait(30)  # the others ask for the lock meanwhile

    writer = threading.Thread(target=back_to_back)
    writer.start()
    waiters = []
    try:
        assert holding.wait(30)
        for name in ("a", "b", "c", "d"):
            waiters.append(threading.Thread(target=_one_write, args=(store, events, name)))
            waiters[-1].start()
            wait_for(lambda: _blocked(waiters[-1]), 30, f"waiter {name} at the lock")
        waiting.set()
        for w in waiters:
            w.join(30)
    finally:
        waiting.set()
        writer.join(30)
        store.close()
    assert events[:6] == ["writer 0", "a", "b", "c", "d", "writer 1"], events[:6]


def _one_write(store: Store, events: list[str], name: str) -> None:
    with store.write() as conn:
        conn.execute("INSERT INTO actions (time, kind, subject, job, node, status, shadow,"
                     " detail) VALUES (0, ?, '', '', '', 'ok', 0, '')", (name,))
        events.append(name)


def _blocked(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside the store's write (while another holds the lock: it
    waits for it there)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == "write" and frame.f_code.co_filename.endswith("store.py"):
            return True
        frame = frame.f_back
    return False


def test_the_publisher_woken_for_a_decisions_first_node_finds_all_its_commands(
        tmp_path: Path) -> None:
    """A decision's commands are queued in one transaction: when the bus publisher is woken
    for its first node, every node's command of it is there to take in one go."""
    store = Store(tmp_path / "collector.db")
    queue = CommandQueue(store, CollectorMetrics())
    seen: list[int] = []
    queue.on_enqueue = lambda node: seen.append(len(queue.list()))
    try:
        assert len(queue.order_checkpoint(NODES, order())) == len(NODES)
    finally:
        store.close()
    assert seen == [len(NODES)] * len(NODES)


def test_a_decisions_commands_are_queued_and_taken_within_a_run_of_group_commits(
        tmp_path: Path) -> None:
    """While the ingest writer commits group after group, the policy's order for 8 nodes
    and the publisher's take of it need one turn each at the write lock, each given before
    the writer's next group: both are done a few group commits after the order was made,
    long before the run ends (one transaction per command took 16 turns)."""
    store = Store(tmp_path / "collector.db")
    metrics = CollectorMetrics()
    commits: list[int] = []
    started = threading.Event()

    def stored(batches: list[AgentBatch], _addresses: list[str]) -> None:
        commits.append(len(batches))
        started.set()

    groups = 60
    writer = IngestWriter(store, metrics, group_max=16, on_stored=stored)
    queue = CommandQueue(store, metrics)
    futures = [writer.submit(b, encode(b)) for b in telemetry(groups, 16)]
    writer.start()
    try:
        assert started.wait(30)
        before = len(commits)
        queued = queue.order_checkpoint(NODES, order())
        taken = queue.take_many(NODES)
        after = len(commits)
        for f in futures:
            f.result(60)
    finally:
        writer.stop()
        store.close()
    assert len(queued) == len(NODES)
    assert sorted(taken) == NODES and all(len(c) == 1 for c in taken.values())
    assert after < groups, "the commands were taken only after the run of group commits"
    assert after - before <= 4, f"{after - before} group commits went first"


def _group_behind_the_lock(store: Store, writer: IngestWriter, batches: list[AgentBatch]
                           ) -> tuple[threading.Event, threading.Thread, list[Any]]:
    """Hold the write lock in a thread of our own while ``writer`` takes ``batches`` as
    one group and waits for the lock (so what the test does next happens while the group
    is about to be written); returns (release, the holder, the batches' futures)."""
    release, holding = threading.Event(), threading.Event()

    def hold() -> None:
        with store.write():
            holding.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(30)
    futures = [writer.submit(b, encode(b)) for b in batches]
    writer.start()
    wait_for(lambda: writer.queued == 0 and _blocked(writer._thread), 30,
             "the writer at the lock with its group")
    return release, holder, futures


def test_a_transaction_waiting_for_the_lock_goes_in_during_a_group_commit(
        tmp_path: Path) -> None:
    """A short transaction that asks for the write lock while the ingest writer writes a
    group (a decision's record, its commands, the publisher's take) waits for the batch
    being written, not for the whole group: the writer commits what it has and lets it in."""
    store = Store(tmp_path / "collector.db")
    writer = IngestWriter(store, CollectorMetrics(), group_max=256)
    group = telemetry(1, 64)
    seen: list[int] = []

    def count_stored() -> None:
        with store.write() as conn:
            seen.append(int(conn.execute("SELECT COUNT(*) FROM batches").fetchone()[0]))

    release, holder, futures = _group_behind_the_lock(store, writer, group)
    waiter = threading.Thread(target=count_stored)
    try:
        waiter.start()
        wait_for(lambda: _blocked(waiter), 30, "the waiter at the lock")
        release.set()
        waiter.join(30)
        results = [f.result(30) for f in futures]
    finally:
        release.set()
        holder.join(30)
        writer.stop()
        store.close()
    assert all(r.value == "stored" for r in results)
    assert seen and seen[0] < len(group), f"the waiter went in after {seen} batches"


def test_an_urgent_batch_queued_during_a_group_commit_is_stored_before_the_rest_of_it(
        tmp_path: Path) -> None:
    """An urgent batch (a fatal finding) queued while the writer writes a group of
    telemetry is committed after the batch being written, then the rest of the group in
    its order: it does not wait for the whole group commit."""
    store = Store(tmp_path / "collector.db")
    stored: list[str] = []
    writer = IngestWriter(store, CollectorMetrics(), group_max=256, on_stored=lambda bs, _a:
                          stored.extend(b.agent_id for b in bs))
    group = telemetry(1, 64)
    urgent = AgentBatch(node="n1", agent_id="urgent", seq=0, created=time.time(),
                        urgent=True)
    release, holder, futures = _group_behind_the_lock(store, writer, group)
    try:
        futures.append(writer.submit(urgent, encode(urgent)))
        release.set()
        for f in futures:
            f.result(30)
    finally:
        release.set()
        holder.join(30)
        writer.stop()
        store.close()
    before = stored.index("urgent")
    assert before < len(group), "the urgent batch waited for the whole group"
    assert [a for a in stored if a != "urgent"] == [b.agent_id for b in group]
