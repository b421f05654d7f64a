"""The command lines of forewarn's own daemons and their flat TOML configs, as the chaos
lab (:mod:`forewarn.chaos.daemons`), the demo (:mod:`forewarn.demo.run`) and the tests
start them: one place that knows how ``forewarn collector`` and ``forewarn agent`` are
invoked. Starting and stopping the processes is :class:`forewarn.spawn.procs.Procs`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

__all__ = ["agent_command", "collector_command", "toml_value", "write_config"]


def collector_command(config: Path) -> list[str]:
    """``forewarn collector --config CONFIG run`` with this interpreter."""
    return [sys.executable, "-m", "forewarn", "collector", "--config", str(config), "run"]


def agent_command(node: str, *, scenario: Path | None = None, socket: Path | str | None = None,
                  listen: str = "127.0.0.1:0", interval: float = 0.25,
                  config: Path | None = None, collector: str = "",
                  token_file: Path | None = None, sim_speed: float | None = None,
                  source: str | None = "sim", extra: tuple[str, ...] = ()) -> list[str]:
    """``forewarn agent`` for ``node`` reading ``source`` (``sim``: the simulated node of
    ``scenario``, or the embedded one without it; None: as configured, or in ``extra``),
    listening on ``listen``, polling every ``interval`` s, without the kernel log;
    reporting to ``collector`` with ``token_file`` when given; ``extra``: more arguments,
    last."""
    args = [sys.executable, "-m", "forewarn", "agent"]
    if config is not None:
        args += ["--config", str(config)]
    if source is not None:
        args += ["--source", source]
    args += ["--node", node, "--listen", listen, "--no-kmsg", "--interval", f"{interval:g}"]
    if scenario is not None:
        args += ["--scenario", str(scenario)]
    if sim_speed is not None:
        args += ["--sim-speed", f"{sim_speed:g}"]
    if socket is not None:
        args += ["--socket", str(socket)]
    if collector:
        if token_file is None:
            raise ValueError("an agent reporting to a collector needs its token file")
        args += ["--collector", collector, "--token-file", str(token_file)]
    return [*args, *extra]


def toml_value(value: Any) -> str:
    """``value`` (bool, number, string or list of them) as a TOML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_config(path: Path, **keys: Any) -> Path:
    """A flat TOML config file of ``keys``; its path."""
    path.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in keys.items()))
    return path
