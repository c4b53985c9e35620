"""ZeroFabricStrategy: Lightning Fabric's front door to the same ZeRO session as the Trainer's ``ZeroStrategy``.

Fabric glue over ``session.py`` (the engine, its setup and checkpoint I/O), ``collectives.py`` and
``precision_settings.py``, which both strategies share; the step protocol is the engine's (see [Note: the step
window] in core/step/optimizer_step.py). Imports no ``lightning.pytorch``.
Checkpoints: see [Note: Fabric checkpoints] in fabric_checkpoints.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import lightning.fabric.wrappers as fabric_wrappers
import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import (
    _BackwardSyncControl,
    _Sharded,
)
from lightning.fabric.utilities.types import _PATH, ReduceOp
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero import collectives, fabric_checkpoints, loss_weighting
from lightning_zero.checkpoint import remove_sharded
from lightning_zero.core.engine import ZeroEngine, release_previous_engine
from lightning_zero.core.options import OffloadTarget
from lightning_zero.core.stage3.meta_init import on_meta_device
from lightning_zero.core.stage3.units import UnitHook
from lightning_zero.fabric_precision import ZeroFabricPrecision
from lightning_zero.front_door import ZeroFrontDoor
from lightning_zero.session import ZeroSession, move_materialized

__all__ = ["ZeroFabricStrategy"]


class ZeroFabricStrategy(ZeroFrontDoor, ParallelStrategy, _Sharded):
    """ZeRO data parallelism for Fabric: optimizer state (stage 1), gradients (stage 2) and parameters (stage 3)
    sharded, with the options and guarantees of :class:`~lightning_zero.ZeroStrategy` (see its arguments; they are
    the same, and ``docs/configuration.md`` lists them).

    Example::

        fabric = Fabric(strategy=ZeroFabricStrategy(stage=3), devices=2, precision="bf16-mixed")
        fabric.launch()
        with fabric.init_module():  # stage 3: created sharded, never whole on one rank
            model = GPT(config)
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-4))
    """

    def __init__(
        self,
        stage: Literal[1, 2, 3] = 2,
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
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
    ) -> None:
        self._take_options(locals(), start_method)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self._backward_sync_control = _ZeroBackwardSyncControl(self.session)
        self._module: nn.Module | None = None
        self._steps = 0  # optimizer steps taken, for the loss weighting's messages
        self._iterations = _IterationStarts(self.session)

    # ------------------------------------------------------------------ topology (see front_door.py)
    @property
    @override
    def precision(self) -> ZeroFabricPrecision:
        if not isinstance(self._precision, ZeroFabricPrecision):
            self._precision = ZeroFabricPrecision()
        return self._precision

    @precision.setter
    @override
    def precision(self, precision: Precision | None) -> None:
        # Fabric hands over the plugin it chose for its `precision` flag (or `plugins`): translated, or refused with
        # the supported list.
        self._precision = None if precision is None else ZeroFabricPrecision.from_plugin(precision)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._start_process_group()
        self.precision.device = self.root_device.type  # autocast's device

    # ------------------------------------------------------------------ creating and setting up the model
    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """Stage 3: modules created inside go to the meta device; ``setup_module`` then creates, initialises
        (``reset_parameters()``) and shards them one gather unit at a time, so no rank holds the whole model."""
        if self.config.engine.stage != 3:
            return super().module_init_context(empty_init)
        stack = ExitStack()
        stack.enter_context(on_meta_device())
        stack.enter_context(self.precision.module_init_context())
        return stack

    @contextmanager
    @override
    def module_sharded_context(self) -> Generator[None, None, None]:
        with self.module_init_context():
            yield

    @contextmanager
    def allow_autograd_grad(self) -> Generator[None, None, None]:
        """Inside, ``torch.autograd.grad`` may differentiate the outputs of the module Fabric set up (a gradient
        penalty, a saliency map). Fabric refuses any gradient through them outside ``fabric.backward`` when the
        strategy or precision has a backward of its own, as this one does (and Fabric's DeepSpeed): "requires you to
        call `fabric.backward(loss)` instead of `loss.backward()`". The engine itself supports such passes at every
        stage (docs/configuration.md, "Stage 3 and several backward passes"); the loss still goes to
        ``fabric.backward``."""
        previous = getattr(fabric_wrappers, "_in_fabric_backward", False)
        fabric_wrappers._in_fabric_backward = True  # what Fabric sets inside fabric.backward
        try:
            yield
        finally:
            fabric_wrappers._in_fabric_backward = previous

    @override
    def module_to_device(self, module: nn.Module) -> None:
        # Modules created under init_module() at stage 3 are on the meta device: the engine creates them. Everything
        # else moves now.
        release_previous_engine(module)  # a module another strategy trained: its parameters in full again
        move_materialized(module, self.root_device)

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any | None]:
        self._build(module, optimizers, optimizers_later=False)
        return module, optimizers, scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` (collective); optimizers over its parameters join with :meth:`setup_optimizer`."""
        self._build(module, [], optimizers_later=True)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Manage ``optimizer``, made from the parameters of the module set up before (collective)."""
        if not self.session.sharded:
            raise RuntimeError(
                "ZeroFabricStrategy: set up the model first: `model = fabric.setup_module(model)`, then create the "
                "optimizer from `model.parameters()` and call `fabric.setup_optimizers(optimizer)` (or set both up "
                "together with `fabric.setup(model, optimizer)`)."
            )
        self.session.engine.add_optimizer(optimizer)
        return optimizer

    def _build(self, module: nn.Module, optimizers: list[Optimizer], optimizers_later: bool) -> None:
        if self._module is not None:
            raise RuntimeError(
                "ZeroFabricStrategy shards one model: it set one up already. Put the models in one nn.Module (e.g. "
                "an nn.ModuleDict) and set that up, with all their optimizers."
            )
        precision = self.precision
        self.session.checkpoint_activations(module)
        self.session.build(
            module,
            optimizers,
            True,
            self.root_device,
            precision.policy(),
            precision.scaler,
            optimizers_later=optimizers_later,
        )
        self._module = module  # only once sharded: a setup refused before anything changed can be retried
        precision.attach(self.session.engine_or_none)
        # First, before the root unit's own hook gathers it: a new iteration frees every unit (see Stage3Scheduler).
        # A copy of the module (an EMA: copy.deepcopy, AveragedModel) keeps no hook of this strategy's.
        module.register_forward_pre_hook(UnitHook(self._iterations.before_forward), prepend=True)
        module.register_forward_hook(UnitHook(self._iterations.after_forward))

    # ------------------------------------------------------------------ backward and step
    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        # fabric.backward(loss_sum, loss_weight=n): the weight goes to the engine, not to torch's backward.
        weight = kwargs.pop(loss_weighting.WEIGHT_KEY, None)
        self._iterations.end()
        self.session.take_manual_backward(tensor, weight, self._steps, call="fabric.backward")
        super().backward(tensor, module, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self._steps += 1
        self._iterations.end()
        return super().optimizer_step(optimizer, **kwargs)

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip the step gradients of ``optimizer`` by their norm over every shard; returns the norm (collective)."""
        norm = self._engine_for_step().step_of(optimizer).clip_grad_norm_(max_norm, norm_type)
        if error_if_nonfinite and self.precision.scaler is None and not torch.isfinite(norm):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients is non-finite, so it cannot be clipped. "
                "To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`"
            )
        return norm

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self._engine_for_step().step_of(optimizer).clip_grad_value_(clip_val)

    def _engine_for_step(self) -> ZeroEngine:
        if not self.session.sharded:
            raise RuntimeError("ZeroFabricStrategy has no sharded model yet: call `fabric.setup(model, optimizer)`.")
        return self.session.engine

    # ------------------------------------------------------------------ collectives (see front_door.py)
    @override
    def all_reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        return collectives.reduce(self.session.comm, tensor, group, reduce_op)

    # ------------------------------------------------------------------ checkpoints (see [Note: Fabric checkpoints])
    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        if not fabric_checkpoints.is_sharded(module, self._module):
            return module.state_dict()
        return self.session.module_state_dict(module, keep=self.is_global_zero)

    @override
    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        if not fabric_checkpoints.is_sharded(module, self._module):
            module.load_state_dict(state_dict, strict=strict)
            return
        self.session.load_module_state_dict(module, {"state_dict": state_dict}, strict)

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self.session.optimizer_state(optimizer, keep=self.is_global_zero)

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        state = fabric_checkpoints.with_precision(state, self.precision)
        if not self.session.sharded_checkpoints:
            super().save_checkpoint(path, state, storage_options, filter)
            return
        if filter:
            raise ValueError("ZeroFabricStrategy: `fabric.save(..., filter=...)` needs state_dict_type='full'.")
        checkpoint = fabric_checkpoints.sharded_checkpoint(self.session, self._module, state)
        self.session.save_sharded(checkpoint, path, self.precision.precision)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        raw = isinstance(state, nn.Module | Optimizer)  # fabric.load_raw: the file holds its own state dict
        if raw:
            key = "model" if isinstance(state, nn.Module) else "optimizer"
            state = {key: state}
        if os.path.isdir(path):
            remainder = fabric_checkpoints.load_sharded(self.session, path, state or {}, strict, self._module)
            return fabric_checkpoints.restore_precision(remainder, self.precision) if state else remainder
        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        if raw:
            fabric_checkpoints.load_full(self.session, {key: checkpoint}, state, strict, self._module)
            return {}
        remainder = fabric_checkpoints.load_full(self.session, checkpoint, state or {}, strict, self._module)
        return fabric_checkpoints.restore_precision(remainder, self.precision) if state else remainder

    def remove_checkpoint(self, path: _PATH) -> None:
        """Rank 0 removes a sharded checkpoint directory (or a link to one)."""
        if self.is_global_zero:
            remove_sharded(path)

    # ------------------------------------------------------------------ lifecycle
    @override
    def teardown(self) -> None:
        # The engine stays (without hooks): memory_report(), fabric.save() and gathered_params() work afterwards.
        self.session.remove_hooks()
        super().teardown()


