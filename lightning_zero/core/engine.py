"""ZeroEngine: shards a module's parameters, gradients and optimizer state for ZeRO stages 1 to 3.

The engine knows nothing about Lightning; any training loop drives it with a few calls down:

1. ``ZeroEngine(module, optimizers, options, comm)``: the ranks agree on parameters and options, rank 0's
   parameters and buffers are broadcast, and the trainable parameters are packed into flat buffers (see
   [Note: flat layout]): for stages 1 and 2 those of each optimizer param group, in buckets of at most
   ``bucket_cap_mb``; for stage 3 every parameter of each gather unit (see [Note: stage-3 gather units]),
   which then keeps only its shard. Each buffer an optimizer trains gets a store (see core/store/stores.py) and a
   gradient bucket; each optimizer gets an :class:`OptimizerStep` (see [Note: the step window]).
2. ``begin_iteration()`` before each forward: whatever an exception left behind is reset (see [Note: bucket
   state]) and parameters unfrozen or added to an optimizer since the last iteration are sharded (see
   [Note: changes after setup]).
3. ``loss = scale_loss(loss)``; ``loss.backward()``: gradient hooks fill the buckets and reduce-scatter them
   (see [Note: bucket order]); stage 3 gathers each unit around its forward and backward (see [Note:
   stage-3 backward plan]). ``finish_backward()`` after it makes sure the end of backward ran on this rank
   even where the loss reached no trainable parameter.
4. Optionally ``clip_grad_norm_(optimizer, ...)``; then ``optimizer.step()`` and ``optimizer.zero_grad()``
   as usual: the step window hands the optimizer its pieces, and stages 1 and 2 gather the new shards.

[Note: the order of collectives]
Every rank must issue the same collectives in the same order, whatever the options, or the job hangs (or, with
gloo, aborts on a message of another size). So the ranks' agreement on the parameters and options (``Communicator.
agree``) is the first collective an engine issues, and everything that depends on an option comes after it:
process groups (``Topology.build``: ``new_group`` is itself a collective, a store wait that a lost rank does not
end), the offload checks, the owners' agreement, the broadcast of rank 0's states. A rank that fails before it
posts a notice (see [Note: a rank that raises and stays alive]) that ends the others' wait in the agreement.
``tests/distributed/test_collective_order.py`` records the collectives of every combination of options.

[Note: changes after setup]
A parameter frozen when the engine was built holds no gradient bucket. When it becomes trainable and an
optimizer holds it (``requires_grad_(True)`` on a parameter of a param group, ``add_param_group``, Lightning's
``BaseFinetuning``), ``begin_iteration`` notices the change (a fingerprint of each optimizer's parameters and
their ``requires_grad``), agrees on it with the other ranks (one small all-reduce per iteration; ranks that
disagree raise) and shards those parameters: stages 1 and 2 pack them into new buckets, stage 3 splits the
frozen buffers of their units. Nothing else is touched: the other buffers, gradients and optimizer state stay.
Plain DDP never reduces a parameter that was frozen when it wrapped the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_zero.core import named_state
from lightning_zero.core.comm import CommStats, Communicator
from lightning_zero.core.comm.changes import ChangeWatch
from lightning_zero.core.comm.hyperparams import HyperparameterAgreement
from lightning_zero.core.comm.topology import Topology
from lightning_zero.core.layout.flat_buffer import FlatParamBuffer
from lightning_zero.core.layout.optim_state import shard_param_state
from lightning_zero.core.layout.owners import OwnerPlan
from lightning_zero.core.layout.resting import RestingParameter, clone_gathered_in_state_dicts, engine_access
from lightning_zero.core.memory import MemoryReport, tensor_nbytes
from lightning_zero.core.mixed_precision import DynamicLossScaler, PrecisionPolicy
from lightning_zero.core.named_state import NamedState
from lightning_zero.core.options import EngineOptions
from lightning_zero.core.packing import Packed, Packer
from lightning_zero.core.stage3.reachability import reached_leaves
from lightning_zero.core.stage3.scheduler import Stage3Scheduler
from lightning_zero.core.stage3.units import GatherUnit
from lightning_zero.core.step.buckets import BucketState, GradBucket, GradReducer
from lightning_zero.core.step.elementwise import check_elementwise, check_per_tensor
from lightning_zero.core.step.full_bucket import FullGradBucket
from lightning_zero.core.step.loss_weight import LossWeights
from lightning_zero.core.step.optimizer_step import (
    LossScaling,
    OptimizerStep,
    StepEntry,
    install_module_zero_grad,
    uninstall_module_zero_grad,
)
from lightning_zero.core.step.shard_bucket import ShardGradBucket
from lightning_zero.core.store.checks import check_offload, offloaded_bytes_per_rank
from lightning_zero.core.store.offload import Offload, prefer_fused_kernels
from lightning_zero.core.store.stores import MasterStore, ShardStore
from lightning_zero.core.store.swap import IOCounts

_BUCKET_TYPES: dict[int, type[GradBucket]] = {1: FullGradBucket, 2: ShardGradBucket, 3: ShardGradBucket}


class ZeroEngine:
    """ZeRO stages 1-3 for ``module`` trained by ``optimizers``. See the module docstring.

    Args:
        module: the model; at stage 3 it may be on the meta device (each unit is then created on ``device``
            and initialised with its modules' ``reset_parameters()`` in turn, so the full model never exists
            on one rank).
        optimizers: the user's optimizers over ``module``'s parameters (a parameter may be in several).
        options: how to shard.
        comm: the ranks that share the state.
        device: where sharded tensors live (default: the parameters' device).
        precision: the dtypes held (default: the parameters' own, no master copy).
        loss_scaler: fp16 dynamic loss scaling, decided by all ranks together.
        agree_also: further ``(name, value)`` pairs every rank must agree on (the caller's own options).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        options: EngineOptions,
        comm: Communicator,
        device: torch.device | None = None,
        precision: PrecisionPolicy | None = None,
        loss_scaler: DynamicLossScaler | None = None,
        agree_also: Sequence[tuple[str, object]] = (),
    ) -> None:
        self.module = module
        self.options = options
        self.comm = comm
        self.policy = precision or PrecisionPolicy()
        self.loss_weights = LossWeights(comm, device or next(module.parameters(), torch.empty(0)).device)
        self.scaling = LossScaling(loss_scaler, self.loss_weights)
        self.device = device or next(module.parameters(), torch.empty(0)).device
        self.names = {param: name for name, param in module.named_parameters()}
        self.optimizers = list(optimizers)
        self._check_optimizers()
        self._agree_across_ranks(agree_also)  # the first collective of setup: see [Note: the order of collectives]
        self.topology = Topology.build(comm, options.stage)  # groups are created only once the ranks agree
        if options.stage < 3:
            self.broadcast_module_states(module, comm)
        self.buffers: list[FlatParamBuffer] = []
        self.stores: dict[int, ShardStore] = {}  # id(buffer) -> its store (trainable buffers only)
        self.buckets: list[GradBucket] = []
        self._bucket_of: dict[int, GradBucket] = {}  # id(buffer) -> its bucket
        self.units: list[GatherUnit] = []  # stage 3 only; the root unit last
        self._unit_of: dict[int, GatherUnit] = {}  # stage 3: id(buffer) -> its unit
        self._state_dict_hooks: list[RemovableHandle] = []  # stage 3: state_dict() in gathered() copies
        self.reducer = GradReducer(
            [],
            comm,
            options.overlap_comm,
            reduce_every_backward=options.stage >= 2,
            on_backward_event=self._queue_end_of_backward,
            on_bucket_ready=self._on_bucket_ready if options.stage == 3 else None,
            rider=HyperparameterAgreement(comm, self.optimizers),  # see [Note: agreeing on hyper-parameters]
        )
        self.offload = self._build_offload()
        self.owners = OwnerPlan(comm.world_size) if options.partition == "parameter" else None
        self._assign_owners()
        self.packer = Packer(
            module, self.names, comm, self.device, self.policy, options.bucket_cap_bytes, self.offload, self.owners
        )
        if options.stage == 3:
            self.units, packed = self.packer.units(options.wrap_policy, {id(p) for p in self._optimized()})
            self._unit_of = {id(b): unit for unit in self.units for b in unit.buffers}
            self._add_buffers(packed)
            self._state_dict_hooks = clone_gathered_in_state_dicts(module)
        else:
            self._add_buffers(self.packer.replicated(self._optimized_trainable()))
        self.scheduler = (
            Stage3Scheduler(self.units, self.topology.gather, options.overlap_comm, self._passed_over)
            if self.units
            else None
        )
        self.steps = [
            OptimizerStep(
                optimizer,
                [],
                comm,
                self.device,
                self.scaling,
                self._take_step_comm,
                self.loss_weights.agree,
            )
            for optimizer in self.optimizers
        ]
        self._bind_optimizers()
        install_module_zero_grad(module, self.steps)
        self.changes = ChangeWatch(self.optimizers, comm, self.device)  # see [Note: changes after setup]
        self.changes.remember(self._managed_ids())
        self._end_queued = False
        self._backward_ended = False  # the end of backward ran from autograd; finish_backward consumes it
        self._backward_roots: list[object] = []  # the grad_fn of the loss given to scale_loss, until backward ends
        self._reached: set[int] | None = None  # leaves its graph reaches, once asked (see _passed_over)
        self.last_step_comm = CommStats()

    # ------------------------------------------------------------------ setup
    def _check_optimizers(self) -> None:
        for index, optimizer in enumerate(self.optimizers):
            # Flat pieces, or whole tensors apart: see [Note: the element-wise probe].
            check = check_elementwise if self.options.partition == "flat" else check_per_tensor
            check(optimizer, index)
            for group_index, group in enumerate(optimizer.param_groups):
                for param in group["params"]:
                    if param not in self.names:
                        raise ValueError(
                            f"optimizer {index} param group {group_index} holds a parameter of shape "
                            f"{tuple(param.shape)} that is not in the model. Create the optimizer in "
                            "configure_optimizers() from self.parameters()."
                        )

    def _agree_across_ranks(self, agree_also: Sequence[tuple[str, object]]) -> None:
        groups: dict[nn.Parameter, list[tuple[int, int]]] = {}
        for index, optimizer in enumerate(self.optimizers):
            for group_index, group in enumerate(optimizer.param_groups):
                for param in group["params"]:
                    groups.setdefault(param, []).append((index, group_index))
        params = [
            (name, (tuple(p.shape), str(p.dtype), p.requires_grad, groups.get(p)))
            for name, p in self.module.named_parameters()
        ]
        fix = "Build the same model and optimizers, with the same Trainer precision, on every rank before Trainer.fit."
        self.comm.agree("the model's parameters (shape, dtype, requires_grad, optimizer group)", params, fix)
        options = sorted(self.options.describe().items()) + list(self.policy.describe().items()) + list(agree_also)
        fix = "Pass the same ZeroStrategy options and Trainer precision on every rank."
        self.comm.agree("ZeroStrategy options and precision", options, fix)

    def _build_offload(self) -> Offload | None:
        """Check what offload needs of every rank's machine (collective) and open the rank's swap file."""
        options = self.options
        if not (options.offload_optimizer or options.offload_params):
            return None
        needs = {"cpu": 0, "nvme": 0}  # bytes a rank keeps on the host / in its swap file
        if options.offload_optimizer:
            needs[options.offload_optimizer] += offloaded_bytes_per_rank(self.optimizers, self.comm.world_size)
            prefer_fused_kernels(self.optimizers)
        if options.offload_params == "nvme":
            nbytes = sum(p.numel() * p.element_size() for p in self.module.parameters())
            if options.offload_optimizer == "nvme":  # gradients rest there too: the held one and an accumulation
                nbytes += 2 * sum(p.numel() * p.element_size() for p in self.module.parameters() if p.requires_grad)
            needs["nvme"] += -(-nbytes // self.comm.world_size)
        for target in ("cpu", "nvme"):
            if needs[target] or options.offload_optimizer == target:  # the same checks on every rank
                check_offload(target, options.nvme_path, needs[target], self.comm)
        return Offload(options.offload_optimizer, options.offload_params, options.nvme_path, self.comm.rank)

    def _assign_owners(self) -> None:
        """``partition="parameter"``: owners for the trained tensors that have none yet, agreed by every rank
        (collective). Stage 3 shards every trainable tensor, stages 1 and 2 those an optimizer trains."""
        if self.owners is None:
            return
        optimized = {id(p) for p in self._optimized()}
        trained = [p for p in self.names if p.requires_grad and (self.options.stage == 3 or id(p) in optimized)]
        if self.owners.assign(trained):
            self.owners.agree(self.comm, self.names)

    @staticmethod
    def broadcast_module_states(module: nn.Module, comm: Communicator) -> None:
        """Give every rank rank 0's parameters and buffers, as DDP does at construction."""
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                comm.broadcast(tensor.data, src=0)

    def _optimized(self) -> list[nn.Parameter]:
        """Every parameter some optimizer holds, once, in the order of the optimizers and their groups."""
        return list(dict.fromkeys(p for o in self.optimizers for g in o.param_groups for p in g["params"]))

    def _optimized_trainable(self) -> list[list[nn.Parameter]]:
        """Per optimizer param group (each parameter in its first group only), its trainable parameters not yet
        held by a buffer."""
        held = {id(p) for b in self.buffers for p in b.params}
        seen: set[int] = set()
        groups = []
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                fresh = [p for p in group["params"] if p.requires_grad and id(p) not in held and id(p) not in seen]
                seen.update(id(p) for p in fresh)
                groups.append(fresh)
        return groups

    def _add_buffers(self, packed: list[Packed]) -> None:
        """Take new buffers into the engine: trainable ones get a bucket, appended to the launch order."""
        bucket_type = _BUCKET_TYPES[self.options.stage]
        for buffer, store in packed:
            self.buffers.append(buffer)
            if store is None:
                continue
            self.stores[id(buffer)] = store
            widened = self.policy.param_dtype is not None and buffer.data.dtype == self.policy.param_dtype
            reduce_dtype = self.policy.reduce_dtype if isinstance(store, MasterStore) or widened else None
            resting = self.offload.gradient_resting() if self.offload is not None and store.paged else None
            bucket = (
                ShardGradBucket(buffer, self.comm, reduce_dtype, resting)
                if resting
                else bucket_type(buffer, self.comm, reduce_dtype)
            )
            self.buckets.append(bucket)
            self._bucket_of[id(buffer)] = bucket
        self.reducer.remove_hooks()
        self.reducer.buckets = list(self.buckets)
        self.reducer.register_hooks()

    def _bind_optimizers(self) -> None:
        """Tell each optimizer step which of its parameters the engine holds; slice full-size optimizer state."""
        where = {id(p): (b, slot) for b in self.buffers if id(b) in self.stores for slot, p in enumerate(b.params)}
        for step in self.steps:
            entries = []
            for param in dict.fromkeys(p for g in step.optimizer.param_groups for p in g["params"]):
                if id(param) not in where:
                    continue  # frozen: not trained, nothing to shard
                buffer, slot = where[id(param)]
                entries.append(StepEntry(param, slot, self.stores[id(buffer)], self._bucket_of[id(buffer)]))
                self._shard_existing_state(step.optimizer, param, buffer, slot)
            step.set_entries(entries)
            step.install()
            self.absorb_optimizer_state(step.optimizer)

    def _shard_existing_state(
        self, optimizer: Optimizer, param: nn.Parameter, buffer: FlatParamBuffer, slot: int
    ) -> None:
        state = optimizer.state.get(param)
        shape = buffer.layout.slots[slot].shape
        if buffer.layout.whole_tensors:  # the owner keeps its state whole, as it is; the others none
            if state and buffer.owned_elsewhere(slot):
                del optimizer.state[param]
            return
        if state and any(isinstance(v, Tensor) and tuple(v.shape) == shape and v.dim() > 0 for v in state.values()):
            optimizer.state[param] = shard_param_state(state, buffer.pieces[slot], shape, self.names[param])

    def absorb_optimizer_state(self, optimizer: Optimizer) -> None:
        """Optimizer state set from outside (a checkpoint, state made before setup) moves into paged stores."""
        for store, params in self._paged_params(optimizer):
            store.absorb_state(optimizer, params)  # type: ignore[attr-defined]

    def optimizer_state(self, optimizer: Optimizer) -> dict[int, dict]:
        """``optimizer``'s state by ``id(param)``, with state that rests in paged stores read back (copies)."""
        states = {id(p): dict(s) for p, s in optimizer.state.items() if s}
        for store, params in self._paged_params(optimizer):
            states.update(store.read_state(optimizer, params))  # type: ignore[attr-defined]
        return states

    def _paged_params(self, optimizer: Optimizer) -> list[tuple[ShardStore, list[tuple[nn.Parameter, int]]]]:
        by_store: dict[int, tuple[ShardStore, list[tuple[nn.Parameter, int]]]] = {}
        for step in self.steps:
            if step.optimizer is optimizer:
                for entry in step.entries:
                    if entry.store.paged:
                        by_store.setdefault(id(entry.store), (entry.store, []))[1].append((entry.param, entry.slot))
        return list(by_store.values())

    # ------------------------------------------------------------------ each iteration
    def begin_iteration(self) -> None:
        """Start a training iteration (before its forward): reset what an exception left and take changes made to
        trainable parameters and param groups since the last one (collective). See [Note: changes after setup]."""
        self._reset_pass()
        for step in self.steps:
            step.abort()
            step.discard()
        if self.scheduler is not None:
            self.scheduler.begin_iteration()
        if self.changes.changed(self._managed_ids()):
            self._take_changes()
            self.changes.remember(self._managed_ids())

    def _managed_ids(self) -> set[int]:
        return {id(p) for b in self.buffers if id(b) in self.stores for p in b.params}

    def _take_changes(self) -> None:
        """Shard the parameters that became trainable in an optimizer since setup (collective)."""
        self._check_optimizers()
        self._agree_across_ranks(())
        self._assign_owners()
        if self.options.stage == 3:
            self._split_frozen_buffers()
        else:
            self._add_buffers(self.packer.replicated(self._optimized_trainable()))
        self._bind_optimizers()

    def _split_frozen_buffers(self) -> None:
        """Stage 3: frozen buffers that now hold trainable, optimized parameters are split by ``requires_grad``."""
        optimized = {id(p) for p in self._optimized()}
        for unit in self.units:
            for buffer in [b for b in unit.buffers if id(b) not in self.stores]:
                if not any(p.requires_grad and id(p) in optimized for p in buffer.params):
                    continue
                unit.unshard(self.topology.gather)
                packed = self.packer.split_frozen(unit, buffer, optimized)
                unit.reshard()
                self.buffers.remove(buffer)
                self._unit_of.update((id(b), unit) for b, _ in packed)
                self._add_buffers(packed)

    # ------------------------------------------------------------------ backward
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside skip the reduction where the stage allows it (gradient accumulation)."""
        with self.reducer.no_sync():
            yield

    @property
    def in_no_sync(self) -> bool:
        """Inside :meth:`no_sync` (a micro-batch of gradient accumulation that is not the last)."""
        return self.reducer.in_no_sync

    def use_loss_scaler(self, scaler: DynamicLossScaler | None) -> None:
        """Scale fp16 losses with ``scaler`` from now on (its state is the caller's to save and load)."""
        self.scaling.scaler = scaler

    def _reset_pass(self) -> None:
        """Forget a backward pass that raised. See [Note: bucket state]."""
        self.reducer.reset()
        if self.scheduler is not None:
            self.scheduler.abandon_backward()
        self._end_queued = self._backward_ended = False
        self._forget_backward_graph()

    def _forget_backward_graph(self) -> None:
        self._backward_roots, self._reached = [], None

    def scale_loss(self, loss: Tensor) -> Tensor:
        """The loss to call ``backward()`` on: times the fp16 loss scale. Call it before every backward (the
        Lightning glue does): a backward that raised since the last one is forgotten here, so a retry inside the
        same iteration starts clean, and prepared steps are stale (the backward changes the held gradients)."""
        scheduler_stale = self.scheduler is not None and self.scheduler.pass_running
        if self._end_queued or scheduler_stale or any(b.state is not BucketState.IDLE for b in self.buckets):
            self._reset_pass()
        for step in self.steps:
            step.discard()
        if self.scheduler is not None:
            self.scheduler.open_plan()  # see [Note: stage-3 backward plan]
            self._backward_roots, self._reached = [loss.grad_fn], None  # see [Note: units a backward passes over]
        scaler = self.scaling.scaler
        if scaler is None:
            return loss
        self.scaling.backward_scale = scaler.scale  # every optimizer stepped on these gradients unscales by it
        return loss * scaler.scale

    def weight_losses(self, enabled: bool = True, loss_factor: float = 1.0) -> None:
        """Train on the gradient of the global mean loss: each backward's loss is a sum over tokens, given with its
        weight by :meth:`add_loss_weight`; ``loss_factor`` is what the loop multiplied each loss by (``1/k`` for
        Lightning's ``accumulate_grad_batches=k``). See [Note: weighted loss]."""
        self.loss_weights.enabled = enabled
        self.loss_weights.loss_factor = loss_factor

    def add_loss_weight(self, weight: float, loss: float = 0.0) -> None:
        """The weight (token count) of the loss of a backward pass, and that loss's value (for the global mean)."""
        self.loss_weights.add(weight, loss)

    def _queue_end_of_backward(self) -> None:
        if not self._end_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._end_queued = True

    def _end_of_backward(self) -> None:
        self._end_queued = False
        self._run_end_of_backward()
        self._backward_ended = True

    def finish_backward(self) -> None:
        """Call after every ``backward()`` (the Lightning glue does): where this rank's loss reached no trainable
        parameter, no hook ran, so the end of backward runs here, in step with the other ranks."""
        if self._backward_ended:
            self._backward_ended = False
            return
        self._run_end_of_backward()

    def _run_end_of_backward(self) -> None:
        # Reductions are launched before stage-3 gathers are waited for: another rank may be waiting in a
        # reduction before it issues the gather this rank waits in (see [Note: stage-3 backward plan]).
        self.reducer.launch_remaining()
        if self.scheduler is not None:
            self.scheduler.finish_backward()
        self.reducer.finish()
        if self.scheduler is not None:
            self.scheduler.end_backward()
        self._forget_backward_graph()

    def _passed_over(self, units: list[GatherUnit]) -> None:
        """Stage 3: this rank's backward issued the gathers of ``units`` on its way to a later unit; their trained
        parameters that its graph does not reach get no gradient in this pass. See [Note: units a backward passes
        over]."""
        if self._reached is None:
            self._reached = reached_leaves(self._backward_roots)
        for unit in units:
            for buffer in unit.buffers:
                bucket = self._bucket_of.get(id(buffer))
                if bucket is not None:
                    unreached = [s for s, p in enumerate(buffer.params) if id(p) not in self._reached]
                    self.reducer.skip(bucket, unreached)

    def _on_bucket_ready(self, bucket_index: int) -> None:
        assert self.scheduler is not None
        unit = self._unit_of[id(self.buckets[bucket_index].buffer)]
        if all(self._bucket_of[id(b)].ready for b in unit.buffers if id(b) in self._bucket_of):
            self.scheduler.gradients_complete(unit)

    # ------------------------------------------------------------------ step
    def manages(self, optimizer: Optimizer) -> bool:
        return any(step.optimizer is optimizer for step in self.steps)

    def step_of(self, optimizer: Optimizer) -> OptimizerStep:
        for step in self.steps:
            if step.optimizer is optimizer:
                return step
        raise ValueError(f"{type(optimizer).__name__} is not managed by this ZeroEngine")

    def prepare_step(self, optimizer: Optimizer, loss_scale: float | None = None) -> bool:
        """Make ``optimizer``'s step gradients (unscaled by the loss scale of the last backward, or ``loss_scale``)
        and agree whether they are finite; returns whether the step will change anything. ``optimizer.step()``
        does this itself when it was not called; call it first to clip, or to know."""
        return self.step_of(optimizer).prepare(loss_scale)

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip ``optimizer``'s gradients by their global norm over all shards; returns the norm (collective)."""
        return self.step_of(optimizer).clip_grad_norm_(max_norm, norm_type)

    def clip_grad_value_(self, optimizer: Optimizer, clip_value: float) -> None:
        self.step_of(optimizer).clip_grad_value_(clip_value)

    def skip_step(self, optimizer: Optimizer) -> None:
        """``optimizer`` will not step on the gradients of this iteration (they stay held, as torch keeps them)."""
        self.step_of(optimizer).skip()

    def _take_step_comm(self) -> None:
        stats = self.comm.stats.reset()
        if self.topology.gather is not self.comm:
            stats = stats.merged(self.topology.gather.stats.reset())
        self.last_step_comm = stats

    def sync_buffers(self) -> None:
        """Broadcast rank 0's module buffers (e.g. BatchNorm statistics), as DDP does before each forward."""
        with torch.no_grad():
            for buffer in self.module.buffers():
                self.comm.broadcast(buffer, src=0)

    # ------------------------------------------------------------------ hooks
    def remove_hooks(self) -> None:
        self.reducer.remove_hooks()
        if self.scheduler is not None:
            self.scheduler.remove_hooks()

    def register_hooks(self) -> None:
        """Undo :meth:`remove_hooks`: the engine drives the module again (e.g. evaluation after ``fit``)."""
        self.reducer.register_hooks()
        if self.scheduler is not None:
            self.scheduler.register_hooks()

    # ------------------------------------------------------------------ stage 3
    def unshard_root(self) -> None:
        """Gather the root unit: Lightning's step methods use it without calling the root's forward."""
        if self.scheduler is not None:
            self.scheduler.unshard_root()

    @contextmanager
    def hold_root(self) -> Iterator[None]:
        """Stage 3: keep the root unit gathered inside the block, across backward passes (a no-op before)."""
        if self.scheduler is None:
            yield
            return
        with self.scheduler.hold_root():
            yield

    def reshard_all(self) -> None:
        """Free every unit; a step (or an evaluation batch) is over."""
        if self.scheduler is not None:
            self.scheduler.reshard_all()

    @contextmanager
    def gathered(self, write_back: bool = False) -> Iterator[None]:
        """Hold every parameter in full inside the block (stage 3; a no-op before).

        With ``write_back`` changes made to the parameters inside (e.g. ``load_state_dict``) are kept.
        """
        if self.scheduler is None:
            yield
            return
        with self.scheduler.gathered():
            try:
                yield
            finally:
                for buffer in self.buffers:  # a parameter given new data inside: kept with write_back, else undone
                    buffer.reattach() if write_back else buffer.restore_param_views()
                if write_back:
                    for unit in self.units:
                        unit.write_back()
                    for store in self.stores.values():
                        store.sync_from_params()

    # ------------------------------------------------------------------ full values and state
    def best_values(self, buffer: FlatParamBuffer) -> Tensor:
        """This rank's shard of ``buffer`` in the best precision held (the fp32 master where there is one)."""
        store = self.stores.get(id(buffer))
        if store is None:
            return buffer.shard
        if buffer.may_change_at_rest:
            store.sync_from_params()  # in-place writes since the last step (e.g. an averaging callback)
        return store.best()

    def named_state(self) -> NamedState:
        """The engine's state by name, for checkpoints (see core/named_state.py)."""
        return NamedState(self)

    def full_state_dict(self, keep: bool) -> dict[str, Tensor]:
        """The module's ``state_dict`` with full tensors (fp32 masters where kept), collected on ranks with ``keep``
        (collective)."""
        return named_state.full_state_dict(self, keep)

    def load_state_dict(self, state_dict: Mapping[str, Tensor], strict: bool = True) -> None:
        """Load an ordinary (unsharded) ``state_dict`` into the module, its shards and master copies (collective)."""
        with self.gathered(write_back=True), torch.no_grad():
            self.module.load_state_dict(state_dict, strict=strict)
        named_state.load_masters(self, state_dict)

    def full_optimizer_state_dict(self, optimizer: Optimizer) -> dict:
        """The state dict ``optimizer`` would have without sharding (collective; every rank gets it)."""
        return named_state.full_optimizer_state_dict(self, optimizer)

    def load_full_optimizer_state_dict(self, optimizer: Optimizer, state_dict: dict) -> None:
        """Load an ordinary (unsharded) optimizer state dict into ``optimizer``'s shards."""
        named_state.load_full_optimizer_state_dict(self, optimizer, state_dict)

    def release(self) -> None:
        """Give every parameter a full tensor of its own in its best precision (the fp32 masters where there are
        some) and stop driving the module and its optimizers (collective). The optimizer state keeps its shards."""
        for step in self.steps:
            step.uninstall()
        uninstall_module_zero_grad(self.module)
        for handle in self._state_dict_hooks:
            handle.remove()
        self.remove_hooks()
        with torch.no_grad(), engine_access():
            for buffer in self.buffers:
                best = self.best_values(buffer)
                if best is buffer.shard and buffer.may_change_at_rest:
                    continue  # already full and in its own dtype
                full = buffer.full_values(best, self.comm)
                for param, values in zip(buffer.params, buffer.param_views(full), strict=True):
                    param.data = values.clone()
                    RestingParameter.release(param)
                del full
        for store in self.stores.values():
            store.close()
        if self.offload is not None:
            self.offload.close()
        self.units, self.scheduler = [], None

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Around a checkpoint save: state that rests in the swap file is given as read-only maps of it, so the
        save streams it instead of holding the rank's share in memory (see core/store/disk.py)."""
        swap = self.offload.swap if self.offload is not None else None
        with swap.mapped_reads() if swap is not None else nullcontext():
            yield

    # ------------------------------------------------------------------ reports
    def memory_report(self) -> MemoryReport:
        """Bytes of parameters, gradients and optimizer state this rank holds now."""
        managed = {id(p) for b in self.buffers for p in b.params}
        unmanaged = [p for p in self.module.parameters() if id(p) not in managed]
        with engine_access():
            params = sum(b.nbytes for b in self.buffers) + sum(tensor_nbytes(p) for p in unmanaged)
            grads = sum(b.nbytes for b in self.buckets) + sum(tensor_nbytes(p.grad) for p in unmanaged)
        grads += sum(step.step_grad_nbytes for step in self.steps)
        masters = sum(store.nbytes for store in self.stores.values())  # counted with the optimizer, as in the paper
        offloaded = sum(store.offloaded_nbytes for store in self.stores.values())
        offloaded += sum(b.shard_nbytes for b in self.buffers if getattr(b, "shard_offloaded", False))
        offloaded += sum(bucket.offloaded_nbytes for bucket in self.buckets)
        host_params = {id(e.param) for s in self.steps for e in s.entries if e.store.offloaded}
        resident = offloaded_states = 0
        for optimizer in self.optimizers:
            for param, state in optimizer.state.items():
                nbytes = sum(map(tensor_nbytes, state.values()))
                if id(param) in host_params:
                    offloaded_states += nbytes
                else:
                    resident += nbytes
        owned = [0] * self.comm.world_size  # per rank (layouts are the same on every rank, so no collective)
        for buffer in self.buffers:
            if id(buffer) in self.stores:
                for rank in range(self.comm.world_size):
                    owned[rank] += buffer.layout.shard_size(rank)
        return MemoryReport(
            params=params,
            gradients=grads,
            optimizer_states=resident + masters,
            offloaded=offloaded + offloaded_states,
            owned_max=max(owned),
            owned_min=min(owned),
        )

    @property
    def io_counts(self) -> IOCounts:
        """Bytes this rank's swap file read and wrote so far (``offload_optimizer="nvme"``)."""
        return self.offload.io if self.offload is not None else IOCounts()
