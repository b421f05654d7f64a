"""Data formats the models read and write, and their validation.

* **Samples** (the agent's replay format): one row per GPU per sample time, columns named
  as :class:`forewarn.wire.GpuSample` fields; NVLink counters flattened as
  ``nvlink<L>_crc_flit``, ``nvlink<L>_crc_data``, ``nvlink<L>_replay``,
  ``nvlink<L>_recovery`` (or summed over the links, ``nvlink_crc_flit``..., as the
  collector's telemetry history holds them). Units: seconds since the epoch, degrees Celsius, watts.
* **XIDs**: one row per event, columns ``node, gpu, time, xid`` (``code`` accepted), as
  the agent's replay events file; an ``xid`` column in the samples file counts too.
* **Labels** (simulator ground truth, or a fleet's own failure log): one row per failure,
  columns ``node, gpu, time, cause, had_precursor``.

Files are Parquet (``.parquet``) or CSV (``.csv``). :func:`validate_samples` names every
missing column and every column whose values are in the wrong unit (Kelvin for Celsius,
milliwatts for watts, milliseconds for seconds), so a bad file fails with a message a
person can act on.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

import numpy as np
import pandas as pd

from forewarn.errors import InputError

__all__ = [
    "LABEL_COLUMNS",
    "REQUIRED_SAMPLE_COLUMNS",
    "SAMPLE_COLUMNS",
    "XID_COLUMNS",
    "DataError",
    "nvlink_columns",
    "nvlink_sums",
    "read_table",
    "validate_labels",
    "validate_samples",
    "validate_xids",
    "write_table",
]


class DataError(InputError, ValueError):
    """A data file is unusable; the message names the file, the column and the problem."""


SAMPLE_COLUMNS: Final = (
    "node", "gpu", "uuid", "time", "state", "temperature_c", "slowdown_margin_c",
    "power_w", "power_limit_w", "throttle_reasons", "ecc_corrected_volatile",
    "ecc_uncorrected_volatile", "remapped_rows_correctable", "remapped_rows_uncorrectable",
    "remap_pending", "remap_failure", "retired_pages_sbe", "retired_pages_dbe",
    "retired_pages_pending", "pcie_replay_total", "pcie_link_width", "pcie_link_width_max",
)
"""Columns the simulator writes (plus ``nvlink<L>_*``)."""

REQUIRED_SAMPLE_COLUMNS: Final = ("node", "gpu", "time")
"""Columns without which nothing can be computed; every other column may be absent
(an unsupported field), in which case its features are zero."""

XID_COLUMNS: Final = ("node", "gpu", "time", "code")
LABEL_COLUMNS: Final = ("node", "gpu", "time", "cause", "had_precursor")

_NVLINK_RE: Final = re.compile(r"^nvlink(\d*)_(crc_flit|crc_data|replay|recovery)$")

# Plausible ranges: a value outside them means the wrong unit, not a hot GPU.
_UNIT_CHECKS: Final = (
    ("temperature_c", -40.0, 150.0, "degrees Celsius (values look like Kelvin or Fahrenheit)"),
    ("slowdown_margin_c", -60.0, 150.0, "degrees Celsius"),
    ("power_w", 0.0, 5000.0, "watts (values look like milliwatts)"),
    ("power_limit_w", 0.0, 5000.0, "watts (values look like milliwatts)"),
    ("time", 0.0, 1e11, "seconds since the epoch (values look like milliseconds)"),
)


def nvlink_columns(columns: pd.Index | list[str]) -> dict[str, list[str]]:
    """The NVLink columns present, by counter kind: per link (``nvlink<L>_<kind>``, replay
    files) or already summed over the links (``nvlink_<kind>``, the collector's telemetry
    history)."""
    out: dict[str, list[str]] = {"crc_flit": [], "crc_data": [], "replay": [], "recovery": []}
    for col in columns:
        m = _NVLINK_RE.match(str(col))
        if m:
            out[m.group(2)].append(str(col))
    return out


def nvlink_sums(samples: pd.DataFrame) -> dict[str, pd.Series]:
    """Each sample's NVLink counters summed over its links, as the grid's ``nvl_crc``
    (flit and data CRC errors), ``nvl_replay`` and ``nvl_recovery`` (a link without the
    counter adds 0); NaN where the sample has the counter on no link: not known, not 0."""
    links = nvlink_columns(samples.columns)
    nan = pd.Series(np.nan, index=samples.index)
    out = {}
    for name, kinds in (("nvl_crc", ("crc_flit", "crc_data")), ("nvl_replay", ("replay",)),
                        ("nvl_recovery", ("recovery",))):
        cols = [pd.to_numeric(samples[c], errors="coerce") for k in kinds for c in links[k]]
        out[name] = pd.concat([nan, *cols], axis=1).sum(axis=1, min_count=1)
    return out


def _require(df: pd.DataFrame, cols: tuple[str, ...], what: str) -> None:
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise DataError(f"{what}: missing column(s) {', '.join(missing)}")


def _check_units(df: pd.DataFrame, what: str) -> None:
    bad = []
    for col, lo, hi, unit in _UNIT_CHECKS:
        if col not in df.columns:
            continue
        values = pd.to_numeric(df[col], errors="coerce")
        if values.notna().sum() == 0:
            continue
        med = float(values.median())
        if not lo <= med <= hi:
            bad.append(f"{col} (median {med:g}; expected {unit})")
    if bad:
        raise DataError(f"{what}: wrong unit in column(s) {'; '.join(bad)}")


def validate_samples(df: pd.DataFrame, what: str = "samples") -> pd.DataFrame:
    """Check a samples table; return it with ``gpu`` as int and ``node`` as str.

    Raises :class:`DataError` naming missing columns or columns in the wrong unit.
    """
    _require(df, REQUIRED_SAMPLE_COLUMNS, what)
    out = df.copy()
    out["time"] = _seconds(out["time"], what)
    _check_units(out, what)
    out["node"] = out["node"].astype(str)
    out["gpu"] = pd.to_numeric(out["gpu"], errors="raise").astype(np.int64)
    out["time"] = pd.to_numeric(out["time"], errors="raise").astype(np.float64)
    return out


def _seconds(col: pd.Series, what: str) -> pd.Series:
    """Times as Unix seconds: numbers pass, timestamps and ISO 8601 strings convert."""
    if pd.api.types.is_numeric_dtype(col):
        return col.astype(np.float64)
    ts = pd.to_datetime(col, utc=True, errors="coerce")
    if ts.isna().any():
        raise DataError(f"{what}: column time has an unreadable value "
                        f"{col[ts.isna()].iloc[0]!r}")
    return (ts - pd.Timestamp(0, tz="UTC")).dt.total_seconds()


def validate_xids(df: pd.DataFrame, what: str = "xids") -> pd.DataFrame:
    """Check an XID table (``node, gpu, time, code``; the agent's replay events file
    names the code column ``xid``, which is accepted too)."""
    if "code" not in df.columns and "xid" in df.columns:
        df = df.rename(columns={"xid": "code"})
    _require(df, XID_COLUMNS, what)
    out = df.copy()
    out["time"] = _seconds(out["time"], what)
    _check_units(out[["time"]], what)
    out["node"] = out["node"].astype(str)
    out["gpu"] = pd.to_numeric(out["gpu"], errors="coerce").fillna(-1).astype(np.int64)
    out["code"] = pd.to_numeric(out["code"], errors="raise").astype(np.int64)
    return out


def validate_labels(df: pd.DataFrame, what: str = "labels") -> pd.DataFrame:
    """Check a failure-label table (``node, gpu, time, cause, had_precursor``)."""
    _require(df, LABEL_COLUMNS, what)
    _check_units(df[["time"]], what)
    out = df.copy()
    out["node"] = out["node"].astype(str)
    out["gpu"] = pd.to_numeric(out["gpu"], errors="raise").astype(np.int64)
    out["had_precursor"] = out["had_precursor"].astype(bool)
    return out


def read_table(path: str | Path) -> pd.DataFrame:
    """Read a Parquet or CSV file (or a directory of Parquet files, e.g. the collector's
    ``telemetry/date=YYYY-MM-DD/`` store)."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: no such file or directory")
    if p.is_dir() or p.suffix == ".parquet":
        return pd.read_parquet(p)
    if p.suffix == ".csv":
        return pd.read_csv(p)
    raise DataError(f"{p}: unknown format (expected .parquet, .csv or a Parquet directory)")


def write_table(df: pd.DataFrame, path: str | Path) -> None:
    """Write a table as Parquet or CSV, by suffix."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.suffix == ".csv":
        df.to_csv(p, index=False)
    else:
        df.to_parquet(p, index=False)
