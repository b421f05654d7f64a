"""A command whose extra is not installed says which extra to install, in one line, and
exits 2: no traceback. Absence is simulated honestly and cheaply: a folder first on
PYTHONPATH holds a package of the module's name whose import fails exactly as a missing
module's does (ModuleNotFoundError with its name)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _without(tmp_path: Path, module: str) -> dict[str, str]:
    """The environment of a Python that cannot import ``module``."""
    blocked = tmp_path / "blocked" / module
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text(
        f"raise ModuleNotFoundError(\"No module named '{module}'\", name='{module}')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(tmp_path / "blocked"), env.get("PYTHONPATH")) if p)
    return env


def _forewarn(tmp_path: Path, module: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "forewarn", *argv], capture_output=True,
                          text=True, timeout=120, env=_without(tmp_path, module), cwd=tmp_path)


@pytest.mark.parametrize(("module", "argv", "extra"), [
    ("starlette", ("collector", "--data-dir", "data", "--tokens-file", "tokens.toml",
                   "--listen", "127.0.0.1:0", "run"), "collector"),
    ("uvicorn", ("collector", "--data-dir", "data", "--tokens-file", "tokens.toml",
                 "--listen", "127.0.0.1:0", "run"), "collector"),
    ("grafana_client", ("dashboards", "push", "--url", "http://127.0.0.1:9",
                        "--token", "t"), "grafana"),
    ("rich", ("demo", "--fast"), "demo"),
])
def test_missing_extra_is_one_line_and_exit_2(tmp_path: Path, module: str,
                                              argv: tuple[str, ...], extra: str) -> None:
    r = _forewarn(tmp_path, module, *argv)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert f"pip install 'forewarn[{extra}]'" in lines[0] and module in lines[0], lines


def test_demo_without_torch_says_so_before_starting_anything(tmp_path: Path) -> None:
    """Without torch the demo's job could never start: it says so at once instead of
    restarting a failing job."""
    r = _forewarn(tmp_path, "torch", "demo", "--fast", "--workdir", str(tmp_path / "demo"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install torch" in lines[0], r.stderr
    assert not (tmp_path / "demo" / "collector").exists(), "it started the demo anyway"

