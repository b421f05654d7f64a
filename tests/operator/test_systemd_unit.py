"""deploy/forewarn-agent.service passes ``systemd-analyze verify`` (with ExecStart pointed
at this environment's ``forewarn`` as ``forewarn deploy install`` writes it, since verify
checks the binary exists) and keeps the settings the agent relies on; every path a
service writes is one its unit lets it write; the units' exposure score stays at or below
1.8 (collector) and 2.9 (agent)."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from support.paths import REPO

UNIT = REPO / "deploy" / "forewarn-agent.service"


def forewarn_binary() -> str:
    found = Path(sys.executable).parent / "forewarn"
    return str(found) if found.exists() else (shutil.which("forewarn") or "")


def verify(analyze: str, text: str, tmp_path: Path) -> tuple[int, list[str]]:
    """Run verify on ``text`` as a unit; return the exit status and the lines about it."""
    unit = tmp_path / "forewarn-agent.service"
    unit.write_text(text)
    r = subprocess.run([analyze, "verify", str(unit)],
                       capture_output=True, text=True, timeout=60)
    about = [line for line in (r.stdout + r.stderr).splitlines()
             if "forewarn-agent" in line]
    return r.returncode, about


def localised(unit: Path = UNIT) -> str:
    """The unit as ``forewarn deploy install`` writes it for this environment."""
    from forewarn.deploy.cli import render

    binary = forewarn_binary()
    assert binary, "the forewarn command is not installed in this environment"
    return render(unit.read_text(), binary)


@pytest.fixture
def analyze(require_binary: Callable[[str], str]) -> str:
    """systemd-analyze; skips when missing (fails under CI, see conftest)."""
    return require_binary("systemd-analyze")


def test_systemd_analyze_verify_passes(analyze: str, tmp_path: Path) -> None:
    rc, about = verify(analyze, localised(), tmp_path)
    assert rc == 0 and about == [], about


def test_verify_would_catch_a_broken_unit(analyze: str, tmp_path: Path) -> None:
    """The check above can fail: a misspelt key is reported about this unit."""
    _, about = verify(analyze, localised().replace("WatchdogSec=", "WatchdogSecs="), tmp_path)
    assert any("WatchdogSecs" in line for line in about), about


def test_unit_settings() -> None:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str  # type: ignore[assignment,method-assign]
    cp.read_string(UNIT.read_text())
    svc = cp["Service"]
    assert svc["Type"] == "notify" and int(svc["WatchdogSec"]) > 0
    assert svc["Restart"] == "on-failure" and svc["RestartPreventExitStatus"] == "2"
    assert svc["RuntimeDirectory"] == "forewarn" and svc["StateDirectory"] == "forewarn"
    for key, want in (("ProtectSystem", "strict"), ("ProtectHome", "yes"),
                      ("NoNewPrivileges", "yes"), ("PrivateTmp", "yes"),
                      ("ProtectKernelTunables", "yes"), ("DevicePolicy", "closed")):
        assert svc[key] == want, key
    assert set(svc["RestrictAddressFamilies"].split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    assert "CAP_SYSLOG" in svc["CapabilityBoundingSet"]
    # Reading the GPUs and the kernel log must stay possible.
    assert "PrivateDevices" not in svc and "ProtectKernelLogs" not in svc
    text = UNIT.read_text()
    for allow in ("DeviceAllow=char-nvidia-frontend rw", "DeviceAllow=/dev/nvidiactl rw",
                  "DeviceAllow=/dev/nvidia-uvm rw", "DeviceAllow=/dev/kmsg r"):
        assert allow in text


COLLECTOR_UNIT = UNIT.parent / "forewarn-collector.service"


def test_collector_unit_verifies(analyze: str, tmp_path: Path) -> None:
    unit = tmp_path / "forewarn-collector.service"
    unit.write_text(localised(COLLECTOR_UNIT))
    r = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                       timeout=60)
    about = [line for line in (r.stdout + r.stderr).splitlines() if "forewarn-collector" in line]
    assert r.returncode == 0 and about == [], about


def test_a_configuration_error_is_not_restarted_forever() -> None:
    """Exit 2 is a configuration error (or a missing extra): restarting will not fix it."""
    for unit in (UNIT, COLLECTOR_UNIT):
        svc = _service(unit)
        assert svc["Restart"] == "on-failure" and svc["RestartPreventExitStatus"] == "2", unit


def test_shipped_units_start_the_documented_venv() -> None:
    """As shipped, ExecStart is the README's venv (/opt/forewarn), never a /usr/bin that a
    pip install does not create; `deploy install` rewrites it for any other venv."""
    for unit, args in ((UNIT, "agent --config /etc/forewarn/agent.toml"),
                       (COLLECTOR_UNIT, "collector --config /etc/forewarn/collector.toml run")):
        assert f"ExecStart=/opt/forewarn/bin/forewarn {args}\n" in unit.read_text(), unit


def _service(unit: Path) -> configparser.SectionProxy:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str  # type: ignore[assignment,method-assign]
    cp.read_string(unit.read_text())
    return cp["Service"]


def _writable(unit: Path) -> list[Path]:
    """The paths a unit's service may write under ProtectSystem=strict."""
    svc = _service(unit)
    out = []
    for key, base in (("StateDirectory", "/var/lib"), ("RuntimeDirectory", "/run"),
                      ("LogsDirectory", "/var/log"), ("CacheDirectory", "/var/cache")):
        out += [Path(base) / d for d in svc.get(key, "").split()]
    return out + [Path(p) for p in svc.get("ReadWritePaths", "").split()]


