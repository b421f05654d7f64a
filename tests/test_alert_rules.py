"""The Prometheus alert rules are valid and every rule has a promtool unit test."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

RULES = Path(__file__).resolve().parent.parent / "dashboards" / "rules"


def test_rules_check_and_unit_tests_pass(require_binary: Callable[[str], str]) -> None:
    promtool = require_binary("promtool")
    check = subprocess.run([promtool, "check", "rules", str(RULES / "forewarn.rules.yml")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    test = subprocess.run([promtool, "test", "rules", str(RULES / "forewarn.rules.test.yml")],
                          capture_output=True, text=True, timeout=60, cwd=RULES)
    assert test.returncode == 0, test.stdout + test.stderr


def test_every_rule_is_tested_and_documented() -> None:
    rules = (RULES / "forewarn.rules.yml").read_text()
    tests = (RULES / "forewarn.rules.test.yml").read_text()
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
