"""The fault-injection suite (``forewarn chaos``), part 2: the scenarios on the telemetry
path and the store (collector, agents on simulated nodes); tests/support/chaos.py checks
every scenario's figures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("torch")

from forewarn.chaos.lab import Lab
from forewarn.chaos.scenarios import Outcome, Scenario

from support.chaos import lab_for, params, run_and_check

REPORT: dict[str, Outcome] = {}


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    yield from lab_for(tmp_path_factory.mktemp("chaos"), REPORT)


@pytest.mark.timeout(200)
@params({"telemetry", "store"})
def test_scenario_meets_its_expectation(lab: Lab, scenario: Scenario) -> None:
    run_and_check(lab, scenario, REPORT)
