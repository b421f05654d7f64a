"""Failure labels from a fleet's own telemetry, for retraining without a failure log.

A failure is the first of: a fatal XID (48 double-bit ECC, 64 remap failure, 74 NVLink,
79 off the bus, 95 uncontained ECC, 119/120 GSP; docs/reference.md XID classes), a sample whose
``state`` is not ``ok`` (GPU lost / reset required), a new uncorrectable ECC error or
uncorrectable row remap, a row remap failure (NVML's flag), or another outcome the caller
knows of (the collector's drains). Events on one GPU within ``dedup_s`` of a kept one are
the same failure. ``had_precursor`` is unknown for real data and set true (it only splits recall).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from forewarn.gpu import FATAL_XIDS
from forewarn.models.schema import validate_samples, validate_xids

__all__ = ["labels_from_telemetry"]



def labels_from_telemetry(samples: pd.DataFrame, xids: pd.DataFrame | None = None,
                          dedup_s: float = 86400.0, outcomes: pd.DataFrame | None = None
                          ) -> pd.DataFrame:
    """Failure labels (``node, gpu, time, cause, had_precursor``) found in telemetry, with
    ``outcomes`` (``node, gpu, time, cause``) known from elsewhere."""
    s = validate_samples(samples).sort_values(["node", "gpu", "time"], kind="stable")
    parts = []
    if "state" in s.columns:
        bad = s[s["state"].astype(str) != "ok"]
        parts.append(bad[["node", "gpu", "time"]].assign(cause="gpu_" + bad["state"].astype(str)))
    for col, cause in (("ecc_uncorrected_volatile", "dbe"),
                       ("remapped_rows_uncorrectable", "remap_uncorrectable")):
        if col in s.columns:
            v = pd.to_numeric(s[col], errors="coerce")
            inc = v.groupby([s["node"], s["gpu"]]).diff() > 0
            parts.append(s.loc[inc, ["node", "gpu", "time"]].assign(cause=cause))
    if "remap_failure" in s.columns:
        # The flag stays set once raised: its rising edge is the failure.
        flag = s["remap_failure"].fillna(False).astype(bool)
        was = flag.groupby([s["node"], s["gpu"]]).shift(fill_value=False).astype(bool)
        parts.append(s.loc[flag & ~was, ["node", "gpu", "time"]].assign(cause="remap_failure"))
    if xids is not None and len(xids):
        x = validate_xids(xids)
        x = x[x["code"].isin(sorted(FATAL_XIDS))]
        parts.append(x[["node", "gpu", "time"]].assign(cause="xid:" + x["code"].astype(str)))
    if outcomes is not None and len(outcomes):
        parts.append(outcomes[["node", "gpu", "time", "cause"]])
    ev = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(
        columns=["node", "gpu", "time", "cause"])
    if ev.empty:
        return ev.assign(had_precursor=pd.Series(dtype=bool))
    ev = ev.sort_values(["node", "gpu", "time"], kind="stable", ignore_index=True)
    # Keep an event when it is the GPU's first or comes dedup_s after the last kept one.
    kept = np.zeros(len(ev), bool)
    last: dict[tuple[str, int], float] = {}
    for i, (node, gpu, t) in enumerate(zip(ev["node"], ev["gpu"], ev["time"], strict=True)):
        k = (str(node), int(gpu))
        if k not in last or t - last[k] > dedup_s:
            kept[i] = True
            last[k] = float(t)
    return ev.loc[kept].assign(had_precursor=True).reset_index(drop=True)
