"""``forewarn deploy`` details that need no built wheel: ``--dry-run`` writes nothing and
says what it would do, ``print`` renders a unit with this installation's ``forewarn`` and
names the shipped files when asked for another."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _forewarn(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "forewarn", *argv], capture_output=True,
                          text=True, timeout=120)


def test_dry_run_writes_nothing(tmp_path: Path) -> None:
    r = _forewarn("deploy", "install", "--role", "agent", "--prefix", str(tmp_path / "root"),
                  "--dry-run")
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "root").exists()
    lines = r.stdout.splitlines()
    assert any(line.startswith("would write") and "forewarn-agent.service" in line
               for line in lines), lines
    assert any(line.startswith("would create") and "/var/lib/forewarn" in line
               for line in lines), lines


def test_print_renders_the_unit_for_this_installation() -> None:
    r = _forewarn("deploy", "print", "forewarn-collector.service")
    assert r.returncode == 0, r.stderr
    exec_start = next(line for line in r.stdout.splitlines() if line.startswith("ExecStart="))
    assert exec_start.split()[0] == f"ExecStart={Path(sys.executable).parent / 'forewarn'}"


def test_print_of_an_unknown_file_names_the_shipped_ones() -> None:
    r = _forewarn("deploy", "print", "../../etc/passwd")
    assert r.returncode == 2
    assert "agent.toml" in r.stderr and "prometheus.yml" in r.stderr
    assert r.stdout == ""


def test_print_gives_the_prometheus_alert_rules_the_repository_checks() -> None:
    """The rules that deploy/prometheus.yml loads ship with the package: an operator who
    installed only the wheel prints them (the same file promtool checks in dashboards/rules/)."""
    from support.paths import REPO

    r = _forewarn("deploy", "print", "rules/forewarn.rules.yml")
    assert r.returncode == 0, r.stderr
    assert r.stdout == (REPO / "dashboards" / "rules" / "forewarn.rules.yml").read_text()


def test_agent_install_writes_the_sysctl_file_that_raises_the_socket_queue(
        tmp_path: Path) -> None:
    """The hooks' datagrams queue on the agent socket up to net.unix.max_dgram_qlen (10 by
    default): the agent's install raises it to what the agent checks for. Under --prefix
    (a package root) it is written, not applied to this machine."""
    from forewarn.agent.socket_queue import RECOMMENDED, SYSCTL_FILE

    root = tmp_path / "root"
    r = _forewarn("deploy", "install", "--role", "agent", "--prefix", str(root))
    assert r.returncode == 0, r.stderr
    conf = root / SYSCTL_FILE.lstrip("/")
    settings = [line.split("=") for line in conf.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert [(k.strip(), v.strip()) for k, v in settings] == [
        ("net.unix.max_dgram_qlen", str(RECOMMENDED))]
    assert conf.stat().st_mode & 0o777 == 0o644
    assert any("not applied (--prefix)" in line and str(conf) in line
               for line in r.stdout.splitlines()), r.stdout
    collector = tmp_path / "collector-root"
    r = _forewarn("deploy", "install", "--role", "collector", "--prefix", str(collector))
    assert r.returncode == 0, r.stderr
    assert not (collector / SYSCTL_FILE.lstrip("/")).exists()