class _IterationStarts:
    """Which forwards of the set-up module begin a training iteration (collective; the Trainer begins one per
    ``training_step``): the first training forward after a backward or a step. Not forwards under
    ``torch.no_grad()`` or in ``eval()`` mode, as DDP's; nor a second forward before the backward (a siamese or
    contrastive loss over two calls of the model: beginning an iteration there freed the units the first forward's
    graph needs), unless the forward before it raised."""

    def __init__(self, session: ZeroSession) -> None:
        self.session = session
        self.awaits_backward = False  # a training forward ran since the last backward (or step)
        self.running = False  # a training forward began and has not returned (it raised, if another begins)

    def before_forward(self, module: nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled():
            new_iteration = not self.awaits_backward or self.running
            self.running = True
            self.session.begin_training_forward(new_iteration=new_iteration)
        else:
            self.session.begin_evaluation_forward()

    def after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.running:
            self.running, self.awaits_backward = False, True

    def end(self) -> None:
        """A backward or an optimizer step: the next training forward begins an iteration."""
        self.awaits_backward = False


class _ZeroBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: backward passes inside accumulate without reducing where the stage allows
    (stage 1 keeps full local gradients; stages 2 and 3 reduce every backward into the held shards)."""

    def __init__(self, session: ZeroSession) -> None:
        self.session = session

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return self.session.no_sync() if enabled else nullcontext()
