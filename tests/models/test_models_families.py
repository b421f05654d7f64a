"""The simulator's behaviour families and the leave-one-family-out evaluation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from forewarn.cli import main
from forewarn.models.families import BENIGN, PRECURSORS
from forewarn.models.fleetsim import load_params, simulate_fleet

from support.paths import REPO
from support.polling import poll

pytestmark = pytest.mark.timeout(900)


def test_families_have_random_shapes_durations_and_realistic_prevalence() -> None:
    p = load_params()
    assert p.real_per_1000_node_days == 6.5 and p.real_per_1000_gpu_days == 6.5 / 8
    # Durations from minutes to days.
    medians = [f.median_min for f in PRECURSORS.values()]
    assert min(medians) < 60 and max(medians) > 24 * 60
    # Every family belongs to a cause of the mix.
    assert {f.cause for f in PRECURSORS.values()} <= {c.name for c in p.causes}
    for name in ("nvlink_multi", "pcie_steps", "thermal_oscillation", "pending_remaps",
                 "ecc_drift_days", "sample_thinning"):
        assert name in PRECURSORS
    d = simulate_fleet(p.replace(nodes=6, days=2.0, rate_per_1000_gpu_days=400.0,
                                 balanced_families=True, seed=7))
    fams = d.labels["family"]
    assert fams.nunique() >= 6 and (fams == "none").any()
    # Same family, different shapes: precursor lengths vary.
    assert d.labels.loc[fams != "none", "precursor_minutes"].std() > 10
    gpus = 6 * 8
    share = d.behaviours.groupby("behaviour")["gpu"].size() / gpus
    assert 0.1 < share["ecc_trickle"] < 0.45, share  # a large share of healthy GPUs
    assert set(share.index) <= {*BENIGN, "power_cap"}
    # A trickle GPU that never fails reports correctable ECC all the time.
    trickle = d.behaviours[d.behaviours["behaviour"] == "ecc_trickle"]
    failed = set(zip(d.labels["node"], d.labels["gpu"], strict=True))
    node, gpu = next((n, g) for n, g in zip(trickle["node"], trickle["gpu"], strict=True)
                     if (n, g) not in failed)
    s = d.samples[(d.samples["node"] == node) & (d.samples["gpu"] == gpu)]
    assert s["ecc_corrected_volatile"].iloc[-1] > 0
    assert np.all(np.diff(s["ecc_corrected_volatile"].to_numpy()) >= 0)


def test_eval_families_writes_the_per_family_table(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "models.md"
    doc.write_text("before\n<!-- eval-families:begin -->\nSTALE-TABLE\n<!-- eval-families:end -->\n"
                   "after\n")
    assert main(["models", "eval-families", "--scale", "0.1", "--family", "thermal_oscillation",
                 "--family", "hot_spells", "--markdown", str(doc),
                 "--out", str(tmp_path / "lofo.csv")]) == 0
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "STALE-TABLE" not in text
    for who in ("model", "rules", "isolation_forest", "rules_forest"):
        assert f"| thermal_oscillation | precursor | {who} |" in text
    assert "| hot_spells | benign | model |" in text
    assert "precision (real rate)" in text and "Best on leave-family-out" in text


def test_a_parameter_file_cannot_redefine_the_families(tmp_path: Path) -> None:
    """Families, their causes and durations are one table (families.PRECURSORS): a
    parameter file that still lists them is refused, naming the key, not half-applied."""
    shipped = (REPO / "models/data/fleet_params.toml").read_text()
    for extra, key in (('families = ["ecc_accel"]\n', "causes.hbm3.families"),
                       ("", "families")):
        text = shipped.replace("[causes.hbm3]", f"[causes.hbm3]\n{extra}", 1)
        if not extra:
            text += "\n[families.ecc_accel]\nmedian_min = 5.0\nsigma = 0.1\n"
        path = tmp_path / "fleet.toml"
        path.write_text(text)
        with pytest.raises(ValueError, match=rf"fleet parameters: {key}: .*PRECURSORS"):
            load_params(path)


@pytest.mark.system
def test_eval_families_keeps_each_finished_fold_and_resumes(tmp_path: Path) -> None:
    """Each fold's rows are in the CSV as soon as the fold finishes: a run killed after its
    first fold leaves that fold's rows; run again, it skips that fold and does the rest."""
    out = tmp_path / "lofo.csv"
    cmd = [sys.executable, "-m", "forewarn", "models", "eval-families", "--scale", "0.1",
           "--family", "thermal_oscillation", "--family", "hot_spells", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def first_fold() -> bool:
            return out.exists() and len(pd.read_csv(out)) >= 4
        assert poll(first_fold, timeout=600, interval=0.2), "no fold was written"
        proc.kill()  # cut off: the second fold has not finished
    finally:
        proc.kill()
        proc.wait()
    done = pd.read_csv(out)
    assert set(done["family"]) == {"thermal_oscillation"}
    assert sorted(done["detector"]) == ["isolation_forest", "model", "rules", "rules_forest"]
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    assert "thermal_oscillation: done before, skipped" in rerun.stderr
    res = pd.read_csv(out)
    assert sorted(res["family"]) == ["hot_spells"] * 4 + ["thermal_oscillation"] * 4
    assert "| thermal_oscillation | precursor | model |" in rerun.stdout


def test_eval_families_seed_picks_the_pool(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """``--seed N`` draws another pool (and split): the same seed gives the same rows, another
    seed other rows; ``--seed A,B`` pools the folds of both and names each seed's figures."""
    from forewarn.models.lofo import family_pool

    a, again, b = (family_pool(scale=0.1, seed=s) for s in (1, 1, 2))
    pd.testing.assert_frame_equal(a.features, again.features)
    pd.testing.assert_frame_equal(a.labels, again.labels)
    assert not a.labels[["gpu", "time"]].equals(b.labels[["gpu", "time"]])
    assert set(family_pool(scale=0.1).labels["node"].str[:5]) == {"f301:", "f302:", "f303:"}
    with pytest.raises(ValueError, match="seed"):
        family_pool(scale=0.1, seed=-1)
    out = tmp_path / "lofo.csv"
    assert main(["models", "eval-families", "--scale", "0.1", "--family", "one_off_bursts",
                 "--seed", "1,2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "--seed 1,2" in text
    for who in ("model", "rules", "isolation_forest"):
        assert f"| **{who}** (seed 1) |" in text and f"| **{who}** (seed 2) |" in text
        assert f"| **{who}** |" in text  # the folds of both pools together
    assert sorted(set(pd.read_csv(out)["seed"])) == [1, 2]
