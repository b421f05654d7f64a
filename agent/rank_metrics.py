"""Prometheus metrics of the training ranks, their checkpoints and the agent socket.

A custom collector (prometheus_client ``Collector``) that renders the rank table, the order
book and the socket counters at scrape time; it holds no metric objects of its own and is
registered into the agent's explicit registry by the rank component.

=================================================  ===========================================
``forewarn_rank_info``                             1; ``local_rank``, ``world_size``, ``gpu``
``forewarn_rank_step``                             last step reported
``forewarn_rank_step_seconds``                     summary over the last 256 steps: quantile
                                                   0.5/0.99, ``_sum``/``_count`` cumulative
``forewarn_rank_loss`` / ``forewarn_rank_grad_norm``  last values (NaN when the rank sent NaN)
``forewarn_rank_heartbeat_age_seconds``            seconds since the rank last spoke
``forewarn_rank_alive``                            1 while beats arrive and the pid exists
``forewarn_rank_restarts_total``                   new processes seen for the same rank
``forewarn_rank_hook_dropped_total``               reports the hook could not send (its count)
``forewarn_rank_findings_total``                   ``check``: times a rank check fired
``forewarn_rank_finding_step``                     ``check``: the step it last fired at
``forewarn_rank_finding_timestamp_seconds``        ``check``: when it last fired (detection)
``forewarn_rank_last_checkpoint_step``             step of the rank's last saved checkpoint
``forewarn_checkpoint_duration_seconds``           how long the rank's last save took
``forewarn_checkpoint_bytes``                      size of the rank's last save
``forewarn_checkpoint_orders_total``               ``training_job``, ``reason``: orders issued
``forewarn_checkpoint_order_outcomes_total``       ``outcome``: done/superseded/failed/expired/ended
``forewarn_checkpoint_orders_open``                ``training_job``: orders waiting for reports
``forewarn_checkpoint_order_seconds``              ``training_job``: order to last rank done
``forewarn_checkpoint_orders_deferred_total``      ``training_job``: fast-path orders left to
                                                   the collector
``forewarn_save_holds_given_up_total``             ``why``: expired/restarted/crowded/reissues
``forewarn_rank_hangs_confirmed_total``            ``training_job``
``forewarn_rank_hang_signals_total``               ``training_job``, ``signal``
                                                   SIGTERM/SIGKILL/refused
``forewarn_agent_datagrams_received_total``        ``kind`` step/beat/checkpoint
``forewarn_agent_datagrams_dropped_total``         ``reason`` (see ingest.DROP_REASONS)
``forewarn_agent_orders_sent_total``               datagrams sent to ranks; ``_errors_total``
``forewarn_agent_socket_max_dgram_qlen``           the socket's queue limit (NaN: unknown);
                                                   below 512 hooks drop records in a stall
=================================================  ===========================================

Rank series carry ``node``, ``training_job`` and ``rank`` labels.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)

from forewarn.agent.hang import HangTerminator
from forewarn.agent.holds import GIVEN_UP
from forewarn.agent.ingest import RankIngest
from forewarn.agent.orders import CheckpointOrders
from forewarn.agent.rank_state import quantile
from forewarn.agent.ranks import RankTable

__all__ = ["RankCollector"]

_RANK_LABELS = ["node", "training_job", "rank"]


class RankCollector:
    """Renders rank state at scrape time (parts other than ``table`` are optional)."""

    def __init__(
        self,
        node: str,
        table: RankTable,
        *,
        ingest: RankIngest | None = None,
        orders: CheckpointOrders | None = None,
        terminator: HangTerminator | None = None,
        gpu_of: Callable[[int], int | None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.node = node
        self.table = table
        self.ingest = ingest
        self.orders = orders
        self.terminator = terminator
        self.gpu_of = gpu_of or (lambda local_rank: local_rank)
        self.clock = clock

    def describe(self) -> Iterable[Metric]:
        return []  # families vary with the ranks present; nothing to pre-declare

    def collect(self) -> Iterable[Metric]:
        now = self.clock()
        node = self.node
        info = GaugeMetricFamily("forewarn_rank_info", "A training rank heard on this node.",
                                 labels=[*_RANK_LABELS, "local_rank", "world_size", "gpu"])
        step = _g("forewarn_rank_step", "Last training step the rank reported.")
        summary = Metric("forewarn_rank_step_seconds",
                         "Step time of the rank (quantiles over the last 256 steps).", "summary")
        loss = _g("forewarn_rank_loss", "Last loss the rank reported.")
        gnorm = _g("forewarn_rank_grad_norm", "Last gradient norm the rank reported.")
        age = _g("forewarn_rank_heartbeat_age_seconds", "Seconds since the rank last spoke.")
        alive = _g("forewarn_rank_alive", "1 while the rank beats and its process exists.")
        restarts = _c("forewarn_rank_restarts", "New processes seen for the same job and rank.")
        hook_dropped = _c("forewarn_rank_hook_dropped",
                          "Reports the rank's hook could not send (reported by the hook).")
        ck_step = _g("forewarn_rank_last_checkpoint_step", "Step of the rank's last checkpoint.")
        ck_dur = _g("forewarn_checkpoint_duration_seconds", "Duration of the rank's last save.")
        ck_bytes = _g("forewarn_checkpoint_bytes", "Size of the rank's last save.")
        for v in self.table.views():
            labels = [node, v.job, str(v.rank)]
            gpu = self.gpu_of(v.local_rank)
            info.add_metric([*labels, str(v.local_rank), str(v.world_size),
                             "" if gpu is None else str(gpu)], 1)
            if v.last_step is not None:
                step.add_metric(labels, v.last_step)
            if v.step_seconds:
                for q in (0.5, 0.99):
                    summary.add_sample("forewarn_rank_step_seconds",
                                       {**dict(zip(_RANK_LABELS, labels, strict=True)),
                                        "quantile": str(q)},
                                       quantile(v.step_seconds, q) or 0.0)
                base = dict(zip(_RANK_LABELS, labels, strict=True))
                summary.add_sample("forewarn_rank_step_seconds_sum", base, v.step_seconds_sum)
                summary.add_sample("forewarn_rank_step_seconds_count", base,
                                   v.step_seconds_count)
            if v.loss is not None:
                loss.add_metric(labels, v.loss)
            if v.grad_norm is not None:
                gnorm.add_metric(labels, v.grad_norm)
            age.add_metric(labels, max(0.0, now - v.last_msg))
            alive.add_metric(labels, 1 if self.table.alive(v, now) else 0)
            restarts.add_metric(labels, v.restarts)
            hook_dropped.add_metric(labels, v.hook_dropped)
            if v.last_checkpoint_step is not None:
                ck_step.add_metric(labels, v.last_checkpoint_step)
            if v.checkpoint_seconds is not None:
                ck_dur.add_metric(labels, v.checkpoint_seconds)
            if v.checkpoint_bytes is not None:
                ck_bytes.add_metric(labels, v.checkpoint_bytes)
        yield from (info, step, summary, loss, gnorm, age, alive, restarts, hook_dropped,
                    ck_step, ck_dur, ck_bytes)
        yield from self._findings()
        yield from self._orders()
        yield from self._socket()

    def _findings(self) -> Iterable[Metric]:
        fired = CounterMetricFamily("forewarn_rank_findings", "Times a rank check fired.",
                                    labels=[*_RANK_LABELS, "check"])
        at = GaugeMetricFamily("forewarn_rank_finding_step",
                               "Training step at which a rank check last fired.",
                               labels=[*_RANK_LABELS, "check"])
        when = GaugeMetricFamily("forewarn_rank_finding_timestamp_seconds",
                                 "Unix time at which a rank check last fired (first detection).",
                                 labels=[*_RANK_LABELS, "check"])
        for (job, rank, check), (count, step, t) in sorted(self.table.finding_marks().items()):
            labels = [self.node, job, str(rank), check]
            fired.add_metric(labels, count)
            when.add_metric(labels, t)
            if step is not None:
                at.add_metric(labels, step)
        yield from (fired, at, when)

    def _orders(self) -> Iterable[Metric]:
        orders, term = self.orders, self.terminator
        if orders is not None:
            total = CounterMetricFamily("forewarn_checkpoint_orders",
                                        "Checkpoint orders issued to local ranks.",
                                        labels=["node", "training_job", "reason"])
            for (job, reason), n in sorted(orders.orders_total.items()):
                total.add_metric([self.node, job, reason], n)
            outcomes = CounterMetricFamily("forewarn_checkpoint_order_outcomes",
                                           "How checkpoint orders ended.",
                                           labels=["node", "outcome"])
            for outcome in ("done", "superseded", "failed", "expired", "ended"):
                outcomes.add_metric([self.node, outcome], orders.outcomes_total[outcome])
            open_ = GaugeMetricFamily("forewarn_checkpoint_orders_open",
                                      "Checkpoint orders waiting for rank reports.",
                                      labels=["node", "training_job"])
            counts: dict[str, int] = {}
            for st in orders.open_orders():
                counts[st.order.job] = counts.get(st.order.job, 0) + 1
            for job, n in sorted(counts.items()):
                open_.add_metric([self.node, job], n)
            secs = GaugeMetricFamily("forewarn_checkpoint_order_seconds",
                                     "Seconds from the last order to every local rank done.",
                                     labels=["node", "training_job"])
            for job, s in sorted(orders.last_duration.items()):
                secs.add_metric([self.node, job], s)
            deferred = CounterMetricFamily(
                "forewarn_checkpoint_orders_deferred",
                "Local fast-path orders left to the collector: the job spans nodes.",
                labels=["node", "training_job"])
            for job, n in sorted(orders.deferred_total.items()):
                deferred.add_metric([self.node, job], n)
            given_up = CounterMetricFamily(
                "forewarn_save_holds_given_up",
                "Save holds the agent gave up on (why: expired, a rank not reached within the"
                " orders' time to live; restarted, a rank's process replaced; crowded, too"
                " many holds waiting; reissues, its own hold missed after the last reissue).",
                labels=["node", "why"])
            for why in GIVEN_UP:
                given_up.add_metric([self.node, why], orders.holds.given_up_total[why])
            yield from (total, outcomes, open_, secs, deferred, given_up)
        if term is not None:
            conf = CounterMetricFamily("forewarn_rank_hangs_confirmed",
                                       "Confirmed hangs of a job on this node.",
                                       labels=["node", "training_job"])
            for job, n in sorted(term.confirmed_total.items()):
                conf.add_metric([self.node, job], n)
            sig = CounterMetricFamily("forewarn_rank_hang_signals",
                                      "Signals sent to hung ranks (refused: pid not verified).",
                                      labels=["node", "training_job", "signal"])
            for (job, name), n in sorted(term.signals_total.items()):
                sig.add_metric([self.node, job, name], n)
            yield from (conf, sig)

    def _socket(self) -> Iterable[Metric]:
        ing = self.ingest
        if ing is None:
            return
        rec = CounterMetricFamily("forewarn_agent_datagrams_received",
                                  "Datagrams from training hooks accepted.", labels=["kind"])
        for kind in ("step", "beat", "checkpoint"):
            rec.add_metric([kind], ing.received[kind])
        drop = CounterMetricFamily("forewarn_agent_datagrams_dropped",
                                   "Datagrams from training hooks dropped, by reason.",
                                   labels=["reason"])
        for reason, n in sorted(ing.dropped.items()):
            drop.add_metric([reason], n)
        sent = CounterMetricFamily("forewarn_agent_orders_sent",
                                   "Datagrams the agent sent to ranks' order sockets.")
        sent.add_metric([], ing.sent)
        errs = CounterMetricFamily("forewarn_agent_orders_send_errors",
                                   "Datagrams to ranks that could not be sent.")
        errs.add_metric([], ing.send_errors)
        yield from (rec, drop, sent, errs)
        limit = ing.queue_limit
        if limit is not None:
            yield GaugeMetricFamily(
                "forewarn_agent_socket_max_dgram_qlen",
                "net.unix.max_dgram_qlen when the agent socket was created: the datagrams "
                "it queues (NaN: unknown). Below 512, hooks drop step records while the "
                "agent stalls.", value=math.nan if limit.value is None else limit.value)


def _g(name: str, doc: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=_RANK_LABELS)


def _c(name: str, doc: str) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=_RANK_LABELS)
