"""ZeroStrategy: Lightning glue around the sharding core. Each hook is a few lines that call into ``core``."""

from __future__ import annotations

import logging
import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero import loss_weighting
from lightning_zero.checkpoint import (
    CheckpointError,
    ShardedCheckpoint,
    load_sharded_optimizers,
    load_sharded_params,
    remove_sharded,
    save_sharded,
)
from lightning_zero.checkpoint.state import tensor_specs
from lightning_zero.checkpoint.state_view import saving_changes, saving_state_dict, values_of
from lightning_zero.config import START_METHODS, ZeroConfig
from lightning_zero.core.comm import CommStats, Communicator
from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.layout.resting import RestingParameter, engine_access
from lightning_zero.core.memory import MemoryReport
from lightning_zero.core.named_state import PARAM_NAMES_KEY, restore_added_param_groups
from lightning_zero.core.options import EngineOptions, OffloadTarget
from lightning_zero.core.stage3.activation_checkpointing import apply_activation_checkpointing
from lightning_zero.launcher import ZeroMultiProcessingLauncher, destroy_groups_at_exit, note_exception
from lightning_zero.precision import ZeroPrecision, unwrap_optimizer
from lightning_zero.version import __version__

log = logging.getLogger(__name__)

# Marks a checkpoint dict that load_checkpoint built from a sharded directory; holds the opened checkpoint.
_SHARDED_KEY = "lightning_zero_sharded"


