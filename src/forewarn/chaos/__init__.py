"""Fault injection against a real forewarn stack on one machine (``forewarn chaos``).

* :mod:`forewarn.chaos.scenarios`: the scenario registry (``SCENARIOS``), each a fault, a
  stated expectation and the check of it, returning an ``Outcome``; the scenarios
  themselves live in one module per rig (``training_scenarios``, ``hardware_scenarios``,
  ``telemetry_scenarios``, ``hostile_scenarios``, ``store_scenarios``, ``scale_scenarios``);
* :mod:`forewarn.chaos.lab`: the real processes they run against (collectors, agents on
  simulated nodes, training jobs), one module per rig (``training_rig``, ``hardware_rig``,
  ``telemetry_rig``, ``scale_lab``) built of :mod:`forewarn.chaos.daemons`, and
  :mod:`forewarn.chaos.proxy` (a cuttable TCP proxy); the processes themselves are
  started with :mod:`forewarn.spawn` (shared with the demo and the tests), and
  :mod:`forewarn.chaos.exposition` reads their ``/metrics``;
* the training ranks, with faults injected by a control file: :mod:`forewarn.spawn.workload`
  (the demo runs them too);
* :mod:`forewarn.chaos.accounting`: telemetry produced by an agent against stored by its
  collector;
* :mod:`forewarn.chaos.cli`: the command (table, JSON, exit status).
"""

__all__: list[str] = []
