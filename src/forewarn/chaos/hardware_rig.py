"""The chaos lab's hardware rig: agent ``chaos-node-2``, a simulated 4-GPU node with one
scripted fault per GPU and one hook-only job per GPU (see :mod:`forewarn.chaos.lab`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forewarn.chaos.daemons import LabAgent
from forewarn.demo.launch import python_module
from forewarn.spawn import workload

if TYPE_CHECKING:
    from forewarn.chaos.lab import Lab

HW_FAULTS = ("ecc_storm", "pcie_replay", "remap_growth", "thermal_runaway")
"""The fault on simulated GPU 0, 1, 2, 3 of ``chaos-node-2``."""


class HardwareRig:
    """Agent ``chaos-node-2`` with one scripted fault per GPU and one job per GPU."""

    NODE = "chaos-node-2"

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        o = lab.options
        self.collector = lab.main_collector()
        faults = "".join(
            f'\n[[faults]]\ngpu = {g}\nkind = "{kind}"\nstart_s = {o.hw_fault_start_s}\n'
            f"duration_s = {o.hw_fault_duration_s}\n"
            + ("recover = false\n" if kind == "thermal_runaway" else "")
            for g, kind in enumerate(HW_FAULTS))
        self.scenario = (
            '# forewarn chaos: one fault per simulated GPU, all values simulated\n'
            'name = "chaos-node-2"\ndescription = "one scripted fault per GPU"\n'
            f"gpus = {len(HW_FAULTS)}\nseed = 5\n{faults}")
        self.agent = LabAgent(lab, "agent-node-2", self.NODE, self.collector.url,
                              self.collector.tokens[self.NODE], self.scenario,
                              interval_s=o.agent_interval_s, push_s=o.push_interval_s,
                              sim_speed=o.hw_sim_speed)
        self.logs: dict[int, Path] = {}
        for g in range(len(HW_FAULTS)):
            log = lab.dir / f"hw-job-gpu{g}.jsonl"
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            lab.procs.spawn(f"hw-job-{g}", python_module(
                workload.__name__, "light", "--job", self.job(g), "--gpu", str(g),
                "--socket", self.agent.socket, "--checkpoint-dir",
                str(lab.dir / f"hw-ckpt-{g}")), log, env)
            self.logs[g] = log

    @staticmethod
    def job(gpu: int) -> str:
        return f"chaos-hw-gpu{gpu}"

    def events(self, gpu: int) -> list[dict[str, Any]]:
        out = []
        for line in self.logs[gpu].read_text(errors="replace").splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if isinstance(e, dict):
                out.append(e)
        return out

    def sim_start(self) -> float:
        """Wall time the simulated node's scenario began (from the agent's start; the
        sim clock starts when the agent opens its backend, within a second of this)."""
        return self.agent.started