class ZeroStrategy(ParallelStrategy):
    """ZeRO data parallelism: optimizer state (stage 1), gradients (stage 2) and parameters (stage 3) sharded.

    Args:
        stage: 1 shards optimizer state; 2 also gradients; 3 also parameters.
        offload_optimizer: ``False``, ``"cpu"`` or ``"nvme"``: where the fp32 master and the optimizer state live
            and the user's optimizer steps (host memory, or a swap file under ``nvme_path``); see docs/offload.md.
        offload_params: ``False``, ``"cpu"`` or ``"nvme"``: stage-3 parameter shards rest in host memory or in the
            swap file between uses (needs ``offload_optimizer``).
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
        weighted_loss: train on the gradient of the global mean over tokens: ``training_step`` returns
            ``{"loss": loss_sum, "loss_weight": n_tokens}`` (or calls ``self.manual_backward(loss_sum,
            loss_weight=n_tokens)``); see docs/weighted_loss.md.

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
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        self.config = ZeroConfig(
            EngineOptions(
                stage=stage,
                bucket_cap_mb=bucket_cap_mb,
                overlap_comm=overlap_comm,
                wrap_policy=wrap_policy,
                offload_optimizer=offload_optimizer,
                offload_params=offload_params,
                nvme_path=nvme_path,
                partition=partition,
            ),
            shard_size=shard_size,
            activation_checkpointing=activation_checkpointing,
            state_dict_type=state_dict_type,
            process_group_backend=process_group_backend,
            timeout=timeout,
            weighted_loss=weighted_loss,
        )
        if start_method not in START_METHODS:
            raise ValueError(f"start_method={start_method!r} is not supported; choose one of {list(START_METHODS)}.")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._start_method = start_method
        self._num_nodes = 1
        self._comm: Communicator | None = None
        self._engine: ZeroEngine | None = None
        self._checkpointing_applied = False  # forward wrappers are added once per strategy
        self._sync_buffers_next = True

    # ------------------------------------------------------------------ topology
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        """Lightning adds a DistributedSampler for strategies that say so."""
        return True

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str:
        return self.config.process_group_backend or _get_default_process_group_backend_for_device(self.root_device)

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
        self.set_world_ranks()
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment, self.process_group_backend, timeout=self.config.timeout, device_id=device_id
        )
        self._comm = Communicator()
        destroy_groups_at_exit()  # see [Note: destroying the groups when a rank ends] in launcher.py

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ setup and training
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        assert self.model is not None
        assert self._comm is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.device = self.root_device.type  # autocast's device, as Lightning's plugins have it
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self._keep_engine(fitting):
            self.setup_precision_plugin()
            return
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if not self._checkpointing_applied:
            apply_activation_checkpointing(self.model, self.config.activation_checkpointing)
            self._checkpointing_applied = True
        if fitting:
            self.setup_optimizers(trainer)
        self._setup_engine(fitting)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _keep_engine(self, fitting: bool) -> bool:
        """Evaluation of the module an earlier ``fit`` left sharded keeps that engine (its shards, masters and
        optimizers: a checkpoint saved now has them). Any other module, or a new ``fit``, first gives the earlier
        module its full parameters back (from the fp32 masters where there are some)."""
        engine = self._engine
        if engine is None:
            return False
        if not fitting and engine.module is self.model:
            engine.backward.register_hooks()
            self.precision_plugin.attach(engine)
            return True
        engine.release()
        self._engine = None
        self.precision_plugin.attach(None)
        return False

    def _setup_engine(self, fitting: bool) -> None:
        """Build the engine that shards the module: for training, and at stage 3 for evaluation too (it creates the
        parameters of a model built in ``configure_model``)."""
        assert self.model is not None
        assert self._comm is not None
        if not (fitting or self.config.engine.stage == 3):
            ZeroEngine.broadcast_module_states(self.model, self._comm)
            return
        optimizers = (
            [unwrap_optimizer(o) for o in self.optimizers if not isinstance(o, _MockOptimizer)] if fitting else []
        )
        engine_keys = set(self.config.engine.describe())
        self._engine = ZeroEngine(
            self.model,
            optimizers,
            self.config.engine,
            self._comm,
            device=self.root_device,
            precision=self.precision_plugin.policy(),
            loss_scaler=self.precision_plugin.scaler,
            agree_also=[(k, v) for k, v in sorted(self.config.describe().items()) if k not in engine_keys],
        )
        self.precision_plugin.attach(self._engine)
        if fitting and self.config.weighted_loss:
            module = self.lightning_module
            # Lightning divides each automatic-optimization loss by accumulate_grad_batches: undone exactly.
            factor = 1.0 / module.trainer.accumulate_grad_batches if module.automatic_optimization else 1.0
            self._engine.loss_weights.enabled, self._engine.loss_weights.loss_factor = True, factor
        if fitting:
            # Lightning's optimizer wrappers copy their optimizer's class: make them again now that the engine has
            # given each optimizer a zero_grad that empties the gradient shards (see core/step/optimizer_step.py).
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
        if self.config.engine.stage != 3:
            yield
            return
        with torch.device("meta"):
            yield

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._engine is not None:
            # Whatever an exception in the last iteration left is reset; parameters unfrozen or added to an optimizer
            # since then are sharded (collective).
            self._engine.begin_iteration()
            # As DDP: rank 0's buffers (BatchNorm statistics) are broadcast in a forward that follows one whose
            # gradients were reduced, not after a micro-batch of gradient accumulation.
            if self._sync_buffers_next:
                self._engine.sync_buffers()
            self._sync_buffers_next = not self._engine.backward.in_no_sync
            # Stage 3: the step may use root-unit parameters without calling the root's forward; the end of
            # backward frees them again, except in manual optimization, where forwards may follow a backward.
            self._engine.model.scheduler.unshard_root()
            if not self.lightning_module.automatic_optimization:
                with self._engine.model.scheduler.hold_root():
                    output = super().training_step(*args, **kwargs)
            else:
                output = super().training_step(*args, **kwargs)
            module = self.lightning_module
            step = module.trainer.global_step
            loss_weighting.take_training_step_output(
                self._engine, self.config.weighted_loss, output, module.automatic_optimization, step
            )
            return output
        return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        # manual_backward(loss_sum, loss_weight=n) reaches here; torch's backward must not see the weight.
        weight = kwargs.pop(loss_weighting.WEIGHT_KEY, None)
        module = self.lightning_module
        if self._engine is not None and module is not None and not module.automatic_optimization:
            step = module.trainer.global_step
            loss_weighting.take_manual_backward(self._engine, self.config.weighted_loss, closure_loss, weight, step)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @property
    def global_loss_weight(self) -> float | None:
        """``weighted_loss=True``: the global weight (tokens of every rank and micro-batch) of the last step."""
        return self._engine.loss_weights.global_weight if self._engine is not None else None

    @property
    def global_mean_loss(self) -> float | None:
        """``weighted_loss=True``: the last step's loss summed over every rank and micro-batch, over its global
        weight: the mean per token, what to log (e.g. ``self.log("train_loss", strategy.global_mean_loss)``)."""
        return self._engine.loss_weights.global_mean_loss if self._engine is not None else None

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._root_gathered():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._root_gathered():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._root_gathered():
            return super().predict_step(*args, **kwargs)

    @contextmanager
    def _root_gathered(self) -> Generator[None, None, None]:
        if self._engine is None:
            yield
            return
        self._engine.model.scheduler.unshard_root()
        try:
            yield
        finally:
            self._engine.model.scheduler.reshard_all()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        if self._engine is None:
            yield
            return
        with self._engine.backward.no_sync():
            yield

    @contextmanager
    def gathered_params(self, write_back: bool = False) -> Generator[None, None, None]:
        """Hold the module's full parameters inside the block (stage 3; at stages 1 and 2 they are full anyway).

        A stage-3 module keeps only shards between steps and after ``fit``; use this to export or inspect it.
        With ``write_back=True`` changes made inside (e.g. ``load_state_dict``) are kept. Every rank must enter it.
        In 16-bit runs the parameters are the 16-bit ones: the fp32 masters take the 16-bit values written. To load
        fp32 values exactly, use ``trainer.strategy.load_model_state_dict({"state_dict": state_dict})``.

        Example::

            with trainer.strategy.gathered_params():
                torch.save(model.state_dict(), "model.pt")
        """
        if self._engine is None:  # nothing is sharded (stages 1 and 2 in evaluation, or before setup)
            yield
            return
        with self._engine.gathered(write_back=write_back):
            yield

    def memory_report(self) -> MemoryReport:
        """Bytes of parameters, gradients and optimizer state that this rank holds now.

        Raises:
            RuntimeError: before ``Trainer.fit`` has set the strategy up.
        """
        return self._require_engine().memory_report()

    def comm_report(self) -> CommStats:
        """Bytes this rank moved in collectives during the last optimizer step (see docs/design.md)."""
        return self._require_engine().last_step_comm

    def _require_engine(self) -> ZeroEngine:
        if self._engine is None:
            raise RuntimeError("ZeroStrategy has no sharded state yet: call this during or after Trainer.fit setup.")
        return self._engine

    # ------------------------------------------------------------------ collectives
    # The strategy's own collectives go through the communicator where it reads failure notices (gloo), so a rank
    # waiting in a barrier, a broadcast or a logged metric's reduction stops when another rank raised (see [Note: a
    # rank that raises and stays alive]); NCCL and other groups use torch's directly.
    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        elif self._comm is not None:
            self._comm.barrier()
        else:
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        if self._comm is not None:
            return self._comm.broadcast_object(obj, src)
        wrapped = [obj]
        torch.distributed.broadcast_object_list(wrapped, src)
        return wrapped[0]

    @override
    def reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        if not isinstance(tensor, Tensor):
            return tensor
        op = _plain_reduce_op(reduce_op)
        if group is not None or self._comm is None or self._comm.notices is None or op is None:
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        name, mean = op
        self._comm.barrier()  # as Lightning's _sync_ddp, whose results these are
        self._comm.all_reduce(tensor, name, counted=False)
        if not mean:
            return tensor
        if not torch.is_floating_point(tensor):
            return tensor.copy_(tensor / self._comm.world_size)
        return tensor.div_(self._comm.world_size)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """This rank raised: the other ranks stop waiting for it within a fraction of a second, with an error naming
        it and its exception (see [Note: a rank that raises and stays alive]). Its groups stay at exit (see [Note:
        destroying the groups when a rank ends])."""
        note_exception()
        if self._comm is not None:
            self._comm.post_failure(exception)

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Optimizer state is loaded into the pieces, which exist only once the engine is built.
        return True

    @property
    def _sharded_checkpoints(self) -> bool:
        return self.config.state_dict_type == "sharded" and self._engine is not None

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        if self._engine is None:
            return self.lightning_module.state_dict()
        if self._sharded_checkpoints:  # save_checkpoint writes each rank's shards; hooks see the keys
            state = self._engine.named_state()
            return saving_state_dict(state.state_dict_keys(), tensor_specs(state))
        # Only rank 0 writes the file: it alone collects the tensors, gathered one stage-3 unit at a time.
        return self._engine.full_state_dict(keep=self.is_global_zero)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        if _SHARDED_KEY in checkpoint and self._engine is not None:
            # As on_load_checkpoint left it: see [Note: the state_dict of sharded checkpoint hooks].
            state = self._engine.named_state()
            sharded = checkpoint[_SHARDED_KEY].as_left_by_hook(checkpoint["state_dict"], state.state_dict_keys())
            checkpoint[_SHARDED_KEY] = sharded  # load_optimizer_state_dict follows the same names
            load_sharded_params(state, sharded, strict=strict)
            return
        if _SHARDED_KEY in checkpoint:  # e.g. validate() at stages 1 and 2: the plain module, in full
            self.lightning_module.load_state_dict(values_of(checkpoint["state_dict"]), strict=strict)
            return
        if self._engine is None:
            self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)
            return
        self._engine.load_state_dict(checkpoint["state_dict"], strict=strict)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        inner = unwrap_optimizer(optimizer)
        if self._engine is None or not self._engine.model.manages(inner):
            return inner.state_dict()
        if self._sharded_checkpoints:
            return {}  # save_checkpoint writes each rank's part of it
        state = self._engine.full_optimizer_state_dict(inner)  # collective
        return state if self.is_global_zero else {}

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        managed = [o for o in map(unwrap_optimizer, self.optimizers) if self._engine and self._engine.model.manages(o)]
        if not managed:
            return  # nothing to load (e.g. configure_optimizers returned None)
        engine = self._require_engine()
        if _SHARDED_KEY in checkpoint:
            sharded = checkpoint[_SHARDED_KEY]
            saved = [
                (opt["param_groups"], sharded.param_groups(i)) for i, opt in enumerate(sharded.metadata["optimizers"])
            ]
        else:
            saved = [(s.get(PARAM_NAMES_KEY), s["param_groups"]) for s in checkpoint["optimizer_states"]]
        if restore_added_param_groups(engine.model, managed, saved):
            engine.begin_iteration()  # shards the parameters of the groups added back (collective)
        if _SHARDED_KEY in checkpoint:
            _load_sharded_optimizers(engine, checkpoint[_SHARDED_KEY], self.lightning_module.strict_loading)
            return
        for optimizer, state in zip(managed, checkpoint["optimizer_states"], strict=True):
            engine.load_full_optimizer_state_dict(optimizer, state)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if not self._sharded_checkpoints:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        assert self._engine is not None
        self._refuse_changed_state_dict(checkpoint.get("state_dict"))
        extra = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        with_optimizers = "optimizer_states" in checkpoint  # absent for save_checkpoint(weights_only=True)
        save_sharded(
            self._engine.named_state(),
            filepath,
            extra,
            __version__,
            self.precision_plugin.precision,
            with_optimizers,
            partition=self.config.engine.partition,
        )

    def _refuse_changed_state_dict(self, state_dict: Any) -> None:
        """Raise on every rank where a hook changed ``checkpoint["state_dict"]`` on any rank (collective): see
        [Note: the state_dict of sharded checkpoint hooks]."""
        assert self._engine is not None
        comm = self._engine.comm
        change = saving_changes(state_dict, self._engine.named_state().state_dict_keys())
        changes = {rank: change for rank, change in enumerate(comm.all_gather_object(change)) if change}
        if not changes:
            return
        rank, change = next(iter(changes.items()))
        raise CheckpointError(
            f"on_save_checkpoint (of the LightningModule or of a callback) changed checkpoint['state_dict'] on "
            f"{len(changes)} of {comm.world_size} ranks (rank {rank}: {change}). A sharded checkpoint saves each "
            "rank's shards of the module's own tensors and cannot hold a changed state_dict (ModelPruning("
            "make_pruning_permanent=True) and WeightAveraging change it). Nothing was saved. Save full "
            "checkpoints, ZeroStrategy(state_dict_type='full'), or rename keys when loading: on_load_checkpoint can."
        )

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        if not os.path.isdir(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        sharded = ShardedCheckpoint(checkpoint_path, comm=self._comm)  # the ranks share the checksums
        checkpoint = sharded.lightning_state()
        checkpoint["state_dict"] = sharded.lazy_state_dict()  # values read only if a hook uses them
        if sharded.metadata.get("optimizer_states", bool(sharded.metadata["optimizers"])):
            # else saved with weights_only=True: Lightning then says so
            checkpoint["optimizer_states"] = [{} for _ in sharded.metadata["optimizers"]]
        checkpoint[_SHARDED_KEY] = sharded
        return checkpoint

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Rank 0 removes ``filepath``: a sharded directory, a symbolic link to one (the link only:
        ``ModelCheckpoint(save_last="link")``'s ``last.ckpt``) or a file."""
        if not self.is_global_zero:
            return
        if os.path.islink(filepath) or os.path.isdir(filepath):
            remove_sharded(filepath)
        else:
            super().remove_checkpoint(filepath)

    # ------------------------------------------------------------------ lifecycle
    @override
    def teardown(self) -> None:
        # The engine stays (without hooks) so memory_report(), save_checkpoint(), gathered_params() and evaluation
        # work after fit, and so does the module, where it is: its parameters are views of the engine's buffers
        # (at stage 3, of freed ones: gathering them here could exceed a rank's memory). Lightning's teardown would
        # move the module to the CPU, away from those buffers; this one does the rest of what Lightning's does.
        if self._engine is None and not self._half_built():
            super().teardown()
            return
        # With an engine, or after a stage-3 setup that raised part way (some parameters still on the meta device,
        # which a move to the CPU would fail on, hiding the setup's own error).
        if self._engine is not None:
            self._engine.backward.remove_hooks()
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        _optimizers_to_device(self.optimizers, torch.device("cpu"))
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def _half_built(self) -> bool:
        """A stage-3 setup raised part way: parameters are still on the meta device, or sharded by units committed
        before the error (neither can be moved to the CPU)."""
        module = self.lightning_module
        if module is None:
            return False
        with engine_access():
            return any(p.is_meta or isinstance(p, RestingParameter) for p in module.parameters())

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        presets = {
            "zero_1": ({"stage": 1}, "ZeRO stage 1: optimizer state sharded"),
            "zero_2": ({"stage": 2}, "ZeRO stage 2: optimizer state and gradients sharded"),
            "zero_3": ({"stage": 3}, "ZeRO stage 3: optimizer state, gradients and parameters sharded"),
            # As Lightning's deepspeed_stage_2_offload / deepspeed_stage_3_offload.
            "zero_2_offload": ({"stage": 2, "offload_optimizer": "cpu"}, "ZeRO stage 2, optimizer state on the CPU"),
            "zero_3_offload": (
                {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
                "ZeRO stage 3, optimizer state and parameters on the CPU",
            ),
        }
        for name, (init_params, description) in presets.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **init_params)


