"""TrainingState: a run killed (SIGKILL) and resumed from forewarn's checkpoint ends
bit-identical to the uninterrupted run, for DDP and FSDP2 on 2 gloo ranks; without the
RNG or sampler state it does not. Plus the pieces: safe RNG form, the sampler, the
world-size-1 path keeping optimizer momentum."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from forewarn.hook import CheckpointWriter, ResumableSampler, TrainingState  # noqa: E402
from forewarn.hook.state import capture_rng, restore_rng  # noqa: E402

from support.paths import TESTS  # noqa: E402
from support.polling import free_port  # noqa: E402

WORKER = TESTS / "resume_worker.py"
STEPS, SAVE_AT, KILL_AT = 30, 14, 19  # 24 samples per rank, batch 4: epochs of 6 steps
_TORCH_EXIT_ABORT = "terminate called without an active exception"  # see test_hook_checkpoint


def _ranks(args: list[str], ckpt: Path, out: Path, expect: int = 0) -> None:
    """Run the two ranks of the worker; ``expect`` is each rank's exit code."""
    out.mkdir(exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), *args, "--steps", str(STEPS), "--ckpt", str(ckpt),
             "--out", str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True))
    outs = [p.communicate(timeout=240) for p in procs]  # a failing rank's peer says little:
    told = "\n".join(f"--- rank {r}: exit {p.returncode}\n{so}{se[-3000:]}"  # show both
                     for r, (p, (so, se)) in enumerate(zip(procs, outs, strict=True)))
    for p, (_, se) in zip(procs, outs, strict=True):
        if expect == 0 and p.returncode == -6 and se.strip().endswith(_TORCH_EXIT_ABORT):
            continue  # torch's own exit-time abort after DCP, once the work is all done
        assert p.returncode == expect, told


def _final(out: Path) -> list[dict[str, object]]:
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def _differences(a: list[dict[str, object]], b: list[dict[str, object]]) -> list[str]:
    diff = []
    for r, (x, y) in enumerate(zip(a, b, strict=True)):
        assert sorted(x) == sorted(y)
        diff += [f"rank {r} {k}" for k in x if not torch.equal(x[k], y[k])]
    return diff


def _killed_and_resumed(tmp_path: Path, mode: str, *extra: str) -> list[dict[str, object]]:
    ck, out = tmp_path / "ck-resumed", tmp_path / "resumed"
    _ranks(["--mode", mode, "--save-at", str(SAVE_AT), "--kill-at", str(KILL_AT), *extra],
           ck, out, expect=-signal.SIGKILL)
    assert [s for s, _ in CheckpointWriter(ck).checkpoints()] == [SAVE_AT]
    _ranks(["--mode", mode, *extra], ck, out)
    return _final(out)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, object]]]:
    runs = {}
    for mode in ("ddp", "fsdp"):
        base = tmp_path_factory.mktemp(mode)
        # saves at SAVE_AT like the killed run: a save must not change the training
        _ranks(["--mode", mode, "--save-at", str(SAVE_AT)], base / "ck", base / "out")
        runs[mode] = _final(base / "out")
    return runs


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_killed_and_resumed_run_ends_bitwise_identical(
    tmp_path: Path, uninterrupted: dict[str, list[dict[str, object]]], mode: str
) -> None:
    resumed = _killed_and_resumed(tmp_path, mode)
    assert _differences(uninterrupted[mode], resumed) == []
    # the comparison covers parameters, AdamW's moments and step, the EMA, the sampler
    keys = set(resumed[0])
    assert any(".exp_avg_sq" in k for k in keys) and any(k.endswith(".step") for k in keys)
    assert mode == "fsdp" or any(k.startswith("ema.") for k in keys)


def test_async_save_resumes_bitwise_identical(
    tmp_path: Path, uninterrupted: dict[str, list[dict[str, object]]]
) -> None:
    resumed = _killed_and_resumed(tmp_path, "ddp", "--async-save")
    assert _differences(uninterrupted["ddp"], resumed) == []


@pytest.mark.parametrize("without", ["rng", "sampler"])
def test_without_rng_or_sampler_state_the_resume_differs(
    tmp_path: Path, uninterrupted: dict[str, list[dict[str, object]]], without: str
) -> None:
    """The control: what the bitwise test would see if forewarn saved only what the user
    passed (model, optimizer, scheduler...), as it did before TrainingState."""
    resumed = _killed_and_resumed(tmp_path, "ddp", "--without", without)
    assert any(k.startswith("rank 0 model.") for k in _differences(uninterrupted["ddp"], resumed))


