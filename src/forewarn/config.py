"""Config is data: a frozen dataclass per service, loaded from TOML, then ``FOREWARN_*``
environment variables, then command-line overrides (later wins).

Keys are the dataclass field names. An environment variable is ``FOREWARN_<SERVICE>_<KEY>``
in upper case (``FOREWARN_AGENT_INTERVAL_S=0.5``). Unknown keys and bad values raise
:class:`ConfigError` naming the key and where it came from.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from forewarn.errors import InputError

__all__ = ["ConfigError", "load_config"]

C = TypeVar("C")


class ConfigError(InputError, ValueError):
    """A config key is unknown or its value is bad; the message names the key."""


def _convert(key: str, origin: str, value: Any, hint: Any) -> Any:
    """Coerce ``value`` to the field's type ``hint``; strings (from env/flags) are parsed."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        is_none = value is None or (isinstance(value, str) and value.lower() in ("", "none"))
        if is_none and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(key, origin, value, arg)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{origin}: {key}: bad value {value!r}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{origin}: {key}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, bool):
            raise ConfigError(f"{origin}: {key}: expected an integer, got {value!r}")
        try:
            if isinstance(value, str | int):
                return int(value)
            return _bad(key, origin, value, "an integer")
        except ValueError:
            return _bad(key, origin, value, "an integer")
    if hint is float:
        if isinstance(value, bool):
            return _bad(key, origin, value, "a number")
        try:
            if isinstance(value, str | int | float):
                return float(value)
            return _bad(key, origin, value, "a number")
        except ValueError:
            return _bad(key, origin, value, "a number")
    if hint is str:
        if isinstance(value, str):
            return value
        return _bad(key, origin, value, "a string")
    if hint is Path:
        if isinstance(value, str | Path):
            return Path(value)
        return _bad(key, origin, value, "a path")
    if typing.get_origin(hint) is tuple:
        item = args[0]
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            return _bad(key, origin, value, "a list")
        return tuple(_convert(key, origin, v, item) for v in value)
    if typing.get_origin(hint) is dict:
        if isinstance(value, dict):
            return dict(value)
        return _bad(key, origin, value, "a table")
    raise ConfigError(f"{origin}: {key}: unsupported config type {hint!r}")


def _bad(key: str, origin: str, value: Any, what: str) -> Any:
    raise ConfigError(f"{origin}: {key}: expected {what}, got {value!r}")


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

    def put(origin: str, key: str, value: Any) -> None:
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"{origin}: unknown key {key!r} (known keys: {known})")
        values[key] = _convert(key, origin, value, hints[key])

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
            put(f"--{key.replace('_', '-')}", key, value)

    try:
        return cls(**values)
    except TypeError as exc:
        raise ConfigError(str(exc)) from None