def _plain_reduce_op(reduce_op: ReduceOp | str | None) -> tuple[str, bool] | None:
    """``(op, divide by the world size)`` for the reductions the communicator runs; ``None`` for others."""
    if reduce_op is None:
        return "sum", False
    name = (
        reduce_op.lower()
        if isinstance(reduce_op, str)
        else {
            torch.distributed.ReduceOp.SUM: "sum",
            torch.distributed.ReduceOp.MAX: "max",
            torch.distributed.ReduceOp.MIN: "min",
        }.get(reduce_op)
    )
    if name in ("mean", "avg"):
        return "sum", True
    return (name, False) if name in ("sum", "max", "min") else None


def _load_sharded_optimizers(engine: ZeroEngine, checkpoint: ShardedCheckpoint, strict: bool) -> None:
    """Optimizer state needs the param groups it was saved with, whatever ``strict_loading`` says (as with DDP,
    whose ``Optimizer.load_state_dict`` refuses groups of other sizes); without it the error says so."""
    try:
        load_sharded_optimizers(engine.named_state(), checkpoint)
    except CheckpointError as error:
        if strict:
            raise
        raise CheckpointError(
            f"{error} (strict_loading=False skips missing and unexpected tensors of the model only: optimizer state "
            "loads into the param groups it was saved with, as with DDP. To start this model from the checkpoint's "
            "weights with a fresh optimizer, load them with lightning_zero.load_from_checkpoint(Model, path, "
            "strict=False) and fit without ckpt_path.)"
        ) from error


def move_materialized(module: torch.nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for every part of ``module`` that holds no meta tensor: whole subtrees where none is
    (torchmetrics metrics keep their states outside parameters and buffers, and only ``to`` moves those), the own
    buffers of a module whose children are partly on the meta device. Meta tensors stay for the engine."""
    if not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        module.to(device)
        return
    for child in module.children():
        move_materialized(child, device)
    for name, buffer in module._buffers.items():
        if buffer is not None and not buffer.is_meta:
            module._buffers[name] = buffer.to(device)
