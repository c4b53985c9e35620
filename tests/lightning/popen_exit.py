"""Two ZeRO-3 fits on one Trainer, 2 ranks started by Lightning's popen launcher, that read the full weights right after
the last ``fit``, as a script that saves them does: collectives up to the moment the interpreter ends (see [Note:
groups alive at exit] in lightning_zero/core/comm/groups.py); the groups live on between the fits.

``python tests/lightning/popen_exit.py``: this process is rank 0 and Lightning starts the script again as rank 1.
At the end rank 0 waits for rank 1 and prints ``rank 1 exit status N``. Run by tests/lightning/test_launcher.py.
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    model = Model()
    data = TensorDataset(torch.randn(48, 8), torch.randn(48, 1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ZeroStrategy(stage=3, start_method="popen"),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=4))
    trainer.fit_loop.epoch_loop.max_steps = 6  # a Trainer counts steps across fits
    trainer.fit(model, DataLoader(data, batch_size=4))
    assert trainer.global_step == 6
    with trainer.strategy.gathered_params():
        state = {name: value.detach().clone() for name, value in model.state_dict().items()}
    assert all(value.numel() > 0 for value in state.values())
    for proc in getattr(trainer.strategy.launcher, "procs", []):  # rank 0 only: the processes it started
        print(f"rank 1 exit status {proc.wait(timeout=120)}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
