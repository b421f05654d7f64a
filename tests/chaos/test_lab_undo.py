"""A rig that fails half-way through its start stops what it had started, so the next
scenario can build it again (the chaos scale rig left VictoriaMetrics holding its data
directory's lock when a replica failed to start, and every later scale scenario failed
on that lock instead of on the real cause)."""

from __future__ import annotations

from pathlib import Path

import pytest

from forewarn.chaos.lab import Lab


def test_what_a_failed_start_began_is_stopped_and_forgotten(tmp_path: Path) -> None:
    lab = Lab(tmp_path)
    stopped: list[str] = []
    lab.closers.append(lambda: stopped.append("earlier rig"))
    with pytest.raises(RuntimeError, match="replica did not start"), lab.undo_on_failure():
        lab.closers.append(lambda: stopped.append("nats"))
        lab.closers.append(lambda: stopped.append("victoria-metrics"))
        raise RuntimeError("replica did not start")
    assert stopped == ["victoria-metrics", "nats"]
    assert len(lab.closers) == 1  # the earlier rig's stop stays for close()
    with lab.undo_on_failure():
        lab.closers.append(lambda: stopped.append("kept"))
    assert len(lab.closers) == 2
    lab.close()
    assert stopped[-2:] == ["kept", "earlier rig"]
