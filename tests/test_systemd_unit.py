"""deploy/forewarn-agent.service passes ``systemd-analyze verify`` (with ExecStart pointed
at this environment's ``forewarn``, since verify checks the binary exists) and keeps the
settings the agent relies on."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent.parent / "deploy" / "forewarn-agent.service"


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


def localised() -> str:
    binary = forewarn_binary()
    assert binary, "the forewarn command is not installed in this environment"
    text = UNIT.read_text()
    assert "ExecStart=/usr/bin/forewarn agent --config /etc/forewarn/agent.toml" in text
    return text.replace("ExecStart=/usr/bin/forewarn", f"ExecStart={binary}")


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
    binary = forewarn_binary()
    text = COLLECTOR_UNIT.read_text()
    assert "ExecStart=/usr/bin/forewarn collector --config /etc/forewarn/collector.toml run" in text
    unit = tmp_path / "forewarn-collector.service"
    unit.write_text(text.replace("ExecStart=/usr/bin/forewarn", f"ExecStart={binary}"))
    r = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                       timeout=60)
    about = [line for line in (r.stdout + r.stderr).splitlines() if "forewarn-collector" in line]
    assert r.returncode == 0 and about == [], about
