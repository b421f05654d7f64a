"""``forewarn deploy``: install a role's systemd unit, config and directories from the files
this wheel ships, or print one of them.

``forewarn deploy install --role agent|collector [--prefix DIR] [--dry-run]``

- writes ``/etc/systemd/system/forewarn-ROLE.service`` with ``ExecStart`` pointing at this
  installation's ``forewarn`` (the virtual environment's ``bin/``), so the unit runs what
  was installed, wherever that is;
- writes ``/etc/forewarn/ROLE.toml`` from the documented example only when no config is
  there (an operator's config is never overwritten);
- creates the directories the role reads its token from and keeps its state in, owned by
  root with the modes below (systemd hands the collector's state directory to the
  service's dynamic user when it starts);
- agent: writes ``/etc/sysctl.d/60-forewarn.conf`` (``net.unix.max_dgram_qlen = 512``: the
  hooks' datagrams the agent socket queues) and applies it with ``systemd-sysctl`` (else
  ``sysctl -p``), run without a shell; it says so when it cannot (the file still applies at
  the next boot). Under ``--prefix`` it is written, not applied;
- prints each thing it did (``--dry-run``: would do), one line each.

``--prefix DIR`` puts every file under ``DIR`` (as a package build's DESTDIR would): the
unit still names the real paths. ``forewarn deploy print FILE`` prints a shipped file; a
unit is printed as ``install`` would write it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.resources
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from forewarn.errors import InputError

__all__ = ["ROLES", "DeployError", "Role", "forewarn_binary", "install", "register",
           "render"]


class DeployError(InputError):
    """Something ``install`` or ``print`` cannot do; the message says what."""


@dataclasses.dataclass(frozen=True)
class Role:
    """What one role installs: its unit, its config (from the example of the same name),
    its directories with their modes and a sysctl.d file (shipped under that name)."""

    unit: str
    config: str
    dirs: tuple[tuple[str, int], ...]
    sysctl: str = ""


ROLES: dict[str, Role] = {
    # /etc/forewarn holds the config and the agent's token (root only, 0600);
    # /var/lib/forewarn is the unit's StateDirectory (the uplink spool).
    "agent": Role("forewarn-agent.service", "agent.toml",
                  (("/etc/forewarn", 0o755), ("/var/lib/forewarn", 0o700)),
                  sysctl="60-forewarn.conf"),
    # /var/lib/forewarn-collector is the unit's StateDirectory: data_dir and the tokens
    # file, which `forewarn collector token add` keeps readable by the service's user.
    "collector": Role("forewarn-collector.service", "collector.toml",
                      (("/etc/forewarn", 0o755), ("/var/lib/forewarn-collector", 0o700))),
}

UNIT_DIR = "/etc/systemd/system"
CONFIG_DIR = "/etc/forewarn"
SYSCTL_DIR = "/etc/sysctl.d"
# systemd-sysctl FILE applies that file only; procps' sysctl -p FILE where systemd is not.
_SYSCTL_APPLY = (("/usr/lib/systemd/systemd-sysctl",), ("/lib/systemd/systemd-sysctl",),
                 ("/usr/sbin/sysctl", "-p"), ("/sbin/sysctl", "-p"))
# A systemd command line must not need quoting or specifier escapes.
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9._+/-]+")
_EXEC_START = re.compile(r"^ExecStart=\S+", re.MULTILINE)


def shipped(name: str) -> str:
    """The text of the shipped deploy file ``name`` (e.g. ``agent.toml``)."""
    names = available()
    if name not in names:
        raise DeployError(f"no shipped deploy file {name!r}; there are: {', '.join(names)}")
    return importlib.resources.files("forewarn.deploy").joinpath(*name.split("/")).read_text()


def available() -> list[str]:
    """Every shipped deploy file, as ``print`` names them."""
    out = []
    root = importlib.resources.files("forewarn.deploy")
    for entry in root.iterdir():
        if entry.is_file() and not entry.name.endswith((".py", ".pyc")):
            out.append(entry.name)
        elif entry.is_dir() and entry.name != "__pycache__":
            out += [f"{entry.name}/{sub.name}" for sub in entry.iterdir() if sub.is_file()]
    return sorted(out)


def forewarn_binary() -> str:
    """Absolute path of this installation's ``forewarn`` command: the one beside the
    running interpreter (a virtual environment's ``bin/``), else the one on PATH."""
    beside = Path(sys.executable).parent / "forewarn"
    found = str(beside) if beside.is_file() else shutil.which("forewarn")
    if found is None:
        raise DeployError("cannot find the installed `forewarn` command (neither beside "
                          f"{sys.executable} nor on PATH)")
    path = os.path.abspath(found)
    if not _PLAIN_PATH.fullmatch(path):
        raise DeployError(f"{path}: install forewarn under a path of letters, digits and "
                          "._+-/ only (systemd would need it quoted)")
    return path


def render(unit_text: str, binary: str) -> str:
    """The unit with its ``ExecStart`` command replaced by ``binary``."""
    text, n = _EXEC_START.subn(f"ExecStart={binary}", unit_text)
    if n != 1:
        raise DeployError("the shipped unit has no single ExecStart line")
    return text


def _under(prefix: Path | None, path: str) -> Path:
    return Path(path) if prefix is None else prefix / path.lstrip("/")


def install(role: str, prefix: Path | None = None, dry_run: bool = False,
            say: Any = print) -> None:
    """Install ``role`` (see the module docstring); ``say`` gets one line per action."""
    spec = ROLES[role]
    verb = "would " if dry_run else ""
    binary = forewarn_binary()
    for d, mode in spec.dirs:
        target = _under(prefix, d)
        if target.is_dir():
            say(f"kept {target} (exists)")
            continue
        if not dry_run:
            target.mkdir(mode=mode, parents=True)
            target.chmod(mode)  # mkdir's mode is filtered by the umask
        say(f"{verb}create {target} (mode {mode:04o}, owner root)")
    unit = _under(prefix, f"{UNIT_DIR}/{spec.unit}")
    if not dry_run:
        unit.parent.mkdir(parents=True, exist_ok=True)
        _write(unit, render(shipped(spec.unit), binary), 0o644)
    say(f"{verb}write {unit} (ExecStart={binary})")
    config = _under(prefix, f"{CONFIG_DIR}/{spec.config}")
    if config.exists():
        say(f"kept {config} (exists)")
    else:
        if not dry_run:
            _write(config, shipped(spec.config), 0o644)
        say(f"{verb}write {config} (the documented example: every key at its default)")
    if spec.sysctl:
        _install_sysctl(spec.sysctl, prefix, dry_run, say)
    say(f"next: systemctl daemon-reload && systemctl enable --now {spec.unit}")


def _install_sysctl(name: str, prefix: Path | None, dry_run: bool, say: Any) -> None:
    """Write the shipped sysctl.d file ``name`` (ours: replaced like the unit) and apply it
    to the running kernel, except under a prefix or in a dry run."""
    target = _under(prefix, f"{SYSCTL_DIR}/{name}")
    if not dry_run:
        target.parent.mkdir(parents=True, exist_ok=True)
        _write(target, shipped(name), 0o644)
    say(f"{'would ' if dry_run else ''}write {target} (net.unix.max_dgram_qlen: the agent "
        "socket's queue)")
    if prefix is not None:
        say(f"not applied (--prefix): systemd-sysctl applies {target} at boot")
    elif dry_run:
        say(f"would apply {target}")
    else:
        say(_apply_sysctl(target))


def _apply_sysctl(path: Path) -> str:
    """Apply the sysctl.d file ``path`` now (no shell); one line saying what happened."""
    argv = next(([*cmd, str(path)] for cmd in _SYSCTL_APPLY if Path(cmd[0]).is_file()), None)
    if argv is None:
        return (f"cannot apply {path} now: neither systemd-sysctl nor sysctl is installed; "
                "it applies at the next boot")
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot apply {path} now ({argv[0]}: {exc}); it applies at the next boot"
    if r.returncode != 0:
        why = (r.stderr or r.stdout).strip().replace("\n", "; ")
        return (f"cannot apply {path} now ({' '.join(argv)} exited {r.returncode}: {why}); "
                "it applies at the next boot")
    return f"applied {path} ({' '.join(argv)}); restart a running agent for its socket"


def _write(path: Path, text: str, mode: int) -> None:
    """Write ``path`` atomically with ``mode``."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.chmod(mode)
    tmp.replace(path)


def register(sub: Any) -> None:
    """Add ``deploy`` to the ``forewarn`` command."""
    p: argparse.ArgumentParser = sub.add_parser(
        "deploy", help="install a systemd unit and config for the agent or the collector",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    dsub = p.add_subparsers(dest="deploy_cmd", metavar="ACTION", required=True)
    inst = dsub.add_parser("install", help="write the unit, config example and directories")
    inst.add_argument("--role", choices=sorted(ROLES), required=True)
    inst.add_argument("--prefix", type=Path, default=None,
                      help="install under this directory instead of / (e.g. a package root)")
    inst.add_argument("--dry-run", action="store_true", help="say what would be done")
    inst.set_defaults(func=_install)
    pr = dsub.add_parser("print", help="print a shipped file (a unit as install writes it)")
    pr.add_argument("file", help="e.g. forewarn-agent.service, collector.toml, prometheus.yml")
    pr.set_defaults(func=_print)


def _install(args: argparse.Namespace) -> int:
    try:
        install(args.role, args.prefix, args.dry_run)
    except (DeployError, OSError) as exc:
        print(f"forewarn deploy install: {exc}", file=sys.stderr)
        return 2
    return 0


def _print(args: argparse.Namespace) -> int:
    try:
        text = shipped(args.file)
        if args.file.endswith(".service"):
            text = render(text, forewarn_binary())
    except DeployError as exc:
        print(f"forewarn deploy print: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0
