"""The simulators' output for fixed seeds, against golden files.

Every table a seeded fleet writes (samples, XID events, failure labels, behaviours) is
reduced to a SHA-256 of its CSV; a refactoring of the simulator must leave every digest as
it is. The fleets draw failures at a high rate so that every precursor family, every cause
and every failure effect (GPU lost, double-bit error) appears. Regenerate the golden file
only on purpose (a change of what the simulator writes):

    FOREWARN_REGEN_GOLDEN=1 python -m pytest -q tests/models/test_fleetsim_golden.py

The job simulator's tables (one per fault kind, and none) are pinned the same way.
"""

from __future__ import annotations

import hashlib
import json
import os

import pandas as pd

from forewarn.models.families import PRECURSORS
from forewarn.models.fleetsim import FleetData, FleetParams, load_params, simulate_fleet
from forewarn.models.jobsim import FAULTS, simulate_job
from forewarn.models.suites import classic

from support.paths import TESTS

GOLDEN = TESTS / "golden" / "fleet_seeded.json"
JOB_GOLDEN = TESTS / "golden" / "job_seeded.json"


def _fleets() -> dict[str, FleetParams]:
    p = load_params().replace(nodes=3, days=1.0, rate_per_1000_gpu_days=1500.0)
    return {
        "cause_mix": p.replace(seed=11),
        "balanced_families": p.replace(seed=12, balanced_families=True),
        "classic_short_noisy": classic(p).replace(seed=13, precursor_scale=0.5,
                                                  noise_scale=1.6, sample_interval_s=30.0),
    }


def _digest(df: pd.DataFrame) -> str:
    return hashlib.sha256(df.to_csv(index=False).encode()).hexdigest()


def _digests(d: FleetData) -> dict[str, object]:
    return {
        "rows": {"samples": len(d.samples), "xids": len(d.xids), "labels": len(d.labels),
                 "behaviours": len(d.behaviours)},
        "samples": _digest(d.samples), "xids": _digest(d.xids),
        "labels": _digest(d.labels), "behaviours": _digest(d.behaviours),
    }


def test_seeded_fleets_are_what_they_always_were() -> None:
    data = {name: simulate_fleet(p) for name, p in _fleets().items()}
    # The golden fleets cover every family and both failure effects.
    families = set().union(*(set(d.labels["family"]) for d in data.values()))
    assert families >= set(PRECURSORS), sorted(set(PRECURSORS) - families)
    mix = data["cause_mix"]
    assert (mix.samples["state"] == "lost").any()
    assert (mix.samples["ecc_uncorrected_volatile"] > 0).any()
    got = {name: _digests(d) for name, d in data.items()}
    if os.environ.get("FOREWARN_REGEN_GOLDEN"):
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(GOLDEN.read_text())
    for name in want:
        assert got[name] == want[name], f"fleet {name!r} differs from {GOLDEN.name}"
    assert set(got) == set(want)


def test_seeded_jobs_are_what_they_always_were() -> None:
    """The job simulator (peer comparison's data) likewise: every fault kind and none."""
    got = {}
    for seed, fault in enumerate((*FAULTS, None)):
        df, victim = simulate_job(nodes=2, gpus_per_node=4, duration_s=120.0, fault=fault,
                                  onset_s=60.0, seed=seed)
        got[f"job_{fault}"] = {"victim": victim, "rows": len(df), "table": _digest(df)}
    if os.environ.get("FOREWARN_REGEN_GOLDEN"):
        JOB_GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert got == json.loads(JOB_GOLDEN.read_text())
