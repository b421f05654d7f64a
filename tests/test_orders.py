"""Job-wide checkpoint orders: one S for every rank, acks, done, reissue on a miss."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from forewarn.collector.jobview import RankTable
from forewarn.collector.orders import OrderBook, OrderSettings, choose_step
from forewarn.wire import CheckpointOrder, CheckpointReport, CommandAck, RankSummary

T0 = 1_700_000_000.0


class ListSink:
    """Collects what would be queued per node (the CommandSink contract)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, CheckpointOrder]] = []

    def order_checkpoint(self, nodes: Iterable[str], order: CheckpointOrder) -> Sequence[Any]:
        out = [(n, order) for n in sorted(set(nodes))]
        self.sent += out
        return out


def three_node_job(step_s: float = 0.5, reported: float = T0) -> RankTable:
    table = RankTable()
    ranks = []
    for node in range(3):
        for gpu in range(2):
            rank = node * 2 + gpu
            ranks.append(RankSummary(
                job="big", rank=rank, world_size=6, node=f"node{node + 1}", gpu=gpu,
                pid=100 + rank, last_step=1000 + rank, last_step_time=reported,
                step_seconds_p50=step_s + 0.1 * rank))
    table.update(ranks, now=T0 - 3600)
    return table


def test_step_is_ahead_of_the_fastest_rank_by_latency_over_step_time() -> None:
    job = three_node_job(step_s=0.5).job("big")
    assert job is not None
    settings = OrderSettings(delivery_latency_s=0.5, safety_s=2.0, min_margin_steps=2)
    step, inputs = choose_step(job, T0, settings)
    # furthest rank: 1005; fastest p50: 0.5 s; margin = ceil(2.5 / 0.5) + 1 = 6
    assert inputs["estimated_step"] == 1005 and inputs["margin_steps"] == 6
    assert step == 1011
    # stale reports: 10 s later rank 0 (0.5 s/step) is at 1020, rank 5 (1.0 s/step) at 1015
    step_later, inputs = choose_step(job, T0 + 10, settings)
    assert inputs["estimated_step"] == 1020 and step_later == 1026
    # slow steps: the minimum margin holds
    slow = three_node_job(step_s=60).job("big")
    assert slow is not None
    assert choose_step(slow, T0, settings)[1]["margin_steps"] == 2


def test_issue_reaches_every_node_and_completes_when_every_rank_saved() -> None:
    table = three_node_job()
    sink = ListSink()
    registry = CollectorRegistry()
    book = OrderBook(sink, clock=lambda: T0, registry=registry, new_id=lambda: "ord-1")
    job = table.job("big")
    assert job is not None
    order = book.issue(job, "GPU 1 of node2 unhealthy", decision_id="d1")
    assert [n for n, _ in sink.sent] == ["node1", "node2", "node3"]
    assert {o.step for _, o in sink.sent} == {order.step}
    assert all(o.job == "big" and o.request_id == "ord-1" for _, o in sink.sent)
    book.on_ack(CommandAck(id="ord-1@node2", node="node2", time=T0))
    assert book.get("ord-1").acks == {"node2": True}  # type: ignore[union-attr]
    for rank in range(6):
        book.on_report(CheckpointReport(job="big", rank=rank, request_id="ord-1",
                                        step=order.step, phase="started", time=T0))
        assert order.status == "issued"
        book.on_report(CheckpointReport(job="big", rank=rank, request_id="ord-1",
                                        step=order.step, phase="done", seconds=3.0, time=T0))
    assert order.status == "done"
    assert set(order.rank_steps.values()) == {order.step}
    assert registry.get_sample_value("forewarn_collector_checkpoint_orders_total",
                                     {"event": "done"}) == 1.0


def test_missed_order_is_reissued_past_the_rank_that_missed() -> None:
    table = three_node_job()
    sink = ListSink()
    ids = iter(["ord-1", "ord-2", "ord-3"])
    book = OrderBook(sink, OrderSettings(max_reissues=1), clock=lambda: T0,
                     new_id=lambda: next(ids))
    job = table.job("big")
    assert job is not None
    first = book.issue(job, "risk")
    new = book.on_report(CheckpointReport(job="big", rank=4, request_id="ord-1",
                                          step=first.step + 40, phase="missed", time=T0))
    assert new is not None and new.request_id == "ord-2"
    assert new.step > first.step + 40 and new.attempt == 1
    assert first.status == "reissued" and first.next_id == "ord-2"
    assert [o.request_id for _, o in sink.sent[-3:]] == ["ord-2"] * 3
    # late reports about the superseded order change nothing
    assert book.on_report(CheckpointReport(job="big", rank=5, request_id="ord-1",
                                           step=first.step + 41, phase="missed",
                                           time=T0)) is None
    # the reissue limit: a second miss fails the order instead of looping
    assert book.on_report(CheckpointReport(job="big", rank=0, request_id="ord-2",
                                           step=new.step + 5, phase="missed", time=T0)) is None
    assert new.status == "failed"


def test_failed_rank_fails_the_order_and_unknown_reports_are_ignored() -> None:
    table = three_node_job()
    book = OrderBook(ListSink(), clock=lambda: T0, new_id=lambda: "ord-1")
    job = table.job("big")
    assert job is not None
    order = book.issue(job, "risk")
    assert book.on_report(CheckpointReport(job="big", rank=0, request_id="other", step=1,
                                           phase="done", time=T0)) is None
    book.on_report(CheckpointReport(job="big", rank=3, request_id="ord-1", step=order.step,
                                    phase="failed", time=T0))
    assert order.status == "failed"
