"""support.leftovers: what a test started is found until it is really gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.leftovers import wait_gone

# A supervisor whose own command line does not name the marker: it starts one process
# that does (stdin held open: it lives until told), and forks a second one that waits
# between fork and exec (its command line the supervisor's) until the supervisor ends,
# then becomes a marked process too.
_SUPERVISOR = """
import os, subprocess, sys
marker = os.environ["LEFTOVER_MARKER"]
first = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", marker],
                         stdin=subprocess.PIPE)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(w)
    first.stdin.close()  # or the first one would never see the end of its input
    os.read(r, 1)
    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", marker])
os.close(r)
print("ready", pid, flush=True)
sys.stdin.readline()
first.stdin.close()
first.wait()
print("gone", flush=True)
sys.stdin.readline()
"""


@pytest.mark.system
def test_a_process_between_fork_and_exec_is_not_gone(tmp_path: Path) -> None:
    """The marked process ends while its successor is between fork and exec: no command
    line names the marker for that moment, but the supervisor and the successor are
    still there (and the successor is about to be marked)."""
    marker = str(tmp_path / "marker")
    sup = subprocess.Popen([sys.executable, "-c", _SUPERVISOR], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, start_new_session=True,
                           env={**os.environ, "LEFTOVER_MARKER": marker})
    assert sup.stdin is not None and sup.stdout is not None
    try:
        word, forked = sup.stdout.readline().split()
        assert word == b"ready"
        looks = 0

        def pause(seconds: float) -> None:
            # after the first look (which saw the marked process): let it end
            nonlocal looks
            looks += 1
            if looks == 1:
                assert sup.stdin is not None and sup.stdout is not None
                sup.stdin.write(b"end\n")
                sup.stdin.flush()
                assert sup.stdout.readline() == b"gone\n"

        left = wait_gone(marker, timeout=1.0, pause=pause)
        assert looks >= 1
        assert sorted(int(line.split(":")[0]) for line in left) == sorted(
            [sup.pid, int(forked)]), left
    finally:
        os.killpg(sup.pid, signal.SIGKILL)
        sup.wait(10)


@pytest.mark.system
def test_gone_when_ended_also_in_our_own_process_group(tmp_path: Path) -> None:
    """A marked process in the test's own process group, ended, and one in a group of its
    own, ended but not yet reaped (a zombie): nothing is left."""
    marker = str(tmp_path / "marker")
    argv = [sys.executable, "-c", "import sys; sys.stdin.read()", marker]
    ours = subprocess.Popen(argv, stdin=subprocess.PIPE)
    own = subprocess.Popen(argv, stdin=subprocess.PIPE, start_new_session=True)
    try:
        ours.kill()
        ours.wait(10)
        own.kill()  # not waited for: a zombie until the end of the test
        assert wait_gone(marker, timeout=5.0) == []
    finally:
        for p in (ours, own):
            p.kill()
            p.wait(10)
