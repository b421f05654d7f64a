"""Config is data: a frozen dataclass per service, loaded from TOML, then ``FOREWARN_*``
environment variables, then command-line flags (later wins).

Keys are the dataclass field names; the values of all three are decoded into the
dataclass in one :func:`msgspec.convert`. Every key is also an environment variable,
``FOREWARN_<SERVICE>_<KEY>`` in upper case (``FOREWARN_AGENT_INTERVAL_S=0.5``), and a flag,
``--<key>`` with dashes (``--interval-s 0.5``; a boolean is ``--kmsg`` / ``--no-kmsg``),
generated from the dataclass by :func:`add_config_arguments` so that flags, variables and
keys cannot drift apart; the help of a flag is the docstring under its field. Variables and
flags are parsed alike: a list is comma-separated (``a,b``), a table is ``name=value,...``.
Unknown keys and bad values raise :class:`ConfigError` naming the key and where it came from.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import os
import re
import textwrap
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from forewarn.errors import InputError

__all__ = [
    "LOG_FORMATS", "LOG_LEVELS", "ConfigError", "add_config_arguments", "check_logging",
    "env_name", "flag_name", "load_config", "load_from_args",
]

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
LOG_FORMATS = ("text", "json")

C = TypeVar("C")


class ConfigError(InputError, ValueError):
    """A config key is unknown or its value is bad; the message names the key."""


def _base(hint: Any) -> tuple[Any, bool]:
    """``(type, optional)`` of a field's hint: ``Path | None`` is ``(Path, True)``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(hint))
    return hint, False


def _prepare(key: str, origin: str, value: Any, hint: Any) -> Any:
    """A string value (every environment variable and flag; some TOML values) in the shape
    :func:`msgspec.convert` takes for ``hint``: a list or table written inline (``a,b``,
    ``name=x,...``), ``none`` or empty for an optional key, yes/no/on/off for a boolean.
    Anything else goes to msgspec as it is."""
    if not isinstance(value, str):
        return value
    base, optional = _base(hint)
    if optional and value.strip().lower() in ("", "none"):
        return None
    if base is bool:
        return {"yes": "true", "on": "true", "no": "false", "off": "false"}.get(
            value.strip().lower(), value)
    if typing.get_origin(base) is tuple:
        return [v.strip() for v in value.split(",") if v.strip()]
    if typing.get_origin(base) is dict:
        return _parse_table(key, origin, value)
    return value


def _dec_hook(typ: Any, obj: Any) -> Any:
    """Paths, which msgspec does not know, from strings (a TypeError becomes msgspec's
    ValidationError, naming the key)."""
    if typ is Path and isinstance(obj, str | Path):
        return Path(obj)
    raise TypeError(f"Expected a path, got {obj!r}")


_AT_KEY = re.compile(r"^(?P<msg>.*) - at `\$\.(?P<key>\w+)(?P<rest>[^`]*)`$", re.S)


def _parse_table(key: str, origin: str, text: str) -> dict[str, str]:
    """``name=value,name=value`` (a table from a flag or variable) as a dict of strings."""
    table = {}
    for item in (i.strip() for i in text.split(",")):
        name, sep, value = item.partition("=")
        if item and (not sep or not name.strip()):
            raise ConfigError(f"{origin}: {key}: expected name=value,..., got {text!r}")
        if item:
            table[name.strip()] = value.strip()
    return table


