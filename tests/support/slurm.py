"""A real one-node Slurm cluster for tests: munged, ``slurmctld -D`` and ``slurmd -D`` run
as root from a slurm.conf written in a temp dir (Debian's ``slurm-wlm`` 22.05 and
``munge``).

The node is this host (``hostname -s``) with two GPUs whose GRES ``File=`` are character
devices made with ``mknod`` (major 195, like /dev/nvidiaN: slurmd refuses plain files).
Two partitions, ``low`` (default) and ``high``, let a high-priority job preempt
(``preempt/partition_prio``, ``PreemptMode=REQUEUE``). ``Prolog=`` (``Epilog=``) runs
``<dir>/prolog`` (``epilog``) which does nothing until a test writes ``<dir>/prolog.env``
(``epilog.env``); then it runs ``deploy/slurm/prolog.sh`` (``epilog.sh``) with those
settings. Client commands find the cluster
through :attr:`SlurmCluster.env` (``SLURM_CONF``).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from support.polling import free_port

__all__ = ["BINARIES", "CPUS", "SlurmCluster", "missing_binaries"]

BINARIES = ("munged", "munge", "slurmctld", "slurmd", "sinfo", "srun", "sbatch", "scontrol",
            "scancel", "squeue")
CPUS = 8
"""CPUs the node claims (config_overrides): more tasks than this machine has cores."""
REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "slurm"


def missing_binaries() -> list[str]:
    """The Slurm/munge programs that are not installed."""
    return [b for b in BINARIES if shutil.which(b) is None]


def _die_with_parent() -> None:
    """In the daemon's child before exec: SIGTERM it when the test process dies, so a
    killed test run leaves no daemon behind (prctl PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)


def _mknod_gpus(devdir: Path, count: int) -> list[Path]:
    devdir.mkdir()
    paths = []
    for i in range(count):
        path = devdir / f"nvidia{i}"
        os.mknod(path, 0o600 | 0o020000, os.makedev(195, i))  # S_IFCHR
        paths.append(path)
    return paths


