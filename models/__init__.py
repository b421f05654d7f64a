"""forewarn.models: features, detectors, failure prediction, evaluation, simulators.

Modules (imported on demand; nothing heavy loads with the package):
``schema`` data formats and validation; ``features`` windowed GPU and rank features;
``zscore``, ``peers``, ``iforest``, ``predictor`` the detectors; ``lemon`` fleet risk
ranking from event logs; ``persist`` skops save/load with an allow-list and
``load_default_model``; ``live`` the collector's :class:`~forewarn.models.live.LiveScorer`
with shadow scoring; ``fleetsim`` and ``jobsim`` simulators; ``labels`` failure labels from
telemetry; ``evaluate`` and ``report`` evaluation; ``suites`` the shipped model's data
sets; ``cli`` ``forewarn models``. See docs/models.md.
"""
