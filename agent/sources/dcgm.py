"""``dcgm``: scrape a dcgm-exporter ``/metrics`` endpoint into GPU samples.

For nodes that already run NVIDIA's dcgm-exporter (Kubernetes GPU operator), the agent
reads its Prometheus exposition instead of calling NVML itself. Series are matched on
their ``gpu`` label (``UUID``, ``pci_bus_id`` and ``modelName`` fill the inventory) and
mapped onto :class:`~forewarn.wire.GpuSample` fields (table in ``docs/sources.md``).
Units are converted: framebuffer MiB to bytes; the slowdown margin is
``DCGM_FI_DEV_SLOWDOWN_TEMP - DCGM_FI_DEV_GPU_TEMP``.

* NVLink: per-link fields (``DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_L3``) become per-link
  counters; with only the ``..._TOTAL`` fields (dcgm-exporter's defaults) the sum over all
  links is reported as link 0.
* XIDs: ``DCGM_FI_DEV_XID_ERRORS`` holds the *last* XID code of the GPU; a change of
  value between scrapes becomes an :class:`~forewarn.wire.XidEvent`. The first scrape only
  sets the baseline (an old XID is not news), and the same code twice in a row is not
  seen: pair this source with ``kmsg`` for every XID.
* MIG: series of a GPU instance (``GPU_I_ID`` label) are used only when the whole GPU has
  no series of its own.
* A GPU seen at :meth:`DcgmBackend.open` that is missing from a later scrape is reported
  with ``state = lost`` (DCGM stops reporting a GPU that fell off the bus).

Failures: an endpoint that is down, hangs past ``timeout_s``, answers non-200, or serves
text with no ``DCGM_FI_DEV_*`` sample raises :class:`DcgmError` (a
:class:`~forewarn.agent.backend.SourceUnavailable` naming the URL and the problem); the
agent logs it and retries. Lines that do not parse are skipped and counted in
``skipped``; the rest of the scrape is used.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from forewarn.agent.backend import GpuInfo, SourceUnavailable
from forewarn.wire import GpuSample, GpuState, NvlinkCounters, XidEvent

__all__ = ["FIELD_MAP", "DcgmBackend", "DcgmError", "parse_exposition"]

log = logging.getLogger(__name__)

MIB = 1024 * 1024
MAX_BODY = 16 * MIB
"""A /metrics body larger than this is refused (an exporter gone wrong, not telemetry)."""

FIELD_MAP: dict[str, str] = {
    "DCGM_FI_DEV_GPU_TEMP": "temperature_c",
    "DCGM_FI_DEV_MEMORY_TEMP": "memory_temperature_c",
    "DCGM_FI_DEV_POWER_USAGE": "power_w",
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": "power_limit_w",
    "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": "power_limit_w",
    "DCGM_FI_DEV_SM_CLOCK": "sm_clock_mhz",
    "DCGM_FI_DEV_MEM_CLOCK": "mem_clock_mhz",
    "DCGM_FI_DEV_GPU_UTIL": "gpu_util_pct",
    "DCGM_FI_DEV_MEM_COPY_UTIL": "mem_util_pct",
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": "ecc_corrected_volatile",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": "ecc_uncorrected_volatile",
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": "ecc_corrected_aggregate",
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": "ecc_uncorrected_aggregate",
    "DCGM_FI_DEV_RETIRED_SBE": "retired_pages_sbe",
    "DCGM_FI_DEV_RETIRED_DBE": "retired_pages_dbe",
    "DCGM_FI_DEV_RETIRED_PENDING": "retired_pages_pending",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": "remapped_rows_correctable",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": "remapped_rows_uncorrectable",
    "DCGM_FI_DEV_ROW_REMAP_PENDING": "remap_pending",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": "remap_failure",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": "pcie_replay_total",
    "DCGM_FI_DEV_PCIE_LINK_GEN": "pcie_link_gen",
    "DCGM_FI_DEV_PCIE_MAX_LINK_GEN": "pcie_link_gen_max",
    "DCGM_FI_DEV_PCIE_LINK_WIDTH": "pcie_link_width",
    "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH": "pcie_link_width_max",
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": "throttle_reasons",
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": "throttle_reasons",  # renamed in DCGM 3.3
    "DCGM_FI_DEV_PSTATE": "pstate",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": "energy_mj",  # mJ, as NVML
    # Profiling (DCP) fields: dcgm-exporter's dcp-metrics-included.csv, DCGM 2.1 and later.
    "DCGM_FI_PROF_SM_ACTIVE": "sm_active",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": "tensor_active",
    "DCGM_FI_PROF_DRAM_ACTIVE": "dram_active",
    "DCGM_FI_PROF_PCIE_TX_BYTES": "pcie_tx_bytes_per_s",  # a rate despite the name
    "DCGM_FI_PROF_PCIE_RX_BYTES": "pcie_rx_bytes_per_s",
    "DCGM_FI_PROF_NVLINK_TX_BYTES": "nvlink_tx_bytes_per_s",
    "DCGM_FI_PROF_NVLINK_RX_BYTES": "nvlink_rx_bytes_per_s",
}
"""dcgm-exporter series -> GpuSample field (same units unless converted below)."""

_FLOAT_FIELDS = {"temperature_c", "memory_temperature_c", "power_w", "power_limit_w",
                 "sm_clock_mhz", "mem_clock_mhz", "gpu_util_pct", "mem_util_pct"}
_BOOL_FIELDS = {"retired_pages_pending", "remap_pending", "remap_failure"}
_RATIO_FIELDS = {"sm_active", "tensor_active", "dram_active"}
_RATE_FIELDS = {"pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s", "nvlink_tx_bytes_per_s",
                "nvlink_rx_bytes_per_s"}
_NVLINK = re.compile(
    r"^DCGM_FI_DEV_NVLINK_(CRC_FLIT|CRC_DATA|REPLAY|RECOVERY)_ERROR_COUNT_(TOTAL|L(\d{1,2}))$")
_NVLINK_FIELD = {"CRC_FLIT": "crc_flit", "CRC_DATA": "crc_data", "REPLAY": "replay",
                 "RECOVERY": "recovery"}
_FB = {"DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_TOTAL",
       "DCGM_FI_DEV_FB_RESERVED"}
LOG_EVERY_S = 60.0


class DcgmError(SourceUnavailable):
    """A scrape failed (down, timeout, HTTP error, junk); the message names URL and cause."""


class _Gpu:
    """What one scrape said about one GPU."""

    def __init__(self) -> None:
        self.labels: dict[str, str] = {}
        self.values: dict[str, float] = {}
        self.mig: dict[str, float] = {}


def parse_exposition(text: str) -> tuple[dict[int, _Gpu], int]:
    """Group the DCGM series of an exposition by GPU index; return (gpus, skipped lines).

    Lines the Prometheus parser refuses are skipped one by one, so one broken line does
    not hide the rest of the scrape.
    """
    skipped = 0
    # Keep only the series we map (cheap string checks) before the costly parser: a
    # full 8-GPU scrape with profiling fields is mostly series we do not use.
    text = "".join(ln + "\n" for ln in text.splitlines() if _wanted(ln))
    try:
        samples = [_named(fam, s) for fam in text_string_to_metric_families(text)
                   for s in fam.samples]
    except Exception:  # the parser raises ValueError and friends on any bad line
        samples = []
        for line in text.splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            try:
                samples += [_named(fam, s) for fam in text_string_to_metric_families(line + "\n")
                            for s in fam.samples]
            except Exception:
                skipped += 1
    gpus: dict[int, _Gpu] = {}
    for name, s in samples:
        if not name.startswith(("DCGM_FI_DEV_", "DCGM_FI_PROF_")):
            continue
        idx = s.labels.get("gpu", "")
        if not idx.isdigit() or not math.isfinite(s.value):
            skipped += 1
            continue
        g = gpus.setdefault(int(idx), _Gpu())
        if s.labels.get("GPU_I_ID"):
            g.mig.setdefault(name, s.value)
            if not g.labels:
                g.labels = dict(s.labels)
        else:
            g.values[name] = s.value
            if "GPU_I_ID" not in g.labels:
                g.labels = dict(s.labels)
    for g in gpus.values():
        for name, value in g.mig.items():
            g.values.setdefault(name, value)
    return gpus, skipped


_WANTED = frozenset(FIELD_MAP) | _FB | {"DCGM_FI_DEV_SLOWDOWN_TEMP", "DCGM_FI_DEV_XID_ERRORS"}


def _wanted(line: str) -> bool:
    """A sample line of a series we map, or any line that is not a comment (so that junk
    is still seen and counted)."""
    if not line or line.startswith("#"):
        return False
    if not line.startswith("DCGM_FI_"):
        return bool(line.strip())
    end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=len(line))
    name = line[:end]
    return name in _WANTED or _NVLINK.match(name) is not None


def _named(fam: Any, s: Any) -> tuple[str, Any]:
    # The parser appends "_total" to the samples of a counter family whose name does not
    # end in lower-case "_total" (DCGM_FI_DEV_PCIE_REPLAY_COUNTER -> ..._COUNTER_total):
    # keep the name dcgm-exporter wrote.
    name = fam.name if s.name in (fam.name, fam.name + "_total") else s.name
    return name, s


class DcgmBackend:
    """dcgm-exporter as a GPU source (implements :class:`forewarn.agent.backend.GpuBackend`).

    ``client`` is the HTTP transport (an :class:`httpx.Client`; tests may pass one with a
    mock transport); by default one is made with ``timeout_s``.
    """

    name = "dcgm"
    simulated = False

    def __init__(
        self,
        url: str = "http://127.0.0.1:9400/metrics",
        *,
        node: str,
        timeout_s: float = 2.0,
        client: httpx.Client | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be positive, got {timeout_s}")
        self.url = url
        self.node = node
        self.timeout_s = timeout_s
        self.skipped = 0
        """Exposition lines that did not parse or named no GPU."""
        self._client = client
        self._own_client = client is None
        self._clock = clock
        self._infos: dict[int, GpuInfo] = {}
        self._last_xid: dict[int, int] = {}
        self._xids: list[XidEvent] = []
        self._last_log = -LOG_EVERY_S

    def _http(self) -> httpx.Client:
        if self._client is None:
            self._client = httpx.Client(timeout=self.timeout_s, follow_redirects=False)
            self._own_client = True
        return self._client

    def _scrape(self) -> dict[int, _Gpu]:
        try:
            with self._http().stream("GET", self.url, timeout=self.timeout_s) as resp:
                if resp.status_code != 200:
                    raise DcgmError(f"dcgm {self.url}: HTTP {resp.status_code}")
                body = b""
                for chunk in resp.iter_bytes():
                    body += chunk
                    if len(body) > MAX_BODY:
                        raise DcgmError(f"dcgm {self.url}: response larger than "
                                        f"{MAX_BODY // MIB} MiB refused")
        except httpx.TimeoutException:
            raise DcgmError(f"dcgm {self.url}: timed out after {self.timeout_s:g}s") from None
        except httpx.HTTPError as exc:
            raise DcgmError(f"dcgm {self.url}: {type(exc).__name__}: {exc}") from None
        text = body.decode("utf-8", "replace")
        gpus, skipped = parse_exposition(text)
        self.skipped += skipped
        if skipped:
            self._rate_limited("dcgm %s: skipped %d unparseable line(s)", self.url, skipped)
        if not gpus:
            raise DcgmError(f"dcgm {self.url}: no DCGM_FI_DEV_* series with a gpu label in "
                            f"the response ({len(text)} bytes, {skipped} bad line(s)): "
                            "not a dcgm-exporter endpoint?")
        return gpus

    def open(self) -> list[GpuInfo]:
        """Scrape once for the inventory; :class:`DcgmError` when the endpoint fails."""
        gpus = self._scrape()
        self._infos = {}
        for idx, g in sorted(gpus.items()):
            lab = g.labels
            fb = _fb_bytes(g.values)
            self._infos[idx] = GpuInfo(index=idx, uuid=lab.get("UUID", ""),
                                       name=lab.get("modelName", ""),
                                       pci_bus_id=lab.get("pci_bus_id", ""),
                                       memory_total_bytes=fb[1])
            xid = g.values.get("DCGM_FI_DEV_XID_ERRORS")
            if xid is not None and idx not in self._last_xid:
                self._last_xid[idx] = int(xid)  # baseline: an old XID is not news
        return list(self._infos.values())

    def sample(self, now: float) -> list[GpuSample]:
        """Scrape and map every GPU; GPUs gone from the scrape are ``lost``."""
        gpus = self._scrape()
        out = []
        for idx in sorted(set(gpus) | set(self._infos)):
            g = gpus.get(idx)
            info = self._infos.get(idx)
            if info is None and g is not None:
                lab = g.labels
                info = self._infos[idx] = GpuInfo(
                    index=idx, uuid=lab.get("UUID", ""), name=lab.get("modelName", ""),
                    pci_bus_id=lab.get("pci_bus_id", ""))
            assert info is not None
            common: dict[str, Any] = dict(node=self.node, gpu=idx, uuid=info.uuid[:128],
                                          pci_bus_id=info.pci_bus_id[:64],
                                          name=info.name[:128], time=now, source="dcgm")
            if g is None:
                out.append(GpuSample(**common, state=GpuState.LOST,
                                     errors=("gpu: missing from the dcgm-exporter scrape",)))
                continue
            self._note_xid(idx, info, g.values.get("DCGM_FI_DEV_XID_ERRORS"), now)
            out.append(GpuSample(**common, **_fields(g.values)))
        return out

    def _note_xid(self, idx: int, info: GpuInfo, value: float | None, now: float) -> None:
        if value is None:
            return
        code = int(value)
        prev = self._last_xid.get(idx)
        self._last_xid[idx] = code
        if prev is None or code == prev or code <= 0 or code > 100_000:
            return
        self._xids.append(XidEvent(
            node=self.node, gpu=idx, pci_bus_id=info.pci_bus_id[:64], code=code,
            text="DCGM_FI_DEV_XID_ERRORS changed (last XID of the GPU)", time=now,
            source="dcgm"))

    def drain_xids(self) -> list[XidEvent]:
        out, self._xids = self._xids, []
        return out

    def close(self) -> None:
        if self._client is not None and self._own_client:
            self._client.close()
            self._client = None

    def _rate_limited(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            log.warning(msg, *args)


def _fb_bytes(values: dict[str, float]) -> tuple[int | None, int | None]:
    """(used, total) framebuffer bytes from the MiB series."""
    used = values.get("DCGM_FI_DEV_FB_USED")
    total = values.get("DCGM_FI_DEV_FB_TOTAL")
    if total is None and used is not None and "DCGM_FI_DEV_FB_FREE" in values:
        total = used + values["DCGM_FI_DEV_FB_FREE"] + values.get("DCGM_FI_DEV_FB_RESERVED", 0.0)
    return (None if used is None or used < 0 else int(used * MIB),
            None if total is None or total < 0 else int(total * MIB))


def _fields(values: dict[str, float]) -> dict[str, Any]:
    """Map one GPU's series onto GpuSample fields; impossible values are dropped."""
    out: dict[str, Any] = {}
    for metric, value in values.items():
        fld = FIELD_MAP.get(metric)
        if fld is not None:
            converted = _convert(fld, value)
            if converted is not None:
                out[fld] = converted
    used, total = _fb_bytes(values)
    if used is not None:
        out["memory_used_bytes"] = used
    if total is not None:
        out["memory_total_bytes"] = total
    slowdown = values.get("DCGM_FI_DEV_SLOWDOWN_TEMP")
    temp = values.get("DCGM_FI_DEV_GPU_TEMP")
    if slowdown is not None and temp is not None and slowdown > 0:
        out["slowdown_margin_c"] = float(slowdown - temp)
    nvlink = _nvlink(values)
    if nvlink:
        out["nvlink"] = nvlink
    return out


