"""Drain a node with an operator's command, run as an argument list, never through a shell.

The template is a list of arguments, each formatted on its own, e.g.::

    ["scontrol", "update", "nodename={node}", "state=drain", "reason={reason}"]
    ["kubectl", "cordon", "{node}"]

Slots: ``{node}`` takes a node name only; ``{reason}`` is free text, so it may only be
the value of an option (``--reason={reason}``, ``reason={reason}``: the argument starts
with literal text) or an operand after a ``--`` argument (``["drain-node", "{node}",
"--", "{reason}"]``); a program could take a whole argument of free text for an option.

Rules, checked when the template is built (:class:`DrainTemplate`, at config load):

* the only placeholders are ``{node}`` and ``{reason}``: no positional (``{}``, ``{0}``),
  attribute or index access (``{node.__class__}``, ``{node[0]}``), conversion (``{node!r}``)
  or format spec (``{node:>99}``); literal braces are written ``{{`` ``}}``;
* the program (first argument) has no placeholder;
* an argument starting with ``{reason}`` comes after a ``--`` argument.

and when it runs (:meth:`DrainRunner.run`), each value is checked before anything runs:

* ``node`` must match :data:`NODE_RE` (host-name characters, starting with a letter or
  digit, so it cannot become an option like ``--all`` or carry ``;``, ``$()``, spaces);
* ``reason`` is refused when it contains a control character (newline, tab, escape,
  NUL, DEL, U+2028/2029) or when, reduced to :data:`REASON_SAFE` characters and single
  spaces, it starts with ``-`` (a reason of ``- --all`` must never become ``--all``); it
  is cut to :data:`REASON_MAX` characters.

Anything refused raises :class:`DrainError`, runs nothing, and is counted in
``forewarn_collector_drain_refused_total{slot}`` (``node`` or ``reason``). The command runs
with ``shell=False``, a timeout, no stdin, and its output captured. Drain is off by default:
the policy puts ``drain`` in shadow mode until an operator enables it (``drain_enabled``).
"""

from __future__ import annotations

import dataclasses
import re
import string
import subprocess
import time
import unicodedata
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter

from forewarn.errors import InputError

__all__ = [
    "NODE_RE",
    "REASON_MAX",
    "REASON_SAFE",
    "DrainError",
    "DrainResult",
    "DrainRunner",
    "DrainTemplate",
    "check_reason",
    "sanitize_reason",
]

NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
"""A node name: RFC 1123 host-name characters (plus ``_``), not starting with ``-`` or ``.``."""
REASON_SAFE = re.compile(r"[^A-Za-z0-9 _.,:=/+-]")
"""Characters removed from a reason."""
REASON_MAX = 128
_FIELDS = frozenset({"node", "reason"})


class DrainError(InputError, ValueError):
    """A drain template or value was rejected; nothing was run. ``slot`` names the
    refused value (``node``, ``reason``), empty for a bad template."""

    def __init__(self, message: str, slot: str = "") -> None:
        super().__init__(message)
        self.slot = slot


def sanitize_reason(reason: str) -> str:
    """``reason`` in the safe charset, single-spaced, at most 128 chars (``forewarn`` when
    nothing is left)."""
    cleaned = " ".join(REASON_SAFE.sub("", reason).split())
    return cleaned[:REASON_MAX] or "forewarn"


def _control(text: str) -> str | None:
    """The first control character of ``text`` as ``U+XXXX``, or ``None``."""
    for ch in text:
        if unicodedata.category(ch) in ("Cc", "Zl", "Zp"):
            return f"U+{ord(ch):04X}"
    return None


def check_reason(node: str, reason: str) -> str:
    """The reason as it goes into the command; :class:`DrainError` when it carries a
    control character or would start with ``-``."""
    bad = _control(reason)
    if bad is not None:
        raise DrainError(f"refusing to drain {node}: reason contains the control character "
                         f"{bad}", "reason")
    safe = sanitize_reason(reason)
    if safe.startswith("-"):
        raise DrainError(f"refusing to drain {node}: reason {safe[:40]!r} starts with '-' "
                         "(it could be taken for an option)", "reason")
    return safe


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
        operands = False
        for i, arg in enumerate(self.argv[1:], start=1):
            operands = operands or arg == "--"
            if arg.startswith("{reason}") and not operands:
                raise DrainError(
                    f"drain template argument {i} {arg!r}: {{reason}} is free text; pass it "
                    "as an option value (--reason={reason}) or after a '--' argument")

    def render(self, node: str, reason: str) -> list[str]:
        """The argument list for ``node``; raises :class:`DrainError` on a bad node name."""
        if not isinstance(node, str) or not NODE_RE.fullmatch(node):
            raise DrainError(f"refusing to drain: invalid node name {node[:80]!r}", "node")
        safe = check_reason(node, reason)
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
        self.refused = Counter("forewarn_collector_drain_refused",
                               "Drains refused before running: a bad node name or reason.",
                               ["slot"], registry=None)

    def register(self, registry: CollectorRegistry) -> None:
        """Export the refusal counter in ``registry``."""
        registry.register(self.refused)

    def render(self, node: str, reason: str) -> list[str]:
        """The argument list (:meth:`DrainTemplate.render`); refusals are counted."""
        try:
            return self.template.render(node, reason)
        except DrainError as exc:
            self.refused.labels(exc.slot or "template").inc()
            raise

    def run(self, node: str, reason: str) -> DrainResult:
        """Drain ``node``; :class:`DrainError` if the values are rejected (nothing runs)."""
        argv = self.render(node, reason)
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
