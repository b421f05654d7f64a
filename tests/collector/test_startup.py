"""The collector's start does not wait for the model stack: building the app (config,
store, policy with the failure predictor) imports neither scikit-learn, skops, pandas nor
torch on the starting thread; the shipped model loads on a thread of its own and
``/readyz`` says when prediction is ready."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from forewarn.spawn.commands import collector_command

from support.polling import free_port, poll

HEAVY = ("sklearn", "skops", "pandas", "torch")

# Records which thread first imports each heavy package, then builds the app as
# `forewarn collector run` does and waits for the model to load.
PROBE = textwrap.dedent("""
    import json, sys, threading, time
    from pathlib import Path
    HEAVY = {heavy!r}
    first = {{}}

    class Watch:
        def find_spec(self, name, path=None, target=None):
            top = name.partition(".")[0]
            if top in HEAVY and top not in first:
                first[top] = threading.current_thread().name
            return None

    sys.meta_path.insert(0, Watch())
    from forewarn.collector.config import CollectorConfig
    from forewarn.collector.decide.policy_service import PolicyService
    from forewarn.collector.http.app import create_app
    from forewarn.collector.storage.state import open_state

    config = CollectorConfig(data_dir=Path({data!r}))
    create_app(config, open_state(config), policy=PolicyService.from_config(config))
    on_main = sorted(k for k, v in first.items() if v == threading.main_thread().name)
    deadline = time.monotonic() + 300
    while "sklearn" not in first and time.monotonic() < deadline:
        time.sleep(0.05)
    print(json.dumps({{"on_main": on_main, "first": first}}))
""")


@pytest.mark.timeout(400)
def test_building_the_collector_imports_no_model_stack(tmp_path: Path) -> None:
    code = PROBE.format(heavy=HEAVY, data=str(tmp_path / "data"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=360)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["on_main"] == [], got
    # the model stack is still loaded, in the background
    assert got["first"]["sklearn"] == "forewarn-model-load", got


def _get(url: str) -> tuple[int, object]:
    try:
        r = httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return 0, None
    return r.status_code, r.json() if r.headers.get("content-type", "").startswith(
        "application/json") else r.text


@pytest.mark.system
@pytest.mark.timeout(300)
def test_readyz_says_when_the_predictor_is_ready(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "collector.toml"
    config.write_text(f'listen = "127.0.0.1:{port}"\ndata_dir = "{tmp_path / "data"}"\n'
                      'log_level = "warning"\n')
    log = (tmp_path / "collector.log").open("wb")
    proc = subprocess.Popen(collector_command(config), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def ready() -> object:
            assert proc.poll() is None, (tmp_path / "collector.log").read_text()
            code, body = _get(url + "/readyz")
            return code == 200 and body

        body = poll(ready, 240, 0.2)
        assert isinstance(body, dict), _get(url + "/readyz")
        predictor = body["components"]["predictor"]
        assert predictor["ready"] is True and "default" in predictor["detail"], predictor
        # what /readyz promised: the model answers
        code, risk = _get(url + "/api/v1/risk")
        assert code == 200 and isinstance(risk, dict) and risk["model"]["loaded"], risk
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
