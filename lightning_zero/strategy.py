"""ZeroStrategy: Lightning glue around one model's ZeRO session (session.py: the engine, its setup and checkpoint
I/O) and the strategy's collectives (collectives.py), which a Fabric strategy shares. Each hook is a few lines."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.callbacks import ModelPruning, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero import collectives, loss_weighting
from lightning_zero.checkpoint import is_dcp_checkpoint, remove_sharded
from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.options import OffloadTarget
from lightning_zero.core.stage3.meta_init import on_meta_device
from lightning_zero.front_door import ZeroFrontDoor
from lightning_zero.launcher import ZeroMultiProcessingLauncher
from lightning_zero.precision import ZeroPrecision, unwrap_optimizer
from lightning_zero.session import FABRIC_KEYS, half_built, move_materialized

__all__ = ["ZeroStrategy", "move_materialized"]

log = logging.getLogger(__name__)


# The Trainer's settings every rank must share: ranks that differ would step at other times (silently diverging
# at stage 3, whose step has no collective) or wait in another collective (a clip's norm).
_AGREED_TRAINER_SETTINGS = ("accumulate_grad_batches", "gradient_clip_val", "gradient_clip_algorithm")


# Lightning's callbacks that read and replace the parameters between steps, where stage 3 holds none: without this
# refusal they raise only when they first read them, after epochs of training (SWA at its swa_epoch_start).
_READ_PARAMS_BETWEEN_STEPS = (StochasticWeightAveraging, WeightAveraging, ModelPruning)


def _trainer_settings(module: pl.LightningModule | None, stage: int, automatic: bool) -> list[tuple[str, object]]:
    """The settings of the Trainer fitting ``module`` that every rank must share (those of automatic optimization),
    once its callbacks suit ``stage``."""
    if module is None:
        return []
    trainer = module.trainer
    refused = [type(c).__name__ for c in trainer.callbacks if isinstance(c, _READ_PARAMS_BETWEEN_STEPS)]
    if stage == 3 and refused:
        raise ValueError(
            f"the callback(s) {', '.join(refused)} read and replace the model's parameters between training steps, "
            "where ZeroStrategy(stage=3) holds only its shards (its parameters have values inside the forward and "
            "backward of their unit only). Train with stage 1 or 2, which run these callbacks exactly as DDP does, "
            "or remove the callback."
        )
    return [(f"Trainer {name}", getattr(trainer, name)) for name in _AGREED_TRAINER_SETTINGS] if automatic else []


class ZeroStrategy(ZeroFrontDoor, ParallelStrategy):
    """ZeRO data parallelism: optimizer state (stage 1), gradients (stage 2) and parameters (stage 3) sharded.

    Args:
        stage: 1 shards optimizer state; 2 also gradients; 3 also parameters.
        offload_optimizer: ``False``, ``"cpu"`` or ``"nvme"``: where the fp32 master and the optimizer state live
            and the user's optimizer steps (host memory, or a swap file under ``nvme_path``); see docs/offload.md.
        offload_params: ``False``, ``"cpu"``, ``"nvme"``: where stage-3 parameter shards rest (needs offload_optimizer).
        nvme_path: directory of each rank's (unnamed) swap file for ``"nvme"`` offload.
        partition: ``"flat"`` (element-wise shards) or ``"parameter"`` (whole tensors per rank).
        bucket_cap_mb: size of the gradient reduce and parameter gather buckets.
        overlap_comm: reduce gradient buckets while backward still runs.
        shard_size: shard inside groups of this many ranks, replicate across them (``None``: all ranks).
        wrap_policy: stage-3 gather units.
        activation_checkpointing: module classes to checkpoint.
        state_dict_type: ``"sharded"`` or ``"full"``: what ``trainer.save_checkpoint`` writes.
        process_group_backend: ``"nccl"`` or ``"gloo"``; default by device.
        timeout: collective timeout.
        start_method: ``"popen"``, ``"spawn"`` or ``"fork"``, as in Lightning's ``DDPStrategy``.
        weighted_loss: train on the mean over all ranks' tokens: ``training_step`` returns ``{"loss": loss_sum,
            "loss_weight": n_tokens}`` (or ``manual_backward(loss_sum, loss_weight=n)``); docs/weighted_loss.md.
        secondary_shard_size: stage 3 (ZeRO++ hpZ): after forward keep each unit sharded over groups of this many
            ranks inside a node, so backward's gathers stay there (see docs/configuration.md for its memory).
        quantize_gradients: reduce inside each node, then across nodes as int8 with block scales and error feedback
            (an fp32 residual per rank; see docs/configuration.md). Changes nothing on one node.
        quantize_weights: stage 3: parameter all-gathers send int8 with one fp32 scale per 256 elements (ZeRO++'s
            qwZ); shards, fp32 masters and checkpoints stay exact.
        free_gradients_after_step: each ``optimizer.step()`` empties the gradients only it steps on, so they are not
            held through the next forward, where Lightning calls ``zero_grad`` (see docs/configuration.md).

    Raises:
        ValueError: for an invalid option, naming the option, the value and the fix.
    """

    def __init__(
        self,
        stage: int = 2,
        offload_optimizer: OffloadTarget = False,
        offload_params: OffloadTarget = False,
        nvme_path: str | None = None,
        partition: Literal["flat", "parameter"] = "flat",
        bucket_cap_mb: float = 25,
        overlap_comm: bool = True,
        shard_size: int | None = None,
        wrap_policy: Any = None,
        activation_checkpointing: Any = None,
        state_dict_type: Literal["sharded", "full"] = "sharded",
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=30),
        start_method: Literal["popen", "spawn", "fork"] = "popen",
        weighted_loss: bool = False,
        quantize_weights: bool = False,
        quantize_gradients: bool = False,
        secondary_shard_size: int | None = None,
        free_gradients_after_step: bool = False,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        self._take_options(locals(), start_method)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )

    @property
    def _engine(self) -> ZeroEngine | None:
        """The engine, once a setup has sharded the module (tests and benchmarks read it)."""
        return self.session.engine_or_none

    # ------------------------------------------------------------------ topology (see front_door.py)
    @property
    def is_distributed(self) -> bool:
        """Lightning adds a DistributedSampler for strategies that say so."""
        return True

    @property
    @override
    def precision_plugin(self) -> ZeroPrecision:
        return self._precision_plugin if self._precision_plugin is not None else ZeroPrecision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        # None stays None so that Lightning applies the Trainer's `precision` flag or `plugins`, which then
        # arrive here as Lightning's own plugin and are translated (or refused with the supported list).
        self._precision_plugin = None if precision_plugin is None else ZeroPrecision.from_plugin(precision_plugin)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = ZeroMultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self._start_process_group()

    # ------------------------------------------------------------------ setup and training
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        assert self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.device = self.root_device.type  # autocast's device, as Lightning's plugins have it
        fitting = trainer.state.fn == TrainerFn.FITTING
        # Evaluation of the module an earlier fit left sharded keeps that engine; anything else releases it.
        kept = self.session.keeps(self.model, fitting)
        self.precision_plugin.attach(self.session.engine_or_none)
        if kept:
            self.setup_precision_plugin()
            return
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.session.checkpoint_activations(self.model)
        if fitting:
            self.setup_optimizers(trainer)
        self._setup_engine(fitting)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _setup_engine(self, fitting: bool) -> None:
        assert self.model is not None
        module = self.lightning_module
        # Lightning divides each automatic-optimization loss by accumulate_grad_batches: undone exactly.
        automatic = fitting and module is not None and module.automatic_optimization
        factor = 1.0 / module.trainer.accumulate_grad_batches if automatic else 1.0
        optimizers = [unwrap_optimizer(o) for o in self.optimizers if not isinstance(o, _MockOptimizer)]
        precision = self.precision_plugin
        settings = _trainer_settings(module, self.config.engine.stage, automatic) if fitting else ()
        policy, scaler = precision.policy(), precision.scaler
        self.session.build(self.model, optimizers, fitting, self.root_device, policy, scaler, factor, False, settings)
        precision.attach(self.session.engine_or_none)
        if fitting:
            # Lightning's optimizer wrappers copy their optimizer's class: make them again now that the engine has
            # given each optimizer a zero_grad that empties the gradient shards (see core/step/zero_grad.py).
            self.optimizers = self.optimizers

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        # Modules created in configure_model under stage 3 are on the meta device: the engine creates each unit on the
        # device. Everything else (metrics, modules made in __init__) moves now, as Lightning moves a whole model.
        move_materialized(self.model, self.root_device)

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Stage 3: modules created in ``configure_model`` go to the meta device; the engine then creates, initialises
        (``reset_parameters()``) and shards them one gather unit at a time, so no rank ever holds the full model."""
        with on_meta_device() if self.config.engine.stage == 3 else nullcontext():
            yield

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # A background save's outcome, taken at the same step on every rank (collective while one is in flight).
        if self.session.comm is not None:
            self.session.background.poll(self.session.comm)
            # The first asynchronous save's copies, made ahead once the optimizer state exists (after a step).
            if isinstance(self.checkpoint_io, AsyncCheckpointIO) and self.lightning_module.trainer.global_step:
                self.session.prepare_background_saves()
        super().on_train_batch_start(batch, batch_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        with self.session.training_forward(manual=not module.automatic_optimization):
            output = super().training_step(*args, **kwargs)
        self.session.take_training_step_output(output, module.automatic_optimization, module.trainer.global_step)
        return output

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        # manual_backward(loss_sum, loss_weight=n) reaches here; torch's backward must not see the weight.
        weight = kwargs.pop(loss_weighting.WEIGHT_KEY, None)
        module = self.lightning_module
        if module is not None and not module.automatic_optimization:
            self.session.take_manual_backward(closure_loss, weight, module.trainer.global_step)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self.lightning_module.trainer
        fitting = trainer.state.fn == TrainerFn.FITTING  # DDP's wrapper runs the step (and syncs buffers) in fit only
        with self.session.evaluation_step(_is_last_batch(trainer._evaluation_loop), sync_buffers=fitting):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.session.evaluation_step(_is_last_batch(self.lightning_module.trainer._evaluation_loop)):
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.session.evaluation_step(_is_last_batch(self.lightning_module.trainer.predict_loop)):
            return super().predict_step(*args, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        with self.session.no_sync():
            yield

    # ------------------------------------------------------------------ collectives
    # Through the communicator, so that a waiting rank stops when another raised: see [Note: the strategy's
    # collectives] in collectives.py.
    @override
    def reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        return collectives.reduce(self.session.comm, tensor, group, reduce_op)

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Optimizer state is loaded into the pieces, which exist only once the engine is built.
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        # Only rank 0 writes a full checkpoint: it alone collects the tensors.
        return self.session.module_state_dict(self.lightning_module, keep=self.is_global_zero)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        self.session.load_module_state_dict(self.lightning_module, checkpoint, strict)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self.session.optimizer_state(unwrap_optimizer(optimizer), keep=self.is_global_zero)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        optimizers = [unwrap_optimizer(o) for o in self.optimizers]
        self.session.load_optimizer_states(optimizers, checkpoint, self.lightning_module.strict_loading)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if not self.session.sharded_checkpoints:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        background = isinstance(self.checkpoint_io, AsyncCheckpointIO)  # see [Note: asynchronous sharded saves]
        self.session.save_sharded(checkpoint, filepath, self.precision_plugin.precision, background)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        if not os.path.isdir(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        checkpoint = self.session.open_sharded(checkpoint_path)
        if FABRIC_KEYS in checkpoint:
            _resume_fabric_checkpoint(checkpoint, checkpoint_path)
        elif is_dcp_checkpoint(checkpoint_path) and "loops" not in checkpoint:
            _resume_dcp_without_loops(checkpoint, checkpoint_path)
        return checkpoint

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Rank 0 removes ``filepath``: a sharded directory, a symbolic link to one (the link only:
        ``ModelCheckpoint(save_last="link")``'s ``last.ckpt``) or a file."""
        if not self.is_global_zero or self.session.background.remove_later(filepath):
            return  # a save in flight removes it once committed (see [Note: asynchronous sharded saves])
        if os.path.islink(filepath) or os.path.isdir(filepath):
            remove_sharded(filepath)
        else:
            super().remove_checkpoint(filepath)

    # ------------------------------------------------------------------ lifecycle
    @override
    def teardown(self) -> None:
        # The engine stays (without hooks) so memory_report(), saves, gathered_params() and evaluation work after
        # fit; the module stays where it is, its parameters views of the engine's buffers (Lightning's teardown would
        # move it to the CPU). fit ends once a background save committed; its error is raised after the teardown.
        error = _error_of(self.session.background.close)
        if not self.session.sharded and not half_built(self.lightning_module):
            super().teardown()
            _raise(error)
            return
        # With an engine, or after a stage-3 setup that raised part way (some parameters still on the meta device,
        # which a move to the CPU would fail on, hiding the setup's own error).
        self.session.remove_hooks()
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        _optimizers_to_device(self.optimizers, torch.device("cpu"))
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        _raise(error)


def _error_of(call: Callable[[], None]) -> BaseException | None:
    try:
        call()
    except Exception as error:
        return error
    return None


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error


def _resume_fabric_checkpoint(checkpoint: dict[str, Any], path: _PATH) -> None:
    """A checkpoint that ``fabric.save`` wrote holds the model's and the optimizers' state but none of the Trainer's
    loops, LR schedulers or callbacks: those start fresh (Lightning would refuse the missing schedulers as a
    weights-only checkpoint's), with a warning that names the entries left unread."""
    checkpoint.setdefault("lr_schedulers", [])
    unread = sorted(k for k in checkpoint if not k.startswith(("lightning_zero", "pytorch-lightning")))
    unread = [k for k in unread if k not in ("state_dict", "optimizer_states", "lr_schedulers")]
    rank_zero_warn(
        f"'{path}' was written by fabric.save: the model and optimizer states are restored, but the Trainer's loops "
        f"(global_step, epoch), LR schedulers and callbacks start fresh, and its entries {unread} are not restored. "
        "Set max_steps for the steps still to run, or restore those entries in on_load_checkpoint."
    )


def _resume_dcp_without_loops(checkpoint: dict[str, Any], path: _PATH) -> None:
    """A DCP directory without Lightning's ``meta.pt`` (``dcp.save`` of ``get_state_dict`` in a plain loop) holds the
    model's and the optimizers' state only: the Trainer's loops, LR schedulers and callbacks start fresh, with a
    warning."""
    checkpoint.setdefault("pytorch-lightning_version", pl.__version__)
    checkpoint.setdefault("lr_schedulers", [])
    rank_zero_warn(
        f"'{path}' is a torch.distributed.checkpoint directory without Lightning's meta.pt: the model and optimizer "
        "states are restored, but the Trainer's loops (global_step, epoch), LR schedulers and callbacks start fresh. "
        "Set max_steps for the steps still to run."
    )


def _is_last_batch(loop: Any) -> bool:
    """Whether the evaluation step about to run is this rank's last in ``loop`` (Lightning's data fetcher knows it
    ahead of the step); ``False`` where the loop does not say."""
    progress = getattr(loop, "batch_progress", None)
    return bool(getattr(progress, "is_last_batch", False))
