"""How parameters become flat buffers, and which store each trainable buffer gets.

Stages 1 and 2 pack the trainable parameters of each optimizer param group (each parameter once, in its first
group), by dtype, into :class:`ReplicatedBuffer` buckets of at most ``bucket_cap_mb`` in reverse registration
order (see [Note: bucket order]). Stage 3 packs every parameter of each gather unit (see [Note: stage-3 gather
units]) into :class:`ShardedBuffer` s by (``requires_grad``, dtype), which keep only their shard. Precision
chooses each trainable buffer's store (see core/store/stores.py): a :class:`MasterStore` for 16-bit parameters that
an optimizer trains, an :class:`InPlaceStore` otherwise (fp32 runs; batch-norm, complex and integer parameters).
With offload, every floating-point buffer an optimizer trains gets the offload's store instead (core/store/),
and stage-3 shards rest where the offload says.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_zero.core.comm import Communicator
from lightning_zero.core.comm.topology import Topology
from lightning_zero.core.layout.flat_buffer import FlatParamBuffer, ReplicatedBuffer, ShardedBuffer
from lightning_zero.core.layout.owners import OwnerPlan
from lightning_zero.core.layout.pieces import plan_buckets
from lightning_zero.core.layout.resting import RestingParameter, engine_access
from lightning_zero.core.mixed_precision import PrecisionPolicy
from lightning_zero.core.options import WrapPolicy
from lightning_zero.core.shards import BufferGroup
from lightning_zero.core.stage3.meta_init import initialise, materialize_buffers
from lightning_zero.core.stage3.units import GatherUnit, assign_params, select_units
from lightning_zero.core.step.buckets import GradBucket
from lightning_zero.core.step.quantized_reduction import QuantizedReduction
from lightning_zero.core.step.reduction import GradientReduction
from lightning_zero.core.step.shard_bucket import ShardGradBucket
from lightning_zero.core.store.offload import Offload
from lightning_zero.core.store.stores import InPlaceStore, MasterStore, ShardStore


class Packer:
    """Builds the buffers and stores of one engine. See the module docstring.

    Args:
        module: the model (for its parameter order and batch-norm layers).
        names: every parameter's (first) name.
        topology: the groups (shards over ``topology.shard``; rank 0 of ``topology.world`` gives the values).
        device: where sharded tensors live.
        policy: the dtypes held.
        bucket_cap_bytes: the size of a stage-1/2 bucket.
        bucket_type: the gradient bucket of a trained buffer (replicated gradients at stage 1, shards after).
        offload: where offloaded states live (its do-nothing form: everything on ``device``).
        owners: whole-tensor owners of the trained tensors (``partition="parameter"``; ``None``: flat shards).
    """

    def __init__(
        self,
        module: nn.Module,
        names: dict[nn.Parameter, str],
        topology: Topology,
        device: torch.device,
        policy: PrecisionPolicy,
        bucket_cap_bytes: int,
        bucket_type: type[GradBucket],
        offload: Offload,
        owners: OwnerPlan | None = None,
    ) -> None:
        self.module = module
        self.owners = owners
        self.names = names
        self.shard, self.world = topology.shard, topology.world
        self.reduction = GradientReduction(topology.shard, topology.replicate, QuantizedReduction.of(topology))
        self.device = device
        self.policy = policy
        self.bucket_cap_bytes = bucket_cap_bytes
        self.bucket_type = bucket_type
        self.offload = offload
        # Batch norm keeps fp32 parameters next to its fp32 statistics in 16-bit runs (see norm_params).
        self.keep_dtype = norm_params(module) if policy.param_dtype is not None else set()

    def store_for(self, buffer: FlatParamBuffer, optimized: bool) -> ShardStore:
        """The store of a trainable buffer; call while the buffer holds its full values (it may cast them)."""
        kept = buffer.params[0] in self.keep_dtype or not buffer.data.dtype.is_floating_point
        floating = buffer.data.dtype.is_floating_point
        if optimized and floating:
            master_dtype = torch.promote_types(buffer.data.dtype, self.policy.master_dtype or torch.float32)
            offloaded = self.offload.store(buffer, master_dtype)
            if offloaded is not None:
                if not kept:
                    buffer.cast(self.policy.param_dtype)
                return offloaded
        if optimized and not kept and self.policy.master_dtype is not None:
            store = MasterStore(buffer, self.policy.master_dtype)
            buffer.cast(self.policy.param_dtype)
            return store
        return InPlaceStore(buffer)

    def group(self, buffer: FlatParamBuffer, store: ShardStore | None, unit: GatherUnit | None = None) -> BufferGroup:
        """``buffer``'s record: with a store (trained), also its gradient bucket (see [Note: buffer groups])."""
        if store is None:
            return BufferGroup(buffer, unit=unit)
        widened = self.policy.param_dtype is not None and buffer.data.dtype == self.policy.param_dtype
        reduce_dtype = self.policy.reduce_dtype if isinstance(store, MasterStore) or widened else None
        resting = self.offload.gradient_resting() if store.paged else None
        bucket = (
            ShardGradBucket(buffer, self.reduction, reduce_dtype, resting)
            if resting
            else self.bucket_type(buffer, self.reduction, reduce_dtype)
        )
        return BufferGroup(buffer, store, bucket, unit)

    def replicated(self, groups: Sequence[Sequence[nn.Parameter]]) -> list[BufferGroup]:
        """Stages 1, 2: buckets of ``groups`` (trainable parameters per param group), in launch order."""
        order = {p: i for i, p in enumerate(reversed(list(self.names)))}
        planned: list[list[nn.Parameter]] = []
        for params in groups:
            for same in split_by_dtype(sorted(params, key=order.__getitem__), self.keep_dtype):
                cap = max(1, self.bucket_cap_bytes // same[0].element_size())
                planned.extend([same[i] for i in indices] for indices in plan_buckets([p.numel() for p in same], cap))
        # Launch order: by the member whose gradient comes last (the earliest registered). Sorting by the first member
        # put a bucket of every block's biases and norms (a param group without weight decay) first, and as buckets
        # launch in order, no reduction started before the end of backward and every staging buffer lived till then.
        planned.sort(key=lambda members: max(order[p] for p in members))
        packed: list[BufferGroup] = []
        for members in planned:
            buffer = ReplicatedBuffer(members, self.shard.rank, self.shard.world_size, owners=self._owners(members))
            packed.append(self.group(buffer, self.store_for(buffer, optimized=True)))
        return packed

    def units(self, wrap_policy: WrapPolicy, optimized: set[int]) -> tuple[list[GatherUnit], list[BufferGroup]]:
        """Stage 3: every unit (the root last), each created, initialised and sharded in turn; its buffers in
        launch order (backward meets the last units first)."""
        unit_modules = select_units(self.module, wrap_policy)
        assigned = assign_params(self.module, unit_modules)
        materialize_buffers(self.module, self.device)
        module_names = {module: name for name, module in self.module.named_modules()}
        units: list[GatherUnit] = []
        packed: list[BufferGroup] = []
        for unit_module in [*unit_modules, self.module]:
            params = assigned[unit_module]
            on_meta = [p for p in params if p.is_meta]
            buffers = self._sharded(params)
            initialise(self.module, on_meta)
            stores = [self._commit(buffer, optimized) for buffer in buffers]
            name = module_names.get(unit_module) or "<root>"
            unit = GatherUnit(unit_module, name, buffers, is_root=unit_module is self.module)
            units.append(unit)
            packed.extend(self.group(buffer, store, unit) for buffer, store in zip(buffers, stores, strict=True))
        with torch.no_grad():
            for tensor in self.module.buffers():
                self.world.broadcast(tensor, src=0)
        # Launch order: the last unit's buckets first (backward meets it first), the root's last. The root holds what
        # is used both first and last in forward (a tied embedding and output head, position embeddings): its
        # gradients complete at the very end of backward, and a bucket launches only after those before it, so a
        # root launched first would keep every unit's full-size staging alive until the end of backward.
        roots = len(units[-1].buffers)
        return units, [*reversed(packed[: len(packed) - roots]), *packed[len(packed) - roots :]]

    def split_frozen_groups(
        self, groups: Sequence[BufferGroup], optimized: set[int], gather: Communicator
    ) -> list[tuple[BufferGroup, list[BufferGroup]]]:
        """Stage 3: each frozen group whose parameters became trainable in an optimizer, with the groups that replace
        it (see [Note: changes after setup]); its unit is gathered over ``gather`` for the split (collective)."""
        replaced = []
        for group in [g for g in groups if g.store is None]:
            unit = group.unit
            if unit is None or not any(p.requires_grad and id(p) in optimized for p in group.buffer.params):
                continue
            unit.unshard(gather)
            replaced.append((group, self.split_frozen(unit, group.buffer, optimized)))  # type: ignore[arg-type]
            unit.reshard()
        return replaced

    def split_frozen(self, unit: GatherUnit, buffer: ShardedBuffer, optimized: set[int]) -> list[BufferGroup]:
        """Stage 3: a frozen buffer of a gathered ``unit`` whose parameters became trainable, split by
        ``requires_grad`` into new buffers that replace it in the unit (see [Note: changes after setup])."""
        with engine_access():
            for param in buffer.params:
                RestingParameter.release(param)
        new = self._sharded(buffer.params)
        unit.replace_buffer(buffer, new)
        return [self.group(piece, self._commit(piece, optimized), unit) for piece in new]

    def _owners(self, params: Sequence[nn.Parameter]) -> list[int] | None:
        return self.owners.owners_of(params) if self.owners is not None else None

    def _sharded(self, params: Sequence[nn.Parameter]) -> list[ShardedBuffer]:
        return [
            ShardedBuffer(
                same,
                self.shard.rank,
                self.shard.world_size,
                device=self.device,
                shard_home=self.offload.shard_home,
                resting=self.offload.resting(),
                owners=self._owners(same) if flag else None,  # frozen tensors: flat (no optimizer steps them)
            )
            for flag in (True, False)
            for same in split_by_dtype([p for p in params if p.requires_grad is flag], self.keep_dtype)
        ]

    def _commit(self, buffer: ShardedBuffer, optimized: set[int]) -> ShardStore | None:
        """Rank 0's values everywhere (whatever each rank's RNG did), the store chosen, only the shard kept."""
        self.world.broadcast(buffer.data, src=0)
        store = None
        if buffer.params[0].requires_grad:
            store = self.store_for(buffer, optimized=any(id(p) in optimized for p in buffer.params))
        buffer.commit_shard()
        with engine_access():
            for param in buffer.params:
                RestingParameter.adopt(param, self.names[param])
        return store


def split_by_dtype(params: list[nn.Parameter], keep_dtype: set[nn.Parameter]) -> list[list[nn.Parameter]]:
    """``params`` grouped by (dtype, device, in ``keep_dtype``), each group in the given order."""
    groups: dict[tuple[torch.dtype, torch.device, bool], list[nn.Parameter]] = {}
    for param in params:
        groups.setdefault((param.dtype, param.device, param in keep_dtype), []).append(param)
    return list(groups.values())


def norm_params(module: nn.Module) -> set[nn.Parameter]:
    """Parameters of batch-norm layers. Their running statistics stay fp32, and CPU ``batch_norm`` (no autocast op)
    needs its weight in their dtype, so a 16-bit policy leaves these parameters in fp32 (as FSDP's mixed precision
    does): the optimizer updates them directly, without a master."""
    return {p for m in module.modules() if isinstance(m, _BatchNorm) for p in m.parameters(recurse=False)}
