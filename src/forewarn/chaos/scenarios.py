"""The chaos scenarios: each injects one fault into the real stack of the
:class:`~forewarn.chaos.lab.Lab`, states what must happen, and checks it.

Every scenario returns an :class:`Outcome`: what was detected (which check, on what),
how fast (seconds from the fault to the finding, by the agent's own finding time), what
action ran, and what was lost (telemetry: batches and samples, which must be none;
training: steps since the checkpoint the job resumed from). ``passed`` is the check of
the stated expectation; ``problems`` says what did not hold.

The registry :data:`SCENARIOS` is an explicit list, in the order they run.
"""

from __future__ import annotations

import time

from forewarn.chaos.hardware_scenarios import (
    REMAP_MAX_LOSS_S,
    ecc_storm_dbe,
    row_remap_failure,
    thermal_runaway,
    xid79_off_bus,
)
from forewarn.chaos.hostile_scenarios import (
    SKEW_S,
    SLOWLORIS_NOFILE,
    SLOWLORIS_SOCKETS,
    alert_storm_with_fatal,
    clock_skew,
    impostor_agent,
    poisoned_sample,
    slowloris,
)
from forewarn.chaos.lab import Lab
from forewarn.chaos.outcome import Outcome, Scenario
from forewarn.chaos.scale_scenarios import SCALE_SCENARIOS
from forewarn.chaos.store_scenarios import DISK_MB, collector_mismatched_db, disk_full
from forewarn.chaos.telemetry_scenarios import (
    PARTITION_S,
    agent_cut_off,
    agent_restart,
    collector_restart,
    nats_outage_60s,
    partition_60s,
    spool_full,
)
from forewarn.chaos.training_scenarios import (
    corrupt_checkpoint,
    grad_explosion,
    nan_loss,
    rank_hung,
    rank_killed,
    straggler,
)

