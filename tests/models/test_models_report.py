"""The shipped model reproduces the documented figures, and the report's PNGs render.

``docs/models_eval_small/report.json`` is the golden output of
``forewarn models eval --heldout --scale 0.125 --report docs/models_eval_small`` on the
shipped model (a small slice of the held-out suite, so it runs in a test); the full-size
figures in docs/models.md come from the same command at scale 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forewarn.models.persist import load_default_model
from forewarn.models.report import evaluate_model, write_report
from forewarn.models.suites import heldout_suite, iter_features

from support.images import check_png
from support.paths import REPO

ROOT = REPO
pytestmark = pytest.mark.timeout(600)


def test_shipped_model_reproduces_the_documented_figures(tmp_path: Path) -> None:
    golden = json.loads((ROOT / "docs/models_eval_small/report.json").read_text())
    report = evaluate_model(load_default_model(), iter_features(heldout_suite(scale=0.125)))
    assert report["threshold"] == golden["threshold"]
    assert report["overall"] == golden["overall"]
    assert report["sets"] == golden["sets"]
    paths = write_report(report, tmp_path)
    for key in ("pr_curve", "lead_times"):
        check_png(paths[key])
    docs = (ROOT / "docs/models.md").read_text()
    small = (ROOT / "docs/models_eval_small/report.md").read_text()
    assert small.strip() in docs, "docs/models.md must quote the small-scale table verbatim"
    full = (ROOT / "docs/models_eval/report.md").read_text()
    assert full.strip() in docs, "docs/models.md must quote the full held-out table verbatim"


@pytest.mark.parametrize("name", ["pr_curve.png", "lead_times.png"])
def test_checked_in_report_pngs_have_content(name: str) -> None:
    check_png(ROOT / "docs/models_eval" / name)
