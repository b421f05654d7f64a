"""The collector's tokens file stays usable across enrolment on a running collector: `token
add` keeps the file's owner and mode (the service's dynamic user must still read it after
root enrols a node), the running registry sees every change to the file (not only a new
mtime), and a file it cannot use is an error in its log, not silent 401s."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from forewarn.collector.http.auth import AuthError, TokenRegistry, add_token, enroll

NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand the file to another user")
def test_token_add_keeps_the_files_owner_and_mode(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    add_token(path, "node-1")
    os.chown(path, NOBODY, NOBODY)  # what systemd does for the DynamicUser at start
    path.chmod(0o640)
    add_token(path, "node-2")  # root enrols another node while the service runs
    st = path.stat()
    assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY)
    assert stat.S_IMODE(st.st_mode) == 0o640


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand the folder to another user")
def test_a_new_tokens_file_belongs_to_its_folders_owner(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.chown(state, NOBODY, NOBODY)
    add_token(state / "tokens.toml", "node-1")
    st = (state / "tokens.toml").stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (NOBODY, 0o600)


def test_enroll_writes_the_hash_and_a_private_token_file(tmp_path: Path) -> None:
    """What the demo, the chaos lab and the tests hand an agent: the tokens file gets the
    hash, the agent's token file the token itself, readable by its owner only (even when
    it existed with a wider mode, and whatever the umask)."""
    tokens, token_file = tmp_path / "tokens.toml", tmp_path / "node-1.token"
    token_file.write_text("stale\n")
    token_file.chmod(0o644)
    old = os.umask(0)
    try:
        token = enroll(tokens, "node-1", token_file)
    finally:
        os.umask(old)
    assert token_file.read_text() == token + "\n"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert TokenRegistry(tokens).authenticate(_bearer(token)) == "node-1"


def _bearer(token: str) -> str:
    return f"Bearer {token}"


def test_a_change_that_keeps_the_mtime_is_still_seen(tmp_path: Path) -> None:
    """Reloads key on the file's identity (inode, size, ctime), not its mtime alone: a
    chmod, or a copy that keeps the mtime (cp -p, rsync -t), is picked up."""
    path = tmp_path / "tokens.toml"
    add_token(path, "node-1")
    before = path.stat()
    registry = TokenRegistry(path, reload_s=0.0)
    second = add_token(path, "node-2")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert registry.authenticate(_bearer(second)) == "node-2"


def test_an_unusable_tokens_file_is_logged_and_counted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "tokens.toml"
    first = add_token(path, "node-1")
    counted: list[int] = []
    registry = TokenRegistry(path, reload_s=0.0, on_error=lambda: counted.append(1))
    path.write_text('"node-1" = "not a hash"\n')
    with caplog.at_level(logging.ERROR, logger="forewarn.collector.http.auth"):
        # The last good tokens keep working; the error names the file and the entry.
        assert registry.authenticate(_bearer(first)) == "node-1"
        assert registry.authenticate(_bearer(first)) == "node-1"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors  # once per change of the file, not per request
    assert str(path) in errors[0] and "node-1" in errors[0]
    assert counted == [1] and registry.error is not None
    with pytest.raises(AuthError):
        TokenRegistry(path)  # at start it is fatal: the collector exits 2 naming it
    add_token(path.with_name("good.toml"), "node-1")
    os.replace(path.with_name("good.toml"), path)
    registry.authenticate(_bearer(first))
    assert registry.error is None
