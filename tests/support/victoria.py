"""A real VictoriaMetrics single-node server for tests (``victoria-metrics`` from the
machine), on a free loopback port with its data in a temp dir: the Prometheus-compatible
series store that the collector's remote write feeds."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import httpx

from support.polling import free_port, wait_for

__all__ = ["VictoriaMetrics"]


class VictoriaMetrics:
    """``victoria-metrics`` serving ``url``; :meth:`stop` removes its data."""

    def __init__(self, binary: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="forewarn-vm-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.write_url = f"{self.url}/api/v1/write"
        # Data visible to queries at once (the default waits 30 s for late samples). No
        # deduplication: a sample sent twice shows twice in /api/v1/export.
        self.proc = subprocess.Popen(
            [binary, f"-storageDataPath={self.dir}", f"-httpListenAddr=127.0.0.1:{self.port}",
             "-search.latencyOffset=0s", "-search.disableCache", "-loggerLevel=ERROR"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self._healthy, what="victoria-metrics start")

    def _healthy(self) -> bool:
        assert self.proc.poll() is None, "victoria-metrics exited"
        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant PromQL query; the result vector."""
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        r.raise_for_status()
        body = r.json()
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def export(self, match: str) -> list[dict[str, Any]]:
        """Every raw sample of the series ``match`` selects (``/api/v1/export``)."""
        httpx.get(f"{self.url}/internal/force_flush", timeout=10)
        r = httpx.get(f"{self.url}/api/v1/export", params={"match[]": match}, timeout=10)
        r.raise_for_status()
        return [json.loads(line) for line in r.text.splitlines() if line.strip()]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
