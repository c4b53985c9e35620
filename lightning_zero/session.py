"""ZeroSession: one model's ZeRO session for any training loop: the communicator, the engine built from a
:class:`~lightning_zero.config.ZeroConfig`, the collectives that read failure notices, and the checkpoint I/O of the
engine's state. :class:`~lightning_zero.ZeroStrategy` is Lightning's glue over it; a Fabric strategy would be another.
It imports no ``lightning.pytorch``.

[Note: a session before its engine]
The session exists from the strategy's construction and has a communicator once the process group is up, but an
engine only after a setup that shards: ``fit`` at any stage, evaluation at stage 3. Before that, and in evaluation at
stages 1 and 2, nothing is sharded: the session holds :data:`UNSHARDED`, a do-nothing stand-in with the few parts of
the engine that every loop calls (hooks, the scheduler, ``no_sync``, ``gathered``, the loss weights), so those calls
need no check; state dicts are then the module's own; and what only shards have (``memory_report``,
``comm_report``) raises :data:`NOT_SET_UP` through :attr:`ZeroSession.engine`.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero import loss_weighting
from lightning_zero.checkpoint import (
    CheckpointError,
    ShardedCheckpoint,
    load_sharded_optimizers,
    load_sharded_params,
    open_checkpoint,
    save_sharded,
)
from lightning_zero.checkpoint.background import BackgroundSaves
from lightning_zero.checkpoint.state import tensor_specs
from lightning_zero.checkpoint.state_view import saving_changes, saving_state_dict, values_of
from lightning_zero.config import ZeroConfig
from lightning_zero.core import setup
from lightning_zero.core.comm import CommStats, Communicator
from lightning_zero.core.engine import ZeroEngine, release_previous_engine
from lightning_zero.core.layout.resting import RestingParameter, engine_access
from lightning_zero.core.memory import MemoryReport
from lightning_zero.core.mixed_precision import DynamicLossScaler, PrecisionPolicy
from lightning_zero.core.named_state import PARAM_NAMES_KEY, restore_added_param_groups
from lightning_zero.core.stage3.activation_checkpointing import apply_activation_checkpointing
from lightning_zero.core.stage3.no_scheduler import NoScheduler
from lightning_zero.version import __version__

NOT_SET_UP = "ZeroStrategy has no sharded state yet: call this during or after Trainer.fit setup."

# Marks a checkpoint dict that open_sharded built from a sharded directory; holds the opened checkpoint.
SHARDED_KEY = "lightning_zero_sharded"
# In the extra state of a sharded checkpoint that fabric.save wrote: the names under which its state held the model
# and the optimizers (see [Note: Fabric checkpoints] in fabric_checkpoints.py).
FABRIC_KEYS = "lightning_zero_fabric"


class _NoBackward:
    in_no_sync = False

    def register_hooks(self) -> None:
        pass

    def remove_hooks(self) -> None:
        pass

    def no_sync(self) -> nullcontext[None]:
        return nullcontext()


class _NoModel:
    scheduler = NoScheduler()

    def manages(self, optimizer: Optimizer) -> bool:
        return False


class _NoLossWeights:
    global_weight = None
    global_mean_loss = None


class _Unsharded:
    """Stands in for the engine while nothing is sharded: see [Note: a session before its engine]."""

    module = None
    backward = _NoBackward()
    model = _NoModel()
    loss_weights = _NoLossWeights()

    def begin_iteration(self) -> None:
        pass

    def sync_buffers(self) -> None:
        pass

    def gathered(self, write_back: bool = False) -> nullcontext[None]:
        return nullcontext()

    def release(self) -> None:
        pass


UNSHARDED = _Unsharded()


class ZeroSession:
    """The communicator and engine of one model sharded as ``config`` says; see the module docstring."""

    def __init__(self, config: ZeroConfig) -> None:
        self.config = config
        self.comm: Communicator | None = None  # set once the process group is up
        self._engine: ZeroEngine | _Unsharded = UNSHARDED
        self._sync_buffers_next = True
        self._checkpointing_applied = False  # forward wrappers are added once per session
        self.background = BackgroundSaves()  # asynchronous sharded saves (see [Note: asynchronous sharded saves])

    # ------------------------------------------------------------------ the engine
    @property
    def sharded(self) -> bool:
        """An engine is built: the module's state lives in its shards."""
        return self._engine is not UNSHARDED

    @property
    def engine(self) -> ZeroEngine:
        """The engine; raises ``RuntimeError`` before one is built."""
        if not isinstance(self._engine, ZeroEngine):
            raise RuntimeError(NOT_SET_UP)
        return self._engine

    @property
    def engine_or_none(self) -> ZeroEngine | None:
        return self._engine if isinstance(self._engine, ZeroEngine) else None

    def keeps(self, module: nn.Module, fitting: bool) -> bool:
        """Evaluation of the module an earlier ``fit`` left sharded keeps that engine (its shards, masters and
        optimizers: a checkpoint saved now has them). Any other module, or a new ``fit``, first gives the earlier
        module its full parameters back (from the fp32 masters where there are some; collective)."""
        if not fitting and self._engine.module is module:
            self._engine.backward.register_hooks()
            return True
        self._engine.release()
        self._engine = UNSHARDED
        release_previous_engine(module)  # a module another strategy's engine drives (a new Trainer's second fit)
        return False

    def build(
        self,
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        fitting: bool,
        device: torch.device,
        precision: PrecisionPolicy,
        loss_scaler: DynamicLossScaler | None,
        loss_factor: float = 1.0,
        optimizers_later: bool = False,
        loop_settings: Sequence[tuple[str, object]] = (),
    ) -> None:
        """Build the engine that shards ``module``: for training, and at stage 3 for evaluation too (it creates the
        parameters of a model built on the meta device). Evaluation at stages 1 and 2 only broadcasts rank 0's
        parameters and buffers. ``loss_factor`` undoes the loop's own scaling of each loss (``weighted_loss``);
        ``optimizers_later``: optimizers join afterwards (``ZeroEngine.add_optimizer``); ``loop_settings``: the
        loop's own settings every rank must share too (a Trainer's accumulation and clipping)."""
        comm = self._require_comm()
        if not (fitting or self.config.engine.stage == 3):
            setup.broadcast_module_states(module, comm)
            return
        engine_keys = set(self.config.engine.describe())
        engine = ZeroEngine(
            module,
            optimizers if fitting else [],
            self.config.engine,
            comm,
            device=device,
            precision=precision,
            loss_scaler=loss_scaler,
            agree_also=[(k, v) for k, v in sorted(self.config.describe().items()) if k not in engine_keys]
            + list(loop_settings),
            optimizers_later=optimizers_later,
        )
        self._engine = engine
        if fitting and self.config.weighted_loss:
            engine.loss_weights.enabled, engine.loss_weights.loss_factor = True, loss_factor

    def checkpoint_activations(self, module: nn.Module) -> None:
        """Wrap the forwards of ``config.activation_checkpointing``'s modules, the first time only."""
        if not self._checkpointing_applied:
            apply_activation_checkpointing(module, self.config.activation_checkpointing)
            self._checkpointing_applied = True

    def _require_comm(self) -> Communicator:
        if self.comm is None:
            raise RuntimeError("ZeroSession has no communicator: the process group is not set up yet.")
        return self.comm

    # ------------------------------------------------------------------ training and evaluation
    @contextmanager
    def training_forward(self, manual: bool) -> Generator[None, None, None]:
        """Around one ``training_step``: :meth:`begin_training_forward`, and at stage 3 the root unit held through
        the block in manual optimization, where forwards may follow a backward."""
        self.begin_training_forward()
        with self._engine.model.scheduler.hold_root() if manual else nullcontext():
            yield

    def begin_training_forward(self, new_iteration: bool = True) -> None:
        """Before a training forward: with ``new_iteration`` (not a second forward before one backward) whatever an
        exception in the last iteration left is reset, parameters unfrozen or added to an optimizer since then are
        sharded (collective); rank 0's buffers are broadcast as DDP does; at stage 3 the root unit is gathered."""
        engine = self._engine
        if new_iteration:
            engine.begin_iteration()
        # As DDP: rank 0's buffers (BatchNorm statistics) are broadcast in a forward that follows one whose
        # gradients were reduced, not after a micro-batch of gradient accumulation.
        if self._sync_buffers_next:
            engine.sync_buffers()
        self._sync_buffers_next = not engine.backward.in_no_sync
        # Stage 3: the step may use root-unit parameters without calling the root's forward; the end of
        # backward frees them again, except in manual optimization.
        engine.model.scheduler.unshard_root()

    def begin_evaluation_forward(self) -> None:
        """Before an evaluation forward, as DDP's: rank 0's buffers broadcast if a training forward whose gradients
        were reduced came since the last broadcast (BatchNorm statistics are rank 0's in validation)."""
        if self._sync_buffers_next:
            self._engine.sync_buffers()
        self._sync_buffers_next = False

    def take_training_step_output(self, output: Any, automatic: bool, step: int) -> None:
        """Check ``output`` against ``weighted_loss`` and give its weight to the engine (see loss_weighting.py)."""
        if self.sharded:
            loss_weighting.take_training_step_output(self.engine, self.config.weighted_loss, output, automatic, step)

    def take_manual_backward(self, loss: Tensor, weight: Any, step: int, call: str = "self.manual_backward") -> None:
        """``manual_backward(loss, loss_weight=weight)`` (or ``call``, e.g. ``fabric.backward``): check it and give
        it to the engine."""
        if self.sharded:
            strategy = "ZeroFabricStrategy" if call.startswith("fabric.") else "ZeroStrategy"
            loss_weighting.take_manual_backward(
                self.engine, self.config.weighted_loss, loss, weight, step, call, strategy
            )

    @property
    def global_loss_weight(self) -> float | None:
        return self._engine.loss_weights.global_weight

    @property
    def global_mean_loss(self) -> float | None:
        return self._engine.loss_weights.global_mean_loss

    @contextmanager
    def evaluation_step(self, last: bool, sync_buffers: bool = False) -> Generator[None, None, None]:
        """Around one evaluation step: at stage 3 the root unit gathered, every unit freed after it; ``sync_buffers``
        (validation in ``fit``): :meth:`begin_evaluation_forward`; after this rank's ``last`` step, stage 3 joins the
        ranks still evaluating (see [Note: evaluation loops of different lengths])."""
        scheduler = self._engine.model.scheduler
        scheduler.unshard_root()
        try:
            if sync_buffers:
                self.begin_evaluation_forward()
            yield
        finally:
            scheduler.reshard_all()
        if last:
            scheduler.join_evaluation()

    def no_sync(self) -> Any:
        """Accumulate gradients without reducing them (a do-nothing context while nothing is sharded)."""
        return self._engine.backward.no_sync()

    def gathered(self, write_back: bool = False) -> Any:
        """Every parameter held in full inside the block; see ``ZeroStrategy.gathered_params``."""
        return self._engine.gathered(write_back=write_back)

    def remove_hooks(self) -> None:
        self._engine.backward.remove_hooks()

    def memory_report(self) -> MemoryReport:
        return self.engine.memory_report()

    def comm_report(self) -> CommStats:
        return self.engine.last_step_comm

    # ------------------------------------------------------------------ checkpoints
    @property
    def sharded_checkpoints(self) -> bool:
        """Checkpoints are written as each rank's shards (``state_dict_type="sharded"`` with an engine)."""
        return self.config.state_dict_type == "sharded" and self.sharded

    def module_state_dict(self, module: nn.Module, keep: bool) -> dict[str, Any]:
        """The state dict a checkpoint holds: the module's own while nothing is sharded; the names and specs of
        the tensors for sharded checkpoints (the shards are written by :meth:`save_sharded`); else the full tensors,
        collected on ranks with ``keep`` (collective, one stage-3 unit at a time)."""
        if not self.sharded:
            return module.state_dict()
        if self.sharded_checkpoints:
            state = self.engine.named_state()
            return saving_state_dict(state.state_dict_keys(), tensor_specs(state))
        return self.engine.full_state_dict(keep=keep)

    def load_module_state_dict(self, module: nn.Module, checkpoint: Mapping[str, Any], strict: bool) -> None:
        """Load ``checkpoint["state_dict"]`` (full, or opened by :meth:`open_sharded`) into the module or its
        shards."""
        if SHARDED_KEY in checkpoint and self.sharded:
            # As on_load_checkpoint left it: see [Note: the state_dict of sharded checkpoint hooks].
            state = self.engine.named_state()
            sharded = checkpoint[SHARDED_KEY].as_left_by_hook(checkpoint["state_dict"], state.state_dict_keys())
            checkpoint[SHARDED_KEY] = sharded  # load_optimizer_states follows the same names
            load_sharded_params(state, sharded, strict=strict)
        elif SHARDED_KEY in checkpoint:  # e.g. validate() at stages 1 and 2: the plain module, in full
            module.load_state_dict(values_of(checkpoint["state_dict"]), strict=strict)
        elif not self.sharded:
            module.load_state_dict(checkpoint["state_dict"], strict=strict)
        else:
            self.engine.load_state_dict(checkpoint["state_dict"], strict=strict)

    def optimizer_state(self, optimizer: Optimizer, keep: bool) -> dict[str, Any]:
        """``optimizer``'s state for a checkpoint: its own where the engine does not manage it; empty for sharded
        checkpoints (:meth:`save_sharded` writes it); else in full on ranks with ``keep`` (collective)."""
        if not self._engine.model.manages(optimizer):
            return optimizer.state_dict()
        if self.sharded_checkpoints:
            return {}
        state = self.engine.full_optimizer_state_dict(optimizer)
        return state if keep else {}

    def load_optimizer_states(
        self, optimizers: Sequence[Optimizer], checkpoint: Mapping[str, Any], strict_loading: bool
    ) -> None:
        """Load the checkpoint's optimizer states, in their order, into those of ``optimizers`` the engine manages
        (Fabric's may come in another order than the engine's), first adding back the param groups added after setup
        (collective)."""
        managed = [o for o in optimizers if self._engine.model.manages(o)]
        if not managed:
            return  # nothing to load (e.g. configure_optimizers returned None)
        engine = self.engine
        if SHARDED_KEY in checkpoint:
            sharded = checkpoint[SHARDED_KEY]
            saved = [
                (opt["param_groups"], sharded.param_groups(i)) for i, opt in enumerate(sharded.metadata["optimizers"])
            ]
        else:
            saved = [(s.get(PARAM_NAMES_KEY), s["param_groups"]) for s in checkpoint["optimizer_states"]]
        if restore_added_param_groups(engine.model, managed, saved):
            engine.begin_iteration()  # shards the parameters of the groups added back (collective)
        if SHARDED_KEY in checkpoint:
            position = {id(o): i for i, o in enumerate(engine.optimizers)}
            order = [position[id(o)] for o in managed if id(o) in position]
            whole = sorted(order) == list(range(len(engine.optimizers)))  # else the engine's own, as always
            _load_sharded_optimizers(engine, checkpoint[SHARDED_KEY], strict_loading, order if whole else None)
            return
        for optimizer, state in zip(managed, checkpoint["optimizer_states"], strict=True):
            engine.load_full_optimizer_state_dict(optimizer, state)

    def prepare_background_saves(self) -> None:
        """Make the copies of the first asynchronous save's snapshot ahead, on its worker thread (local; once a fit,
        before its first save; call it once the optimizer state exists): see [Note: asynchronous sharded saves]."""
        if self.sharded_checkpoints and self.background.unprepared:
            self.background.prepare(self.engine.named_state())

    def save_sharded(
        self, checkpoint: Mapping[str, Any], filepath: str | os.PathLike, precision: str, background: bool = False
    ) -> None:
        """Write ``checkpoint`` as a sharded directory: each rank its shards, rank 0 the rest (collective). With
        ``background`` only a snapshot is taken now (see [Note: asynchronous sharded saves])."""
        self._refuse_changed_state_dict(checkpoint.get("state_dict"))
        extra = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        options = {
            "version": __version__,
            "precision": precision,
            "optimizers": "optimizer_states" in checkpoint,  # absent for save_checkpoint(weights_only=True)
            "partition": self.config.engine.partition,
        }
        if background:
            self.background.start(self.engine.named_state(), filepath, extra, **options)
        else:
            self.background.wait()  # saves commit in the order they were made
            save_sharded(self.engine.named_state(), filepath, extra, **options)

    def _refuse_changed_state_dict(self, state_dict: Any) -> None:
        """Raise on every rank where a hook changed ``checkpoint["state_dict"]`` on any rank (collective): see
        [Note: the state_dict of sharded checkpoint hooks]."""
        comm = self.engine.comm
        change = saving_changes(state_dict, self.engine.named_state().state_dict_keys())
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

    def open_sharded(self, path: str | os.PathLike) -> dict[str, Any]:
        """A sharded directory (lightning_zero's, or a DCP one) as a Lightning checkpoint dict whose tensors are read
        only when used."""
        sharded = open_checkpoint(path, comm=self.comm)  # the ranks share the checksums
        checkpoint = sharded.lightning_state()
        checkpoint["state_dict"] = sharded.lazy_state_dict()  # values read only if a hook uses them
        if sharded.metadata.get("optimizer_states", bool(sharded.metadata["optimizers"])):
            # else saved with weights_only=True: Lightning then says so
            checkpoint["optimizer_states"] = [{} for _ in sharded.metadata["optimizers"]]
        checkpoint[SHARDED_KEY] = sharded
        return checkpoint


