"""Telemetry accounting in the scale-out mode: what the agents sealed, against the batches
in PostgreSQL and the GPU samples in the series store (VictoriaMetrics).

Sealed = each agent spool's ``state.json`` ``next_seq`` (every sealed batch got the next
seq and is durable). Sent = the GPU samples in those batches, read from the ``batches``
rows (so only known once every sealed batch is stored). Stored = the points of
``forewarn_gpu_info`` in the series store (the remote write sends one per GPU sample),
each (series, time) counted once; duplicated = the points over that. Run it after the
agents have stopped (gracefully: each seals and sends what it holds).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from forewarn.spawn.procs import wait_until

__all__ = ["ScaleAccount", "account_scale"]


@dataclasses.dataclass
class ScaleAccount:
    """Batches and samples, sealed against stored (module docstring)."""

    batches_sealed: int = 0
    batches_stored: int = 0
    samples_sent: int = 0
    samples_stored: int = 0
    samples_duplicated: int = 0

    @property
    def batches_lost(self) -> int:
        return self.batches_sealed - self.batches_stored

    @property
    def samples_lost(self) -> int:
        return self.samples_sent - self.samples_stored

    def shortfalls(self) -> list[str]:
        """What does not add up, one sentence each."""
        out = []
        if self.batches_lost:
            out.append(f"{self.batches_lost} of {self.batches_sealed} sealed batches are not "
                       "in the state store")
        if self.samples_lost:
            out.append(f"{self.samples_lost} of {self.samples_sent} telemetry samples are not "
                       "in the series store")
        if self.samples_duplicated:
            out.append(f"{self.samples_duplicated} samples are in the series store twice")
        return out


def _sealed(spools: Sequence[Path]) -> dict[str, int]:
    out = {}
    for spool in spools:
        state = json.loads((spool / "state.json").read_text())
        out[str(state["agent_id"])] = int(state["next_seq"])
    return out


def _batches(dsn: str) -> dict[str, dict[int, int]]:
    import psycopg

    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT agent_id, seq, samples FROM batches").fetchall()
    out: dict[str, dict[int, int]] = {}
    for agent_id, seq, samples in rows:
        out.setdefault(str(agent_id), {})[int(seq)] = int(samples)
    return out


def _series(vm: Any, match: str) -> tuple[int, int]:
    distinct = raw = 0
    for series in vm.export(match):
        raw += len(series["timestamps"])
        distinct += len(set(series["timestamps"]))
    return distinct, raw - distinct


def account_scale(spools: Sequence[Path], dsn: str, vm: Any, match: str,
                  wait_s: float = 30.0) -> ScaleAccount:
    """Count (module docstring), waiting up to ``wait_s`` for batches still on their way
    (a killed replica's come back after ``bus_ack_wait_s``) and for the remote write.
    ``vm``: a :class:`~forewarn.demo.servers.VictoriaMetrics`; ``match``: the series
    selector of these agents' nodes."""
    sealed = _sealed(spools)
    acc = ScaleAccount(batches_sealed=sum(sealed.values()))

    def all_stored() -> dict[str, dict[int, int]] | None:
        got = _batches(dsn)
        return got if all(set(range(n)) <= set(got.get(a, {})) for a, n in sealed.items()) \
            else None

    stored = wait_until(all_stored, wait_s, step=0.5) or _batches(dsn)
    mine = [n for a, seqs in stored.items() if a in sealed
            for s, n in seqs.items() if s < sealed[a]]
    acc.batches_stored, acc.samples_sent = len(mine), sum(mine)
    counted = wait_until(lambda: (got := _series(vm, match))[0] >= acc.samples_sent and got,
                         wait_s, step=0.5)
    acc.samples_stored, acc.samples_duplicated = counted or _series(vm, match)
    return acc
