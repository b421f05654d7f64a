"""Per-agent tokens: each node's agent authenticates with its own bearer token.

The tokens file (``tokens_file`` in the collector config, mode 0600, in the collector's
state directory) is TOML mapping a node name to the SHA-256 of its token, never the token
itself::

    "gpu-node-07" = "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"

``forewarn collector token add NODE`` enrols a node: it writes a fresh random token's hash
and prints the token once, keeping the file's owner and mode (a new file takes its
folder's owner): root enrols, the service's user (systemd's DynamicUser, which owns the
state directory) keeps reading it. The file is re-read when it changes (any change: its
inode, size, mtime or ctime), so enrolment needs no restart; a file that cannot be read
or parsed is logged as an error once per change and counted (the collector's
``forewarn_collector_tokens_file_errors_total``), and the last good tokens stay in force.
:func:`enroll` is the same enrolment plus the agent's token file (mode 0600), for whoever
hands the token over as a file (the demo, the chaos lab, the tests).

A token authenticates exactly one node; an agent may only post, poll and ack for that
node. Comparison is constant-time (:func:`hmac.compare_digest`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
import threading
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

from forewarn.errors import InputError

__all__ = ["AuthError", "TokenRegistry", "add_token", "enroll", "hash_token", "node_hashes",
           "parse_bearer"]

PREFIX = "sha256:"

log = logging.getLogger(__name__)


class AuthError(InputError, ValueError):
    """The tokens file is unreadable or malformed; the message names the entry."""


def hash_token(token: str) -> str:
    """``sha256:<hex>`` of ``token``: what the tokens file stores."""
    return PREFIX + hashlib.sha256(token.encode()).hexdigest()


def parse_bearer(header: str | None) -> str | None:
    """The token in an ``Authorization: Bearer <token>`` header, or ``None``."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or len(token) > 512:
        return None
    return token


def node_hashes(path: Path) -> dict[str, str]:
    """node -> ``sha256:<hex>`` of the tokens file ``path`` (raises :class:`AuthError`)."""
    return _read(path)


def _read(path: Path) -> dict[str, str]:
    """node -> ``sha256:<hex>`` from the tokens file (missing file: no tokens)."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise AuthError(f"{path}: cannot read tokens file: {exc}") from None
    out: dict[str, str] = {}
    for node, value in data.items():
        if not isinstance(value, str) or not value.startswith(PREFIX) or len(value) != 71:
            raise AuthError(f"{path}: {node!r}: expected \"sha256:<64 hex digits>\"")
        try:
            bytes.fromhex(value[len(PREFIX):])
        except ValueError:
            raise AuthError(f"{path}: {node!r}: not a hex digest") from None
        out[node] = value.lower()
    return out


class TokenRegistry:
    """Which node a bearer token belongs to; reloads the file when it changes."""

    def __init__(self, path: Path | None = None, *, tokens: dict[str, str] | None = None,
                 reload_s: float = 1.0, on_error: Callable[[], object] | None = None) -> None:
        """Read ``path``, or take ``tokens`` (node -> plain token) directly (tests, demo).
        The file is checked for changes at most every ``reload_s`` seconds; ``on_error``
        is called each time a changed file cannot be used (a metric counts them)."""
        self.on_error = on_error
        self.reload_s = reload_s
        self._checked = time.monotonic()
        self.path = path
        self._lock = threading.Lock()
        self._seen: tuple[int, ...] | None = None
        self.error: str | None = None
        """Why the current tokens file is not in use, or ``None`` when it is."""
        self._static = {node: hash_token(tok) for node, tok in (tokens or {}).items()}
        self._by_hash: dict[str, str] = {}
        self._by_node: dict[str, str] = {}
        self._reload(force=True)

    def _reload(self, *, force: bool = False) -> None:
        entries = dict(self._static)
        if self.path is not None:
            now = time.monotonic()
            if not force and now - self._checked < self.reload_s:
                return
            self._checked = now
            seen = _identity(self.path)
            if not force and seen == self._seen:
                return
            self._seen = seen
            entries.update(_read(self.path))
        self.error = None
        self._by_hash = {digest: node for node, digest in entries.items()}
        self._by_node = entries

    def nodes(self) -> list[str]:
        """Enrolled node names."""
        with self._lock:
            return sorted(set(self._by_hash.values()))

    def authenticate(self, authorization: str | None) -> str | None:
        """The node the ``Authorization`` header's token belongs to, or ``None``."""
        token = parse_bearer(authorization)
        if token is None:
            return None
        digest = hash_token(token)
        with self._lock:
            # A broken file keeps the last good tokens; it is an error in the log once per
            # change of the file (at start it is fatal: see __init__).
            try:
                self._reload()
            except AuthError as exc:
                self.error = str(exc)
                if self.on_error is not None:
                    self.on_error()
                log.error("%s; the previous tokens stay in force", exc)
            node = self._by_hash.get(digest)
            if node is None:
                return None
            expected = self._by_node[node]
        # The dict lookup is keyed by a hash of a 256-bit secret, which leaks nothing
        # useful; the final comparison is constant-time all the same.
        return node if hmac.compare_digest(expected, digest) else None


def _identity(path: Path) -> tuple[int, ...] | None:
    """What changes whenever the file does, a chmod or a same-mtime copy included."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    except OSError:  # e.g. the folder became unreadable: make _read report it
        return (-1,)
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def add_token(path: Path, node: str) -> str:
    """Enrol ``node``: store the hash of a new random token in ``path`` (replacing any
    earlier token of that node) and return the token. The file is written atomically,
    with the owner and mode it had; a new file gets mode 0600 and its folder's owner."""
    if not node or len(node) > 256 or any(c in node for c in "\n\r\0"):
        raise AuthError(f"bad node name {node!r}")
    entries = _read(path)
    token = secrets.token_urlsafe(32)
    entries[node] = hash_token(token)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        st = path.stat()
        owner, mode = (st.st_uid, st.st_gid), stat.S_IMODE(st.st_mode)
    except FileNotFoundError:
        st = path.parent.stat()
        owner, mode = (st.st_uid, st.st_gid), 0o600
    tmp = path.with_name(path.name + ".tmp")
    # JSON strings are valid TOML basic strings for the names we accept.
    text = "".join(f"{json.dumps(n)} = {json.dumps(d)}\n" for n, d in sorted(entries.items()))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
        if (os.geteuid(), os.getegid()) != owner:
            # Root enrolling for the service's user: the running collector must still
            # read the file. Without root this fails, and nothing is replaced.
            try:
                os.fchown(fd, *owner)
            except PermissionError:
                raise AuthError(f"{path}: cannot keep its owner uid {owner[0]}: run "
                                "`forewarn collector token add` as root or as that user") from None
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    return token


def enroll(tokens_file: Path, node: str, token_file: Path) -> str:
    """Enrol ``node`` in ``tokens_file`` (:func:`add_token`) and write its token to the
    agent's ``token_file``, readable by its owner only (mode 0600 from its creation on,
    whatever the umask or the mode an earlier file had); returns the token."""
    token = add_token(tokens_file, node)
    # O_NOFOLLOW: a planted symlink must not redirect the secret elsewhere.
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)
    return token
