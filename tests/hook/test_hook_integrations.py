"""Lightning and Hugging Face callbacks on CPU with tiny models, against a test socket."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from forewarn import wire
from forewarn.hook import Monitor

from support.polling import wait_for

torch = pytest.importorskip("torch")


class Agent:
    """The agent's side of the hook socket: a thread decodes everything as it arrives (the
    kernel queues only net.unix.max_dgram_qlen datagrams), and it can send orders."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.msgs: list[wire.StepRecord | wire.Beat | wire.CheckpointReport] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                return
            if data == b"stop":
                return
            self.msgs.append(wire.decode_hook_message(data))

    def drain(self) -> list[wire.StepRecord | wire.Beat | wire.CheckpointReport]:
        """Everything received; stops the reader (call after the monitor is closed)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(b"stop", self.path)
        self._thread.join(5)
        return self.msgs

    def first_beat(self) -> wire.Beat:
        beat: wire.Beat = wait_for(
            lambda: next((m for m in list(self.msgs) if isinstance(m, wire.Beat)), None),
            what="a beat", interval=0.01)
        return beat

    def order(self, reply_to: str, job: str, step: int) -> None:
        o = wire.CheckpointOrder(request_id=f"o{step}", job=job, step=step, issued=time.time())
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(wire.encode(o), reply_to)


@pytest.fixture
def agent() -> Iterator[Agent]:
    d = tempfile.mkdtemp(prefix="fw-")
    a = Agent(os.path.join(d, "agent.sock"))
    yield a
    a.sock.close()
    shutil.rmtree(d, ignore_errors=True)


def _ordered_monitor(agent: Agent, step: int) -> Monitor:
    mon = Monitor(job="integ", rank=0, world_size=1, socket_path=agent.path,
                  handle_sigterm=False, beat_interval_s=0.2)
    beat = agent.first_beat()
    agent.order(beat.reply_to, "integ", step)
    wait_for(lambda: mon.stats.orders, what="the order", interval=0.01)
    assert mon.stats.orders == 1
    return mon


def _reports(msgs: Sequence[object]) -> list[tuple[str, int]]:
    return [(m.phase, m.step) for m in msgs if isinstance(m, wire.CheckpointReport)]


def test_lightning_callback_reports_steps_and_saves_at_the_ordered_step(
    tmp_path: Path, agent: Agent
) -> None:
    pl = pytest.importorskip("pytorch_lightning")
    from forewarn.hook.lightning import ForewarnCallback

    base: Any = pl.LightningModule

    class Tiny(base):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch: tuple[object, object], idx: int) -> object:
            x, y = batch
            return torch.nn.functional.mse_loss(self.lin(x), y)

        def configure_optimizers(self) -> object:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    mon = _ordered_monitor(agent, 5)
    cb = ForewarnCallback(monitor=mon, checkpoint_dir=tmp_path / "ck")
    trainer = pl.Trainer(max_steps=8, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path), callbacks=[cb])
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
    mon.close()
    assert cb.saved == [str(tmp_path / "ck" / "forewarn-step=5.ckpt")]
    ckpt = torch.load(cb.saved[0], map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 5 and "lin.weight" in ckpt["state_dict"]
    msgs = agent.drain()
    steps = [m for m in msgs if isinstance(m, wire.StepRecord)]
    assert [m.step for m in steps] == list(range(1, 9))
    assert all(m.loss is not None and m.loss >= 0 for m in steps)
    assert _reports(msgs) == [("started", 5), ("done", 5)]
    assert mon.dropped == 0
    done = [m for m in msgs if isinstance(m, wire.CheckpointReport)][-1]
    assert done.bytes == os.path.getsize(cb.saved[0]) and done.request_id == "o5"


def test_huggingface_callback_makes_the_trainer_save_at_the_ordered_step(
    tmp_path: Path, agent: Agent
) -> None:
    transformers = pytest.importorskip("transformers")
    from forewarn.hook.huggingface import ForewarnTrainerCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64,
                                     n_positions=16)
    model = transformers.GPT2LMHeadModel(config)  # built from a config: no download
    ids = torch.randint(0, 64, (32, 16))
    data = [{"input_ids": row, "labels": row} for row in ids]
    mon = _ordered_monitor(agent, 5)
    cb = ForewarnTrainerCallback(monitor=mon)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=8, per_device_train_batch_size=4,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
    trainer.train()
    mon.close()
    # save_strategy="no": the only checkpoint is the one forewarn asked for
    saved = sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("checkpoint"))
    assert saved == ["checkpoint-5"] and cb.saved_steps == [5]
    state = transformers.TrainerState.load_from_json(
        str(tmp_path / "out" / "checkpoint-5" / "trainer_state.json"))
    assert state.global_step == 5
    msgs = agent.drain()
    steps = [m for m in msgs if isinstance(m, wire.StepRecord)]
    timed = [m.step for m in steps if m.step_seconds is not None]
    assert timed == list(range(2, 9))  # step 1 has no previous step to time against
    with_loss = sorted({m.step for m in steps if m.loss is not None})
    assert with_loss == list(range(1, 9))
    assert _reports(msgs) == [("started", 5), ("done", 5)]
    assert mon.dropped == 0
    done = [m for m in msgs if isinstance(m, wire.CheckpointReport)][-1]
    assert done.bytes is not None and done.bytes > 0
    assert done.path.endswith("checkpoint-5")
