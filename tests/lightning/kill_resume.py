"""A 2-rank ZeRO-3 fit on the CPU that checkpoints after its first epoch (sharded) and, asked to, is killed later.

``python tests/lightning/kill_resume.py OUT [--kill-at STEP] [--resume CKPT] [--ddp]``: Lightning's popen launcher
starts rank 1; rank 1 SIGKILLs itself before batch STEP. At the end rank 0 writes the full parameters to
``OUT/final.pt``.
Run by tests/lightning/test_kill_resume.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy

STEPS_PER_EPOCH = 4
MAX_STEPS = 12


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 3, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class SaveAt(pl.Callback):
    """``trainer.save_checkpoint`` (sharded) right after step ``step``, the end of the first epoch: Lightning restores
    its loops exactly from a checkpoint saved there (see tests/lightning/models.py, ``SaveAt``)."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


class KillAt(pl.Callback):
    """Rank 1 is killed (SIGKILL: no cleanup, as the out-of-memory killer does) before batch ``step``."""

    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_rank == 1 and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--resume")
    parser.add_argument("--ddp", action="store_true", help="Lightning's DDP instead (the reference)")
    args = parser.parse_args()
    pl.seed_everything(0)
    model = Model()
    generator = torch.Generator().manual_seed(1)
    samples = 2 * 4 * STEPS_PER_EPOCH  # 2 ranks, batches of 4
    data = TensorDataset(torch.randn(samples, 8, generator=generator), torch.randn(samples, 1, generator=generator))
    loader = DataLoader(data, batch_size=4)  # Lightning's DistributedSampler splits it
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp" if args.ddp else ZeroStrategy(stage=3, start_method="popen", timeout=timedelta(seconds=60)),
        max_steps=MAX_STEPS,
        callbacks=[SaveAt(STEPS_PER_EPOCH, args.out / "epoch0.ckpt"), KillAt(args.kill_at)],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(args.out),
    )
    trainer.fit(model, loader, ckpt_path=args.resume)
    gathered = getattr(trainer.strategy, "gathered_params", contextlib.nullcontext)
    with gathered():
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if trainer.global_rank == 0:
        torch.save({"state": state, "global_step": trainer.global_step}, args.out / "final.pt")


if __name__ == "__main__":
    main()
