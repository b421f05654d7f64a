"""``forewarn demo --scale-out --fast`` end to end: on real nats-server, PostgreSQL and
VictoriaMetrics with two collector replicas, the leader SIGKILLed mid-run. Its numbers hold
together (the other replica leads within 5 s, every order delivered, every telemetry sample
in the series store once), nothing it started is left running (also after Ctrl-C), and a
missing server is named with its Debian package."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from forewarn.cli import main
from forewarn.demo import servers

from support.leftovers import wait_gone, wait_started

pytest.importorskip("torch")


@pytest.fixture
def installed(require_binary: object) -> None:
    """The three servers; skip (fail under CI) when one is missing."""
    for binary in ("nats-server", "victoria-metrics"):
        try:
            servers.find_binary(binary)
        except servers.MissingServer:
            require_binary(binary)  # type: ignore[operator]
    if servers.find_postgres_bin() is None:
        require_binary("pg_ctl")  # type: ignore[operator]


def _postgres_dir(out: str) -> str:
    m = re.search(r"PostgreSQL data in (\S+)", out)
    assert m, out[-3000:]
    return m.group(1)


@pytest.mark.timeout(420)
def test_scale_out_demo_numbers_hold_and_nothing_is_left_running(
        tmp_path: Path, installed: None) -> None:
    work = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "forewarn", "demo", "--scale-out", "--fast", "--workdir",
         str(work), "--json"], capture_output=True, text=True, timeout=400)
    out = proc.stdout
    assert proc.returncode == 0, out[-5000:] + proc.stderr[-3000:]
    r = json.loads(out.strip().splitlines()[-1])
    assert r["problems"] == []
    # the leader was killed and the other replica took over within 5 s
    assert r["killed_replica"] and r["new_leader"] and r["killed_replica"] != r["new_leader"]
    assert r["failover_s"] is not None and 0 < r["failover_s"] < 5
    # the new leader ordered the checkpoint: one order per node, each acknowledged, and
    # every rank saved the same step before the failure
    # (one order per node for the precursor; the double-bit error that follows escalates the
    # incident and may order again)
    assert r["orders_issued"] in (2, 4) and r["orders_delivered"] == r["orders_issued"]
    assert len(r["ordered_steps"]) == 2 and len(set(r["ordered_steps"].values())) == 1
    assert set(r["resumed_ranks"].values()) == set(r["ordered_steps"].values())
    # every batch the agents sealed is in PostgreSQL, every sample in VictoriaMetrics once
    assert r["batches_sealed"] == r["batches_stored"] > 0
    assert r["samples_sent"] == r["samples_stored"] > 0
    assert r["samples_lost"] == 0 and r["samples_duplicated"] == 0
    assert (f"telemetry samples         {r['samples_sent']} sent, {r['samples_stored']} "
            "stored") in out
    assert wait_gone(str(work)) == []
    assert wait_gone(_postgres_dir(out)) == []


@pytest.mark.timeout(180)
def test_ctrl_c_stops_every_server_and_replica(tmp_path: Path, installed: None) -> None:
    work = tmp_path / "demo"
    proc = subprocess.Popen(
        [sys.executable, "-m", "forewarn", "demo", "--scale-out", "--fast", "--workdir",
         str(work)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout is not None
    seen = ""
    for line in proc.stdout:
        seen += line
        if "two collector replicas" in line:
            break
    assert wait_started(str(work)), "the demo should have started its processes"
    pg = _postgres_dir(seen)
    assert wait_started(pg), "PostgreSQL should be running"
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=90)[0]
    assert proc.returncode == 130, rest
    assert "interrupted" in rest
    assert wait_gone(str(work)) == []
    assert wait_gone(pg) == []


def test_a_missing_server_is_named_with_its_package(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    # a machine without the servers: nothing on PATH or in the usual folders
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(servers, "SEARCH_DIRS", (str(tmp_path),))
    monkeypatch.setattr(servers, "POSTGRES_DIRS", str(tmp_path / "postgresql" / "*" / "bin"))
    assert main(["demo", "--scale-out", "--fast", "--workdir", str(tmp_path / "w")]) == 2
    out = capsys.readouterr().err
    for binary, package in (("nats-server", "nats-server"), ("pg_ctl", "postgresql"),
                            ("victoria-metrics", "victoria-metrics")):
        assert f"{binary} is not installed: install the Debian package '{package}'" in out
    assert "Traceback" not in out
    assert not (tmp_path / "w").exists(), "nothing starts when a server is missing"
