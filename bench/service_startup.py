"""Start-up time of the real services: from spawning ``forewarn collector run`` (default
config: the predictor on, the shipped model) to its first 200 on ``/healthz`` and on
``/readyz``, and from spawning ``forewarn agent --source sim`` to its ``/healthz``.

``--python`` picks the interpreter, so two installs (e.g. main's venv and a branch's)
are compared in the same minutes: ``--python A --python B`` alternates them.

    python bench/service_startup.py --runs 2 --python /work/main/.venv/bin/python \\
        --python .venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return None


def timed(argv: list[str], urls: list[str], env: dict[str, str] | None = None,
          limit_s: float = 180.0) -> list[float | None]:
    """Seconds from spawning ``argv`` until each of ``urls`` (in turn) first answers 200."""
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env)
    out: list[float | None] = []
    try:
        for url in urls:
            while time.monotonic() - t0 < limit_s and status(url) != 200:
                time.sleep(0.05)
            out.append(round(time.monotonic() - t0, 2) if status(url) == 200 else None)
    finally:
        proc.terminate()
        proc.wait(30)
    return out


def collector(python: str) -> dict[str, float | None]:
    d = Path(tempfile.mkdtemp(prefix="fw-start-"))
    port = free_port()
    cfg = d / "collector.toml"
    cfg.write_text(f'listen = "127.0.0.1:{port}"\ndata_dir = "{d / "data"}"\n'
                   'log_level = "warning"\n')
    url = f"http://127.0.0.1:{port}"
    health, ready = timed([python, "-m", "forewarn", "collector", "--config", str(cfg), "run"],
                          [url + "/healthz", url + "/readyz"])
    return {"collector_healthz_s": health, "collector_readyz_s": ready}


def agent(python: str) -> dict[str, float | None]:
    d = tempfile.mkdtemp(prefix="fw-start-")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FOREWARN_")}
    env.update(FOREWARN_AGENT_SPOOL_DIR=d + "/spool", FOREWARN_AGENT_WATCHDOG="0")
    (health,) = timed([python, "-m", "forewarn", "agent", "--node", "n1", "--listen",
                       f"127.0.0.1:{port}", "--no-kmsg", "--source", "sim", "--socket",
                       d + "/agent.sock"], [f"http://127.0.0.1:{port}/healthz"], env)
    return {"agent_healthz_s": health}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--python", action="append", default=[])
    args = ap.parse_args()
    for i in range(args.runs):
        for python in args.python or ["python"]:
            row = {"run": i, "python": python, **collector(python), **agent(python),
                   "load": round(os.getloadavg()[0], 1)}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