def check_logging(level: str, fmt: str) -> None:
    """The ``log_level`` and ``log_format`` keys every daemon has, named when bad."""
    if level not in LOG_LEVELS:
        raise ConfigError(f"log_level: must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    if fmt not in LOG_FORMATS:
        raise ConfigError(f"log_format: must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")


def load_config(
    cls: type[C],
    *,
    service: str,
    path: Path | None = None,
    required: bool = False,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> C:
    """Build ``cls`` (a frozen dataclass) from TOML at ``path``, the environment and overrides.

    A missing file is fine unless ``required``; ``overrides`` with value ``None`` are
    ignored (unset flags). After building, ``cls.__post_init__`` may validate ranges and
    raise :class:`ConfigError` itself.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}

    def put(origin: str, key: str, value: Any) -> None:
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"{origin}: unknown key {key!r} (known keys: {known})")
        values[key] = _prepare(key, origin, value, hints[key])
        origins[key] = origin

    if path is not None:
        if path.exists():
            try:
                data = tomllib.loads(path.read_text())
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{path}: not valid TOML: {exc}") from None
            for key, value in data.items():
                put(str(path), key, value)
        elif required:
            raise ConfigError(f"{path}: config file not found")

    prefix = f"FOREWARN_{service.upper()}_"
    for name, value in (os.environ if env is None else env).items():
        if name.startswith(prefix):
            put(f"environment {name}", name[len(prefix) :].lower(), value)

    for key, value in (overrides or {}).items():
        if value is not None:
            put(flag_name(key), key, value)

    try:
        # Non-strict: strings from the environment and flags become numbers and booleans.
        # cls.__post_init__ runs inside; its ConfigError arrives as a ValidationError.
        config: C = msgspec.convert(values, cls, strict=False, dec_hook=_dec_hook)
    except msgspec.ValidationError as exc:
        m = _AT_KEY.match(str(exc))
        if m is None:
            raise ConfigError(str(exc)) from None
        key = m["key"]
        raise ConfigError(f"{origins.get(key, 'default')}: {key}{m['rest']}: "
                          f"{m['msg']}") from None
    return config


def env_name(service: str, key: str) -> str:
    """The environment variable of ``key``: ``FOREWARN_<SERVICE>_<KEY>``."""
    return f"FOREWARN_{service.upper()}_{key.upper()}"


def flag_name(key: str) -> str:
    """The command-line flag of ``key``: ``--<key>`` with dashes."""
    return "--" + key.replace("_", "-")


def _dest(key: str) -> str:
    # Namespaced, so that no other argument of a command (a positional NODE) can clash.
    return f"config_key.{key}"


def _field_docs(cls: type[Any]) -> dict[str, str]:
    """The docstring under each field of ``cls`` (the string literal after the field),
    whitespace collapsed; empty where the source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _show(value: Any) -> str:
    """A default as a user would write it in a flag."""
    if value is None or value in ((), {}):
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return str(value) if value != "" else '""'


def _metavar(hint: Any) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint
    if typing.get_origin(base) is tuple:
        return "A,B"
    if typing.get_origin(base) is dict:
        return "NAME=X,..."
    return {int: "N", float: "X", Path: "PATH"}.get(base, "TEXT")


def add_config_arguments(
    parser: argparse.ArgumentParser,
    cls: type[Any],
    *,
    service: str,
    only: tuple[str, ...] | None = None,
    aliases: Mapping[str, str] | None = None,
    suppress: bool = False,
) -> None:
    """Add ``--config`` and one flag per key of ``cls`` (or of the keys in ``only``).

    ``aliases`` gives a key a second, shorter flag (``socket_path``: ``--socket``).
    ``suppress`` leaves an unset flag out of the namespace: for the flags repeated on a
    subcommand, so that a value given before the subcommand is not reset by its default.
    """
    unset = argparse.SUPPRESS if suppress else None
    parser.add_argument("--config", metavar="FILE", default=unset, type=Path,
                        help=f"config file (TOML; default /etc/forewarn/{service}.toml, "
                             "used if present)")
    group = parser.add_argument_group(
        "settings", f"Each flag sets the config key of the same name (dashes for "
                    f"underscores), overriding the config file and the environment "
                    f"variable FOREWARN_{service.upper()}_<KEY>.")
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    for f in dataclasses.fields(cls):
        if not f.init or (only is not None and f.name not in only):
            continue
        default = (f.default_factory() if f.default_factory is not dataclasses.MISSING
                   else f.default)
        help_text = (f"{docs.get(f.name, f.name)} [{env_name(service, f.name)}; default "
                     f"{_show(default)}]").replace("%", "%%")
        names = [flag_name(f.name)]
        if aliases and f.name in aliases:
            names.append(aliases[f.name])
        if hints[f.name] is bool:
            group.add_argument(*names, dest=_dest(f.name), default=unset, help=help_text,
                               action=argparse.BooleanOptionalAction)
        else:
            group.add_argument(*names, dest=_dest(f.name), default=unset, help=help_text,
                               metavar=_metavar(hints[f.name]))


def load_from_args(
    cls: type[C],
    *,
    service: str,
    args: argparse.Namespace,
    default_path: Path,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> C:
    """Load ``cls`` as the command line asks: the ``--config`` file (required when named,
    else ``default_path`` if present), the environment, the flags of
    :func:`add_config_arguments`, then ``overrides`` (what the command itself fixes)."""
    path: Path | None = getattr(args, "config", None)
    flags = {key[len(_dest("")):]: value for key, value in vars(args).items()
             if key.startswith(_dest(""))}
    return load_config(cls, service=service, path=path or default_path,
                       required=path is not None, env=env,
                       overrides={**flags, **(overrides or {})})
