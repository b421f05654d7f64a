"""The scale-out mode's three servers, started from this machine's installed binaries: a
NATS JetStream server (or a cluster of them on loopback), PostgreSQL (``initdb`` +
``pg_ctl`` in a folder of its own) and VictoriaMetrics. ``forewarn demo --scale-out``, the
chaos suite and the tests' fixtures all start them here.

A binary that is not installed raises :class:`MissingServer`, whose message names the
Debian package to install. Every server listens on loopback only, on a free port, and
:meth:`stop` ends it and everything it started.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import itertools
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from forewarn.demo.launch import free_port
from forewarn.errors import UnavailableError
from forewarn.spawn.procs import log_tail, wait_http, wait_ready

__all__ = ["MissingServer", "NatsServer", "PostgresServer", "VictoriaMetrics", "find_binary",
           "find_postgres_bin", "nats_cluster", "scale_out_missing",
           "start_nats", "start_nats_cluster"]

PACKAGES = {"nats-server": "nats-server", "victoria-metrics": "victoria-metrics",
            "pg_ctl": "postgresql"}
"""The Debian package that installs each binary."""

SEARCH_DIRS = ("/usr/sbin", "/usr/bin", "/usr/local/bin", "/usr/local/sbin")
"""Where binaries are looked for after ``PATH`` (Debian puts nats-server in /usr/sbin,
which not every user's PATH has)."""
POSTGRES_DIRS = "/usr/lib/postgresql/*/bin"
"""Where Debian installs PostgreSQL's server binaries (not on PATH)."""


class MissingServer(UnavailableError, RuntimeError):
    """A server binary is not installed; the message names the package to install."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.package = PACKAGES.get(binary, binary)
        super().__init__(f"{binary} is not installed: install the Debian package "
                         f"{self.package!r} (apt install {self.package})")


MODULES = {"psycopg": "scale", "psycopg_pool": "scale", "cramjam": "scale", "nats": "bus"}
"""Python modules the scale-out mode needs, and the extra of forewarn that installs each."""


def scale_out_missing() -> list[str]:
    """What this machine lacks to run the scale-out mode's servers and clients, one
    message each (empty: all there)."""
    import importlib.util

    problems = []
    for binary in ("nats-server", "victoria-metrics"):
        try:
            find_binary(binary)
        except MissingServer as exc:
            problems.append(str(exc))
    if find_postgres_bin() is None:
        problems.append(str(MissingServer("pg_ctl")))
    extras = sorted({extra for module, extra in MODULES.items()
                     if importlib.util.find_spec(module) is None})
    if extras:
        problems.append(f"the Python packages of forewarn[{','.join(extras)}] are not "
                        f"installed: pip install 'forewarn[{','.join(extras)}]'")
    return problems


def find_binary(name: str) -> str:
    """The installed ``name`` (``PATH``, then the sbin folders not every PATH has)."""
    found = shutil.which(name) or next(
        (f"{d}/{name}" for d in SEARCH_DIRS if os.access(f"{d}/{name}", os.X_OK)), None)
    if found is None:
        raise MissingServer(name)
    return found


def find_postgres_bin() -> Path | None:
    """The folder holding ``initdb``, ``pg_ctl`` and ``postgres``, or None."""
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    for folder in sorted(glob.glob(POSTGRES_DIRS), reverse=True):
        if Path(folder, "pg_ctl").exists():
            return Path(folder)
    return None


def _listening(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=0.2):
        return True


def _end(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


# --------------------------------------------------------------------------- NATS

@dataclasses.dataclass
class NatsServer:
    """One nats-server process with a fixed port and JetStream store (restartable: stop or
    kill it and :meth:`start` it again on the same port and store)."""

    name: str
    root: Path
    port: int
    config: str
    binary: str = ""
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.root / f"{self.name}.log"

    def start(self, *, wait_s: float = 20.0) -> NatsServer:
        conf = self.root / f"{self.name}.conf"
        conf.write_text(self.config)
        with self.log.open("ab") as log:
            # a session of its own: a terminal's Ctrl-C reaches the demo, which stops it
            self.proc = subprocess.Popen([self.binary or find_binary("nats-server"), "-c",
                                          str(conf)], stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        wait_ready(lambda: _listening(self.port), wait_s, self.proc, self.log,
                   f"nats-server {self.name}")
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        _end(self.proc, sig)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: the server dies at once."""
        self.stop(signal.SIGKILL)

    def log_tail(self) -> str:
        return log_tail(self.log)


def _nats_config(name: str, root: Path, port: int, authorization: str = "",
                 cluster: str = "", extra: str = "") -> str:
    store = root / f"{name}-js"
    return (f'server_name: "{name}"\nlisten: "127.0.0.1:{port}"\n'
            f'jetstream {{ store_dir: "{store}" }}\n{cluster}{authorization}{extra}')


def start_nats(root: Path, *, authorization: str = "", name: str = "nats", extra: str = "",
               binary: str = "") -> NatsServer:
    """One JetStream server on a free loopback port, its store and log under ``root``;
    ``authorization``: an ``authorization {}`` block; ``extra``: more config lines."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    return NatsServer(name, root, port, _nats_config(name, root, port, authorization,
                                                     extra=extra), binary).start()


def nats_cluster(root: Path, size: int = 3, *, authorization: str = "",
                 binary: str = "") -> list[NatsServer]:
    """A ``size``-server JetStream cluster on loopback, not started yet (start each)."""
    root.mkdir(parents=True, exist_ok=True)
    ports = [(free_port(), free_port()) for _ in range(size)]
    servers = []
    for i, (port, cport) in enumerate(ports):
        routes = ", ".join(f'"nats://127.0.0.1:{c}"' for j, (_p, c) in enumerate(ports)
                           if j != i)
        cluster = (f'cluster {{ name: "fw"\n listen: "127.0.0.1:{cport}"\n'
                   f' routes: [{routes}] }}\n')
        servers.append(NatsServer(f"n{i}", root, port,
                                  _nats_config(f"n{i}", root, port, authorization, cluster),
                                  binary))
    return servers


@contextlib.contextmanager
def start_nats_cluster(root: Path, size: int = 3, *, authorization: str = "",
                       binary: str = "") -> Iterator[list[NatsServer]]:
    """:func:`nats_cluster`, started; every server stopped at the end."""
    servers = nats_cluster(root, size, authorization=authorization, binary=binary)
    try:
        for s in servers:
            s.start()
        yield servers
    finally:
        for s in servers:
            s.stop()


# --------------------------------------------------------------------------- PostgreSQL

class PostgresServer:
    """One PostgreSQL cluster: ``initdb`` into ``root`` (default: a new temp dir), then
    ``pg_ctl start`` on a free loopback port with trust authentication (loopback only).
    As root, the server runs as the ``postgres`` user (it refuses root), so ``root`` must
    be a folder that user can reach. :meth:`stop` removes the folder."""

    def __init__(self, bin_dir: Path | None = None, *, root: Path | None = None,
                 fsync: bool = False) -> None:
        found = bin_dir or find_postgres_bin()
        if found is None:
            raise MissingServer("pg_ctl")
        self.bin = found
        self.fsync = fsync
        self.root = root or Path(tempfile.mkdtemp(prefix="forewarn-pg-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.data = self.root / "data"
        self.port = free_port()
        self._names = itertools.count()
        self._user: list[str] = []
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            self._user = ["runuser", "-u", "postgres", "--"]
        os.chmod(self.root, 0o755)
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres",
                  "--no-sync", "-E", "UTF8")
        self.start()

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run([*self._user, str(self.bin / tool), *args], check=True,
                       capture_output=True, timeout=120, start_new_session=True)

    def _ctl(self, action: str) -> None:
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 "
                   f"-c unix_socket_directories={self.root} "
                   f"-c fsync={'on' if self.fsync else 'off'} "
                   "-c max_connections=200")
        self._run("pg_ctl", action, "-D", str(self.data), "-w", "-t", "60", "-o", options,
                  "-l", str(self.root / "log"), *(["-m", "fast"] if action != "start" else []))

    def start(self) -> None:
        self._ctl("start")

    def restart(self) -> None:
        """A real ``pg_ctl restart -m fast``: every session is cut."""
        self._ctl("restart")

    def halt(self) -> None:
        """``pg_ctl stop -m fast``, keeping the data: every session is cut, and the
        server stays down until :meth:`start`."""
        self._ctl("stop")

    def pid(self) -> int:
        """The postmaster's process id."""
        return int((self.data / "postmaster.pid").read_text().split()[0])

    def dsn(self, dbname: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={dbname}"

    def database(self) -> str:
        """A new, empty database; returns its DSN."""
        import psycopg

        name = f"t{next(self._names)}"
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}".encode())
        return self.dsn(name)

    def stop(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self._run("pg_ctl", "stop", "-D", str(self.data), "-m", "immediate", "-w")
        shutil.rmtree(self.root, ignore_errors=True)


# --------------------------------------------------------------------------- VictoriaMetrics

class VictoriaMetrics:
    """``victoria-metrics`` serving :attr:`url`, its data in ``root`` (default: a new temp
    dir, removed by :meth:`stop`). Data is visible to queries at once (the default hides
    the last 30 s). Run as docs/scale.md tells operators to, with
    ``-dedup.minScrapeInterval=1ms``: a sample written again (the same series and
    millisecond: a retried request, a batch the bus delivered again) is kept once, also in
    :meth:`export`; without it, VictoriaMetrics keeps every copy."""

    def __init__(self, binary: str = "", root: Path | None = None) -> None:
        self.dir = root or Path(tempfile.mkdtemp(prefix="forewarn-vm-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.write_url = f"{self.url}/api/v1/write"
        log = self.dir / "victoria-metrics.log"
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [binary or find_binary("victoria-metrics"), f"-storageDataPath={self.dir}",
                 f"-httpListenAddr=127.0.0.1:{self.port}", "-search.latencyOffset=0s",
                 "-search.disableCache", "-dedup.minScrapeInterval=1ms", "-loggerLevel=ERROR"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        wait_http(self.url + "/health", 30, self.proc, log)

    def _get(self, path: str, **params: str) -> bytes:
        query = "?" + urllib.parse.urlencode(params) if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as r:
            body: bytes = r.read()
            return body

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant PromQL query; the result vector."""
        body = json.loads(self._get("/api/v1/query", query=expr))
        if body.get("status") != "success":
            raise RuntimeError(f"victoria-metrics query {expr!r}: {body}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def export(self, match: str) -> list[dict[str, Any]]:
        """Every raw sample of the series ``match`` selects (``/api/v1/export``)."""
        self._get("/internal/force_flush")
        text = self._get("/api/v1/export", **{"match[]": match}).decode()
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def stop(self) -> None:
        _end(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)
