"""``docs/metrics.md``: every metric forewarn exports, rendered from what the running code
exposes (a scrape of an agent's and a collector's ``/metrics``), never written by hand.

Each family gets its exposed name, type, unit (from the name's suffix, as Prometheus'
naming conventions put it there), labels, HELP text, and the dcgm-exporter / DCGM field it
corresponds to where one exists (:data:`DCGM_FIELDS`), so that a dcgm-exporter user can map
dashboards and alerts across.

The document is refreshed like a golden file, on purpose, by the test that runs a whole
stack (agent with every simulated fault, training ranks, collector, Prometheus)::

    FOREWARN_REGEN_METRICS_DOC=1 python -m pytest -q tests/dashboards/test_dashboards_prometheus.py

and checked by that same test otherwise: a family the code exposes that the document lacks,
or documents with another type, unit, label set or HELP, fails it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["DCGM_FIELDS", "Family", "merge", "parse_exposition", "parse_markdown", "render"]

DCGM_FIELDS: Mapping[str, str] = {
    "forewarn_gpu_temperature_celsius": "DCGM_FI_DEV_GPU_TEMP",
    "forewarn_gpu_memory_temperature_celsius": "DCGM_FI_DEV_MEMORY_TEMP",
    "forewarn_gpu_slowdown_margin_celsius": "DCGM_FI_DEV_SLOWDOWN_TEMP - DCGM_FI_DEV_GPU_TEMP",
    "forewarn_gpu_power_watts": "DCGM_FI_DEV_POWER_USAGE",
    "forewarn_gpu_power_limit_watts": "DCGM_FI_DEV_ENFORCED_POWER_LIMIT",
    "forewarn_gpu_sm_clock_hertz": "DCGM_FI_DEV_SM_CLOCK (MHz)",
    "forewarn_gpu_memory_clock_hertz": "DCGM_FI_DEV_MEM_CLOCK (MHz)",
    "forewarn_gpu_utilization_ratio": "DCGM_FI_DEV_GPU_UTIL (%)",
    "forewarn_gpu_memory_utilization_ratio": "DCGM_FI_DEV_MEM_COPY_UTIL (%)",
    "forewarn_gpu_memory_used_bytes": "DCGM_FI_DEV_FB_USED (MiB)",
    "forewarn_gpu_memory_total_bytes": "DCGM_FI_DEV_FB_TOTAL (MiB)",
    "forewarn_gpu_clock_event_reasons": "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
    "forewarn_gpu_ecc_errors_total": "DCGM_FI_DEV_ECC_{SBE,DBE}_{VOL,AGG}_TOTAL",
    "forewarn_gpu_retired_pages_total": "DCGM_FI_DEV_RETIRED_{SBE,DBE}",
    "forewarn_gpu_retired_pages_pending": "DCGM_FI_DEV_RETIRED_PENDING",
    "forewarn_gpu_remapped_rows_total": "DCGM_FI_DEV_{CORRECTABLE,UNCORRECTABLE}_REMAPPED_ROWS",
    "forewarn_gpu_remap_pending": "DCGM_FI_DEV_ROW_REMAP_PENDING",
    "forewarn_gpu_remap_failure": "DCGM_FI_DEV_ROW_REMAP_FAILURE",
    "forewarn_gpu_pcie_replays_total": "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
    "forewarn_gpu_pcie_link_generation": "DCGM_FI_DEV_PCIE_LINK_GEN",
    "forewarn_gpu_pcie_link_generation_max": "DCGM_FI_DEV_PCIE_MAX_LINK_GEN",
    "forewarn_gpu_pcie_link_width": "DCGM_FI_DEV_PCIE_LINK_WIDTH",
    "forewarn_gpu_pcie_link_width_max": "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH",
    "forewarn_gpu_nvlink_errors_total":
        "DCGM_FI_DEV_NVLINK_{CRC_FLIT,CRC_DATA,REPLAY,RECOVERY}_ERROR_COUNT_L<link>",
    "forewarn_gpu_performance_state": "DCGM_FI_DEV_PSTATE",
    "forewarn_gpu_xid_errors_total": "DCGM_FI_DEV_XID_ERRORS (last XID only)",
    "forewarn_gpu_energy_joules_total": "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION (mJ)",
    "forewarn_gpu_sm_active_ratio": "DCGM_FI_PROF_SM_ACTIVE",
    "forewarn_gpu_tensor_active_ratio": "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
    "forewarn_gpu_dram_active_ratio": "DCGM_FI_PROF_DRAM_ACTIVE",
    "forewarn_gpu_pcie_tx_bytes_per_second": "DCGM_FI_PROF_PCIE_TX_BYTES",
    "forewarn_gpu_pcie_rx_bytes_per_second": "DCGM_FI_PROF_PCIE_RX_BYTES",
    "forewarn_gpu_nvlink_tx_bytes_per_second": "DCGM_FI_PROF_NVLINK_TX_BYTES",
    "forewarn_gpu_nvlink_rx_bytes_per_second": "DCGM_FI_PROF_NVLINK_RX_BYTES",
}
"""forewarn metric -> the dcgm-exporter series (DCGM field) it corresponds to; units in
brackets where DCGM's differ from forewarn's base units."""

# Prometheus naming: the unit is the last word before an optional _total.
_UNITS = ("seconds", "bytes", "celsius", "watts", "joules", "hertz", "ratio", "volts")
_HEADER = "| metric | type | unit | labels | DCGM field | help |"


@dataclasses.dataclass(frozen=True)
class Family:
    """One exposed metric family as a reader of ``/metrics`` sees it."""

    name: str
    """The exposed name: counters with ``_total``, histograms without their suffixes."""
    type: str
    help: str
    labels: frozenset[str]

    @property
    def unit(self) -> str:
        base = self.name.removesuffix("_total")
        return next((u for u in _UNITS if base.endswith("_" + u)), "")


def parse_exposition(text: str) -> dict[str, Family]:
    """The families of one Prometheus text exposition, keyed by exposed name."""
    out: dict[str, Family] = {}
    for fam in text_string_to_metric_families(text):
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        labels = {k for s in fam.samples for k in s.labels if k not in ("le", "quantile")}
        out[name] = Family(name, fam.type, fam.documentation, frozenset(labels))
    return out


def merge(*parts: Mapping[str, Family]) -> dict[str, Family]:
    """Families of several scrapes: labels seen in any of them."""
    out: dict[str, Family] = {}
    for part in parts:
        for name, fam in part.items():
            old = out.get(name)
            out[name] = fam if old is None else dataclasses.replace(
                old, labels=old.labels | fam.labels)
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(sections: Mapping[str, Iterable[Family]]) -> str:
    """The Markdown document: one table per section (``agent``, ``collector``)."""
    lines = [
        "# Metrics",
        "",
        "Every metric the agent (`127.0.0.1:9403/metrics`) and the collector (`/metrics`) "
        "export. Generated from a scrape of the running code by "
        "`FOREWARN_REGEN_METRICS_DOC=1 python -m pytest "
        "tests/dashboards/test_dashboards_prometheus.py` "
        "(`forewarn.dashboards.metrics_doc`); that test fails when this file and the code "
        "disagree. Training jobs are labelled `training_job`, never Prometheus' own `job` "
        "(the scrape job); deploy/prometheus.yml scrapes with `honor_labels: true` so the "
        "agent's `node` and `gpu` labels are kept.",
    ]
    for section, families in sections.items():
        lines += ["", f"## {section}", "", _HEADER, "|---|---|---|---|---|---|"]
        for f in sorted(families, key=lambda f: f.name):
            labels = ", ".join(f"`{x}`" for x in sorted(f.labels))
            dcgm = DCGM_FIELDS.get(f.name, "")
            lines.append(f"| `{f.name}` | {f.type} | {f.unit} | {labels} | "
                         f"{_cell(dcgm)} | {_cell(f.help)} |")
    return "\n".join(lines) + "\n"


_ROW = re.compile(r"^\| `(?P<name>[a-z0-9_:]+)` \| (?P<type>\w+) \| (?P<unit>\w*) \| "
                  r"(?P<labels>[^|]*) \| (?P<dcgm>(?:[^|\\]|\\.)*) \| (?P<help>.*) \|$")


def parse_markdown(text: str) -> dict[str, dict[str, Family]]:
    """Read back what :func:`render` wrote: section -> name -> family."""
    out: dict[str, dict[str, Family]] = {}
    section = ""
    for line in text.splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
            out[section] = {}
        elif (m := _ROW.match(line)) and section:
            labels = frozenset(x.strip(" `") for x in m["labels"].split(",") if x.strip())
            help_ = m["help"].replace("\\|", "|")
            out[section][m["name"]] = Family(m["name"], m["type"], help_, labels)
    return out