def test_rng_state_round_trips_through_weights_only_load(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    np.random.standard_normal()  # and in numpy's
    saved = capture_rng()
    want = (random.random(), random.gauss(0, 1), np.random.standard_normal(), torch.rand(3))
    torch.save(saved, tmp_path / "rng.pt")
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    restore_rng(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (random.random(), random.gauss(0, 1), np.random.standard_normal(), torch.rand(3))
    assert got[:3] == want[:3] and torch.equal(got[3], want[3])


def test_world_size_one_keeps_optimizer_momentum_scheduler_and_rng(tmp_path: Path) -> None:
    def build() -> tuple[object, object, object]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, optim, torch.optim.lr_scheduler.StepLR(optim, 2, gamma=0.5)

    def train(model: object, optim: object, sched: object, steps: range) -> None:
        for _ in steps:
            optim.zero_grad()  # type: ignore[attr-defined]
            model(torch.ones(2, 4)).sum().backward()  # type: ignore[operator]
            optim.step()  # type: ignore[attr-defined]
            sched.step()  # type: ignore[attr-defined]

    writer = CheckpointWriter(tmp_path)
    model, optim, sched = build()
    state = TrainingState(model, optim, scheduler=sched)
    assert state.resume(writer) == 0
    train(model, optim, sched, range(3))
    writer.save(2, state.state_dict(2))
    train(model, optim, sched, range(3, 6))
    want = [p.clone() for p in model.parameters()]  # type: ignore[attr-defined]

    model2, optim2, sched2 = build()
    torch.manual_seed(42)  # a different RNG: the checkpoint must restore it
    state2 = TrainingState(model2, optim2, scheduler=sched2)
    assert state2.resume(writer) == 3
    assert optim2.state_dict()["state"][0]["momentum_buffer"] is not None  # type: ignore[attr-defined]
    train(model2, optim2, sched2, range(3, 6))
    got = list(model2.parameters())  # type: ignore[attr-defined]
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_resume_without_a_checkpoint_leaves_a_fresh_optimizer_fresh(tmp_path: Path) -> None:
    """torch's get_state_dict initialises an empty optimizer by a zero-lr step (Adam's
    step count becomes 1); a first run must train exactly as without forewarn."""
    model = torch.nn.Linear(3, 1)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert TrainingState(model, optim).resume(CheckpointWriter(tmp_path)) == 0
    finally:
        torch.distributed.destroy_process_group()
    assert not optim.state and all(p.grad is None for p in model.parameters())


def test_sampler_resumes_mid_epoch_and_shards_by_rank() -> None:
    whole = [list(ResumableSampler(10, seed=3, num_replicas=2, rank=r)) for r in range(2)]
    assert sorted(whole[0] + whole[1]) == list(range(10))
    s = ResumableSampler(10, seed=3, num_replicas=2, rank=1)
    it = iter(s)
    head = [next(it), next(it)]
    saved = s.state_dict()
    s2 = ResumableSampler(10, seed=3, num_replicas=2, rank=1)
    s2.load_state_dict(saved)
    assert head + list(s2) == whole[1]
    # the next iteration is epoch 1, the order set_epoch(1) gives
    s3 = ResumableSampler(10, seed=3, num_replicas=2, rank=1)
    s3.set_epoch(1)
    s3.set_epoch(1)  # the current epoch again: keeps its position
    assert list(s2) == list(s3) != whole[1] and s2.epoch == 1
    with pytest.raises(ValueError, match="length 10 seed 3"):
        ResumableSampler(11, seed=3, num_replicas=2, rank=1).load_state_dict(saved)


def test_objects_without_state_dict_are_refused_by_name() -> None:
    with pytest.raises(TypeError, match="scheduler: object has no state_dict"):
        TrainingState(torch.nn.Linear(1, 1), scheduler=object())  # type: ignore[arg-type]


def test_model_only_state_round_trips(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path)
    model = torch.nn.Linear(2, 2)
    writer.save(0, TrainingState(model, rng=False).state_dict(0))
    model2 = torch.nn.Linear(2, 2)
    assert TrainingState(model2, rng=False).resume(writer) == 1
    assert torch.equal(model.weight, model2.weight)
