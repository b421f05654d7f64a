"""The fault-injection suite (``forewarn chaos``), part 1: the scenarios on real
training jobs (a real 2-rank gloo job, hook-only jobs on faulty simulated GPUs) and on the
hardware rig, and the suite's own CLI and registry. Parts 2 and 3 (test_chaos_telemetry.py,
test_chaos_scale.py) run the other rigs' scenarios; tests/support/chaos.py checks every
scenario's figures.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

from forewarn.chaos.cli import render, run_chaos
from forewarn.chaos.lab import Lab
from forewarn.chaos.scenarios import SCENARIOS, Outcome, Scenario, by_name

from support.chaos import lab_for, params, run_and_check

REPORT: dict[str, Outcome] = {}


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    yield from lab_for(tmp_path_factory.mktemp("chaos"), REPORT, hardware=True)


@pytest.mark.timeout(200)
@params({"hardware", "training"})
def test_scenario_meets_its_expectation(lab: Lab, scenario: Scenario) -> None:
    run_and_check(lab, scenario, REPORT)


def test_every_scenario_runs_in_one_of_the_three_files() -> None:
    assert {s.rig for s in SCENARIOS} == {"hardware", "training", "telemetry", "store", "scale"}


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