class SlurmCluster:
    """Start with :meth:`start`, stop with :meth:`stop` (every daemon it started)."""

    def __init__(self, directory: Path, gpus: int = 2) -> None:
        self.dir = directory
        self.node = socket.gethostname().split(".")[0]
        self.gpus = gpus
        self.conf = directory / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._procs: list[subprocess.Popen[bytes]] = []

    # -- lifecycle

    def start(self, timeout: float = 60.0) -> None:
        """Write the config, start munged (unless one answers), slurmctld and slurmd, and
        wait until ``sinfo`` shows the node idle."""
        self._write_config()
        self._start_munge()
        for daemon in ("slurmctld", "slurmd"):
            log = open(self.dir / f"{daemon}.out", "wb")  # noqa: SIM115 (owned by the process)
            self._procs.append(subprocess.Popen(
                [daemon, "-D", "-f", str(self.conf)], env=self.env, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent))
            log.close()
        self.wait_state("idle", timeout)

    def stop(self) -> None:
        """Cancel every job, stop the daemons this cluster started (TERM, then KILL)."""
        if self._procs and self._procs[0].poll() is None:
            self.run(["scancel", "--full", "--user", "root"], check=False)
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self._procs):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self._procs.clear()

    # -- client commands

    def run(self, argv: Sequence[str], check: bool = True, timeout: float = 60.0,
            extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a client command against this cluster; output captured as text."""
        env = {**self.env, **(extra_env or {})}
        proc = subprocess.run(list(argv), env=env, capture_output=True, text=True,
                              timeout=timeout, check=False, stdin=subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}:\n"
                                 f"{proc.stdout}\n{proc.stderr}\n{self.logs()}")
        return proc

    def node_state(self) -> str:
        """The node's state as sinfo prints it (``idle``, ``drain``, ``mix``...)."""
        out = self.run(["sinfo", "-h", "-N", "-n", self.node, "-o", "%T"], check=False)
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""

    def drain_reason(self) -> str:
        """The reason ``sinfo -R`` lists for the node ("" when none)."""
        out = self.run(["sinfo", "-R", "-h", "-n", self.node, "-o", "%E"], check=False)
        return out.stdout.strip()

    def wait_state(self, state: str, timeout: float = 60.0) -> None:
        """Poll sinfo until the node is in ``state`` (fail with the daemons' logs)."""
        deadline = time.monotonic() + timeout
        while (seen := self.node_state()) != state:
            dead = [str(p.args) for p in self._procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise AssertionError(f"node {self.node} not {state} (is {seen!r}; exited: "
                                     f"{dead})\n{self.logs()}")
            time.sleep(0.2)

    def resume(self) -> None:
        """Return the node to service and wait until it is idle."""
        self.run(["scontrol", "update", f"nodename={self.node}", "state=resume"])
        self.wait_state("idle")

    def cleanup(self) -> None:
        """Between tests: cancel every job, turn prolog and epilog off, resume a drained node."""
        self.run(["scancel", "--full", "--user", "root"], check=False)
        for script in ("prolog", "epilog"):
            (self.dir / f"{script}.env").unlink(missing_ok=True)
        deadline = time.monotonic() + 60
        while (state := self.node_state()) != "idle":
            if state.startswith("drain"):
                self.resume()
            elif time.monotonic() > deadline:
                raise AssertionError(f"node {self.node} stays {state!r}\n{self.logs()}")
            time.sleep(0.2)

    def job_state(self, job: str) -> str:
        """The job's state from scontrol (``RUNNING``, ``COMPLETED``, ``PENDING``...)."""
        out = self.run(["scontrol", "-o", "show", "job", job], check=False).stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return ""

    def wait_job(self, job: str, states: Sequence[str], timeout: float = 120.0) -> str:
        """Poll until the job is in one of ``states``; return that state."""
        deadline = time.monotonic() + timeout
        while (seen := self.job_state(job)) not in states:
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job} not in {states} (is {seen!r})\n{self.logs()}")
            time.sleep(0.2)
        return seen

    def logs(self) -> str:
        """The tail of each daemon's log, for failure messages."""
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.dir / name
            if path.exists():
                parts.append(f"--- {name}\n" + "\n".join(path.read_text().splitlines()[-30:]))
        return "\n".join(parts)

    # -- setup

    def _start_munge(self) -> None:
        if subprocess.run("munge -n | unmunge", shell=True, capture_output=True,
                          check=False).returncode == 0:
            return  # a munged already answers (the host's own)
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True)
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
        run = Path("/run/munge")
        run.mkdir(exist_ok=True)
        shutil.chown(run, "munge", "munge")
        self._procs.append(subprocess.Popen(
            ["runuser", "-u", "munge", "--", "munged", "--foreground"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent))
        deadline = time.monotonic() + 20
        while subprocess.run("munge -n | unmunge", shell=True, capture_output=True,
                             check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise AssertionError("munged did not answer within 20 s")
            time.sleep(0.1)

    def _write_config(self) -> None:
        d = self.dir
        for sub in ("state", "spool"):
            (d / sub).mkdir()
        devs = _mknod_gpus(d / "dev", self.gpus)
        (d / "gres.conf").write_text("".join(
            f"NodeName={self.node} Name=gpu File={p}\n" for p in devs))
        for script in ("prolog", "epilog"):
            path = d / script
            path.write_text(
                "#!/bin/sh\n"
                f'[ -r "{d}/{script}.env" ] || exit 0\n'
                f'set -a; . "{d}/{script}.env"; set +a\n'
                f'SLURM_CONF="{self.conf}"; export SLURM_CONF\n'
                f'exec "{DEPLOY / (script + ".sh")}"\n')
            path.chmod(0o755)
        self.conf.write_text(f"""\
ClusterName=forewarn
SlurmctldHost={self.node}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
GresTypes=gpu
KillWait=30
ReturnToService=2
SlurmdParameters=config_overrides
Prolog={d}/prolog
Epilog={d}/epilog
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName={self.node} CPUs={CPUS} RealMemory=1000 Gres=gpu:{self.gpus} State=UNKNOWN
PartitionName=low Nodes={self.node} Default=YES PriorityTier=1 MaxTime=INFINITE State=UP
PartitionName=high Nodes={self.node} PriorityTier=10 MaxTime=INFINITE State=UP
""")
