"""``forewarn collector``: run the collector service; ``forewarn collector token add NODE``.

``forewarn collector [run] [--config PATH] [--listen HOST:PORT] [--data-dir DIR] ...``
serves the API under uvicorn (TLS when ``certfile``/``keyfile`` are set).
``forewarn collector token add NODE`` enrols a node's agent: it stores the SHA-256 of a
new random token in ``tokens_file`` and prints the token once (put it in the agent's
``token_file``). ``forewarn collector nats-auth`` writes the nats-server authorization
block for the enrolled nodes (:func:`forewarn.bus.authorization`).

:class:`ServerThread` runs the same app in a background thread (tests, ``forewarn demo``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import socket

    import uvicorn
    from starlette.applications import Starlette

    from .config import CollectorConfig

__all__ = ["ServerThread", "collector_server", "main", "register", "uvicorn_config"]

log = logging.getLogger(__name__)


def register(sub: Any) -> None:
    """Add ``collector`` to the ``forewarn`` command.

    Every key of :class:`~.config.CollectorConfig` is a flag, accepted before the action
    (``forewarn collector --data-dir D run``) and after it (``forewarn collector run
    --data-dir D``, shown by ``forewarn collector run --help``); after wins."""
    from forewarn.config import add_config_arguments

    from .config import CollectorConfig

    p: argparse.ArgumentParser = sub.add_parser(
        "collector",
        help="run the central collector (ingest, job map, policy, commands, API)",
        description="Run the central collector service (the default action), or manage "
                    "agent tokens. Settings come from the config file, then "
                    "FOREWARN_COLLECTOR_<KEY> environment variables, then flags.",
    )
    add_config_arguments(p, CollectorConfig, service="collector")
    p.set_defaults(func=_run, collector_cmd="run")
    csub = p.add_subparsers(dest="collector_cmd", metavar="ACTION")
    actions: list[argparse.ArgumentParser] = []
    run = csub.add_parser("run", help="run the collector service (the default)",
                          description="Run the collector service.")
    run.set_defaults(func=_run)
    actions.append(run)
    tok = csub.add_parser("token", help="manage per-agent tokens")
    toksub = tok.add_subparsers(dest="token_cmd", metavar="ACTION", required=True)
    add = toksub.add_parser("add", help="enrol NODE: store a new token's hash, print the token")
    add.add_argument("node", help="node name, as the agent reports it")
    add.set_defaults(func=_token_add)
    ls = toksub.add_parser("list", help="list enrolled nodes")
    ls.set_defaults(func=_token_list)
    na = csub.add_parser(
        "nats-auth", help="write the nats-server authorization block for the enrolled nodes",
        description="Each enrolled node gets a NATS user that may publish only its own batch"
                    " and answer subjects and pull only its own commands; the collector's"
                    " user (forewarn-collector, password bus_password) may do everything."
                    " Include the output in nats-server.conf; rerun after enrolling a node"
                    " and reload nats-server (nats-server --signal reload).")
    na.add_argument("--output", type=Path, default=None,
                    help="write here (mode 0600) instead of standard output")
    na.set_defaults(func=_nats_auth)
    actions += [add, ls, na]
    for action in actions:
        add_config_arguments(action, CollectorConfig, service="collector", suppress=True)


def _load(args: argparse.Namespace) -> CollectorConfig:
    from forewarn.config import load_from_args

    from .config import DEFAULT_CONFIG_PATH, CollectorConfig

    return load_from_args(CollectorConfig, service="collector", args=args,
                          default_path=DEFAULT_CONFIG_PATH)


def _token_add(args: argparse.Namespace) -> int:
    from forewarn.config import ConfigError

    from .http.auth import AuthError, add_token

    try:
        config = _load(args)
        token = add_token(config.tokens_file, args.node)
    except (ConfigError, AuthError, OSError) as exc:
        print(f"forewarn collector token add: {exc}", file=sys.stderr)
        return 2
    print(token)
    print(f"enrolled {args.node!r} in {config.tokens_file}; give the agent this token "
          "(it is not stored anywhere)", file=sys.stderr)
    return 0


def _token_list(args: argparse.Namespace) -> int:
    from forewarn.config import ConfigError

    from .http.auth import AuthError, TokenRegistry

    try:
        config = _load(args)
        nodes = TokenRegistry(config.tokens_file).nodes()
    except (ConfigError, AuthError, OSError) as exc:
        print(f"forewarn collector token list: {exc}", file=sys.stderr)
        return 2
    for node in nodes:
        print(node)
    return 0


def _nats_auth(args: argparse.Namespace) -> int:
    from forewarn.bus import authorization
    from forewarn.config import ConfigError
    from forewarn.files import write_atomic

    from .config import bus_password
    from .http.auth import AuthError, node_hashes

    try:
        config = _load(args)
        password = bus_password(config)
        if not password:
            raise ConfigError("bus_password: the collector's NATS user needs a password"
                              " (bus_password or bus_password_file)")
        block = authorization(node_hashes(config.tokens_file), password)
        if args.output is None:
            sys.stdout.write(block)
            return 0
        write_atomic(args.output, block.encode())
    except (ConfigError, AuthError, OSError) as exc:
        print(f"forewarn collector nats-auth: {exc}", file=sys.stderr)
        return 2
    return 0


def uvicorn_config(app: Starlette, config: CollectorConfig, **kw: Any) -> uvicorn.Config:
    """uvicorn settings for ``app``: listen address, TLS, no access log (ingest is hot), the
    logging of :mod:`forewarn.logs`, and
    the HTTP protocol guarded by the connection limits (:mod:`.http.connections`), whose metrics
    go to the app's registry."""
    import uvicorn

    from .http.connections import (
        ConnectionGuard,
        connection_cap,
        guarded_protocol,
        protocol_class,
    )

    tls: dict[str, Any] = {}
    if config.certfile is not None and config.keyfile is not None:
        tls = {"ssl_certfile": str(config.certfile), "ssl_keyfile": str(config.keyfile)}
    cap, backlog = connection_cap(config.max_connections)
    guard = ConnectionGuard(
        max_connections=cap,
        header_timeout_s=config.header_timeout_s, body_timeout_s=config.body_timeout_s,
        registry=app.state.ctx.metrics.registry)
    # log_config=None: uvicorn's records go to the root handler of forewarn.logs (same
    # format, journal detection, JSON) instead of uvicorn's own handlers.
    return uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                          log_config=None, access_log=False, lifespan="on",
                          timeout_keep_alive=75,
                          http=guarded_protocol(protocol_class(config.http), guard),
                          backlog=backlog, **tls, **kw)


