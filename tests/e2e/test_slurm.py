"""forewarn under a real Slurm 22.05 (Debian's slurm-wlm and munge) on this machine.

One module-scoped cluster (:mod:`support.slurm`): munged, ``slurmctld -D``, ``slurmd -D``
as root, one node (this host) with two mknod'ed GPU devices. The tests: the hook's job
identity from the Slurm environment, a drain through the collector's drain template and
``sinfo -R``, preemption of a 2-task training job and its resume, and the shipped prolog
draining the node when ``forewarn check`` finds an unhealthy GPU.

Skips only when not root or when the packages are not installed (and fails then under
CI, where ./dev installs them).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from forewarn.collector.decide.drain import DrainRunner

from support.paths import TESTS
from support.polling import free_port
from support.slurm import CPUS, REPO, SlurmCluster, missing_binaries

PY = sys.executable
FOREWARN = str(Path(PY).with_name("forewarn"))
EXAMPLE = REPO / "examples" / "plain_pytorch.py"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    if os.geteuid() != 0:
        pytest.skip("Slurm tests run slurmctld/slurmd and mknod as root; not root")
    missing = missing_binaries()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"{missing} not installed; ./dev must install slurm-wlm and munge")
        pytest.skip(f"Slurm is not installed ({', '.join(missing)}): "
                    "apt-get install slurm-wlm munge")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def idle(slurm: SlurmCluster) -> Iterator[SlurmCluster]:
    """The cluster with its node idle before and after the test."""
    slurm.wait_state("idle")
    yield slurm
    slurm.cleanup()


# -- 1. job identity ---------------------------------------------------------------------

IDENTITY_TASK = """\
import json, os
from forewarn.hook import Monitor
m = Monitor(socket_path="/nonexistent/forewarn.sock", handle_sigterm=False)
i = m.identity
m.close()
keys = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS",
        "SLURM_LOCALID", "SLURM_STEP_NODELIST")
env = {k: os.environ.get(k) for k in keys}
print(json.dumps({"job": i.job, "rank": i.rank, "world_size": i.world_size,
                  "local_rank": i.local_rank, "host": i.host, "env": env}), flush=True)
"""


def _identities(stdout: str) -> list[dict[str, Any]]:
    found = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return sorted(found, key=lambda d: int(d["rank"]))


def test_monitor_identity_from_srun_environment(idle: SlurmCluster, tmp_path: Path) -> None:
    task = tmp_path / "identity.py"
    task.write_text(IDENTITY_TASK)
    # an allocation of 3 tasks whose step runs 2: the world is the step's, not the job's
    out = idle.run(["salloc", "-n3", "srun", "-n2", PY, str(task)], timeout=120).stdout
    ids = _identities(out)
    assert [d["rank"] for d in ids] == [0, 1], out
    for d in ids:
        env = d["env"]
        assert isinstance(env, dict)
        assert d["job"] == f"slurm-{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}"
        assert d["rank"] == int(env["SLURM_PROCID"])
        assert d["world_size"] == int(env["SLURM_STEP_NUM_TASKS"]) == 2
        assert d["local_rank"] == int(env["SLURM_LOCALID"])
        assert env["SLURM_STEP_NODELIST"] == idle.node
        assert d["host"].split(".")[0] == idle.node


def test_two_steps_of_one_allocation_are_two_jobs(idle: SlurmCluster, tmp_path: Path) -> None:
    """Two steps running side by side in one allocation each have a rank 0: with the job
    id alone their records would land in one rank table at the agent."""
    task = tmp_path / "identity.py"
    task.write_text(IDENTITY_TASK)
    script = tmp_path / "steps.sh"
    script.write_text(f"#!/bin/sh\nsrun -n1 --exact {PY} {task} &\n"
                      f"srun -n1 --exact {PY} {task} &\nwait\n")
    out = idle.run(["salloc", "-n2", "sh", str(script)], timeout=120).stdout
    ids = _identities(out)
    assert len(ids) == 2, out
    assert ids[0]["job"] != ids[1]["job"]
    assert all(d["rank"] == 0 and d["world_size"] == 1 for d in ids)


def test_batch_script_itself_is_the_job(idle: SlurmCluster, tmp_path: Path) -> None:
    task = tmp_path / "identity.py"
    task.write_text(IDENTITY_TASK)
    script = _write(tmp_path / "batch.sh", f"#!/bin/sh\n#SBATCH --output={tmp_path}/b.out\n"
                    f"exec {PY} {task}\n")
    job = _submit(idle, script)
    assert idle.wait_job(job, ("COMPLETED", "FAILED")) == "COMPLETED"
    [d] = _identities((tmp_path / "b.out").read_text())
    assert (d["job"], d["rank"], d["world_size"]) == (f"slurm-{job}", 0, 1)


# -- 2. drain through the collector's template -------------------------------------------

def test_drain_template_drains_with_reason_in_sinfo(
        idle: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_CONF", str(idle.conf))
    runner = DrainRunner(
        ["scontrol", "update", "nodename={node}", "state=drain", "reason={reason}"],
        enabled=True)
    res = runner.run(idle.node, "forewarn: XID 79 on GPU 1 (fell off the bus)")
    assert res.ran and res.returncode == 0, res
    idle.wait_state("drained")
    assert idle.drain_reason() == "forewarn: XID 79 on GPU 1 fell off the bus"
    idle.resume()
    assert idle.drain_reason() == ""


# -- 3. preemption and resume ------------------------------------------------------------

def _train_script(tmp_path: Path, ckpt: Path, steps: int, name: str) -> Path:
    """A batch script: 2 tasks of the plain PyTorch example (gloo, DDP, DCP checkpoints)
    with the forewarn hook and no agent (its socket does not exist)."""
    script = tmp_path / f"{name}.sh"
    script.write_text(f"""#!/bin/sh
