"""The fleet's own history read back for retraining: telemetry, XIDs, drains (both state
backends)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from forewarn.collector.config import CollectorConfig
from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.history import read_history
from forewarn.collector.storage.state import StateStore, open_state
from forewarn.collector.storage.telemetry import TelemetryWriter
from forewarn.models.labels import labels_from_telemetry

from support.history import record_drains, store_fleet

T0 = 1_767_225_600.0


@pytest.fixture
def parts(tmp_path: Path, state_backend: dict[str, Any]
          ) -> Iterator[tuple[StateStore, TelemetryWriter]]:
    store = open_state(CollectorConfig(data_dir=tmp_path, **state_backend))
    yield store, TelemetryWriter(store, tmp_path / "telemetry", CollectorMetrics(),
                                  retention_days=3650)
    store.close()


def _samples(minutes: int) -> pd.DataFrame:
    rows = []
    for node, gpu in (("n1", 0), ("n1", 1), ("n2", 0)):
        for i in range(minutes):
            lost = node == "n2" and i >= minutes - 2
            rows.append({"node": node, "gpu": gpu, "time": T0 + 60.0 * i,
                         "state": "lost" if lost else "ok", "temperature_c": 50.0,
                         "ecc_uncorrected_volatile": int(node == "n1" and gpu == 1 and i >= 30),
                         "remap_failure": False})
    return pd.DataFrame(rows)


def test_every_outcome_the_collector_records_becomes_a_label(
        parts: tuple[StateStore, TelemetryWriter]) -> None:
    store, tel = parts
    samples = _samples(60)
    xids = pd.DataFrame({"node": ["n1", "n1"], "gpu": [0, 0], "time": [T0 + 600, T0 + 610],
                         "xid": [13, 79]})
    assert store_fleet(store, tel, samples, xids) == len(samples)
    # An XID the agent could not tie to a GPU index: the gpus table knows its bus id.
    with store.write() as tx:
        tx.execute("UPDATE gpus SET pci_bus_id = '0000:1b:00.0' WHERE node = 'n2'")
        tx.execute("INSERT INTO xids (node, gpu, pci_bus_id, code, text, time, source,"
                   " simulated) VALUES ('n2', NULL, '0000:1b:00.0', 48, '', ?, 'kmsg', 0)",
                   (T0 + 1200,))
    record_drains(store, [("gpu:n3/5", T0 + 900, "done"), ("gpu:n3/6", T0 + 900, "shadow"),
                          ("node:n3", T0 + 900, "done")])
    h = read_history(store, tel)
    assert len(h.samples) == len(samples)
    assert h.xids[["node", "gpu", "code"]].to_dict("records") == [
        {"node": "n1", "gpu": 0, "code": 13}, {"node": "n1", "gpu": 0, "code": 79},
        {"node": "n2", "gpu": 0, "code": 48}]
    assert h.drains.to_dict("records") == [
        {"node": "n3", "gpu": 5, "time": T0 + 900, "cause": "drain"}]
    labels = labels_from_telemetry(h.samples, h.xids, outcomes=h.drains)
    got = {(r["node"], r["gpu"]): (r["time"], r["cause"]) for r in labels.to_dict("records")}
    assert got == {("n1", 0): (T0 + 610, "xid:79"), ("n1", 1): (T0 + 1800, "dbe"),
                   ("n2", 0): (T0 + 1200, "xid:48"), ("n3", 5): (T0 + 900, "drain")}
    assert len(read_history(store, tel, start=T0 + 1000).xids) == 1
