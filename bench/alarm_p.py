"""Measure: the P(failure within the hour) the shipped model's alarms carry, per episode.

``forewarn simulate``'s cost-model gate (``src/forewarn/simulate_gate.py``) draws the P of
each simulated alarm from bands measured here: the shipped model scores four held-out
fleets (``heldout_suite(scale=0.25)``, seeds 901-904, 896 GPU-days, as
``tests/models/test_calibration.py``), its alarms are merged into episodes as the
evaluation does (``alarm_episodes``: one per GPU, gaps under an hour merged), and each
episode is true when its GPU fails between a minute after its start and an hour after its
end (``evaluate_scores``); one whose GPU failed within the hour before its start or less
than a minute after it is ``no lead`` (the evaluation counts it as not true, but it is no
false alarm on a healthy GPU). Per episode: the highest P it reached (the collector weighs a
finding again every 5 minutes while the GPU stays alarmed) and its first minute's P. P is
the model's calibrated probability at a real fleet's failure rate; a false alarm, when
there are none, takes the P at the threshold (the lowest alarming score).

Run: ``python bench/alarm_p.py`` (prints JSON; about 10 min of one core).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd

from forewarn.models.evaluate import alarm_episodes
from forewarn.models.persist import load_default_model
from forewarn.models.predictor import FailurePredictor
from forewarn.models.suites import heldout_suite, simulate_features

FLEETS = ("same_params_new_seed", "short_precursors_x0.5", "long_precursors_x2",
          "noise_x1.6")
HORIZON_S = 3600.0
LEAD_MIN_S = 60.0


def episodes_with_p(model: FailurePredictor, features: pd.DataFrame, labels: pd.DataFrame
                    ) -> list[dict[str, Any]]:
    """Each alarm episode of ``model`` on one fleet: its kind (true, no lead, false), its
    highest and first P, its minutes."""
    scores = model.predict_proba(features)
    p = model.failure_probability(scores)
    if p is None:
        raise SystemExit("the shipped model has no calibration: its alarms carry no P")
    scored = features[["node", "gpu", "time"]].assign(score=scores, p=scores, prob=p)
    out = []
    for ep in alarm_episodes(scored, model.threshold).itertuples():
        rows = scored[(scored["node"] == ep.node) & (scored["gpu"] == ep.gpu)
                      & (scored["time"] >= ep.start) & (scored["time"] <= ep.end)
                      & (scored["score"] >= model.threshold)]
        fails = labels[(labels["node"] == ep.node) & (labels["gpu"] == ep.gpu)]["time"]
        true = bool(((fails >= ep.start + LEAD_MIN_S) & (fails <= ep.end + HORIZON_S)).any())
        late = bool(((fails >= ep.start - HORIZON_S) & (fails < ep.start + LEAD_MIN_S)).any())
        out.append({"kind": "true" if true else "no lead" if late else "false",
                    "max_p": float(rows["prob"].max()),
                    "first_p": float(rows.sort_values("time")["prob"].iloc[0]),
                    "minutes": len(rows)})
    return out


def main() -> None:
    model = load_default_model()
    suite = heldout_suite(scale=0.25)
    episodes: list[dict[str, Any]] = []
    for name in FLEETS:
        f, lab = simulate_features(suite[name])
        for ep in episodes_with_p(model, f, lab):
            episodes.append({"fleet": name, **ep})
    at_threshold = model.failure_probability(np.array([model.threshold]))
    print(json.dumps({
        "threshold": model.threshold,
        "p_at_threshold": None if at_threshold is None else float(at_threshold[0]),
        **{kind: sorted((e for e in episodes if e["kind"] == kind), key=lambda e: -e["max_p"])
           for kind in ("true", "no lead", "false")},
    }, indent=1))


if __name__ == "__main__":
    main()
