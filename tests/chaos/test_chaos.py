"""The fault-injection suite (``forewarn chaos``): every scenario of the registry runs
against one real lab (collector, agents on simulated nodes, a real 2-rank gloo job,
hook-only jobs on faulty simulated GPUs) and must meet its stated expectation.

Scaled down from the CLI default in one place only: the agent is cut off from the
collector for ``CUTOFF_S`` = 12 s instead of 120 s (a factor of 10); the uplink's HTTP
timeout is 10 s, so at least one push still times out in the blackhole.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from forewarn.chaos.cli import render, run_chaos
from forewarn.chaos.lab import Lab, Options
from forewarn.chaos.scenarios import SCENARIOS, Outcome, Scenario, by_name, run_one

CUTOFF_S = 12.0
REPORT: dict[str, Outcome] = {}


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    lab = Lab(tmp_path_factory.mktemp("chaos"), Options(cutoff_s=CUTOFF_S))
    try:
        lab.hardware()  # its scripted faults play out while the training scenarios run
        yield lab
    finally:
        lab.close()
        lines = [f"{o.name}: detected in {o.detection_s} s; action: {o.action}; lost: {o.lost}"
                 for o in REPORT.values()]
        print("\nchaos figures:\n" + "\n".join(lines))


KNOWN_GAPS: dict[str, str] = {
    "replica_killed_series_backlog": "issue 16: the samples a replica queued for remote "
    "write die with it (stored in PostgreSQL and acknowledged on the bus, never re-sent)",
}
"""Scenarios whose stated bound the product does not meet yet: strict xfail, so a fix shows."""


def _params() -> list[Any]:
    return [pytest.param(s, marks=pytest.mark.xfail(reason=KNOWN_GAPS[s.name], strict=True))
            if s.name in KNOWN_GAPS else s for s in SCENARIOS]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("scenario", _params(), ids=[s.name for s in SCENARIOS])
def test_scenario_meets_its_expectation(lab: Lab, scenario: Scenario) -> None:
    out = run_one(lab, scenario)
    REPORT[scenario.name] = out
    if out.skipped:
        if scenario.rig == "scale" and os.environ.get("CI"):  # .ci/run installs the servers
            pytest.fail(f"{scenario.name} skipped under CI: {out.skipped}")
        pytest.skip(out.skipped)
    assert out.passed, f"{scenario.name}: {out.problems}\n{out}"
    assert out.detected, "a passing scenario says what was detected"
    assert out.action, "a passing scenario says what action ran"
    assert out.lost, "a passing scenario says what was lost"
    f = out.figures
    if scenario.rig == "telemetry":
        if scenario.name == "spool_full":
            # every batch that did not arrive is one the agent counted as dropped
            assert f["produced_batches"] - f["stored_batches"] == f["dropped_counted"] > 0
            # the disk refused writes for a while: retried from memory, nothing lost
            assert f["spool_write_errors"] > 0 and f["samples_dropped_from_memory"] == 0
            assert f["gaps"] == 0
        else:
            assert f["produced_batches"] == f["stored_batches"] > 0
            assert f["missing_seqs"] == [] and f["gaps"] == 0
        assert f["samples_in_batches"] == f["samples_stored"] > 0
        assert f["duplicate_samples"] == 0
    elif scenario.rig == "store":
        assert f["parquet_rows"] > 0 and f["empty_rows_lost"] == f["older_rows_lost"] == 0
    elif scenario.rig == "scale":
        # every sealed batch in PostgreSQL, every GPU sample in VictoriaMetrics once
        assert f["batches_sealed"] == f["batches_stored"] > 0
        assert f["samples_sent"] == f["samples_stored"] > 0
        assert f["samples_lost"] == f["samples_duplicated"] == 0
    else:
        assert out.detection_s is not None and out.detection_s >= 0
        assert f["steps_lost"] >= 0
    if scenario.name in ("rank_killed", "rank_hung", "nan_loss", "corrupt_checkpoint"):
        assert f["steps_lost"] == f["failure_step"] - f["resumed_step"]
    if scenario.name == "rank_hung":
        # issue 3: hung within max(3 x p99 step time, 2 s); a hung job's NCCL timeout is
        # 600 s. Generous slack for a loaded 2-core machine.
        assert out.detection_s is not None and out.detection_s < 600
        assert out.detection_s <= max(2.0, float(f["hang_timeout_s"])) + 3.0
    if scenario.name == "nan_loss":
        assert f["reported_step"] == f["nan_step"] and f["resumed_step"] < f["nan_step"]
    if scenario.name == "grad_explosion":
        assert f["fast_path_order"] is True and f["ordered_step"] >= f["spike_step"]
    if scenario.name == "corrupt_checkpoint":
        assert f["resumed_step"] == f["previous_good"] < f["newest"]
    if scenario.name == "poisoned_sample":
        assert f["refused_records"] + f["rejected_batches"] >= f["poisons"]
        assert f["flushed_after"] is True and f["flush_errors"] == 0
    if scenario.name == "impostor_agent":
        assert f["refused_403"] == f["forged"]
    if scenario.name == "slowloris":
        assert f["batches_during"] > 0 and f["batches_late"] == 0 and f["log_lines"] <= 200
    if scenario.name == "alert_storm_with_fatal":
        assert f["order_latency_s"] is not None and f["order_latency_s"] <= 1.0
    if scenario.name == "disk_full":
        assert f["flush_errors"] > 0 or f["readyz"] != [200]
        assert f["written_after_free"] is True
    if scenario.name == "partition_60s":
        assert f["cutoff_s"] == 60.0 and f["spool_peak_batches"] > 0
    if scenario.name == "nats_outage_60s":
        assert f["outage_s"] == 60.0 and f["spool_peak_batches"] > 0
    if scenario.name in ("replica_killed_ingest", "replica_killed_order",
                         "replica_killed_series_backlog"):
        assert f["takeover_s"] is not None and f["takeover_s"] < 5.0
    if scenario.name == "replica_killed_order":
        assert f["orders"] == f["orders_acked"] >= 2
        assert f["rank0_ordered_saves"] == f["rank0_orders"] >= 1
    if scenario.name == "postgres_restart":
        assert f["ready_again_s"] is not None
    if scenario.name == "clock_skew":
        assert abs(f["skew_reported_s"] - f["skew_set_s"]) < 30 and f["real_rows_lag_s"] < 5
    if scenario.name == "row_remap_failure":
        assert f["steps_lost"] <= f["steps_lost_bound"]
    if scenario.rig == "hardware" and scenario.name != "thermal_runaway":
        # the checkpoint came before the failure: at most the steps since it are lost
        assert f["order_lead_s"] > 0 and f["precursor_lead_s"] > 0
        assert f["steps_lost"] == f["step_at_failure"] - f["last_checkpoint_before"]


def test_registry_names_are_unique_and_selectable() -> None:
    names = [s.name for s in SCENARIOS]
    assert len(names) == len(set(names)) == 28
    assert [s.name for s in by_name(["spool_full", "rank_hung"])] == ["rank_hung", "spool_full"]
    with pytest.raises(ValueError, match="unknown scenario"):
        by_name(["meltdown"])


def test_a_scenario_that_misses_its_expectation_fails_and_says_why(tmp_path: Path) -> None:
    def broken(lab: Lab, out: Outcome) -> None:
        out.expect(False, "nothing was detected")

    def crashing(lab: Lab, out: Outcome) -> None:
        raise RuntimeError("the rig did not start")

    outs = run_chaos([Scenario("broken", "telemetry", "must detect", broken),
                      Scenario("crashing", "telemetry", "must start", crashing)],
                     workdir=tmp_path)
    assert [o.passed for o in outs] == [False, False]
    assert outs[0].problems == ["nothing was detected"]
    assert "RuntimeError: the rig did not start" in outs[1].problems[0]
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(render(outs))
    text = console.export_text()
    assert "FAIL" in text and "nothing was detected" in text


def test_cli_lists_runs_one_scenario_prints_json_and_refuses_unknown_names(
        tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "forewarn", "chaos"]
    listed = subprocess.run([*cmd, "--list"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0
    assert all(s.name in listed.stdout for s in SCENARIOS)
    bad = subprocess.run([*cmd, "--only", "meltdown"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "unknown scenario" in bad.stdout
    run = subprocess.run([*cmd, "--only", "collector_restart", "--json", "--workdir",
                          str(tmp_path)], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    (out,) = json.loads(run.stdout)
    assert out["name"] == "collector_restart" and out["passed"] is True
    assert out["figures"]["produced_batches"] == out["figures"]["stored_batches"] > 0
    assert "collector_restart" in run.stderr and "1/1 passed" in run.stderr
    assert not math.isnan(out["detection_s"])
