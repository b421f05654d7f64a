"""A running collector picks up the model registry's current version without a restart:
``forewarn models retrain`` promoting a candidate, or ``forewarn models rollback``, changes
the model the live predictor scores with at its next scoring (docs/models.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from forewarn.cli import main
from forewarn.collector.http.auth import add_token
from forewarn.models.persist import load_default_model
from forewarn.models.registry import ModelRegistry

from support.polling import START_TIMEOUT_S, free_port, wait_for

pytestmark = [pytest.mark.system, pytest.mark.timeout(600)]


def _predictor(url: str) -> dict[str, Any]:
    try:
        body = httpx.get(f"{url}/readyz", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}
    got: dict[str, Any] = body.get("components", {}).get("predictor", {})
    return got


def test_a_promotion_and_a_rollback_reach_the_running_collector(tmp_path: Path) -> None:
    data = tmp_path / "data"
    port = free_port()
    tokens = tmp_path / "tokens.toml"
    add_token(tokens, "n1")
    config = tmp_path / "collector.toml"
    config.write_text(f'listen = "127.0.0.1:{port}"\ndata_dir = "{data}"\n'
                      f'tokens_file = "{tokens}"\npredict_interval_s = 0.5\n')
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "forewarn", "collector", "--config",
                             str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_for(lambda: _predictor(url).get("detail") == "model default",
                 START_TIMEOUT_S + 120, "the shipped model running")
        registry = ModelRegistry(data / "models")
        assert registry.add(load_default_model(), promote=True,
                            reason="test: a retrained candidate") == 1
        got = wait_for(lambda: (p := _predictor(url)).get("detail") == "model registry v1"
                       and p, 120, "the promoted version running")
        assert got["ready"] is True
        # The operator's rollback, through the CLI as they run it.
        assert main(["models", "rollback", "0", "--registry", str(data / "models")]) == 0
        wait_for(lambda: _predictor(url).get("detail") == "model default", 120,
                 "the rolled-back version running")
        assert proc.poll() is None  # the same process throughout: no restart
    finally:
        proc.terminate()
        proc.wait(timeout=60)