def _convert(fld: str, value: float) -> float | int | bool | None:
    """``value`` as sample field ``fld`` holds it; None when impossible (a negative
    counter, a ratio over 1)."""
    if fld in _FLOAT_FIELDS:
        return float(value)
    if fld in _RATIO_FIELDS or fld in _RATE_FIELDS:
        ok = value >= 0 and (value <= 1 or fld in _RATE_FIELDS)
        return float(value) if ok else None
    if fld in _BOOL_FIELDS:
        return value > 0
    return int(value) if value >= 0 else None


def _nvlink(values: dict[str, float]) -> tuple[NvlinkCounters, ...]:
    """The NVLink counters per link; the node-wide totals as link 0 where the exporter
    has no per-link series."""
    per_link: dict[int, dict[str, int]] = {}
    totals: dict[str, int] = {}
    for metric, value in values.items():
        m = _NVLINK.match(metric)
        if m is None or value < 0:
            continue
        counter = _NVLINK_FIELD[m.group(1)]
        if m.group(3) is not None:
            per_link.setdefault(int(m.group(3)), {})[counter] = int(value)
        else:
            totals[counter] = int(value)
    if per_link:
        return tuple(NvlinkCounters(link=k, **v) for k, v in sorted(per_link.items()))
    return (NvlinkCounters(link=0, **totals),) if totals else ()
