"""The ``forewarn`` command's own costs: what starting one subcommand imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# The chaos and demo commands' modules register their flags (``forewarn --help`` lists
# them); their labs, scenarios, launchers and servers are imported when they run.
REGISTRATION_ONLY = {"forewarn.chaos", "forewarn.chaos.cli", "forewarn.demo",
                     "forewarn.demo.cli"}


@pytest.mark.parametrize("service", ["agent", "collector"])
def test_daemon_start_path_does_not_import_chaos_or_demo(service: str, tmp_path: Path) -> None:
    """``forewarn agent`` / ``forewarn collector`` build the whole parser; that must not
    pay for the chaos suite, the demo or their process launching (forewarn.spawn; they
    used to be imported at parser build, about 60 ms of the ~150 ms it takes)."""
    argv = [service, "--config", str(tmp_path / "missing.toml")]
    code = ("import sys\nfrom forewarn.cli import main\n"
            f"print(main({argv!r}))\n"
            "print(' '.join(sorted(n for n in sys.modules\n"
            "                      if n.startswith(('forewarn.chaos', 'forewarn.demo',\n"
            "                                       'forewarn.spawn')))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    rc, modules = r.stdout.splitlines()
    assert rc == "2", r.stderr  # the start path ran up to the missing config file
    assert "missing.toml" in r.stderr
    assert set(modules.split()) == REGISTRATION_ONLY
