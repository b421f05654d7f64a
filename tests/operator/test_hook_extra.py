"""The checkpoint writer's requirement is declared and checked where it can be acted on:
``torch.distributed.checkpoint`` saves with numpy, so ``CheckpointWriter`` needs the
``forewarn[hook]`` extra and says so when it is constructed, not at the first ordered
save (which would crash every rank of the job)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CONSTRUCT = """
import sys
from forewarn.hook import CheckpointWriter
try:
    CheckpointWriter(sys.argv[1])
except ImportError as exc:
    print(f"{type(exc).__name__}: {exc}")
    sys.exit(3)
"""


def test_hook_extra_declares_numpy() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(req.startswith("numpy") for req in extras["hook"]), extras.get("hook")


def test_writer_without_numpy_fails_at_construction_naming_the_extra(tmp_path: Path) -> None:
    blocked = tmp_path / "blocked" / "numpy"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "blocked"))
    r = subprocess.run([sys.executable, "-c", CONSTRUCT, str(tmp_path / "ckpt")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "pip install 'forewarn[hook]'" in r.stdout and "numpy" in r.stdout, r.stdout


def test_writer_with_numpy_constructs(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", CONSTRUCT, str(tmp_path / "ckpt")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
