"""Prometheus exposition of the agent's cached state (served by
:mod:`forewarn.agent.metrics_server`).

The poll loop publishes an immutable :class:`Snapshot` after every cycle; a scrape renders
that snapshot and never touches NVML (after prometheus/client_python's custom collectors
and node_exporter's "cheap scrape path"). The registry is explicit
(:class:`prometheus_client.CollectorRegistry`): nothing is registered at import time, and
other agent components (rank ingest, uplink) register their own collectors into the same
registry through :attr:`forewarn.agent.daemon.Agent.registry`.

Metric families (every GPU series has ``node``, ``gpu``, ``uuid`` and ``simulated``
labels; ``simulated="true"`` marks made-up data from the sim source):

=============================================  ============================================
``forewarn_gpu_info``                          1; ``name``, ``pci_bus_id``, ``source``
``forewarn_gpu_state``                         1 for the current ``state``: ok/lost/reset_required
``forewarn_gpu_temperature_celsius``           core temperature (NVML_TEMPERATURE_GPU)
``forewarn_gpu_memory_temperature_celsius``    HBM temperature where reported
``forewarn_gpu_slowdown_margin_celsius``       degrees left before HW slowdown
``forewarn_gpu_power_watts`` / ``_limit_watts`` power draw and enforced limit
``forewarn_gpu_sm_clock_hertz``                SM clock; ``forewarn_gpu_memory_clock_hertz``
``forewarn_gpu_utilization_ratio``             0..1; ``forewarn_gpu_memory_utilization_ratio``
``forewarn_gpu_memory_used_bytes`` / ``_total_bytes``
``forewarn_gpu_clock_event_reasons``           raw NVML clock-event (throttle) bitmask
``forewarn_gpu_clock_event_reason_active``     0/1 per decoded ``reason``
``forewarn_gpu_ecc_errors_total``              ``type`` corrected/uncorrected,
                                               ``scope`` volatile/aggregate
``forewarn_gpu_retired_pages_total``           ``cause`` sbe/dbe
``forewarn_gpu_retired_pages_pending``         0/1
``forewarn_gpu_remapped_rows_total``           ``type`` correctable/uncorrectable
``forewarn_gpu_remap_pending`` / ``forewarn_gpu_remap_failure``   0/1
``forewarn_gpu_pcie_replays_total``            PCIe replay counter
``forewarn_gpu_pcie_link_generation`` / ``_max``, ``forewarn_gpu_pcie_link_width`` / ``_max``
``forewarn_gpu_nvlink_errors_total``           ``link``, ``type`` crc_flit/crc_data/replay/recovery
``forewarn_gpu_performance_state``             P-state (0 fastest)
``forewarn_gpu_energy_joules_total``           energy since the driver loaded (NVML's mJ / 1000)
``forewarn_gpu_sm_active_ratio``               DCGM profiling, where the source gives them:
``forewarn_gpu_tensor_active_ratio``           SM, tensor pipe and memory interface active
``forewarn_gpu_dram_active_ratio``             (0..1)
``forewarn_gpu_pcie_tx_bytes_per_second``      ... and PCIe / NVLink bytes per second sent
``forewarn_gpu_nvlink_tx_bytes_per_second``    (``_tx_``) and received (``_rx_``)
``forewarn_gpu_field_supported``               ``field``: 1 read, 0 not supported by this GPU
``forewarn_gpu_field_errors_total``            ``field``: reads that failed for another reason
``forewarn_gpu_xid_errors_total``              ``code``, ``class`` (checks/xid.py)
``forewarn_gpu_health``                        worst health of the GPU over all checks
``forewarn_gpu_check_health``                  ``check``: that check's health of the GPU
``forewarn_finding_active``                    1 per non-healthy finding: ``subject``, ``check``,
                                               ``health``, ``action``, and ``gpu``,
                                               ``training_job``, ``rank`` when relevant
``forewarn_agent_check_success``               ``check``: 1 when it ran without raising
``forewarn_agent_check_duration_seconds``      ``check``
``forewarn_agent_source_up``                   ``source``: 1 when the last poll worked
``forewarn_agent_source_poll_duration_seconds``
``forewarn_agent_source_errors_total``         failed polls / opens
``forewarn_agent_xid_source_skipped_total``    unparseable kernel-log lines etc.
``forewarn_agent_polls_total``, ``forewarn_agent_last_poll_timestamp_seconds``
``forewarn_agent_finding_transitions_total``   ``check``, ``health``
``forewarn_agent_build_info``                  1; ``version``
=============================================  ============================================

Health values (``forewarn_gpu_health``, ``forewarn_gpu_check_health``): **0 healthy,
1 degraded, 2 unhealthy, 3 unknown** (:data:`HEALTH_VALUE`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from forewarn.agent.checks.base import CheckRun
from forewarn.gpu import CLOCK_EVENT_REASONS
from forewarn.wire import Finding, GpuSample, GpuState, Health

__all__ = [
    "GPU_GAUGES",
    "HEALTH_VALUE",
    "AgentExporter",
    "Snapshot",
    "SourceStatus",
]

log = logging.getLogger(__name__)

HEALTH_VALUE: dict[Health, int] = {
    Health.HEALTHY: 0,
    Health.DEGRADED: 1,
    Health.UNHEALTHY: 2,
    Health.UNKNOWN: 3,
}
"""Gauge value of each health; higher is worse except unknown (3: could not tell)."""


GPU_GAUGES: tuple[tuple[str, str, str, float], ...] = (
    ("temperature_c", "forewarn_gpu_temperature_celsius", "GPU core temperature.", 1.0),
    ("memory_temperature_c", "forewarn_gpu_memory_temperature_celsius",
     "GPU memory (HBM) temperature.", 1.0),
    ("slowdown_margin_c", "forewarn_gpu_slowdown_margin_celsius",
     "Degrees left before the GPU's hardware slowdown temperature.", 1.0),
    ("power_w", "forewarn_gpu_power_watts", "Power draw.", 1.0),
    ("power_limit_w", "forewarn_gpu_power_limit_watts", "Enforced power limit.", 1.0),
    ("sm_clock_mhz", "forewarn_gpu_sm_clock_hertz", "SM clock.", 1e6),
    ("mem_clock_mhz", "forewarn_gpu_memory_clock_hertz", "Memory clock.", 1e6),
    ("gpu_util_pct", "forewarn_gpu_utilization_ratio", "GPU utilization (0..1).", 0.01),
    ("mem_util_pct", "forewarn_gpu_memory_utilization_ratio",
     "Memory controller utilization (0..1).", 0.01),
    ("memory_used_bytes", "forewarn_gpu_memory_used_bytes", "Frame buffer memory used.", 1.0),
    ("memory_total_bytes", "forewarn_gpu_memory_total_bytes", "Frame buffer memory total.", 1.0),
    ("throttle_reasons", "forewarn_gpu_clock_event_reasons",
     "Raw NVML clock-event (throttle) reason bitmask.", 1.0),
    ("pcie_link_gen", "forewarn_gpu_pcie_link_generation", "Current PCIe link generation.", 1.0),
    ("pcie_link_gen_max", "forewarn_gpu_pcie_link_generation_max",
     "Maximum PCIe link generation.", 1.0),
    ("pcie_link_width", "forewarn_gpu_pcie_link_width", "Current PCIe link width (lanes).", 1.0),
    ("pcie_link_width_max", "forewarn_gpu_pcie_link_width_max",
     "Maximum PCIe link width (lanes).", 1.0),
    ("pstate", "forewarn_gpu_performance_state", "Performance state (0 = fastest).", 1.0),
    # DCGM profiling fields (GpuSample documents each DCGM_FI_PROF_* field).
    ("sm_active", "forewarn_gpu_sm_active_ratio",
     "Share of cycles an SM has at least one warp assigned (0..1).", 1.0),
    ("tensor_active", "forewarn_gpu_tensor_active_ratio",
     "Share of cycles the tensor (HMMA) pipe is active (0..1).", 1.0),
    ("dram_active", "forewarn_gpu_dram_active_ratio",
     "Share of cycles the device memory interface is active (0..1).", 1.0),
    ("pcie_tx_bytes_per_s", "forewarn_gpu_pcie_tx_bytes_per_second",
     "PCIe bytes sent per second, protocol headers included.", 1.0),
    ("pcie_rx_bytes_per_s", "forewarn_gpu_pcie_rx_bytes_per_second",
     "PCIe bytes received per second, protocol headers included.", 1.0),
    ("nvlink_tx_bytes_per_s", "forewarn_gpu_nvlink_tx_bytes_per_second",
     "NVLink bytes sent per second over all links.", 1.0),
    ("nvlink_rx_bytes_per_s", "forewarn_gpu_nvlink_rx_bytes_per_second",
     "NVLink bytes received per second over all links.", 1.0),
)
"""Every GPU gauge as (sample field, metric name, help, scale to the metric's unit): the
one table the agent's exporter and the collector's remote write (same names, same series)
both read."""

FIELDS: tuple[str, ...] = (
    "temperature_c", "memory_temperature_c", "slowdown_margin_c", "power_w", "power_limit_w",
    "sm_clock_mhz", "mem_clock_mhz", "gpu_util_pct", "mem_util_pct", "memory_used_bytes",
    "memory_total_bytes", "throttle_reasons", "ecc_corrected_volatile",
    "ecc_uncorrected_volatile", "ecc_corrected_aggregate", "ecc_uncorrected_aggregate",
    "retired_pages_sbe", "retired_pages_dbe", "retired_pages_pending",
    "remapped_rows_correctable", "remapped_rows_uncorrectable", "remap_pending",
    "remap_failure", "pcie_replay_total", "pcie_link_gen", "pcie_link_gen_max",
    "pcie_link_width", "pcie_link_width_max", "nvlink", "pstate", "energy_mj",
)
"""Sample fields reported in ``forewarn_gpu_field_supported``."""


@dataclasses.dataclass(frozen=True)
class SourceStatus:
    """How one telemetry source is doing, for the agent's self-metrics."""

    name: str
    up: bool
    poll_seconds: float = 0.0
    errors_total: int = 0
    skipped_total: int = 0
    """Input the source could not use (kernel-log lines that did not parse...)."""
    last_error: str = ""


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Everything a scrape renders; built by the poll loop, never mutated afterwards."""

    node: str
    time: float
    samples: tuple[GpuSample, ...] = ()
    """Latest sample of every GPU."""
    findings: tuple[Finding, ...] = ()
    """Current finding of every (check, subject)."""
    check_runs: tuple[CheckRun, ...] = ()
    sources: tuple[SourceStatus, ...] = ()
    xid_sources: tuple[SourceStatus, ...] = ()
    xid_counts: Mapping[tuple[str, int, str], int] = dataclasses.field(default_factory=dict)
    """(gpu label, code, class) -> events since the agent started."""
    field_errors: Mapping[tuple[int, str], int] = dataclasses.field(default_factory=dict)
    transitions: Mapping[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    """(check, new health) -> finding transitions since the agent started."""
    polls_total: int = 0
    simulated: bool = False


def _b(value: bool) -> str:
    return "true" if value else "false"


class AgentExporter:
    """A prometheus_client custom collector rendering the latest :class:`Snapshot`.

    :meth:`publish` swaps the snapshot reference (atomic in CPython), so scrapes on the
    HTTP threads never see a half-written state and never block the poll loop.
    """

    def __init__(self, node: str, version: str) -> None:
        self.version = version
        self._snapshot = Snapshot(node=node, time=0.0)

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    def publish(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        # Names vary with the data; an empty description skips registry collision checks
        # (and keeps register() from calling collect()).
        return []

    def collect(self) -> Iterable[Metric]:
        snap = self._snapshot
        yield from self._gpu_metrics(snap)
        yield from self._health_metrics(snap)
        yield from self._agent_metrics(snap)

    # -- per-GPU telemetry ---------------------------------------------------------------

    def _gpu_metrics(self, snap: Snapshot) -> Iterable[Metric]:
        samples = sorted(snap.samples, key=lambda s: s.gpu)
        yield from _inventory(samples)
        yield from _gauges(samples)
        yield from _counters(samples)
        yield from _flags(samples)
        yield from _link_counters(samples)
        yield _supported(samples)
        yield from _error_counts(snap)

    # -- health and findings -------------------------------------------------------------

    def _health_metrics(self, snap: Snapshot) -> Iterable[Metric]:
        by_gpu = {s.gpu: s for s in snap.samples}
        base = ["node", "gpu", "uuid", "simulated"]
        worst: dict[int, Health] = {}
        check_health = GaugeMetricFamily(
            "forewarn_gpu_check_health",
            "Health of the GPU by one check: 0 healthy, 1 degraded, 2 unhealthy, 3 unknown.",
            labels=[*base, "check"])
        active = GaugeMetricFamily(
            "forewarn_finding_active",
            "1 for every current non-healthy finding, with its suggested action.",
            labels=["node", "subject", "gpu", "training_job", "rank", "check", "health", "action",
                    "simulated"])
        findings = sorted(snap.findings, key=lambda f: (f.subject.key(), f.check))
        for f in findings:
            subj = f.subject
            gpu = "" if subj.gpu is None else str(subj.gpu)
            if subj.kind == "gpu" and subj.gpu is not None:
                s = by_gpu.get(subj.gpu)
                uuid = s.uuid if s is not None else ""
                check_health.add_metric([snap.node, gpu, uuid, _b(f.simulated), f.check],
                                        HEALTH_VALUE[f.health])
                prev = worst.get(subj.gpu, Health.HEALTHY)
                if f.health.severity > prev.severity:
                    worst[subj.gpu] = f.health
                else:
                    worst.setdefault(subj.gpu, prev)
            if f.health != Health.HEALTHY:
                active.add_metric(
                    [subj.node or snap.node, subj.kind, gpu, subj.job,
                     "" if subj.rank is None else str(subj.rank), f.check, f.health.value,
                     f.action.value, _b(f.simulated)], 1)
        health = GaugeMetricFamily(
            "forewarn_gpu_health",
            "Worst health of the GPU over all checks: 0 healthy, 1 degraded, 2 unhealthy, "
            "3 unknown.", labels=base)
        for index in sorted(set(by_gpu) | set(worst)):
            sample = by_gpu.get(index)
            h = worst.get(index, Health.UNKNOWN)
            health.add_metric(
                [snap.node, str(index), sample.uuid if sample else "",
                 _b(sample.simulated if sample else snap.simulated)], HEALTH_VALUE[h])
        yield health
        yield check_health
        yield active

    # -- the agent itself ----------------------------------------------------------------

    def _agent_metrics(self, snap: Snapshot) -> Iterable[Metric]:
        ok = GaugeMetricFamily("forewarn_agent_check_success",
                               "1 when the check ran without raising on the last poll.",
                               labels=["check"])
        dur = GaugeMetricFamily("forewarn_agent_check_duration_seconds",
                                "Seconds the check took on the last poll.", labels=["check"])
        for run in sorted(snap.check_runs, key=lambda r: r.name):
            ok.add_metric([run.name], 1 if run.ok else 0)
            dur.add_metric([run.name], run.seconds)
        yield ok
        yield dur

        up = GaugeMetricFamily("forewarn_agent_source_up",
                               "1 when the source's last poll worked.", labels=["source", "kind"])
        poll = GaugeMetricFamily("forewarn_agent_source_poll_duration_seconds",
                                 "Seconds the last poll of the source took.", labels=["source"])
        errs = CounterMetricFamily("forewarn_agent_source_errors_total",
                                   "Failed polls or opens of the source.", labels=["source"])
        skipped = CounterMetricFamily("forewarn_agent_xid_source_skipped_total",
                                      "Input an XID source could not parse (skipped).",
                                      labels=["source"])
        for src in snap.sources:
            up.add_metric([src.name, "gpu"], 1 if src.up else 0)
            poll.add_metric([src.name], src.poll_seconds)
            errs.add_metric([src.name], src.errors_total)
        for src in snap.xid_sources:
            up.add_metric([src.name, "xid"], 1 if src.up else 0)
            skipped.add_metric([src.name], src.skipped_total)
        yield up
        yield poll
        yield errs
        yield skipped

        polls = CounterMetricFamily("forewarn_agent_polls_total", "Poll cycles run.")
        polls.add_metric([], snap.polls_total)
        yield polls
        last = GaugeMetricFamily("forewarn_agent_last_poll_timestamp_seconds",
                                 "Unix time of the last poll cycle.")
        last.add_metric([], snap.time)
        yield last
        trans = CounterMetricFamily("forewarn_agent_finding_transitions_total",
                                    "Findings whose health or action changed.",
                                    labels=["check", "health"])
        for (check, health), n in sorted(snap.transitions.items()):
            trans.add_metric([check, health], n)
        yield trans
        build = GaugeMetricFamily("forewarn_agent_build_info", "forewarn agent build (1).",
                                  labels=["version", "node"])
        build.add_metric([self.version, snap.node], 1)
        yield build


# -- per-GPU telemetry: one function per group of families, in exposition order -----------

_BASE = ["node", "gpu", "uuid", "simulated"]
"""Labels of every per-GPU series."""


def _key(s: GpuSample) -> list[str]:
    return [s.node, str(s.gpu), s.uuid, _b(s.simulated)]


def _inventory(samples: list[GpuSample]) -> Iterable[Metric]:
    info = GaugeMetricFamily("forewarn_gpu_info", "GPU inventory (always 1).",
                             labels=[*_BASE, "name", "pci_bus_id", "source"])
    state = GaugeMetricFamily("forewarn_gpu_state",
                              "1 for the GPU's current state (ok, lost, reset_required).",
                              labels=[*_BASE, "state"])
    for s in samples:
        info.add_metric([*_key(s), s.name, s.pci_bus_id, s.source], 1)
        for st in GpuState:
            state.add_metric([*_key(s), st.value], 1 if s.state == st else 0)
    yield info
    yield state


def _gauges(samples: list[GpuSample]) -> Iterable[Metric]:
    """The plain gauges of :data:`GPU_GAUGES` (each a sample field read by its name)."""
    for field, name, help_, scale in GPU_GAUGES:
        fam = GaugeMetricFamily(name, help_, labels=_BASE)
        for s in samples:
            v = getattr(s, field)
            if v is not None:
                fam.add_metric(_key(s), float(v) * scale)
        yield fam


def _labelled(s: GpuSample) -> dict[str, tuple[tuple[tuple[str, ...], int | None], ...]]:
    """The labelled counters of one sample: family name -> ((extra labels, value), ...)."""
    return {
        "ecc": ((("corrected", "volatile"), s.ecc_corrected_volatile),
                (("uncorrected", "volatile"), s.ecc_uncorrected_volatile),
                (("corrected", "aggregate"), s.ecc_corrected_aggregate),
                (("uncorrected", "aggregate"), s.ecc_uncorrected_aggregate)),
        "retired": ((("sbe",), s.retired_pages_sbe), (("dbe",), s.retired_pages_dbe)),
        "remapped": ((("correctable",), s.remapped_rows_correctable),
                     (("uncorrectable",), s.remapped_rows_uncorrectable)),
    }


def _counters(samples: list[GpuSample]) -> Iterable[Metric]:
    """Clock-event reasons, ECC errors, retired pages and remapped rows."""
    reasons = GaugeMetricFamily("forewarn_gpu_clock_event_reason_active",
                                "1 when the NVML clock-event (throttle) reason is active.",
                                labels=[*_BASE, "reason"])
    families = {
        "ecc": CounterMetricFamily("forewarn_gpu_ecc_errors_total",
                                   "ECC errors (NVML_MEMORY_ERROR_TYPE_*, volatile = since reset).",
                                   labels=[*_BASE, "type", "scope"]),
        "retired": CounterMetricFamily("forewarn_gpu_retired_pages_total",
                                       "Retired frame-buffer pages by cause.",
                                       labels=[*_BASE, "cause"]),
        "remapped": CounterMetricFamily("forewarn_gpu_remapped_rows_total",
                                        "Remapped memory rows by error type.",
                                        labels=[*_BASE, "type"]),
    }
    for s in samples:
        if s.throttle_reasons is not None:
            for reason, bit in CLOCK_EVENT_REASONS.items():
                reasons.add_metric([*_key(s), reason], 1 if s.throttle_reasons & bit else 0)
        for family, values in _labelled(s).items():
            for labels, v in values:
                if v is not None:
                    families[family].add_metric([*_key(s), *labels], v)
    yield reasons
    yield from families.values()


def _flags(samples: list[GpuSample]) -> Iterable[Metric]:
    """Pending retirement/remap and remap failure (0/1)."""
    retire_pending = GaugeMetricFamily(
        "forewarn_gpu_retired_pages_pending",
        "1 when a page retirement waits for the next reset.", labels=_BASE)
    remap_pending = GaugeMetricFamily(
        "forewarn_gpu_remap_pending", "1 when a row remap waits for the next reset.",
        labels=_BASE)
    remap_failure = GaugeMetricFamily(
        "forewarn_gpu_remap_failure", "1 when a row remap failed (no spare rows).",
        labels=_BASE)
    for s in samples:
        for fam, flag in ((retire_pending, s.retired_pages_pending),
                          (remap_pending, s.remap_pending), (remap_failure, s.remap_failure)):
            if flag is not None:
                fam.add_metric(_key(s), 1.0 if flag else 0.0)
    yield from (retire_pending, remap_pending, remap_failure)


def _link_counters(samples: list[GpuSample]) -> Iterable[Metric]:
    """PCIe replays, energy and the NVLink error counters per link."""
    pcie = CounterMetricFamily("forewarn_gpu_pcie_replays_total",
                               "PCIe replay counter (link-level retransmissions).",
                               labels=_BASE)
    energy = CounterMetricFamily("forewarn_gpu_energy_joules_total",
                                 "Energy used since the driver loaded "
                                 "(nvmlDeviceGetTotalEnergyConsumption).", labels=_BASE)
    nvlink = CounterMetricFamily("forewarn_gpu_nvlink_errors_total",
                                 "NVLink error counters (NVML_NVLINK_ERROR_DL_*) per link.",
                                 labels=[*_BASE, "link", "type"])
    for s in samples:
        k = _key(s)
        if s.pcie_replay_total is not None:
            pcie.add_metric(k, s.pcie_replay_total)
        if s.energy_mj is not None:
            energy.add_metric(k, s.energy_mj / 1000.0)
        for link in s.nvlink:
            for kind, v in (("crc_flit", link.crc_flit), ("crc_data", link.crc_data),
                            ("replay", link.replay), ("recovery", link.recovery)):
                if v is not None:
                    nvlink.add_metric([*k, str(link.link), kind], v)
    yield pcie
    yield energy
    yield nvlink


def _supported(samples: list[GpuSample]) -> Metric:
    supported = GaugeMetricFamily("forewarn_gpu_field_supported",
                                  "1 when the field is read, 0 when this GPU does not "
                                  "support it (not an error).", labels=[*_BASE, "field"])
    for s in samples:
        unsupported = set(s.unsupported)
        for field in (*FIELDS, *sorted(unsupported - set(FIELDS))):
            supported.add_metric([*_key(s), field], 0 if field in unsupported else 1)
    return supported


def _error_counts(snap: Snapshot) -> Iterable[Metric]:
    """Field reads that failed and XIDs seen, since the agent started."""
    errors = CounterMetricFamily("forewarn_gpu_field_errors_total",
                                 "Field reads that failed for a reason other than "
                                 "'not supported'.", labels=["node", "gpu", "field"])
    for (index, field), n in sorted(snap.field_errors.items()):
        errors.add_metric([snap.node, str(index), field], n)
    yield errors
    xids = CounterMetricFamily("forewarn_gpu_xid_errors_total",
                               "NVIDIA XID errors seen since the agent started, by code and "
                               "class (application, memory, interconnect, bus, gsp, other).",
                               labels=["node", "gpu", "code", "class", "simulated"])
    for (gpu_label, code, cls), n in sorted(snap.xid_counts.items()):
        xids.add_metric([snap.node, gpu_label, str(code), cls, _b(snap.simulated)], n)
    yield xids
