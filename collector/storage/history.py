"""The fleet's own history, read back for retraining a failure model (``forewarn models
retrain``): telemetry and the outcomes that label it.

Everything a label needs is already recorded, so nothing new is stored for it:

* **telemetry** -- the Parquet store (:meth:`~.telemetry.TelemetryWriter.read`): GPU state
  (``lost``, ``reset_required``: off the bus), uncorrectable ECC and uncorrectable row
  remap counters, the row-remap-failure flag;
* **XIDs** -- the ``xids`` table, every XID the agents sent (the fatal ones, 48, 64, 74,
  79, 95, 119, 120, are failures); an XID the agent could not tie to a GPU index gets it
  from the ``gpus`` table by PCI bus id;
* **drains** -- the ``actions`` table: a drain that ran (``status = 'done'``) about a GPU
  (subject ``gpu:<node>/<index>``). A node drain names no GPU and labels none; a drain in
  shadow mode did not happen.

Which of these is a failure is the models' business (:mod:`forewarn.models.labels`).
Reads go through the :class:`~.state.StateStore` seam, so SQLite and PostgreSQL state both
work; staged samples not yet in Parquet (at most ``flush_interval_s`` of them) are left out,
so a process beside a running collector never opens its staging log.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

from .state import StateStore
from .telemetry import TelemetryWriter

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["History", "read_history"]

_GPU_SUBJECT = re.compile(r"^gpu:(?P<node>.+)/(?P<gpu>\d+)$")

_XIDS = (
    "SELECT x.node AS node, COALESCE(x.gpu, (SELECT MIN(g.gpu) FROM gpus g"
    " WHERE g.node = x.node AND g.pci_bus_id = x.pci_bus_id AND x.pci_bus_id != ''))"
    " AS gpu, x.time AS time, x.code AS code FROM xids x"
    " WHERE x.time >= ? AND x.time < ? ORDER BY x.time"
)

_DRAINS = ("SELECT node, subject, time FROM actions WHERE kind = 'drain' AND status = 'done'"
           " AND time >= ? AND time < ? ORDER BY time")


@dataclasses.dataclass(frozen=True)
class History:
    """Telemetry and outcome records of ``[start, end)``."""

    samples: pd.DataFrame
    """One row per GPU per sample time, the replay columns (:data:`.telemetry.COLUMNS`)."""
    xids: pd.DataFrame
    """``node, gpu, time, code``; XIDs tied to no GPU are left out."""
    drains: pd.DataFrame
    """``node, gpu, time, cause`` (``drain``) of every drain that ran about a GPU."""


def read_history(store: StateStore, telemetry: TelemetryWriter, *,
                 start: float = 0.0, end: float = float("inf")) -> History:
    """The fleet's telemetry, XIDs and drains of ``[start, end)``."""
    import pandas as pd

    samples = telemetry.read(start=start, end=end, include_staged=False)
    xids = pd.DataFrame(store.query(_XIDS, (start, end)),
                        columns=["node", "gpu", "time", "code"]).dropna(subset=["gpu"])
    drains = []
    for row in store.query(_DRAINS, (start, end)):
        m = _GPU_SUBJECT.match(str(row["subject"]))
        if m is not None:
            drains.append((m["node"], int(m["gpu"]), float(row["time"]), "drain"))
    return History(
        samples=samples,
        xids=xids.astype({"gpu": "int64", "code": "int64", "time": "float64"}),
        drains=pd.DataFrame(drains, columns=["node", "gpu", "time", "cause"]))
