"""ZeroEngine: shards a module's parameters, gradients and optimizer state for ZeRO stages 1 to 3.

The engine knows nothing about Lightning; any training loop drives it with a few calls down:

1. ``ZeroEngine(module, optimizers, options, comm)``: the ranks agree on parameters and options, rank 0's
   parameters and buffers are broadcast, and the trainable parameters are packed into flat buffers (see
   [Note: flat layout]): for stages 1 and 2 those of each optimizer param group, in buckets of at most
   ``bucket_cap_mb``; for stage 3 every parameter of each gather unit (see [Note: stage-3 gather units]),
   which then keeps only its shard. Each buffer an optimizer trains gets a store (see core/store/stores.py) and a
   gradient bucket, held together in its record (see [Note: buffer groups]); each optimizer gets an
   :class:`OptimizerStep` (see [Note: the step window]). The engine coordinates: the records and what reads them
   live in :class:`~lightning_zero.core.shards.ShardedModel` (``engine.model``), the backward side in
   :class:`~lightning_zero.core.backward.BackwardPass` (``engine.backward``), the stage-3 scheduler (a do-nothing
   one at stages 1 and 2) in ``engine.model.scheduler``.
2. ``begin_iteration()`` before each forward: whatever an exception left behind is reset (see [Note: bucket
   state]) and parameters unfrozen or added to an optimizer since the last iteration are sharded (see
   [Note: changes after setup]).
3. ``loss = scale_loss(loss)``; ``loss.backward()``: gradient hooks fill the buckets and reduce-scatter them
   (see [Note: bucket order]); stage 3 gathers each unit around its forward and backward (see [Note:
   stage-3 backward plan]). ``finish_backward()`` after it makes sure the end of backward ran on this rank
   even where the loss reached no trainable parameter.
4. Optionally ``step_of(optimizer).clip_grad_norm_(...)``; then ``optimizer.step()`` and ``optimizer.zero_grad()``
   as usual: the step window hands the optimizer its pieces, and stages 1 and 2 gather the new shards.

[Note: the order of collectives]
Every rank must issue the same collectives in the same order, whatever the options, or the job hangs (or, with
gloo, aborts on a message of another size). So the ranks' agreement on the parameters and options (``Communicator.
agree``) is the first collective an engine issues, and everything that depends on an option comes after it:
process groups (``Topology.build``: ``new_group`` is itself a collective, a store wait that a lost rank does not
end), the offload checks, the owners' agreement, the broadcast of rank 0's states. A rank that fails before it
posts a notice (see [Note: a rank that raises and stays alive]) that ends the others' wait in the agreement.
``tests/distributed/test_collective_order.py`` records the collectives of every combination of options.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.core import named_state, setup
from lightning_zero.core.backward import BackwardPass
from lightning_zero.core.comm import CommStats, Communicator
from lightning_zero.core.comm.changes import ChangeWatch
from lightning_zero.core.comm.topology import Topology
from lightning_zero.core.layout.owners import OwnerPlan
from lightning_zero.core.layout.resting import clone_gathered_in_state_dicts
from lightning_zero.core.memory import MemoryReport
from lightning_zero.core.mixed_precision import DynamicLossScaler, PrecisionPolicy
from lightning_zero.core.named_state import NamedState
from lightning_zero.core.norm_inputs import cast_fp32_norm_inputs
from lightning_zero.core.options import EngineOptions
from lightning_zero.core.packing import Packer
from lightning_zero.core.shards import BufferGroup, ShardedModel
from lightning_zero.core.stage3.scheduler import Stage3Scheduler
from lightning_zero.core.step.full_bucket import FullGradBucket
from lightning_zero.core.step.loss_weight import LossWeights
from lightning_zero.core.step.optimizer_step import LossScaling, OptimizerStep
from lightning_zero.core.step.shard_bucket import ShardGradBucket
from lightning_zero.core.step.zero_grad import install_module_zero_grad, uninstall_module_zero_grad
from lightning_zero.core.store.swap import IOCounts

# The engine that drives each module now: one at a time (see release_previous_engine).
_DRIVING: weakref.WeakKeyDictionary[nn.Module, ZeroEngine] = weakref.WeakKeyDictionary()


def release_previous_engine(module: nn.Module) -> None:
    """Give ``module`` back from the engine that drives it, if any (collective: its parameters are gathered in full),
    so that a new engine, or a new strategy's move to its device, finds ordinary parameters. A second ``fit`` of the
    same module with a new Trainer, or a Fabric set up with a module another strategy trained, relies on it."""
    previous = _DRIVING.get(module)
    if previous is not None:
        previous.release()


class ZeroEngine:
    """ZeRO stages 1-3 for ``module`` trained by ``optimizers``. See the module docstring.

    Args:
        module: the model; at stage 3 it may be on the meta device (each unit is then created on ``device``
            and initialised with its modules' ``reset_parameters()`` in turn, so the full model never exists
            on one rank).
        optimizers: the user's optimizers over ``module``'s parameters (a parameter may be in several).
        options: how to shard.
        comm: every rank of the job (with ``options.shard_size`` the engine splits it, see [Note: hybrid sharding]).
        device: where sharded tensors live (default: the parameters' device).
        precision: the dtypes held (default: the parameters' own, no master copy).
        loss_scaler: fp16 dynamic loss scaling, decided by all ranks together.
        agree_also: further ``(name, value)`` pairs every rank must agree on (the caller's own options).
        optimizers_later: optimizers will join after setup (:meth:`add_optimizer`, Fabric's ``setup_optimizers``):
            at stage 3 every trainable parameter gets the store of an optimized one (fp32 master, offload) now,
            since its unit is sharded now.
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
        optimizers_later: bool = False,
    ) -> None:
        release_previous_engine(module)  # one engine drives a module at a time
        self.module, self.options, self.comm = module, options, comm
        self._released = False
        # On CUDA: reset the allocator's peak statistics at each iteration and report its peak in the step peak.
        # Off by default: it changes what torch.cuda.max_memory_allocated() reads for everyone (ZeroMonitor sets it).
        self.allocator_peak = False
        self.optimizers = list(optimizers)
        self.policy = precision or PrecisionPolicy()
        self.device = device or next(module.parameters(), torch.empty(0)).device
        self.loss_weights = LossWeights(comm, self.device)
        self.scaling = LossScaling(loss_scaler, self.loss_weights)
        names = {param: name for name, param in module.named_parameters()}
        setup.check_optimizers(self.optimizers, names, options.partition)
        # The first collective of setup, then everything that depends on an option: see [Note: the order of collectives]
        setup.agree_on_model(comm, module, self.optimizers, setup.describe(options, self.policy, agree_also, comm))
        # Groups are created only once the ranks agree (see [Note: hybrid sharding]).
        self.topology = Topology.build(
            comm, options.stage, options.shard_size, options.secondary_shard_size, options.quantize_gradients
        )
        shard = self.topology.shard
        if options.stage < 3:
            setup.broadcast_module_states(module, comm)
        offload = setup.build_offload(options, module, self.optimizers, self.topology)
        self.model = ShardedModel(module, self.optimizers, self.topology, offload, options.stage)
        self.owners = OwnerPlan(shard.world_size) if options.partition == "parameter" else None
        setup.assign_owners(self.owners, self.model, options.stage)
        bucket_type = FullGradBucket if options.stage == 1 else ShardGradBucket
        self.packer = Packer(
            module,
            names,
            self.topology,
            self.device,
            self.policy,
            options.bucket_cap_bytes,
            bucket_type,
            offload,
            self.owners,
        )
        self._state_dict_hooks = []  # stage 3: state_dict() in gathered() copies
        self._norm_input_hooks = cast_fp32_norm_inputs(module, self.policy.param_dtype)  # see its note
        if options.stage == 3:
            trained = module.parameters() if optimizers_later else setup.optimized(self.optimizers)
            units, groups = self.packer.units(options.wrap_policy, {id(p) for p in trained if p.requires_grad})
            self.model.groups = groups
            self._state_dict_hooks = clone_gathered_in_state_dicts(module)
        else:
            self.model.groups = self.packer.replicated(setup.trainable_by_group(self.optimizers, set()))
        self.backward = BackwardPass(self.model, comm, options.overlap_comm, options.stage, self.scaling)
        if options.stage == 3:
            self.model.scheduler = Stage3Scheduler(
                units,
                self.topology.gather,
                options.overlap_comm,
                self.backward.passed_over,
                self.topology.secondary,
                options.quantize_weights,
            )
        self.last_step_comm = CommStats()
        self.model.steps = [self._step(o) for o in self.optimizers]
        setup.bind_optimizers(self.model)
        install_module_zero_grad(module, self.model.steps)
        self.changes = ChangeWatch(self.optimizers, comm, self.device)  # see [Note: changes after setup]
        self.changes.remember(self.model.managed_ids())
        self.model.attach_ledger()
        self.topology.take_stats()  # setup's broadcasts and agreements are not the first step's communication
        _DRIVING[module] = self

    def _step(self, optimizer: Optimizer) -> OptimizerStep:
        free = self.options.free_gradients_after_step
        return OptimizerStep(
            optimizer, [], self.topology, self.device, self.scaling, self._take_comm, self.loss_weights.agree, free
        )

    def _take_comm(self) -> None:
        self.last_step_comm = self.topology.take_stats()

    def add_optimizer(self, optimizer: Optimizer) -> None:
        """Manage ``optimizer``, created after setup over the module's (sharded) parameters: its parameters not
        held yet are sharded, its existing state sliced (collective: every rank adds the same optimizers in the same
        order). See [Note: changes after setup]."""
        if any(optimizer is other for other in self.optimizers):
            raise ValueError(f"{type(optimizer).__name__} is managed by this ZeroEngine already.")
        # Before anything changes (local, so every rank raises alike): a refused optimizer leaves the engine as it was.
        setup.check_optimizers([optimizer], self.model.names, self.options.partition, first=len(self.optimizers))
        self.optimizers.append(optimizer)
        self.model.steps.append(self._step(optimizer))
        self.changes.optimizers.append(optimizer)
        self.backward.hyperparameters.optimizers.append(optimizer)
        install_module_zero_grad(self.module, self.model.steps)
        self._take_changes()
        self.changes.remember(self.model.managed_ids())
        self.model.attach_ledger()

    # ------------------------------------------------------------------ each iteration
    def begin_iteration(self) -> None:
        """Start a training iteration (before its forward): reset what an exception left and take changes made to
        trainable parameters and param groups since the last one (collective). See [Note: changes after setup]."""
        self.backward.reset()
        for step in self.model.steps:
            step.abort()
            step.discard()
        self.model.scheduler.begin_iteration()
        if self.changes.changed(self.model.managed_ids()):
            self._take_changes()
            self.changes.remember(self.model.managed_ids())
            self.model.attach_ledger()
        self.model.ledger.reset()  # the step's peak starts here (see memory_report)
        if self.allocator_peak and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _take_changes(self) -> None:
        """Shard the parameters that became trainable in an optimizer since setup (collective)."""
        setup.check_optimizers(self.optimizers, self.model.names, self.options.partition)
        setup.agree_on_model(
            self.comm, self.module, self.optimizers, setup.describe(self.options, self.policy, (), self.comm)
        )
        setup.assign_owners(self.owners, self.model, self.options.stage)
        if self.options.stage == 3:
            optimized = {id(p) for p in setup.optimized(self.optimizers)}
            for frozen, split in self.packer.split_frozen_groups(self.model.groups, optimized, self.topology.gather):
                self.model.groups.remove(frozen)
                self._add_groups(split)
        else:
            held = {id(p) for b in self.model.buffers for p in b.params}
            self._add_groups(self.packer.replicated(setup.trainable_by_group(self.optimizers, held)))
        setup.bind_optimizers(self.model)

    def _add_groups(self, groups: list[BufferGroup]) -> None:
        self.model.groups.extend(groups)
        self.backward.add_buckets([group.bucket for group in groups if group.bucket is not None])

    def scale_loss(self, loss: Tensor, retain_graph: bool = False) -> Tensor:
        """The loss to call ``backward()`` on, ``retain_graph`` as that backward's (:meth:`BackwardPass.scale_loss`)."""
        return self.backward.scale_loss(loss, retain_graph)

    def finish_backward(self) -> None:
        """Call after every ``backward()`` (see :meth:`BackwardPass.finish`)."""
        self.backward.finish()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside skip the reduction where the stage allows it (gradient accumulation), as DDP's."""
        with self.backward.no_sync():
            yield

    def step_of(self, optimizer: Optimizer) -> OptimizerStep:
        """``optimizer``'s step: ``prepare()``, ``clip_grad_norm_(...)``, ``skip()`` (see [Note: the step window])."""
        return self.model.step_of(optimizer)

    def sync_buffers(self) -> None:
        """Broadcast rank 0's module buffers (e.g. BatchNorm statistics), as DDP does before each forward."""
        with torch.no_grad():
            for buffer in self.module.buffers():
                self.comm.broadcast(buffer, src=0)

    # ------------------------------------------------------------------ full values and state
    @contextmanager
    def gathered(self, write_back: bool = False) -> Iterator[None]:
        """Hold every parameter in full inside the block (stage 3; a no-op before). With ``write_back`` changes made
        to the parameters inside (e.g. ``load_state_dict``) are kept."""
        with self.model.gathered(write_back):
            yield

    def named_state(self, order: Sequence[int] | None = None) -> NamedState:
        """The engine's state by name, for checkpoints (see core/named_state.py); ``order``: its optimizer ``i`` is
        the engine's ``order[i]``."""
        return NamedState(self.model, order)

    def full_state_dict(self, keep: bool) -> dict[str, Tensor]:
        """The module's ``state_dict`` with full tensors (fp32 masters where kept), collected on ranks with ``keep``
        (collective)."""
        return named_state.full_state_dict(self.model, keep)

    def load_state_dict(self, state_dict: Mapping[str, Tensor], strict: bool = True) -> None:
        """Load an ordinary (unsharded) ``state_dict`` into the module, its shards and master copies (collective)."""
        with self.gathered(write_back=True), torch.no_grad():
            self.module.load_state_dict(state_dict, strict=strict)
        named_state.load_masters(self.model, state_dict)

    def full_optimizer_state_dict(self, optimizer: Optimizer) -> dict:
        """The state dict ``optimizer`` would have without sharding (collective; every rank gets it)."""
        return named_state.full_optimizer_state_dict(self.model, optimizer)

    def load_full_optimizer_state_dict(self, optimizer: Optimizer, state_dict: dict) -> None:
        """Load an ordinary (unsharded) optimizer state dict into ``optimizer``'s shards."""
        named_state.load_full_optimizer_state_dict(self.model, optimizer, state_dict)

    def release(self) -> None:
        """Give every parameter a full tensor of its own in its best precision (the fp32 masters where there are
        some) and stop driving the module and its optimizers (collective; once). The optimizer state keeps its
        shards."""
        if self._released:
            return
        self._released = True
        for step in self.model.steps:
            step.uninstall()
        uninstall_module_zero_grad(self.module)
        for handle in [*self._state_dict_hooks, *self._norm_input_hooks]:
            handle.remove()
        self.backward.remove_hooks()
        self.model.release()
        if _DRIVING.get(self.module) is self:
            del _DRIVING[self.module]

    # ------------------------------------------------------------------ reports
    def memory_report(self) -> MemoryReport:
        """Bytes of parameters, gradients and optimizer state this rank holds now (see :class:`ShardedModel`), and
        the peak since the last :meth:`begin_iteration` by kind (``step_peak``; with :attr:`allocator_peak` on CUDA
        also the allocator's peak)."""
        report = self.model.memory_report()
        measured = self.allocator_peak and self.device.type == "cuda"
        allocated = torch.cuda.max_memory_allocated(self.device) if measured else None
        return dataclasses.replace(report, step_peak=self.model.step_peak(report, allocated))

    @property
    def io_counts(self) -> IOCounts:
        """Bytes this rank's swap file read and wrote so far (``offload_optimizer="nvme"``)."""
        return self.model.offload.io