def collector_server(app: Starlette, config: CollectorConfig) -> uvicorn.Server:
    """The uvicorn server for ``app``. On shutdown it first answers the agents' open long
    polls, which uvicorn would otherwise wait out (up to ``long_poll_max_s``) before it
    stops; agents reconnect to the next collector process."""
    import uvicorn

    commands = app.state.ctx.commands

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            commands.release_polls()
            await super().shutdown(sockets)

    return Server(uvicorn_config(app, config))


def _run(args: argparse.Namespace) -> int:
    # uvicorn is imported only to serve: import it first, so that a missing extra is
    # reported (by `forewarn`) before the store and the model load.
    import uvicorn  # noqa: F401

    from forewarn.config import ConfigError
    from forewarn.logs import setup_logging

    from .decide.policy_service import PolicyService
    from .http.app import create_app
    from .http.auth import AuthError
    from .storage.state import open_state
    from .storage.store import StoreError

    try:
        config = _load(args)
        setup_logging(config.log_level, config.log_format)
        store = open_state(config)
    except (ConfigError, StoreError, OSError) as exc:
        print(f"forewarn collector: {exc}", file=sys.stderr)
        return 2
    try:
        app = create_app(config, store, policy=PolicyService.from_config(config))
    # ConfigError: e.g. model_path unusable; StoreError: a database not this data's.
    except (AuthError, ConfigError, StoreError) as exc:
        print(f"forewarn collector: {exc}", file=sys.stderr)
        store.close()
        return 2
    server = collector_server(app, config)
    from .http.lograte import rate_limit_logging

    rate_limit_logging(config.log_every_s)  # after uvicorn configured its loggers
    try:
        server.run()
    finally:
        store.close()
    return 0


class ServerThread:
    """Serve ``app`` with uvicorn on a background thread; a context manager.

    ``port=0`` in the config picks a free port; :attr:`url` says which after start.
    """

    def __init__(self, app: Starlette, config: CollectorConfig) -> None:
        self.config = config
        self.server = collector_server(app, config)
        self._thread = threading.Thread(target=self._serve, name="forewarn-collector",
                                        daemon=True)
        self._error: BaseException | None = None

    def _serve(self) -> None:
        try:
            asyncio.run(self.server.serve())
        except BaseException as exc:  # reported by start()
            self._error = exc

    @property
    def url(self) -> str:
        scheme = "https" if self.config.certfile else "http"
        servers = getattr(self.server, "servers", [])
        port = self.config.port
        if servers and servers[0].sockets:
            port = servers[0].sockets[0].getsockname()[1]
        return f"{scheme}://{self.config.host}:{port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = threading.Event()
        for _ in range(int(timeout / 0.02)):
            if self.server.started or self._error is not None or not self._thread.is_alive():
                break
            deadline.wait(0.02)
        if not self.server.started:
            raise RuntimeError(f"collector did not start: {self._error!r}")
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m forewarn.collector.cli``: the same as ``forewarn collector``."""
    parser = argparse.ArgumentParser(prog="forewarn")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(["collector", *(sys.argv[1:] if argv is None else argv)])
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
