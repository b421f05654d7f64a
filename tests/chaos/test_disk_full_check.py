"""The disk_full scenario's check of a visible error (forewarn.chaos.store_scenarios) on
a rig whose disk is NOT full: it must see nothing, so that when it passes on a full disk
it passed for the disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from forewarn.chaos.lab import Lab, Options
from forewarn.chaos.store_scenarios import disk_error_visible, watch_errors


@pytest.mark.system
@pytest.mark.timeout(120)
def test_a_collector_still_loading_its_model_is_no_disk_error(tmp_path: Path) -> None:
    """Right after a start /readyz is 503 while the predictor loads the shipped model
    (seconds on a loaded machine): that is not the disk speaking, and the check used to
    count any non-200 as one."""
    lab = Lab(tmp_path, Options())
    try:
        rig = lab.telemetry("healthy-disk")
        seen = watch_errors(rig, 3.0)
    finally:
        lab.close()
    assert seen["alive"], seen
    assert "storage" not in seen["readyz_not_ready"], seen
    assert not disk_error_visible(seen), seen
