"""The collector's own Prometheus metrics, on an explicit registry (nothing at import time).

Names (all prefixed ``forewarn_collector_``):

* ``ingest_batches_total{result}``: batches by outcome: ``stored``, ``duplicate``, ``rejected``.
* ``ingest_rejected_total{reason}``: rejected requests by reason (``auth``, ``too_large``,
  ``decode``, ``limits``, ``node_mismatch``, ``identity_mismatch`` (another node's
  ``agent_id``), ``not_your_job``, ``content_type``, ``quarantined`` (a batch the store
  could not hold), ``store``).
* ``ingest_ignored_records_total{reason}``: records of a stored batch not applied
  (``rank_held``, ``rank_moved``, ``other_node``: :mod:`forewarn.collector.ingest.authz`).
* ``ingest_refused_records_total{record,reason}``: records left out of stored batches
  (``record``: samples, xids, findings, ranks, checkpoints; ``reason``: ``time``,
  ``non_finite``, ``range``, ``type``).
* ``agent_clock_skew_seconds{node}``: the agent's clock minus the collector's, from the
  send time on its last upload (positive: the agent is ahead).
* ``ingest_samples_total``, ``ingest_bytes_total``, ``ingest_xids_total``.
* ``ingest_lag_seconds``: histogram of receive time minus the batch's ``created`` time
  (a replayed spool shows up here as large lag).
* ``ingest_commit_seconds`` / ``ingest_group_size``: the group commit;
  ``ingest_commits_cut_total``: group commits ended early at a batch boundary to let an
  urgent batch or a waiting transaction in.
* ``findings_total{health,origin}``, ``commands_total{kind,event}`` (``queued``,
  ``delivered``, ``acked``, ``failed``), ``commands_pending``, ``long_polls``.
* ``telemetry_staged_samples``, ``telemetry_rows_total``, ``telemetry_flush_seconds``,
  ``telemetry_flush_errors_total`` (flushes that failed), ``telemetry_bad_rows_total``
  (staged rows a flush could not write, left out so the rest is written).
* ``quarantined_files_total{reason}``: files moved to ``<data_dir>/quarantine``:
  ``unrecorded`` (found at start-up, held nowhere else), ``damaged`` (failed a scrub or a
  compaction read), ``poison_batch`` (an agent batch the store could not hold, kept in
  ``quarantine/ingest/``).
* ``telemetry_read_errors_total`` (a read skipped a damaged or missing Parquet file),
  ``telemetry_missing_files`` (recorded files not on disk at the last scrub).
* ``pruned_rows_total{table}``: rows removed by retention (``telemetry``: Parquet rows);
  ``data_bytes{part}``: bytes on disk (``sqlite``, ``staging``, ``telemetry``,
  ``quarantine``); ``upkeep_errors_total{task}`` (``retention``, ``scrub``).
* ``policy_errors_total``: exceptions raised by the policy hook (counted, never fatal);
  ``policy_backlog_batches`` and ``policy_skipped_batches_total`` (sample-only batches
  not handed to a policy that fell behind).
* ``urgent_seconds{stage}``: where an urgent batch (a finding, a checkpoint report) spends
  its time from the writer's queue to the policy's decision, per stage in order: ``feed``
  (shared state: the leader's ``decide-urgent`` consumer took it → handed to the policy
  thread, waiting for its ingest), ``queued`` (handed to the writer → its group's
  transaction began), ``commit`` (that transaction, with its fsync), ``policy_wait``
  (stored → the policy thread began it), ``observe`` (the policy's ``on_batches``:
  the batch's samples and reports), ``decide`` (its ``on_findings``: the decision, its
  commands queued included).

The policy and actions modules add their own metrics to :attr:`CollectorMetrics.registry`,
a :class:`~forewarn.labels.BoundedLabelsRegistry`: label values that come from outside (job
names) are bounded to 128 characters of valid UTF-8 at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from forewarn.labels import BoundedLabelsRegistry

__all__ = ["CollectorMetrics"]

P = "forewarn_collector_"


class CollectorMetrics:
    """Every metric the collector service itself exports."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else BoundedLabelsRegistry()
        r = self.registry
        self.batches = Counter(P + "ingest_batches", "Agent batches by result.", ["result"],
                               registry=r)
        self.rejected = Counter(P + "ingest_rejected", "Rejected ingest requests by reason.",
                                ["reason"], registry=r)
        self.ignored_records = Counter(
            P + "ingest_ignored_records",
            "Records of stored batches not applied: rank_held (a live rank of another "
            "node), rank_moved (a dead rank now on another node), other_node (a finding "
            "asking for nothing about another node's job).", ["reason"], registry=r)
        self.refused = Counter(P + "ingest_refused_records",
                               "Records left out of stored batches, by record and reason.",
                               ["record", "reason"], registry=r)
        self.clock_skew = Gauge(P + "agent_clock_skew_seconds",
                                "Agent clock minus collector clock at the last upload.",
                                ["node"], registry=r)
        self.samples = Counter(P + "ingest_samples", "GPU samples accepted.", registry=r)
        self.bytes = Counter(P + "ingest_bytes", "Bytes of accepted batch bodies.", registry=r)
        self.xids = Counter(P + "ingest_xids", "XID events accepted.", registry=r)
        self.lag = Histogram(
            P + "ingest_lag_seconds", "Receive time minus batch creation time.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 86400),
            registry=r,
        )
        self.commit_seconds = Histogram(
            P + "ingest_commit_seconds", "Duration of one group commit.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
            registry=r,
        )
        self.commits_cut = Counter(
            P + "ingest_commits_cut", "Group commits ended early to let an urgent batch or"
            " a waiting transaction in (the rest of the group is committed next).",
            registry=r)
        self.group_size = Histogram(
            P + "ingest_group_size", "Batches per group commit.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r,
        )
        self.findings = Counter(P + "findings", "Findings stored.", ["health", "origin"],
                                registry=r)
        self.commands = Counter(
            P + "commands", "Command events: queued, delivered, acked, failed (the agent's"
            " answer), refused (kind invalid: a command the queue could not take; nothing of"
            " its batch queued).", ["kind", "event"], registry=r)
        self.commands_pending = Gauge(P + "commands_pending", "Commands not yet acknowledged.",
                                      registry=r)
        self.long_polls = Gauge(P + "long_polls", "Command long polls held open.", registry=r)
        self.staged = Gauge(P + "telemetry_staged_samples",
                            "Samples staged in the state store, not yet in Parquet"
                            " (counted at ingest, read from the store at each flush).",
                            registry=r)
        self.telemetry_rows = Counter(P + "telemetry_rows", "Rows written to Parquet.",
                                      registry=r)
        self.flush_seconds = Histogram(P + "telemetry_flush_seconds",
                                       "Duration of one staging-to-Parquet flush.", registry=r)
        self.flush_errors = Counter(P + "telemetry_flush_errors", "Failed Parquet flushes.",
                                    registry=r)
        self.quarantined = Counter(P + "quarantined_files",
                                   "Files moved to the quarantine folder, by reason.",
                                   ["reason"], registry=r)
        self.read_errors = Counter(P + "telemetry_read_errors",
                                   "Parquet files a read skipped (damaged or missing).",
                                   registry=r)
        self.missing_files = Gauge(P + "telemetry_missing_files",
                                   "Recorded Parquet files not on disk at the last scrub.",
                                   registry=r)
        self.pruned = Counter(P + "pruned_rows", "Rows removed by retention, by table.",
                              ["table"], registry=r)
        self.data_bytes = Gauge(P + "data_bytes", "Bytes on disk of the data dir, by part.",
                                ["part"], registry=r)
        self.upkeep_errors = Counter(P + "upkeep_errors", "Failed retention or scrub passes.",
                                     ["task"], registry=r)
        self.bad_rows = Counter(P + "telemetry_bad_rows",
                                "Staged rows a flush could not write (left out).", registry=r)
        self.policy_errors = Counter(P + "policy_errors", "Exceptions raised by the policy.",
                                     registry=r)
        self.store_retries = Counter(P + "store_retries", "Group commits tried again because"
                                     " the state store was unavailable.", registry=r)
        self.remote_write_samples = Counter(
            P + "remote_write_samples", "GPU samples the remote-write store took.", registry=r)
        self.remote_write_dropped = Counter(
            P + "remote_write_dropped_samples", "GPU samples never sent to the remote-write"
            " store, by reason (queue_full, refused, shutdown).", ["reason"], registry=r)
        self.remote_write_resent = Counter(
            P + "remote_write_resent_samples", "GPU samples of batches the bus delivered again"
            " (found stored already) queued for remote write again: their replica may have"
            " died before sending them; the store keeps an equal sample once.", registry=r)
        self.remote_write_retries = Counter(
            P + "remote_write_retries", "Remote-write requests tried again.", registry=r)
        self.remote_write_queued = Gauge(
            P + "remote_write_queued_samples", "GPU samples waiting for remote write.",
            registry=r)
        self.remote_write_seconds = Histogram(
            P + "remote_write_request_seconds", "Remote-write request duration.", registry=r)
        self.leader = Gauge(P + "leader", "1 while this replica runs the policy (always 1"
                            " with embedded state).", registry=r)
        self.leader_changes = Counter(P + "leader_changes", "Times this replica became or"
                                      " stopped being the leader.", registry=r)
        self.fenced_writes = Counter(
            P + "fenced_writes", "Writes only the leader may make (orders, holds, their"
            " commands and actions, webhooks, drains, the feed's cursor) refused because"
            " another replica had taken the lead; nothing of them was stored.", registry=r)
        self.policy_backlog = Gauge(P + "policy_backlog_batches",
                                    "Stored batches waiting for the policy thread.", registry=r)
        self.tokens_errors = Counter(
            P + "tokens_file_errors",
            "Changes of the tokens file that could not be used (the log names why).",
            registry=r)
        self.policy_skipped = Counter(
            P + "policy_skipped_batches",
            "Sample-only batches not handed to a policy that fell behind.", registry=r)
        self.urgent_seconds = Histogram(
            P + "urgent_seconds", "Seconds an urgent batch spent in each stage on its way"
            " to a decision: feed, queued, commit, policy_wait, observe, decide.", ["stage"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r)

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)
