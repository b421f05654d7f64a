"""The chaos lab: real collectors, real agents on simulated nodes, and real training jobs,
started on demand and shared by the scenarios that can share them without touching each
other.

Three rigs:

* :class:`TrainingRig`: the shared collector, agent ``chaos-node-1`` (a quiet simulated
  2-GPU node, ``hang_action = terminate``) and a 2-rank gloo job on it, launched by
  torchrun (``--nproc-per-node=2``, c10d rendezvous, ``--max-restarts``; the job restarts
  from its newest checkpoint; :class:`~forewarn.demo.launch.TorchrunJob`). Both ranks
  share one node and one agent on purpose: the agent's straggler comparison and its own
  grad-spike order are per node. Training scenarios run one after the other on it; each
  waits for the job to be healthy and stepping first.
* :class:`HardwareRig`: the shared collector and agent ``chaos-node-2``, a simulated
  4-GPU node whose scenario scripts one fault per GPU (ECC storm to a double-bit error,
  PCIe replays to XID 79, row-remap growth to failure, thermal runaway), with one
  hook-only single-rank job on each GPU. The faults are on different GPUs and different
  jobs: independent, and all play out together within ``hw_window_s``.
* :class:`TelemetryRig`: a collector and an agent of their own, per scenario, with the
  agent's uplink going through a :class:`~forewarn.chaos.proxy.TcpProxy`; kills and cuts
  here touch nothing else. :class:`BusRig` is the same over a nats-server of its own.

Each rig is its own module (:mod:`~forewarn.chaos.training_rig`,
:mod:`~forewarn.chaos.hardware_rig`, :mod:`~forewarn.chaos.telemetry_rig`), built of the
collector and agent processes of :mod:`~forewarn.chaos.daemons`; this module holds the
:class:`Options` and the :class:`Lab` that owns them all.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from forewarn.chaos.daemons import LabCollector
from forewarn.chaos.hardware_rig import HW_FAULTS, HardwareRig
from forewarn.chaos.proxy import TcpProxy
from forewarn.chaos.telemetry_rig import BusRig, TelemetryRig
from forewarn.chaos.training_rig import TRAIN_JOB, TrainingRig
from forewarn.demo import servers
from forewarn.demo.launch import TorchrunJob
from forewarn.spawn.procs import Procs

__all__ = ["HW_FAULTS", "TRAIN_JOB", "BusRig", "HardwareRig", "Lab", "Options", "TelemetryRig",
           "TrainingRig"]


@dataclasses.dataclass(frozen=True)
class Options:
    """Knobs of a chaos run. Defaults are the CLI's; the tests scale some down."""

    cutoff_s: float = 120.0
    """How long the agent is cut off from the collector ("minutes": 2 min by default)."""
    spool_max_bytes: int = 128 * 1024
    """Spool bound in the spool-full scenario: a few batches (4 simulated GPUs with 18
    NVLinks each make batches of ~40 KB at the default intervals), so a cut overflows it."""
    disk_full_s: float = 3.0
    """How long the spool's file system refuses writes in the spool-full scenario."""
    step_seconds: float = 0.04
    """Padding per training step (the job's compute stand-in)."""
    checkpoint_every: int = 40
    """Periodic checkpoint interval of the training job, in steps."""
    hw_sim_speed: float = 5.0
    """Simulated seconds per real second on the hardware node."""
    hw_fault_start_s: float = 20.0
    hw_fault_duration_s: float = 150.0
    """Simulated seconds: every hardware fault starts here and ends this much later."""
    agent_interval_s: float = 0.25
    telemetry_interval_s: float = 0.1
    push_interval_s: float = 0.5

    @property
    def hw_window_s(self) -> float:
        """Wall seconds after the hardware agent starts by which every fault has ended."""
        return (self.hw_fault_start_s + self.hw_fault_duration_s) / self.hw_sim_speed


class Lab:
    """Owns every process, rig and proxy of a chaos run; :meth:`close` ends them all."""

    def __init__(self, workdir: Path, options: Options | None = None) -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.options = options or Options()
        self.procs = Procs()
        self.launchers: list[TorchrunJob] = []
        self.proxies: list[TcpProxy] = []
        self._main: LabCollector | None = None
        self._training: TrainingRig | None = None
        self._hardware: HardwareRig | None = None
        self.rigs: dict[str, Any] = {}
        """Rigs other modules build once per lab (the scale-out rig), by name."""
        self.closers: list[Callable[[], None]] = []
        """Stops for what is not a process of :attr:`procs` (servers), run by close()."""

    def main_collector(self) -> LabCollector:
        if self._main is None:
            self._main = LabCollector(self, "collector", [TrainingRig.NODE, HardwareRig.NODE])
        return self._main

    def training(self) -> TrainingRig:
        if self._training is None:
            self._training = TrainingRig(self)
        return self._training

    def hardware(self) -> HardwareRig:
        if self._hardware is None:
            self._hardware = HardwareRig(self)
        return self._hardware

    def telemetry(self, name: str, spool_max_bytes: int | None = None, *,
                  others: tuple[str, ...] = (), disk: Path | None = None,
                  collector_extra: str = "") -> TelemetryRig:
        return TelemetryRig(self, name, spool_max_bytes, others, disk, collector_extra)

    def bus(self, name: str) -> BusRig | None:
        """A :class:`BusRig`, or None when nats-server is not installed."""
        try:
            nats = servers.find_binary("nats-server")
        except servers.MissingServer:
            return None
        return BusRig(self, name, nats=nats)

    @contextlib.contextmanager
    def undo_on_failure(self) -> Iterator[None]:
        """Around a rig's start: if it raises, the stops it added to :attr:`closers` run
        now (newest first) and are forgotten, so nothing it started (a server holding its
        data directory's lock) is left for the next scenario to trip on."""
        mark = len(self.closers)
        try:
            yield
        except BaseException:
            for close in reversed(self.closers[mark:]):
                with contextlib.suppress(Exception):
                    close()
            del self.closers[mark:]
            raise

    def close(self) -> None:
        if self._training is not None:
            self._training.close()
        for launcher in self.launchers:
            launcher.stop()
        for p in self.proxies:
            p.close()
        self.procs.close()
        for close in reversed(self.closers):
            with contextlib.suppress(Exception):  # every server is stopped whatever happens
                close()
