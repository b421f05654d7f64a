"""The Grafana dashboards, as code (grafana-foundation-sdk, Grafana 11 build).

``forewarn dashboards generate`` writes them as JSON into ``dashboards/``; a test checks that
regenerating changes nothing, and another runs every panel's query against a real Prometheus
scraping a real agent and collector (a panel that can never show data is a bug).

Panels and queries are built with :mod:`forewarn.dashboards.panels`. Every query filters
on the template variables ``$cluster`` (all = ``.*``, so it matches
series without a cluster label too), ``$node``, ``$gpu`` and ``$job``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import timeseries

from .panels import (
    DS,
    GPU,
    JOB,
    OK_WARN_BAD,
    RANK_LEGEND,
    G,
    dashboard,
    hm,
    new_or_increase,
    on_node,
    q,
    st,
    tb,
    threshold_steps,
    ts,
)

__all__ = ["DASHBOARDS", "render"]

def fleet() -> dict[str, Any]:
    health = "forewarn_gpu_health{" + G + "}"
    return dashboard(
        "forewarn-fleet", "forewarn / Fleet overview",
        "GPU health across the fleet: what is unhealthy, XIDs by class, ECC and remap trends, "
        "thermals, and the predictor's top risks.", ["fleet"], ["node"],
        [
            ("Health", [
                st("Healthy GPUs", "GPUs every check judges healthy.", "none",
                   q(f"count({health} == 0) or vector(0)", instant=True),
                   threshold_steps((None, "green"))),
                st("Degraded GPUs", "GPUs with at least one degraded finding.", "none",
                   q(f"count({health} == 1) or vector(0)", instant=True),
                   threshold_steps((None, "green"), (1, "orange"))),
                st("Unhealthy GPUs", "GPUs with at least one unhealthy finding.", "none",
                   q(f"count({health} == 2) or vector(0)", instant=True),
                   threshold_steps((None, "green"), (1, "red"))),
                st("Nodes with an unhealthy GPU", "Nodes to drain or inspect.", "none",
                   q(f"count(count by (node) ({health} == 2)) or vector(0)", instant=True),
                   threshold_steps((None, "green"), (1, "red"))),
                tb("GPUs not healthy", "Every GPU whose worst health is above healthy: "
                   "1 degraded, 2 unhealthy, 3 unknown.", "none",
                   q(f"{health} > 0", instant=True), w=12),
                tb("Active findings", "Current non-healthy findings with their suggested action.",
                   "none", q('forewarn_finding_active{' + G + '}', instant=True), w=12),
                st("Open incidents", "Incidents with a finding still firing (the collector "
                   "groups correlated findings about one GPU, node or job into one).", "none",
                   q('sum(forewarn_collector_incidents_open{cluster=~"$cluster"})',
                      instant=True), threshold_steps((None, "green"), (1, "orange"))),
                ts("Incidents over time", "Incidents opened per interval by scope (gpu, node, "
                   "job): the findings one fault raises count once; a fleet-wide rise is a "
                   "shared cause (power, network, a bad driver).", "short",
                   q("sum by (kind) (" + new_or_increase(
                       'forewarn_collector_incidents_total{cluster=~"$cluster"}') + ")",
                      "{{kind}}"), stack=True),
            ]),
            ("Errors", [
                ts("XIDs by class", "XID errors per class over the interval; application "
                   "classes (13, 31, 43, 45) are the program's, not the GPU's.", "short",
                   q("sum by (class) (" + new_or_increase(
                       "forewarn_gpu_xid_errors_total{" + G + "}") + ")", "{{class}}"),
                   stack=True),
                ts("Correctable ECC rate", "Corrected ECC errors per second per GPU: a rising "
                   "rate precedes uncorrectable errors (SC20 DRAM study).", "cps",
                   q("sum by (node, gpu) (rate(forewarn_gpu_ecc_errors_total{" + G
                      + ', type="corrected", scope="volatile"}[$__rate_interval]))',
                      "{{node}}/{{gpu}}"), thresholds=threshold_steps((None, "green"), (1, "red"))),
                ts("Remapped rows", "Rows remapped per GPU; pending remaps need a GPU reset.",
                   "short", q("sum by (node, gpu) (forewarn_gpu_remapped_rows_total{" + G + "})",
                               "{{node}}/{{gpu}}")),
                ts("Uncorrectable ECC errors", "Volatile uncorrectable (double-bit) ECC errors.",
                   "short", q("sum by (node, gpu) (forewarn_gpu_ecc_errors_total{" + G
                               + ', type="uncorrected", scope="volatile"})', "{{node}}/{{gpu}}"),
                   thresholds=threshold_steps((None, "green"), (1, "red"))),
            ]),
            ("Thermals and risk", [
                hm("GPU temperature", "Core temperature of every GPU over time.", "celsius",
                   q("forewarn_gpu_temperature_celsius{" + G + "}", "{{node}}/{{gpu}}")),
                ts("Thermal throttling", "GPUs slowed by HW/SW thermal slowdown (NVML clock "
                   "event reasons).", "short",
                   q("sum by (node, gpu) (forewarn_gpu_clock_event_reason_active{" + G
                      + ', reason=~".*thermal.*"})', "{{node}}/{{gpu}}"),
                   thresholds=threshold_steps((None, "green"), (1, "orange"))),
                tb("Top risk scores", "GPUs with the predictor's highest alarm scores (it "
                   "alarms at forewarn_collector_predictor_threshold; a score, not a "
                   "probability: P is on the predictions dashboard).", "none",
                   q("topk(10, forewarn_gpu_failure_score{" + G + "})", instant=True)),
            ]),
            ("Power and energy", [
                ts("Power against limit per node", "Power drawn by each node's GPUs over the "
                   "sum of their enforced limits: near 1, the GPUs are capped (SW power cap).",
                   "percentunit",
                   q("sum by (node) (forewarn_gpu_power_watts{" + G + "}) / sum by (node) "
                      "(forewarn_gpu_power_limit_watts{" + G + "})", "{{node}}"),
                   thresholds=threshold_steps((None, "green"), (0.9, "orange"), (0.98, "red"))),
                ts("Energy per node", "Joules used by each node's GPUs per interval (NVML total "
                   "energy consumption).", "joule",
                   q("sum by (node) (increase(forewarn_gpu_energy_joules_total{" + G
                      + "}[$__rate_interval]))", "{{node}}"), stack=True),
            ]),
        ],
    )


def node_detail() -> dict[str, Any]:
    def gpu_ts(title: str, desc: str, unit: str, metric: str, legend: str = "{{node}}/{{gpu}}",
               extra: str = "", agg: str = "") -> timeseries.Panel:
        sel = metric + "{" + GPU + extra + "}"
        return ts(title, desc, unit, q(agg.format(sel) if agg else sel, legend))

    findings = (db.AnnotationQuery().name("Findings").datasource(DS).enable(True)
                .icon_color("red").expr("max by (node, gpu, check, health, action) "
                                        "(forewarn_finding_active{" + G + "})"))
    return dashboard(
        "forewarn-node", "forewarn / Node and GPU detail",
        "Every agent metric for one node or GPU, with its findings as annotations.",
        ["node", "gpu"], ["node", "gpu"],
        [
            ("State", [
                ts("Health", "0 healthy, 1 degraded, 2 unhealthy, 3 unknown.", "none",
                   q("forewarn_gpu_health{" + GPU + "}", "{{node}}/{{gpu}}"),
                   thresholds=OK_WARN_BAD),
                ts("Health by check", "Each check's judgement of the GPU.", "none",
                   q("forewarn_gpu_check_health{" + GPU + "}", "{{gpu}} {{check}}"),
                   thresholds=OK_WARN_BAD),
                gpu_ts("Performance state", "P-state; 0 is fastest.", "none",
                       "forewarn_gpu_performance_state"),
                tb("Fields not supported", "Fields this GPU does not report (not an error).",
                   "none", q("forewarn_gpu_field_supported{" + GPU + "} == 0 or "
                              "forewarn_gpu_field_supported{" + GPU + "}", instant=True)),
            ]),
            ("Thermals and power", [
                gpu_ts("Temperature", "GPU core temperature.", "celsius",
                       "forewarn_gpu_temperature_celsius"),
                gpu_ts("Memory temperature", "HBM temperature where reported.", "celsius",
                       "forewarn_gpu_memory_temperature_celsius"),
                gpu_ts("Slowdown margin", "Degrees left before hardware slowdown.", "celsius",
                       "forewarn_gpu_slowdown_margin_celsius"),
                gpu_ts("Power", "Power draw.", "watt", "forewarn_gpu_power_watts"),
                gpu_ts("Power limit", "Enforced power limit.", "watt",
                       "forewarn_gpu_power_limit_watts"),
                gpu_ts("Energy", "Joules each GPU used per interval (NVML total energy "
                       "consumption).", "joule", "forewarn_gpu_energy_joules_total",
                       agg="increase({}[$__rate_interval])"),
                tb("Energy over the time range", "Joules each GPU used over the dashboard's "
                   "time range.", "joule",
                   q("increase(forewarn_gpu_energy_joules_total{" + GPU + "}[$__range])",
                      instant=True)),
                ts("Clock event reasons", "Active throttle reasons.", "short",
                   q("forewarn_gpu_clock_event_reason_active{" + GPU + "} == 1",
                      "{{gpu}} {{reason}}")),
            ]),
            ("Clocks and utilization", [
                gpu_ts("SM clock", "Streaming multiprocessor clock.", "hertz",
                       "forewarn_gpu_sm_clock_hertz"),
                gpu_ts("Memory clock", "Memory clock.", "hertz", "forewarn_gpu_memory_clock_hertz"),
                gpu_ts("GPU utilization", "Share of time a kernel ran.", "percentunit",
                       "forewarn_gpu_utilization_ratio"),
                gpu_ts("Memory utilization", "Share of time memory was read or written.",
                       "percentunit", "forewarn_gpu_memory_utilization_ratio"),
                gpu_ts("Memory used", "Frame buffer used.", "bytes",
                       "forewarn_gpu_memory_used_bytes"),
                gpu_ts("Memory total", "Frame buffer size.", "bytes",
                       "forewarn_gpu_memory_total_bytes"),
            ]),
            ("Profiling (DCGM)", [
                gpu_ts("SM active", "Share of cycles an SM has a warp assigned "
                       "(DCGM_FI_PROF_SM_ACTIVE; empty unless the source is DCGM with "
                       "profiling metrics).", "percentunit", "forewarn_gpu_sm_active_ratio"),
                gpu_ts("Tensor pipe active", "Share of cycles the tensor (HMMA) pipe is active "
                       "(DCGM_FI_PROF_PIPE_TENSOR_ACTIVE).", "percentunit",
                       "forewarn_gpu_tensor_active_ratio"),
                gpu_ts("DRAM active", "Share of cycles the memory interface sends or receives "
                       "(DCGM_FI_PROF_DRAM_ACTIVE).", "percentunit",
                       "forewarn_gpu_dram_active_ratio"),
                ts("PCIe bandwidth", "PCIe bytes per second sent and received "
                   "(DCGM_FI_PROF_PCIE_TX_BYTES / RX_BYTES).", "Bps",
                   q("forewarn_gpu_pcie_tx_bytes_per_second{" + GPU + "}", "{{gpu}} tx"),
                   q("forewarn_gpu_pcie_rx_bytes_per_second{" + GPU + "}", "{{gpu}} rx")),
                ts("NVLink bandwidth", "NVLink bytes per second sent and received, all links "
                   "(DCGM_FI_PROF_NVLINK_TX_BYTES / RX_BYTES).", "Bps",
                   q("forewarn_gpu_nvlink_tx_bytes_per_second{" + GPU + "}", "{{gpu}} tx"),
                   q("forewarn_gpu_nvlink_rx_bytes_per_second{" + GPU + "}", "{{gpu}} rx")),
            ]),
            ("Memory errors", [
                ts("ECC errors", "Corrected and uncorrected, volatile and aggregate.", "short",
                   q("forewarn_gpu_ecc_errors_total{" + GPU + "}",
                      "{{gpu}} {{type}} {{scope}}")),
                ts("Retired pages", "Pages retired for single- and double-bit errors.", "short",
                   q("forewarn_gpu_retired_pages_total{" + GPU + "}", "{{gpu}} {{cause}}")),
                gpu_ts("Retirement pending", "1 when a page retirement waits for a reset.",
                       "bool", "forewarn_gpu_retired_pages_pending"),
                ts("Remapped rows", "Rows remapped for correctable and uncorrectable errors.",
                   "short", q("forewarn_gpu_remapped_rows_total{" + GPU + "}",
                               "{{gpu}} {{type}}")),
                gpu_ts("Remap pending", "1 when a remap waits for a GPU reset.", "bool",
                       "forewarn_gpu_remap_pending"),
                gpu_ts("Remap failure", "1 when the GPU ran out of spare rows.", "bool",
                       "forewarn_gpu_remap_failure"),
            ]),
            ("Interconnect", [
                ts("PCIe replay rate", "PCIe replays per second: a rising rate precedes links "
                   "downgrading and GPUs falling off the bus.", "cps",
                   q("rate(forewarn_gpu_pcie_replays_total{" + GPU + "}[$__rate_interval])",
                      "{{node}}/{{gpu}}")),
                ts("PCIe link width", "Current and maximum link width.", "short",
                   q("forewarn_gpu_pcie_link_width{" + GPU + "}", "{{gpu}} width"),
                   q("forewarn_gpu_pcie_link_width_max{" + GPU + "}", "{{gpu}} max")),
                ts("PCIe link generation", "Current and maximum link generation.", "short",
                   q("forewarn_gpu_pcie_link_generation{" + GPU + "}", "{{gpu}} gen"),
                   q("forewarn_gpu_pcie_link_generation_max{" + GPU + "}", "{{gpu}} max")),
                ts("NVLink errors", "NVLink CRC, replay and recovery errors per second by link.",
                   "cps", q("rate(forewarn_gpu_nvlink_errors_total{" + GPU
                             + "}[$__rate_interval])", "{{gpu}} link {{link}} {{type}}")),
                ts("XIDs", "XID errors by code.", "short",
                   q(new_or_increase("forewarn_gpu_xid_errors_total{" + GPU + "}"),
                      "{{gpu}} xid {{code}} ({{class}})")),
            ]),
            ("Agent", [
                ts("Check duration", "Seconds each check took per poll.", "s",
                   q(on_node("forewarn_agent_check_duration_seconds"), "{{node}} {{check}}")),
                ts("Check success", "1 when the check ran without raising.", "bool",
                   q(on_node("forewarn_agent_check_success"), "{{node}} {{check}}"),
                   thresholds=threshold_steps((None, "red"), (1, "green"))),
                ts("Source poll duration", "Seconds one poll of the GPU source took.", "s",
                   q(on_node("forewarn_agent_source_poll_duration_seconds"),
                      "{{node}} {{source}}")),
                ts("Source errors", "Failed polls or opens of the GPU source.", "short",
                   q(on_node("increase(forewarn_agent_source_errors_total{"
                               'cluster=~"$cluster"}[$__rate_interval])'),
                      "{{node}} {{source}}")),
            ]),
        ],
        annotations=[findings],
    )


def training() -> dict[str, Any]:
    r = "{" + JOB + "}"
    return dashboard(
        "forewarn-training", "forewarn / Training jobs",
        "Per-rank progress, loss, grad norm and heartbeats, hang and NaN findings and "
        "checkpoints, next to the hardware of the GPUs the job runs on.", ["training"],
        ["job", "node"],
        [
            ("Progress", [
                ts("Step", "Last step each rank reported.", "short",
                   q("forewarn_rank_step" + r, RANK_LEGEND)),
                ts("Step time p50", "Median step time per rank; a straggler stands out.", "s",
                   q("forewarn_rank_step_seconds{" + JOB + ', quantile="0.5"}',
                      RANK_LEGEND)),
                ts("Loss", "Training loss per rank.", "none",
                   q("forewarn_rank_loss" + r, RANK_LEGEND)),
                ts("Grad norm", "Gradient norm per rank; a 10x spike over the rolling median "
                   "is flagged.", "none", q("forewarn_rank_grad_norm" + r,
                                             RANK_LEGEND)),
                ts("Heartbeat age", "Seconds since each rank's last liveness beat.", "s",
                   q("forewarn_rank_heartbeat_age_seconds" + r, RANK_LEGEND),
                   thresholds=threshold_steps((None, "green"), (5, "orange"), (30, "red"))),
                tb("Hang, NaN and straggler findings", "Current training findings.", "none",
                   q('forewarn_finding_active{cluster=~"$cluster", training_job=~"$job", '
                      'check=~"rank_hang|rank_gone|nan_loss|grad_spike|straggler"}',
                      instant=True)),
            ]),
            ("Checkpoints", [
                ts("Checkpoint orders", "Orders issued, by reason.", "short",
                   q("sum by (training_job, reason) (increase(forewarn_checkpoint_orders_total" + r
                      + "[$__rate_interval]))", "{{training_job}} {{reason}}")),
                ts("Checkpoint duration", "Seconds the last checkpoint took per rank.", "s",
                   q("forewarn_checkpoint_duration_seconds" + r, RANK_LEGEND)),
                ts("Checkpoint size", "Bytes the last checkpoint wrote per rank.", "bytes",
                   q("forewarn_checkpoint_bytes" + r, RANK_LEGEND)),
            ]),
            ("Hardware under the job", [
                ts("Health of the job's GPUs", "0 healthy, 1 degraded, 2 unhealthy.", "none",
                   q(_under_ranks("forewarn_gpu_health"),
                      "{{training_job}} rank {{rank}} ({{node}}/{{gpu}})"), thresholds=OK_WARN_BAD),
                ts("Temperature of the job's GPUs", "Core temperature of the GPUs under ranks.",
                   "celsius", q(_under_ranks("forewarn_gpu_temperature_celsius"),
                                 "{{training_job}} rank {{rank}} ({{node}}/{{gpu}})")),
                ts("Energy per job", "Joules the GPUs under the job's ranks used per "
                   "interval.", "joule",
                   q(_job_energy("$__rate_interval"), "{{training_job}}"), stack=True),
                st("Job energy over the time range", "Joules the job's GPUs used over the "
                   "dashboard's time range.", "joule",
                   q(_job_energy("$__range"), "{{training_job}}", instant=True),
                   threshold_steps((None, "green"))),
            ]),
        ],
    )


def _under_ranks(metric: str) -> str:
    """``metric`` of the GPU under each rank of ``$job``, labelled with the job and rank:
    ``forewarn_rank_info`` carries the GPU (``local_rank`` mapped by the agent)."""
    return ('max by (node, gpu, training_job, rank) (forewarn_rank_info{' + JOB
            + ', node=~"$node", gpu!=""}) * on (node, gpu) group_left '
            "max by (node, gpu) (" + metric + "{" + G + "})")


def _job_energy(window: str) -> str:
    """Joules per ``$job`` over ``window``: the energy counter of each GPU under one of its
    ranks, counted once per GPU even with several ranks on it."""
    return ("sum by (training_job) (max by (node, gpu, training_job) (forewarn_rank_info{"
            + JOB + ', node=~"$node", gpu!=""}) * on (node, gpu) group_left '
            "max by (node, gpu) (increase(forewarn_gpu_energy_joules_total{" + G + "}["
            + window + "])))")


def predictions() -> dict[str, Any]:
    c = '{cluster=~"$cluster"}'
    return dashboard(
        "forewarn-predictions", "forewarn / Predictions and actions",
        "Risk scores and predictions with their lead time, the predictor's shadow-scored "
        "precision and recall, actions taken or withheld, and webhook deliveries.",
        ["predictions"], ["node"],
        [
            ("Predictions", [
                ts("Failure probability", "P(GPU fails within the model's horizon) at the "
                   "failure rate the model was calibrated at: what the cost-aware policy "
                   "weighs against the work at risk.", "percentunit",
                   q("forewarn_gpu_failure_probability{" + G + "}", "{{node}}/{{gpu}}")),
                ts("Alarm score", "The score the predictor alarms on, against its threshold "
                   "(not a probability).", "none",
                   q("forewarn_gpu_failure_score{" + G + "}", "{{node}}/{{gpu}}"),
                   q("max(forewarn_collector_predictor_threshold" + c + ")", "threshold")),
                ts("Shadow-scored precision and recall", "The predictor judged against what "
                   "later happened.", "percentunit",
                   q("forewarn_collector_prediction_precision" + c, "precision"),
                   q("forewarn_collector_prediction_recall" + c, "recall")),
                ts("Prediction lead time", "Median time from prediction to failure.", "s",
                   q("forewarn_collector_prediction_lead_seconds" + c, "median lead")),
            ]),
            ("Actions", [
                ts("Decisions", "Policy decisions by action and outcome (taken, shadow, "
                   "refused by the circuit breaker, rate limited, cooled down).", "short",
                   q("sum by (action, outcome) (increase(forewarn_collector_decisions_total"
                      + c + "[$__rate_interval]))", "{{action}} {{outcome}}"), stack=True),
                ts("Webhook deliveries", "Outbound webhook deliveries by status.", "short",
                   q("sum by (status) (increase(forewarn_collector_webhook_deliveries_total"
                      + c + "[$__rate_interval]))", "{{status}}"), stack=True),
                ts("Checkpoint orders from the collector", "Job-wide orders by event (issued, "
                   "reissued, done, failed).", "short",
                   q("sum by (event) (increase(forewarn_collector_checkpoint_orders_total"
                      + c + "[$__rate_interval]))", "{{event}}")),
            ]),
            ("Collector state", [
                ts("Leader-only writes refused", "Orders, holds, webhooks, drains and the "
                   "feed's cursor a replica tried after another had taken the lead (the "
                   "fence refused them; alert ForewarnCollectorFencedWrites).", "short",
                   q("sum by (instance) (increase(forewarn_collector_fenced_writes_total"
                      + c + "[$__rate_interval]))", "{{instance}}")),
                ts("Predictor state snapshots", "Snapshots of the failure predictor's learned "
                   "state by result: refused or failed means a fresh scorer after a restart "
                   "(alert ForewarnPredictorStateNotKept).", "short",
                   q("sum by (result) (increase("
                      "forewarn_collector_predictor_state_snapshots_total"
                      + c + "[$__rate_interval]))", "{{result}}"), stack=True),
            ]),
        ],
    )


def goodput() -> dict[str, Any]:
    r = "{" + JOB + "}"
    return dashboard(
        "forewarn-goodput", "forewarn / Goodput",
        "Effective training time per job and where the rest went.", ["goodput"], ["job"],
        [
            ("Goodput", [
                ts("Effective training time", "Share of wall time spent on new progress.",
                   "percentunit", q("forewarn_job_goodput_ratio" + r, "{{training_job}}"),
                   thresholds=threshold_steps((None, "red"), (0.9, "orange"), (0.95, "green"))),
                ts("Lost time by cause", "Checkpoint overhead, work redone after failures, "
                   "detection delay and restart downtime.", "s",
                   q("sum by (training_job, cause) (forewarn_job_lost_seconds_total" + r + ")",
                      "{{training_job}} {{cause}}"), stack=True),
                ts("Advised checkpoint interval", "Young's interval from the job's measured "
                   "checkpoint cost, the fleet's failure rate and current risk.", "s",
                   q("forewarn_job_checkpoint_interval_advice_seconds" + r, "{{training_job}}")),
            ]),
        ],
    )


DASHBOARDS: dict[str, Callable[[], dict[str, Any]]] = {
    "fleet": fleet,
    "node": node_detail,
    "training": training,
    "predictions": predictions,
    "goodput": goodput,
}
"""File stem -> builder. Each becomes ``dashboards/<stem>.json``."""


def render(name: str) -> str:
    """The dashboard ``name`` as stable, pretty JSON."""
    return json.dumps(DASHBOARDS[name](), indent=2, sort_keys=True) + "\n"