def _covered(path: Path, unit: Path) -> bool:
    return any(path == w or w in path.parents for w in _writable(unit))


def test_every_path_the_collector_writes_is_writable_under_its_unit() -> None:
    """DynamicUser + ProtectSystem=strict: data_dir must be the StateDirectory, and the
    tokens file (rewritten by `token add`, read by the service's dynamic user) lives
    there too: the documented owner of both is the service's user."""
    from forewarn.collector.config import CollectorConfig
    from forewarn.config import load_config

    assert _service(COLLECTOR_UNIT)["DynamicUser"] == "yes"
    for config in (CollectorConfig(), load_config(
            CollectorConfig, service="collector", path=UNIT.parent / "collector.toml",
            env={})):
        assert _covered(config.data_dir, COLLECTOR_UNIT), config.data_dir
        assert _covered(config.tokens_file, COLLECTOR_UNIT), config.tokens_file
    example = (UNIT.parent / "collector.toml").read_text()
    assert "/var/lib/forewarn/" not in example, "an example path the service cannot write"


def test_every_path_the_agent_writes_is_writable_under_its_unit() -> None:
    from forewarn.agent.config import AgentConfig
    from forewarn.config import load_config

    for config in (AgentConfig(), load_config(AgentConfig, service="agent",
                                              path=UNIT.parent / "agent.toml", env={})):
        assert _covered(config.spool_dir, UNIT), config.spool_dir
        assert _covered(config.socket_path.parent, UNIT), config.socket_path


EXPOSURE = {COLLECTOR_UNIT: 1.8, UNIT: 2.9}  # systemd 252's score of the units before #13


@pytest.mark.parametrize("unit", list(EXPOSURE), ids=lambda u: u.name)
def test_exposure_stays_at_or_below_todays(analyze: str, tmp_path: Path, unit: Path) -> None:
    path = tmp_path / unit.name
    path.write_text(localised(unit))
    r = subprocess.run([analyze, "security", "--offline=yes", str(path)],
                       capture_output=True, text=True, timeout=60)
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d)", r.stdout + r.stderr)
    assert found, r.stdout + r.stderr
    assert float(found.group(1)) <= EXPOSURE[unit], r.stdout[-3000:]
