"""A real PostgreSQL server for tests, from the machine's binaries
(``/usr/lib/postgresql/*/bin`` or ``PATH``): :class:`forewarn.demo.servers.PostgresServer`
(``initdb`` into a temp dir, ``pg_ctl start`` on a free loopback port, trust auth, run as
the ``postgres`` user under root), which ``forewarn demo --scale-out`` uses too.
:meth:`PostgresServer.database` hands each test an empty database of its own;
:meth:`PostgresServer.restart` is a real ``pg_ctl restart``."""

from __future__ import annotations

from forewarn.demo.servers import PostgresServer, find_postgres_bin

__all__ = ["PostgresServer", "find_postgres_bin"]
