"""A running collector picks up the model registry's current version without a restart:
``forewarn models retrain`` promoting a candidate, or ``forewarn models rollback``, changes
the model the live predictor scores with at its next scoring (docs/models.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from forewarn.cli import main
from forewarn.collector.http.auth import add_token
from forewarn.models.persist import load_default_model
from forewarn.models.registry import ModelRegistry

from support.polling import START_TIMEOUT_S
from support.stack import Processes, start_collector

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
    tokens = tmp_path / "tokens.toml"
    add_token(tokens, "n1")
    procs = Processes(tmp_path)
    try:
        url = start_collector(procs, tokens, data_dir=str(data), predict_interval_s=0.5)
        procs.wait_for("the shipped model running",
                       lambda: _predictor(url).get("detail") == "model default",
                       START_TIMEOUT_S + 120)
        registry = ModelRegistry(data / "models")
        assert registry.add(load_default_model(), promote=True,
                            reason="test: a retrained candidate") == 1
        got = procs.wait_for("the promoted version running",
                             lambda: (p := _predictor(url)).get("detail") == "model registry v1"
                             and p, 120)
        assert got["ready"] is True
        # The operator's rollback, through the CLI as they run it.
        assert main(["models", "rollback", "0", "--registry", str(data / "models")]) == 0
        procs.wait_for("the rolled-back version running",
                       lambda: _predictor(url).get("detail") == "model default", 120)
        assert procs.procs["collector"].poll() is None  # the same process throughout
    finally:
        procs.close()
