"""ZeroMonitor: logs the strategy's memory_report() and communication bytes after each optimizer step."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_zero.strategy import ZeroStrategy


class ZeroMonitor(Callback):
    """Log ``zero/params_bytes``, ``zero/gradients_bytes``, ``zero/optimizer_states_bytes``,
    ``zero/offloaded_bytes``, ``zero/comm_bytes``, ``zero/intra_node_bytes`` and ``zero/inter_node_bytes``; with
    ``shard_size`` also ``zero/shard_group_bytes`` and ``zero/replicate_group_bytes``. The step's peak:
    ``zero/peak_bytes`` and by kind ``zero/peak_model_states_bytes``, ``zero/peak_gathered_bytes``,
    ``zero/peak_buckets_bytes``, ``zero/peak_temporaries_bytes``, with ``secondary_shard_size``
    ``zero/peak_secondary_bytes`` and, on CUDA, ``zero/peak_activations_bytes`` (see
    :class:`~lightning_zero.MemoryReport`'s ``step_peak``). On CUDA the monitor has the strategy reset the
    allocator's peak statistics (``torch.cuda.reset_peak_memory_stats``) before each training forward, so that
    ``torch.cuda.max_memory_allocated()`` reads the step's peak.

    The byte counts are this rank's model states measured from the tensors it holds after the step, and the
    bytes it moved in collectives during that step (see ``ZeroStrategy.comm_report()``), in total, by where they
    travelled, and with hybrid sharding by group: inside its shard group (stage 3's gathers included) and across
    the replicas. With ``AsyncCheckpointIO``, ``zero/checkpoint_snapshot_bytes`` is the largest snapshot a
    background save held (see [Note: asynchronous sharded saves]). With ``"16-mixed"``, ``zero/loss_scale`` and
    ``zero/skipped_steps`` (steps skipped for overflow since the run began, see docs/precision.md). Logged by rank 0,
    every ``log_every_n_steps``.

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
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, ZeroStrategy)
        engine = strategy.session.engine_or_none
        if engine is not None:
            engine.allocator_peak = True  # the step peak on CUDA holds the allocator's

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, ZeroStrategy)
        report, comm = strategy.memory_report(), strategy.comm_report()
        metrics = {
            "zero/params_bytes": float(report.params),
            "zero/gradients_bytes": float(report.gradients),
            "zero/optimizer_states_bytes": float(report.optimizer_states),
            "zero/offloaded_bytes": float(report.offloaded),
            "zero/comm_bytes": float(comm.nbytes),
            "zero/intra_node_bytes": float(comm.intra_node_bytes),
            "zero/inter_node_bytes": float(comm.inter_node_bytes),
        }
        if report.step_peak is not None:
            metrics["zero/peak_bytes"] = float(report.step_peak.total)
            for kind, nbytes in report.step_peak.by_kind.items():
                metrics[f"zero/peak_{kind}_bytes"] = float(nbytes)
        scaler = getattr(strategy.precision_plugin, "scaler", None)
        if scaler is not None:  # "16-mixed": the loss scale after this step, and the steps skipped for overflow
            metrics["zero/loss_scale"] = float(scaler.scale)
            metrics["zero/skipped_steps"] = float(scaler.skipped_steps)
        if strategy.session.background.saves:  # asynchronous saves: the largest snapshot this rank held
            metrics["zero/checkpoint_snapshot_bytes"] = float(strategy.session.background.peak_snapshot_bytes)
        if strategy.config.engine.shard_size is not None:
            shard_group = comm.by_group.get("shard", 0) + comm.by_group.get("gather", 0)
            metrics["zero/shard_group_bytes"] = float(shard_group)
            metrics["zero/replicate_group_bytes"] = float(comm.by_group.get("replicate", 0))
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)