__all__ = ["SCENARIOS", "Outcome", "Scenario", "by_name"]


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("rank_killed", "training",
             "kill -9 one rank: the agent reports it gone, the launcher restarts the job "
             "from its newest checkpoint; lost = steps since that checkpoint", rank_killed),
    Scenario("rank_hung", "training",
             "one rank stops stepping (beats go on): the agent calls it hung within "
             "max(3 x p99 step time, 2 s), ends the job's ranks, the job restarts from its "
             "newest checkpoint", rank_hung),
    Scenario("nan_loss", "training",
             "a NaN loss at step k is reported at step k; the job is rolled back to the "
             "last checkpoint before k", nan_loss),
    Scenario("grad_explosion", "training",
             "a 1000x gradient (real, through DDP) is reported at its step and the agent "
             "orders a checkpoint that both ranks save at the same step; nothing lost",
             grad_explosion),
    Scenario("straggler", "training",
             "one rank computes 4x slower: reported as a straggler against its peer; the "
             "job goes on", straggler),
    Scenario("corrupt_checkpoint", "training",
             "the newest checkpoint is corrupted on disk and the job crashes: the sha256 "
             "check skips it and the previous good checkpoint is loaded", corrupt_checkpoint),
    Scenario("ecc_storm_dbe", "hardware",
             "correctable-ECC storm ending in a double-bit error (XID 48): the storm is "
             "seen first, a checkpoint is ordered before the DBE, the DBE is unhealthy",
             ecc_storm_dbe),
    Scenario("xid79_off_bus", "hardware",
             "PCIe replays grow until the GPU falls off the bus (XID 79): replays seen "
             "first, a checkpoint is ordered before, the loss is unhealthy", xid79_off_bus),
    Scenario("row_remap_failure", "hardware",
             "row remaps grow until remapping fails (XID 64): pending remaps seen first, a "
             "checkpoint is ordered before, the failure is unhealthy; the newest save before "
             f"it is at most {REMAP_MAX_LOSS_S:g} s old (work lost bounded)",
             row_remap_failure),
    Scenario("thermal_runaway", "hardware",
             "temperature climbs to slowdown and stays: found degraded as the margin falls "
             "under 5 °C, before hardware slowdown; the job slows but lives", thermal_runaway),
    Scenario("agent_restart", "telemetry",
             "kill -9 the agent and start it again: every batch it sealed is stored exactly "
             "once; only samples not yet sealed (< push_interval_s) die with it",
             agent_restart),
    Scenario("collector_restart", "telemetry",
             "kill -9 the collector during ingest and restart it: every batch and sample "
             "stored exactly once, no gap", collector_restart),
    Scenario("agent_cut_off", "telemetry",
             "the network between agent and collector is cut (a blackholing proxy) for "
             "minutes: the agent spools, then replays in order; nothing lost, no gap",
             agent_cut_off),
    Scenario("spool_full", "telemetry",
             "a cut-off longer than the spool can hold: the spool stays at its bound, the "
             "oldest batches are dropped and every drop is counted, the newest arrive; then "
             "the file system refuses writes (EFBIG): records wait in memory, none lost",
             spool_full),
    Scenario("poisoned_sample", "telemetry",
             "a client posts samples with +Inf, a millisecond time and NVML's 2^64-1: each "
             "refused naming its field and counted; the real agent's data all stored; the "
             "next flush writes Parquet", poisoned_sample),
    Scenario("impostor_agent", "telemetry",
             "node B's token posts under node A's agent_id and A's next seqs: 403 each; A's "
             "real batches all stored (none taken for duplicates)", impostor_agent),
    Scenario("collector_mismatched_db", "store",
             "restart the collector on an empty, then an older, collector.db: a start-up "
             "error naming the path, or the unaccounted files quarantined; no Parquet row "
             "deleted", collector_mismatched_db),
    Scenario("slowloris", "telemetry",
             f"{SLOWLORIS_SOCKETS} idle or dripping sockets for 20 s against a collector "
             f"with {SLOWLORIS_NOFILE} descriptors: the agent's batches stored within 5 s "
             "throughout, the collector's log bounded, nothing lost", slowloris),
    Scenario("alert_storm_with_fatal", "telemetry",
             "1,000 alerts/s for 20 s to the alert webhook and a fatal finding (GPU off the "
             "bus) in the middle: the checkpoint order within 1 s of it", alert_storm_with_fatal),
    Scenario("disk_full", "telemetry",
             f"the collector's data dir and the agent's spool on a full {DISK_MB} MiB tmpfs: "
             "no crash, a visible error (metric or /readyz), data written once space is "
             "freed, nothing lost", disk_full),
    Scenario("partition_60s", "telemetry",
             f"the agent is cut off its collector for {PARTITION_S:g} s: it spools, then "
             "replays; nothing lost, no gap", partition_60s),
    Scenario("nats_outage_60s", "telemetry",
             f"agent and collector on NATS JetStream; nats-server stopped for {PARTITION_S:g}"
             " s: the agent spools, then replays; nothing lost, no gap", nats_outage_60s),
    Scenario("clock_skew", "telemetry",
             f"an agent's clock {SKEW_S:g} s ahead: the skew is measured and reported, its "
             "future samples refused, its rows follow it once its clock is fixed, other "
             "GPUs' rows not frozen", clock_skew),
    *SCALE_SCENARIOS,
)


def by_name(names: list[str] | None = None) -> list[Scenario]:
    """The selected scenarios in registry order (all when ``names`` is empty)."""
    if not names:
        return list(SCENARIOS)
    known = {s.name: s for s in SCENARIOS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown scenario(s) {', '.join(unknown)}; known: "
                         f"{', '.join(known)}")
    return [s for s in SCENARIOS if s.name in names]


def run_one(lab: Lab, scenario: Scenario) -> Outcome:
    """Run one scenario; an exception becomes a failed outcome naming it."""
    out = Outcome(scenario.name, scenario.expected)
    t0 = time.monotonic()
    try:
        scenario.run(lab, out)
    except Exception as exc:  # a broken scenario is a failed one, with the reason
        out.problems.append(f"{type(exc).__name__}: {exc}")
    out.figures["scenario_s"] = round(time.monotonic() - t0, 1)
    return out.finish()