def half_built(module: nn.Module | None) -> bool:
    """A stage-3 setup raised part way: parameters are still on the meta device, or sharded by units committed
    before the error (neither can be moved to the CPU)."""
    if module is None:
        return False
    with engine_access():
        return any(p.is_meta or isinstance(p, RestingParameter) for p in module.parameters())


def _load_sharded_optimizers(
    engine: ZeroEngine, checkpoint: ShardedCheckpoint, strict: bool, order: list[int] | None = None
) -> None:
    """Optimizer state needs the param groups it was saved with, whatever ``strict_loading`` says (as with DDP,
    whose ``Optimizer.load_state_dict`` refuses groups of other sizes); without it the error says so. ``order``:
    the checkpoint's optimizer ``i`` loads into the engine's ``order[i]``."""
    try:
        load_sharded_optimizers(engine.named_state(order), checkpoint)
    except CheckpointError as error:
        if strict:
            raise
        raise CheckpointError(
            f"{error} (strict_loading=False skips missing and unexpected tensors of the model only: optimizer state "
            "loads into the param groups it was saved with, as with DDP. To start this model from the checkpoint's "
            "weights with a fresh optimizer, load them with lightning_zero.load_from_checkpoint(Model, path, "
            "strict=False) and fit without ckpt_path.)"
        ) from error


def move_materialized(module: nn.Module, device: torch.device) -> None:
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
