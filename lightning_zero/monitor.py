"""ZeroMonitor: logs the strategy's memory_report() and communication bytes after each optimizer step."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_zero.strategy import ZeroStrategy


class ZeroMonitor(Callback):
    """Log ``zero/params_bytes``, ``zero/gradients_bytes``, ``zero/optimizer_states_bytes``,
    ``zero/offloaded_bytes`` and ``zero/comm_bytes``.

    The byte counts are this rank's model states measured from the tensors it holds after the step, and the
    bytes it moved in collectives during that step. Logged by rank 0, every ``log_every_n_steps``.

    Raises:
        ValueError: when the Trainer's strategy is not a :class:`~lightning_zero.ZeroStrategy`.
    """

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not isinstance(trainer.strategy, ZeroStrategy):
            raise ValueError(
                f"ZeroMonitor needs Trainer(strategy=ZeroStrategy(...)), got {type(trainer.strategy).__name__}."
            )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, ZeroStrategy)
        report = strategy.memory_report()
        metrics = {
            "zero/params_bytes": float(report.params),
            "zero/gradients_bytes": float(report.gradients),
            "zero/optimizer_states_bytes": float(report.optimizer_states),
            "zero/offloaded_bytes": float(report.offloaded),
            "zero/comm_bytes": float(strategy.comm_report().nbytes),
        }
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)
