"""A real PostgreSQL server for tests, from the machine's binaries
(``/usr/lib/postgresql/*/bin`` or ``PATH``): ``initdb`` into a temp dir, ``pg_ctl start`` on a
free loopback port, trust auth (loopback only). As root, the server runs as the
``postgres`` user (it refuses root). :meth:`PostgresServer.database` hands each test an
empty database of its own; :meth:`restart` is a real ``pg_ctl restart``."""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from support.polling import free_port

__all__ = ["PostgresServer", "find_postgres_bin"]


def find_postgres_bin() -> Path | None:
    """The folder holding ``initdb``, ``pg_ctl`` and ``postgres``, or None."""
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).parent
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if Path(folder, "pg_ctl").exists():
            return Path(folder)
    return None


class PostgresServer:
    """One PostgreSQL cluster in a temp dir; :meth:`stop` removes it."""

    def __init__(self, bin_dir: Path, *, fsync: bool = False) -> None:
        self.bin = bin_dir
        self.fsync = fsync
        self.root = Path(tempfile.mkdtemp(prefix="forewarn-pg-"))
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
                       capture_output=True, timeout=120)

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
