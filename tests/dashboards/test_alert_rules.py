"""The Prometheus alert rules are valid and every rule has a promtool unit test.

An operator checks the rules folder as a whole (``promtool check rules
dashboards/rules/*.yml``), so nothing but rule files may sit in it: the unit tests live in
``dashboards/rules_tests/``."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

from support.paths import REPO

RULES = REPO / "dashboards" / "rules"
RULE_TESTS = RULES.parent / "rules_tests"


def test_rules_check_and_unit_tests_pass(require_binary: Callable[[str], str]) -> None:
    promtool = require_binary("promtool")
    rule_files = sorted(str(p) for p in RULES.glob("*.yml"))
    check = subprocess.run([promtool, "check", "rules", *rule_files],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    test_files = sorted(str(p) for p in RULE_TESTS.glob("*.yml"))
    assert test_files, f"no promtool unit tests in {RULE_TESTS}"
    test = subprocess.run([promtool, "test", "rules", *test_files],
                          capture_output=True, text=True, timeout=60, cwd=RULE_TESTS)
    assert test.returncode == 0, test.stdout + test.stderr


def test_every_rule_is_tested_and_documented() -> None:
    rules = (RULES / "forewarn.rules.yml").read_text()
    tests = "".join(p.read_text() for p in RULE_TESTS.glob("*.yml"))
    names = re.findall(r"- alert: (\w+)", rules)
    assert len(names) >= 10
    for name in names:
        assert f"alertname: {name}" in tests, f"{name} has no promtool test"
    assert rules.count("description:") == len(names)
    assert rules.count("Runbook:") == len(names)


DEPLOY = RULES.parent.parent / "deploy"


def test_example_prometheus_and_alertmanager_configs_are_valid(
    require_binary: Callable[[str], str], tmp_path: Path
) -> None:
    promtool = require_binary("promtool")
    amtool = require_binary("amtool")
    # The example names the rules file at its installed path: point it at ours.
    prom = (DEPLOY / "prometheus.yml").read_text().replace(
        "/etc/prometheus/forewarn.rules.yml", str(RULES / "forewarn.rules.yml"))
    (tmp_path / "prometheus.yml").write_text(prom)
    check = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    am = (DEPLOY / "alertmanager.yml").read_text().replace(
        "/etc/alertmanager/forewarn-alert-token", str(tmp_path / "token"))
    (tmp_path / "token").write_text("secret\n")
    (tmp_path / "alertmanager.yml").write_text(am)
    check = subprocess.run([amtool, "check-config", str(tmp_path / "alertmanager.yml")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    routed = subprocess.run(
        [amtool, "config", "routes", "test", "--config.file", str(tmp_path / "alertmanager.yml"),
         "forewarn_action=checkpoint", "alertname=ForewarnGpuUnhealthy"],
        capture_output=True, text=True, timeout=60)
    assert "forewarn-collector" in routed.stdout, routed.stdout + routed.stderr
