"""``replay``: recorded telemetry played back as if it came from the GPUs.

A recording is a CSV or Parquet file with one row per GPU per sample time; columns are
:class:`~forewarn.wire.GpuSample` field names (schema in ``docs/sources.md``):

* required: ``node``, ``gpu``, ``time`` (Unix seconds; Parquet timestamps and ISO 8601
  strings are accepted too);
* optional: every scalar ``GpuSample`` field (``temperature_c``, ``ecc_corrected_volatile``,
  ``remap_pending``...), NVLink counters flattened as ``nvlink<L>_crc_flit``,
  ``nvlink<L>_crc_data``, ``nvlink<L>_replay``, ``nvlink<L>_recovery``, ``unsupported`` and
  ``errors`` as ``;``-separated lists, and XIDs as an ``xid`` column (code) with an
  optional ``xid_text``. More XIDs go in a separate events file (``xid_path``: columns
  ``node``, ``gpu``, ``time``, ``xid``, optional ``xid_text``, ``pci_bus_id``);
* anything else (labels of a training set, say) is ignored and listed in
  :attr:`ReplayBackend.ignored_columns`.

Every problem found at :meth:`ReplayBackend.open` raises :class:`ReplayError` naming the
file, the column and the first bad row: a missing required column, a value of the wrong
type, a unit that cannot be right (temperatures above 200 °C are kelvin, power above
10 kW is milliwatts as NVML reports it, negative counters).

Playback: recording time ``r`` is due at wall time ``opened + (r - first) / speed``.
:meth:`ReplayBackend.sample` returns every row that came due since the last call, in
time order (several per GPU when the recording is denser than the poll). With
``retime=True`` (the default) rows are stamped with the wall time at which they came
due, so the agent sees them as live; with ``retime=False`` they keep their recorded
time (backtests). pandas is imported only when a replay is opened.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from forewarn.agent.backend import GpuInfo, SourceUnavailable
from forewarn.wire import GpuSample, GpuState, NvlinkCounters, XidEvent

__all__ = ["NVLINK_COLUMN", "ReplayBackend", "ReplayError", "read_recording", "sample_row"]

log = logging.getLogger(__name__)

REQUIRED = ("node", "gpu", "time")
NVLINK_COLUMN = re.compile(r"^nvlink(\d{1,2})_(crc_flit|crc_data|replay|recovery)$")
"""Flattened NVLink counter columns: ``nvlink3_crc_flit``."""

# Column -> (low, high, hint when out of range). Units are the GpuSample field units.
_RANGES: dict[str, tuple[float, float, str]] = {
    "temperature_c": (-50, 200, "degrees Celsius expected; values above 200 look like kelvin"),
    "memory_temperature_c": (-50, 200,
                             "degrees Celsius expected; values above 200 look like kelvin"),
    "slowdown_margin_c": (-100, 200, "a margin in degrees Celsius expected"),
    "power_w": (0, 10_000, "watts expected; NVML reports milliwatts, divide by 1000"),
    "power_limit_w": (0, 10_000, "watts expected; NVML reports milliwatts, divide by 1000"),
    "sm_clock_mhz": (0, 10_000, "MHz expected"),
    "mem_clock_mhz": (0, 20_000, "MHz expected"),
    "gpu_util_pct": (0, 100, "percent (0..100) expected"),
    "mem_util_pct": (0, 100, "percent (0..100) expected"),
}
_FLOATS = (*_RANGES,)
_COUNTERS = (
    "memory_used_bytes", "memory_total_bytes", "throttle_reasons",
    "ecc_corrected_volatile", "ecc_uncorrected_volatile", "ecc_corrected_aggregate",
    "ecc_uncorrected_aggregate", "retired_pages_sbe", "retired_pages_dbe",
    "remapped_rows_correctable", "remapped_rows_uncorrectable", "pcie_replay_total",
    "pcie_link_gen", "pcie_link_gen_max", "pcie_link_width", "pcie_link_width_max", "pstate",
)
_BOOLS = ("simulated", "retired_pages_pending", "remap_pending", "remap_failure")
_STRINGS = ("uuid", "pci_bus_id", "name")
_LISTS = ("unsupported", "errors")
_IGNORED_QUIETLY = ("v", "source")
_TRUE = {"true", "1", "yes", "t", "y", "1.0"}
_FALSE = {"false", "0", "no", "f", "n", "0.0"}
_STATES = {s.value for s in GpuState}


class ReplayError(SourceUnavailable, ValueError):
    """A recording cannot be replayed; the message names the file, column and row."""


class _Table:
    """A validated recording held as plain Python column lists, sorted by time."""

    def __init__(self, columns: dict[str, list[Any]], ignored: list[str]) -> None:
        self.columns = columns
        self.ignored = ignored
        self.rows = len(columns["time"])


def read_recording(path: str | Path, *, required: Sequence[str] = REQUIRED) -> Any:
    """Read a CSV or Parquet file into a pandas DataFrame (:class:`ReplayError` on failure)."""
    path = Path(path)
    try:
        import pandas as pd
    except ImportError as exc:  # pragma: no cover - pandas is in the agent's extras
        raise ReplayError(f"replay {path}: pandas is needed to read recordings ({exc})") from None
    suffixes = "".join(path.suffixes[-2:]).lower()
    try:
        if suffixes.endswith((".parquet", ".pq")):
            df = pd.read_parquet(path)
        elif suffixes.endswith((".csv", ".csv.gz")):
            df = pd.read_csv(path, low_memory=False)
        else:
            raise ReplayError(f"replay {path}: unknown file type (expected .csv, .csv.gz, "
                              ".parquet or .pq)")
    except ReplayError:
        raise
    except Exception as exc:  # pandas/pyarrow raise many types for a corrupt file
        raise ReplayError(f"replay {path}: cannot read: {type(exc).__name__}: {exc}") from None
    df.columns = [str(c).strip() for c in df.columns]
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise ReplayError(f"replay {path}: missing required column(s) {', '.join(missing)} "
                          f"(found: {', '.join(df.columns[:20]) or 'none'})")
    return df


def _row_label(path: Path, index: int, csv: bool) -> str:
    # CSV: the header is line 1, so data row i is line i + 2.
    return f"line {index + 2}" if csv else f"row {index}"


def _validate(df: Any, path: Path, origin_csv: bool, *, gpu_optional: bool = False) -> _Table:
    """Check types and units column by column; build plain lists."""
    if len(df) == 0:
        raise ReplayError(f"replay {path}: no rows")
    check = _Columns(df, path, origin_csv)
    check.sort_by_time()
    out: dict[str, list[Any]] = {"time": check.times, "node": check.node()}
    out["gpu"] = check.gpu(gpu_optional) if "gpu" in df.columns else [None] * len(df)
    ignored = []
    for column in check.df.columns:
        if column in REQUIRED:
            continue
        values = check.column(column)
        if values is not None:
            out[column] = values
        elif column not in _IGNORED_QUIETLY:
            ignored.append(column)
    return _Table(out, ignored)


class _Columns:
    """Validates a recording's columns one by one; the first bad value raises a
    :class:`ReplayError` naming the column, its row and how many rows are bad."""

    def __init__(self, df: Any, path: Path, origin_csv: bool) -> None:
        import pandas as pd

        self.pd = pd
        self.df = df
        self.path = path
        self.origin_csv = origin_csv
        self.times: list[float] = []

    def fail(self, column: str, mask: Any, why: str) -> None:
        """Raise for the first row of ``mask`` (when any)."""
        if not mask.any():
            return
        idx = int(mask.to_numpy().nonzero()[0][0])
        value = self.df[column].iloc[idx]
        raise ReplayError(f"replay {self.path}: column {column!r}, "
                          f"{_row_label(self.path, idx, self.origin_csv)}:"
                          f" {why} (got {value!r}; {int(mask.sum())} bad row(s))")

    def sort_by_time(self) -> None:
        """time: numbers, datetimes or ISO strings -> Unix seconds; rows sorted by it."""
        pd = self.pd
        t = self.df["time"]
        epoch = pd.Timestamp(0, tz="UTC")
        if pd.api.types.is_datetime64_any_dtype(t):
            aware = t.dt.tz_localize("UTC") if t.dt.tz is None else t
            secs = (aware - epoch).dt.total_seconds()
        else:
            secs = pd.to_numeric(t, errors="coerce")
            if secs.isna().any() and not pd.api.types.is_numeric_dtype(t):
                parsed = pd.to_datetime(t, errors="coerce", utc=True, format="ISO8601")
                secs = secs.fillna((parsed - epoch).dt.total_seconds())
        self.fail("time", secs.isna(), "Unix seconds or an ISO 8601 timestamp expected")
        self.fail("time", secs < 0, "must not be negative")
        self.fail("time", secs > 1e11, "Unix seconds expected; this looks like milliseconds")
        order = secs.to_numpy().argsort(kind="stable")
        self.df = self.df.iloc[order].reset_index(drop=True)
        self.times = secs.iloc[order].reset_index(drop=True).astype(float).tolist()

    def node(self) -> list[str]:
        node = self.df["node"]
        self.fail("node", node.isna() | (node.astype(str).str.strip() == ""),
                  "a node name expected")
        return [str(x) for x in node.astype(str).tolist()]

    def gpu(self, optional: bool) -> list[int | None]:
        raw = self.df["gpu"]
        gpu = self.pd.to_numeric(raw, errors="coerce")
        bad = raw.notna() & (gpu.isna() | (gpu < 0) | (gpu != gpu.round()))
        if not optional:
            bad |= raw.isna()
        self.fail("gpu", bad, "a GPU index (integer >= 0) expected")
        return [None if math.isnan(x) else int(x) for x in gpu.tolist()]

    def column(self, column: str) -> list[Any] | None:
        """The values of an optional column; None for a column of no known kind."""
        col = self.df[column]
        present = col.notna()
        if column in _FLOATS or column in _COUNTERS or NVLINK_COLUMN.match(column):
            return self._numbers(column, col, present)
        if column in _BOOLS:
            text = col.astype(str).str.strip().str.lower()
            self.fail(column, present & ~text.isin(_TRUE | _FALSE), "true or false expected")
            return [None if not p else s in _TRUE
                    for p, s in zip(present.tolist(), text.tolist(), strict=True)]
        if column == "state":
            text = col.astype(str).str.strip().str.lower()
            self.fail(column, present & ~text.isin(_STATES),
                      f"one of {', '.join(sorted(_STATES))} expected")
            return [s if p else None for p, s in zip(present.tolist(), text.tolist(), strict=True)]
        if column == "xid":
            num = self.pd.to_numeric(col, errors="coerce")
            self.fail(column, present & (num.isna() | (num < 0) | (num > 100_000)
                                         | (num != num.round())),
                      "an XID code (integer 0..100000) expected")
            return [None if math.isnan(x) else int(x) for x in num.tolist()]
        if column in _STRINGS or column in _LISTS or column == "xid_text":
            return [str(x) if p else None
                    for p, x in zip(present.tolist(), col.tolist(), strict=True)]
        return None

    def _numbers(self, column: str, col: Any, present: Any) -> list[Any]:
        """A measurement within its range (floats) or a counter (integers >= 0)."""
        num = self.pd.to_numeric(col, errors="coerce")
        self.fail(column, present & num.isna(), "a number expected")
        if column in _RANGES:
            lo, hi, hint = _RANGES[column]
            self.fail(column, present & ((num < lo) | (num > hi)),
                      f"out of range {lo}..{hi}: {hint}")
            return [None if math.isnan(x) else float(x) for x in num.tolist()]
        self.fail(column, present & (num < 0), "a counter must not be negative")
        self.fail(column, present & (num != num.round()), "an integer expected")
        return [None if math.isnan(x) else int(x) for x in num.tolist()]


class ReplayBackend:
    """Recorded telemetry as a GPU source (implements
    :class:`forewarn.agent.backend.GpuBackend`).

    ``node`` picks one node of a multi-node recording (required when it holds several);
    a one-node recording whose node has another name is played as ``node``. ``as_node``
    renames the node in the samples (the agent's own node name, say).
    """

    name = "replay"

    def __init__(
        self,
        path: str | Path,
        *,
        node: str | None = None,
        as_node: str | None = None,
        speed: float = 1.0,
        retime: bool = True,
        xid_path: str | Path | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if speed <= 0:
            raise ValueError(f"speed: must be positive, got {speed}")
        self.path = Path(path)
        self.xid_path = Path(xid_path) if xid_path is not None else None
        self.node = node
        self.as_node = as_node
        self.speed = speed
        self.retime = retime
        self.simulated = False
        self.ignored_columns: list[str] = []
        self.skipped = 0
        """Rows that failed to convert at playback (logged, never raised)."""
        self._clock = clock
        self._table: _Table | None = None
        self._cursor = 0
        self._xids: list[tuple[float, int | None, int, str, str]] = []
        self._xid_cursor = 0
        self._pending: list[XidEvent] = []
        self._first = 0.0
        self._opened = 0.0
        self._bus: dict[int, str] = {}

    @property
    def finished(self) -> bool:
        """True once every row and XID of the recording has been played."""
        return (self._table is not None and self._cursor >= self._table.rows
                and self._xid_cursor >= len(self._xids))

    def open(self) -> list[GpuInfo]:
        """Read and validate the recording; :class:`ReplayError` names any problem."""
        csv = not self.path.name.lower().endswith((".parquet", ".pq"))
        df = read_recording(self.path)
        df = self._select_node(df, self.path)
        table = _validate(df, self.path, csv)
        if table.ignored:
            log.warning("replay %s: ignoring unknown column(s) %s", self.path,
                        ", ".join(table.ignored))
        self.ignored_columns = table.ignored
        self._table = table
        sim = table.columns.get("simulated")
        self.simulated = bool(sim) and any(x is True for x in sim or ())
        self._first = table.columns["time"][0]
        infos: dict[int, GpuInfo] = {}
        cols = table.columns
        for i in range(table.rows):
            g = cols["gpu"][i]
            if g in infos:
                continue
            infos[g] = GpuInfo(
                index=g, uuid=_get(cols, "uuid", i) or "", name=_get(cols, "name", i) or "",
                pci_bus_id=_get(cols, "pci_bus_id", i) or "",
                memory_total_bytes=_get(cols, "memory_total_bytes", i))
            self._bus[g] = infos[g].pci_bus_id
        self._xids = self._row_xids(table)
        if self.xid_path is not None:
            self._xids += self._file_xids(self.xid_path)
        self._xids.sort(key=lambda e: e[0])
        self._first = min(self._first, self._xids[0][0]) if self._xids else self._first
        self._opened = self._clock()
        self._cursor = self._xid_cursor = 0
        return [infos[g] for g in sorted(infos)]

    def _select_node(self, df: Any, path: Path, *, events: bool = False) -> Any:
        nodes = sorted({str(x) for x in df["node"].dropna().unique()})
        if events and self.node is not None and self.node not in nodes and len(nodes) != 1:
            return df.iloc[0:0]  # an events file with none for this node: no XIDs, no error
        if self.node is not None:
            if self.node not in nodes and len(nodes) == 1:
                # A one-node recording is played as this node (the agent passes its name).
                log.info("replay %s: playing node %r as %r", path, nodes[0], self.node)
                self.as_node = self.as_node or self.node
                return df
            if self.node not in nodes:
                raise ReplayError(f"replay {path}: node {self.node!r} not in the recording "
                                  f"(nodes: {', '.join(nodes[:10])})")
            return df[df["node"].astype(str) == self.node]
        if len(nodes) > 1:
            raise ReplayError(f"replay {path}: the recording holds {len(nodes)} nodes "
                              f"({', '.join(nodes[:10])}...); choose one with node=")
        return df

    def _row_xids(self, table: _Table) -> list[tuple[float, int | None, int, str, str]]:
        codes = table.columns.get("xid")
        if not codes:
            return []
        texts = table.columns.get("xid_text")
        return [(table.columns["time"][i], table.columns["gpu"][i], code,
                 (texts[i] if texts else None) or "", self._bus.get(table.columns["gpu"][i], ""))
                for i, code in enumerate(codes) if code is not None]

    def _file_xids(self, path: Path) -> list[tuple[float, int | None, int, str, str]]:
        df = read_recording(path, required=("node", "time", "xid"))
        df = self._select_node(df, path, events=True)
        if len(df) == 0:
            return []
        keep = [c for c in ("node", "gpu", "time", "xid", "xid_text", "pci_bus_id")
                if c in df.columns]
        csv = not path.name.lower().endswith((".parquet", ".pq"))
        cols = _validate(df[keep], path, csv, gpu_optional=True).columns
        out = []
        for i, code in enumerate(cols["xid"]):
            if code is None:
                continue
            g = cols["gpu"][i]
            bus = _get(cols, "pci_bus_id", i) or (self._bus.get(g, "") if g is not None else "")
            out.append((cols["time"][i], g, code, _get(cols, "xid_text", i) or "", bus))
        return out

    def _wall(self, recorded: float) -> float:
        return self._opened + (recorded - self._first) / self.speed

    def sample(self, now: float) -> list[GpuSample]:
        """Rows that came due by wall time ``now`` (possibly none)."""
        table = self._table
        if table is None:
            raise RuntimeError("ReplayBackend.open() was not called")
        upto = self._first + self.speed * max(0.0, now - self._opened)
        cols = table.columns
        times = cols["time"]
        out = []
        while self._cursor < table.rows and times[self._cursor] <= upto:
            i = self._cursor
            self._cursor += 1
            try:
                out.append(self._row(cols, i))
            except (msgspec.ValidationError, TypeError, ValueError) as exc:
                self.skipped += 1
                log.warning("replay %s: row %d skipped: %s", self.path, i, exc)
        while self._xid_cursor < len(self._xids) and self._xids[self._xid_cursor][0] <= upto:
            t, gpu, code, text, bus = self._xids[self._xid_cursor]
            self._xid_cursor += 1
            self._pending.append(XidEvent(
                node=self.as_node or self.node or cols["node"][0], gpu=gpu, pci_bus_id=bus,
                code=code, text=text[:4096], time=self._wall(t) if self.retime else t,
                source="replay", simulated=self.simulated))
        return out

    def _row(self, cols: dict[str, list[Any]], i: int) -> GpuSample:
        rec: dict[str, Any] = {}
        links: dict[int, dict[str, int]] = {}
        for column, values in cols.items():
            value = values[i]
            if value is None or column in ("xid", "xid_text"):
                continue
            m = NVLINK_COLUMN.match(column)
            if m:
                links.setdefault(int(m.group(1)), {})[m.group(2)] = value
            elif column in _LISTS:
                rec[column] = [x.strip() for x in str(value).split(";") if x.strip()]
            else:
                rec[column] = value
        t = rec["time"]
        rec["time"] = self._wall(t) if self.retime else t
        if self.as_node:
            rec["node"] = self.as_node
        rec["source"] = "replay"
        rec.setdefault("simulated", False)
        if links:
            rec["nvlink"] = [NvlinkCounters(link=k, **v) for k, v in sorted(links.items())]
        return msgspec.convert(rec, GpuSample)

    def drain_xids(self) -> list[XidEvent]:
        out, self._pending = self._pending, []
        return out

    def close(self) -> None:
        self._table = None
        self._pending = []


def sample_row(sample: GpuSample, xid: XidEvent | None = None) -> dict[str, Any]:
    """Flatten a sample into one recording row (the inverse of playback): NVLink
    counters become ``nvlink<L>_<counter>`` columns, lists become ``;``-joined strings."""
    row: dict[str, Any] = {}
    for name, value in msgspec.structs.asdict(sample).items():
        if name == "nvlink":
            for c in value:
                for counter, n in msgspec.structs.asdict(c).items():
                    if counter != "link":
                        row[f"nvlink{c.link}_{counter}"] = n
        elif name in _LISTS:
            row[name] = ";".join(value)
        elif isinstance(value, GpuState):
            row[name] = value.value
        else:
            row[name] = value
    if xid is not None:
        row["xid"] = xid.code
        row["xid_text"] = xid.text
    return row


def _get(cols: dict[str, list[Any]], column: str, i: int) -> Any:
    values = cols.get(column)
    return values[i] if values is not None else None