#SBATCH --ntasks=2
#SBATCH --output={tmp_path}/{name}.out
export MASTER_ADDR=127.0.0.1 MASTER_PORT={free_port()} OMP_NUM_THREADS=1
exec srun --kill-on-bad-exit=0 sh -c 'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS \\
  LOCAL_RANK=$SLURM_LOCALID exec {PY} {EXAMPLE} --device cpu --steps {steps} \\
  --ckpt-dir {ckpt} --step-sleep 0.05 --socket {tmp_path}/no-agent.sock'
""")
    return script


def _submit(cluster: SlurmCluster, script: Path, *flags: str) -> str:
    # --chdir: the default slurm-<id>.out lands next to the script, not in the checkout
    out = cluster.run(["sbatch", "--parsable", f"--chdir={script.parent}", *flags,
                       str(script)]).stdout.strip()
    return out.split(";")[0]


def _wait_output(path: Path, pattern: str, timeout: float = 120.0) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text() if path.exists() else ""
        m = re.search(pattern, text, re.MULTILINE)
        if m:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"no {pattern!r} in {path} within {timeout} s:\n{text[-3000:]}")
        time.sleep(0.2)


def _saved_steps(text: str) -> dict[int, int]:
    return {int(r): int(s) for r, s in re.findall(r"^rank (\d) saved step (\d+)", text, re.M)}


def _resume(cluster: SlurmCluster, tmp_path: Path, ckpt: Path, saved: int) -> None:
    """A new job on the same checkpoint directory starts right after the saved step."""
    job = _submit(cluster, _train_script(tmp_path, ckpt, saved + 3, "resume"))
    assert cluster.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED")) == "COMPLETED"
    text = (tmp_path / "resume.out").read_text()
    assert f"start step {saved + 1}" in text, text


@pytest.mark.parametrize("scancel", [
    ["scancel"],  # SIGCONT+SIGTERM to every task and the batch shell, SIGKILL after KillWait
    ["scancel", "--signal=TERM"],  # SIGTERM to every task only
], ids=["scancel", "scancel-signal-TERM"])
def test_scancel_every_rank_saves_one_step_and_a_new_job_resumes(
        idle: SlurmCluster, tmp_path: Path, scancel: list[str]) -> None:
    ckpt = tmp_path / "ckpt"
    job = _submit(idle, _train_script(tmp_path, ckpt, 100_000, "train"))
    out = tmp_path / "train.out"
    _wait_output(out, r"^step 20 ")
    idle.run([*scancel, job])
    try:
        idle.wait_job(job, ("CANCELLED", "COMPLETED", "FAILED"), timeout=60)
    except AssertionError as exc:  # say what the ranks printed (once seen under CI load)
        raise AssertionError(f"{exc}\n--- {out.name}\n{out.read_text()[-3000:]}") from None
    saved = _saved_steps(out.read_text())
    assert set(saved) == {0, 1} and len(set(saved.values())) == 1, out.read_text()[-3000:]
    step = saved[0]
    assert (ckpt / f"step-{step:09d}" / "manifest.json").exists()
    _resume(idle, tmp_path, ckpt, step)


def test_preemption_requeue_every_rank_saves_and_the_requeued_job_resumes(
        idle: SlurmCluster, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    job = _submit(idle, _train_script(tmp_path, ckpt, 100_000, "train"), "--requeue",
                  "--partition=low")
    out = tmp_path / "train.out"
    _wait_output(out, r"^step 20 ")
    hi = _submit(idle, _write(tmp_path / "hi.sh", "#!/bin/sh\ntrue\n"), "--partition=high",
                 f"--ntasks={CPUS}")
    idle.wait_job(hi, ("COMPLETED", "FAILED"), timeout=120)
    saved = _saved_steps(out.read_text())
    assert set(saved) == {0, 1} and len(set(saved.values())) == 1, out.read_text()[-3000:]
    step = saved[0]
    # Slurm's preemption sends SIGTERM, SIGCONT, SIGTERM within milliseconds: the hook saves
    # once (a repeated signal within the grace is absorbed). The requeued job runs again on
    # the same directory, after Slurm's requeue delay (about 2 minutes), from the saved step.
    try:
        _wait_output(out, rf"^start step {step + 1}$", timeout=240)
    except AssertionError as exc:
        shown = idle.run(["scontrol", "-o", "show", "job", job], check=False).stdout
        raise AssertionError(f"{exc}\n{shown}") from None


# -- the prolog: forewarn check drains a node with an unhealthy GPU ----------------------

DATA = TESTS / "data"
BAD_GPU = DATA / "gpu1-off-the-bus.toml"
HEALTHY = DATA / "gpus2-healthy.toml"


def test_prolog_drains_node_with_unhealthy_gpu(idle: SlurmCluster, tmp_path: Path) -> None:
    (idle.dir / "prolog.env").write_text(
        f"FOREWARN={FOREWARN}\nFOREWARN_CHECK_ARGS='--source sim --scenario {BAD_GPU}'\n")
    job = _submit(idle, _write(tmp_path / "true.sh", "#!/bin/sh\ntrue\n"))
    idle.wait_state("drained")
    reason = idle.drain_reason()
    assert reason.startswith("forewarn prolog: unhealthy gpu_lost: GPU 1"), reason
    # Slurm requeues the job (held: a prolog failure) instead of running it here
    assert idle.job_state(job) in ("PENDING", "REQUEUE_HOLD", "REQUEUED"), idle.job_state(job)


def test_prolog_lets_a_job_run_on_a_healthy_node(idle: SlurmCluster, tmp_path: Path) -> None:
    (idle.dir / "prolog.env").write_text(
        f"FOREWARN={FOREWARN}\nFOREWARN_CHECK_ARGS='--source sim --scenario {HEALTHY}'\n")
    job = _submit(idle, _write(tmp_path / "true.sh", "#!/bin/sh\ntrue\n"))
    assert idle.wait_job(job, ("COMPLETED", "FAILED", "REQUEUE_HOLD")) == "COMPLETED"
    assert idle.node_state() == "idle"


def test_epilog_drains_node_whose_gpu_broke_during_the_job(
        idle: SlurmCluster, tmp_path: Path) -> None:
    (idle.dir / "epilog.env").write_text(
        f"FOREWARN={FOREWARN}\nFOREWARN_CHECK_ARGS='--source sim --scenario {BAD_GPU}'\n")
    job = _submit(idle, _write(tmp_path / "true.sh", "#!/bin/sh\ntrue\n"))
    assert idle.wait_job(job, ("COMPLETED", "FAILED")) == "COMPLETED"
    idle.wait_state("drained")
    assert idle.drain_reason().startswith("forewarn epilog: unhealthy gpu_lost: GPU 1")


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
