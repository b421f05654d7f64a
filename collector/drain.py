"""Drain a node with an operator's command, run as an argument list, never through a shell.

The template is a list of arguments, each formatted on its own, e.g.::

    ["scontrol", "update", "nodename={node}", "state=drain", "reason={reason}"]
    ["kubectl", "cordon", "{node}"]

Rules, checked when the template is built (:class:`DrainTemplate`):

* the only placeholders are ``{node}`` and ``{reason}``: no positional (``{}``, ``{0}``),
  attribute or index access (``{node.__class__}``, ``{node[0]}``), conversion (``{node!r}``)
  or format spec (``{node:>99}``); literal braces are written ``{{`` ``}}``;
* the program (first argument) has no placeholder.

and when it runs (:meth:`DrainRunner.run`):

* ``node`` must match :data:`NODE_RE` (host-name characters, starting with a letter or
  digit, so it cannot become an option like ``--all`` or carry ``;``, ``$()``, spaces);
* ``reason`` is reduced to :data:`REASON_SAFE` characters, leading ``-`` removed, at most
  :data:`REASON_MAX` characters.

Anything rejected raises :class:`DrainError` and runs nothing. The command runs with
``shell=False``, a timeout, no stdin, and its output captured. Drain is off by default: the
policy puts ``drain`` in shadow mode until an operator enables it (``drain_enabled``).
"""

from __future__ import annotations

import dataclasses
import re
import string
import subprocess
import time
from collections.abc import Callable, Sequence

__all__ = [
    "NODE_RE",
    "REASON_MAX",
    "REASON_SAFE",
    "DrainError",
    "DrainResult",
    "DrainRunner",
    "DrainTemplate",
    "sanitize_reason",
]

NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
"""A node name: RFC 1123 host-name characters (plus ``_``), not starting with ``-`` or ``.``."""
REASON_SAFE = re.compile(r"[^A-Za-z0-9 _.,:=/+-]")
"""Characters removed from a reason."""
REASON_MAX = 128
_FIELDS = frozenset({"node", "reason"})


class DrainError(ValueError):
    """A drain template or value was rejected; nothing was run."""


def sanitize_reason(reason: str) -> str:
    """``reason`` in the safe charset, single-spaced, no leading ``-``, at most 128 chars."""
    cleaned = REASON_SAFE.sub("", reason.replace("\n", " ").replace("\t", " "))
    cleaned = " ".join(cleaned.split()).lstrip("-").strip()
    return cleaned[:REASON_MAX] or "forewarn"


def _check_arg(i: int, arg: str) -> set[str]:
    """Placeholders used by one template argument; raise on anything but a plain field."""
    used: set[str] = set()
    try:
        parts = list(string.Formatter().parse(arg))
    except ValueError as exc:
        raise DrainError(f"drain template argument {i} {arg!r}: {exc}") from None
    for _literal, field, spec, conversion in parts:
        if field is None:
            continue
        if field not in _FIELDS:
            raise DrainError(
                f"drain template argument {i} {arg!r}: placeholder {{{field}}} is not allowed"
                " (only {node} and {reason})"
            )
        if spec or conversion:
            raise DrainError(
                f"drain template argument {i} {arg!r}: conversions and format specs are not"
                " allowed"
            )
        used.add(field)
    return used


@dataclasses.dataclass(frozen=True)
class DrainTemplate:
    """A validated drain command template (see the module docstring)."""

    argv: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.argv:
            raise DrainError("drain template is empty")
        if any(not isinstance(a, str) or "\x00" in a for a in self.argv):
            raise DrainError("drain template arguments must be strings without NUL")
        if _check_arg(0, self.argv[0]):
            raise DrainError("drain template: the program (first argument) takes no placeholder")
        used: set[str] = set()
        for i, arg in enumerate(self.argv[1:], start=1):
            used |= _check_arg(i, arg)
        if "node" not in used:
            raise DrainError("drain template must name the node with {node}")

    def render(self, node: str, reason: str) -> list[str]:
        """The argument list for ``node``; raises :class:`DrainError` on a bad node name."""
        if not isinstance(node, str) or not NODE_RE.fullmatch(node):
            raise DrainError(f"refusing to drain: invalid node name {node[:80]!r}")
        safe = sanitize_reason(reason)
        return [self.argv[0]] + [a.format(node=node, reason=safe) for a in self.argv[1:]]


@dataclasses.dataclass(frozen=True)
class DrainResult:
    """What happened for one drain: the arguments, whether they ran, and how it went."""

    node: str
    argv: tuple[str, ...]
    ran: bool
    shadow: bool
    returncode: int | None
    output: str
    error: str
    seconds: float


Runner = Callable[..., "subprocess.CompletedProcess[str]"]


class DrainRunner:
    """Renders and runs the drain template. ``enabled=False`` (the default) renders and
    validates but runs nothing (shadow). ``run`` blocks: call it in a thread."""

    def __init__(
        self,
        template: DrainTemplate | Sequence[str],
        *,
        enabled: bool = False,
        timeout_s: float = 30.0,
        runner: Runner = subprocess.run,
    ) -> None:
        self.template = (
            template if isinstance(template, DrainTemplate) else DrainTemplate(tuple(template))
        )
        self.enabled = enabled
        self.timeout_s = timeout_s
        self._runner = runner

    def run(self, node: str, reason: str) -> DrainResult:
        """Drain ``node``; :class:`DrainError` if the values are rejected (nothing runs)."""
        argv = self.template.render(node, reason)
        if not self.enabled:
            return DrainResult(node, tuple(argv), False, True, None, "", "", 0.0)
        start = time.monotonic()
        try:
            proc = self._runner(
                argv, shell=False, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                timeout=self.timeout_s, check=False,
            )
        except subprocess.TimeoutExpired:
            return DrainResult(
                node, tuple(argv), True, False, None, "", f"timed out after {self.timeout_s} s",
                time.monotonic() - start,
            )
        except OSError as exc:
            return DrainResult(
                node, tuple(argv), False, False, None, "", f"{type(exc).__name__}: {exc}",
                time.monotonic() - start,
            )
        return DrainResult(
            node, tuple(argv), True, False, proc.returncode,
            (proc.stdout or "")[-2000:], (proc.stderr or "")[-2000:], time.monotonic() - start,
        )
