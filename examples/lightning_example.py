"""PyTorch Lightning with the forewarn callback: a tiny regression model on synthetic data.

    python examples/lightning_example.py --steps 50 --out /tmp/pl-run

:class:`forewarn.hook.lightning.ForewarnCallback` reports every optimizer step (with the
loss tensor Lightning returns) to the node's forewarn agent and, when the agent orders a
checkpoint (or SIGTERM arrives), calls ``trainer.save_checkpoint`` at that step on every
rank. With no agent running, training is unchanged.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

from forewarn.hook.lightning import ForewarnCallback

_Base: Any = pl.LightningModule


class Regressor(_Base):  # type: ignore[misc]
    """y = sum of the first four features, learnt by a small MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", default="lightning-run")
    ap.add_argument("--job", default=None)
    ap.add_argument("--socket", default=None, help="agent socket (default $FOREWARN_SOCKET)")
    args = ap.parse_args(argv)
    pl.seed_everything(1234, verbose=False)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 16, generator=g)
    y = x[:, :4].sum(dim=1, keepdim=True)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    callback = ForewarnCallback(job=args.job, socket_path=args.socket)
    trainer = pl.Trainer(
        max_steps=args.steps, accelerator="auto", devices=1, default_root_dir=args.out,
        callbacks=[callback], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Regressor(), loader)
    print(f"done: {trainer.global_step} steps, ordered checkpoints: {callback.saved}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
