"""The steps of an engine's setup that are not the engine's to coordinate: checking the optimizers, the ranks'
agreement on the model and options, the offload's checks, rank 0's states everywhere, and binding each optimizer to
the buffer groups that hold its parameters. Each runs in one direction: it reads what exists and builds what comes
next (see [Note: the order of collectives] in core/engine.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.core.comm import Communicator
from lightning_zero.core.comm.topology import Topology
from lightning_zero.core.layout.flat_buffer import FlatParamBuffer
from lightning_zero.core.layout.optim_state import shard_param_state
from lightning_zero.core.layout.owners import OwnerPlan
from lightning_zero.core.mixed_precision import PrecisionPolicy
from lightning_zero.core.options import EngineOptions
from lightning_zero.core.shards import ShardedModel
from lightning_zero.core.step.elementwise import check_elementwise, check_per_tensor
from lightning_zero.core.step.entry import StepEntry
from lightning_zero.core.store.checks import check_offload, offloaded_bytes_per_rank
from lightning_zero.core.store.offload import Offload, prefer_fused_kernels


def check_optimizers(
    optimizers: Sequence[Optimizer], names: dict[nn.Parameter, str], partition: str, first: int = 0
) -> None:
    """Each optimizer steps element-wise (flat pieces) or per tensor (whole tensors apart), over the model's own
    parameters (``first``: the index of ``optimizers[0]`` among the engine's, for the messages). See [Note: the
    element-wise probe]."""
    for index, optimizer in enumerate(optimizers, start=first):
        check = check_elementwise if partition == "flat" else check_per_tensor
        check(optimizer, index)
        for group_index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                if param not in names:
                    raise ValueError(
                        f"optimizer {index} param group {group_index} holds a parameter of shape "
                        f"{tuple(param.shape)} that is not in the model. Create the optimizer from the model's own "
                        "parameters: `self.parameters()` in configure_optimizers(); with Fabric, `model.parameters()` "
                        "of the model given to `fabric.setup` or `fabric.setup_module`."
                    )


def agree_on_model(
    comm: Communicator,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    described: Sequence[tuple[str, object]],
) -> None:
    """Every rank has the same parameters (shape, dtype, ``requires_grad``, optimizer group) and the same options
    (``described``), or every rank raises (collective: the first of setup)."""
    groups: dict[nn.Parameter, list[tuple[int, int]]] = {}
    for index, optimizer in enumerate(optimizers):
        for group_index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                groups.setdefault(param, []).append((index, group_index))
    params = [
        (name, (tuple(p.shape), str(p.dtype), p.requires_grad, groups.get(p))) for name, p in module.named_parameters()
    ]
    fix = "Build the same model, optimizers and precision on every rank (before Trainer.fit or fabric.setup)."
    comm.agree("the model's parameters (shape, dtype, requires_grad, optimizer group)", params, fix)
    fix = (
        "Pass the same options on every rank: ZeroStrategy's and the Trainer's precision, accumulate_grad_batches "
        "and gradient clipping; with Fabric, ZeroFabricStrategy's and Fabric's precision."
    )
    comm.agree("the strategy's options and precision", list(described), fix)


def describe(
    options: EngineOptions, policy: PrecisionPolicy, agree_also: Sequence[tuple[str, object]], comm: Communicator
) -> list[tuple[str, object]]:
    """The options every rank must agree on: the engine's, the dtypes and the caller's own; with ``shard_size`` or
    ``secondary_shard_size`` or ``quantize_gradients`` also the ranks per node (their groups are laid out by it)."""
    grouped = options.shard_size is not None or options.secondary_shard_size is not None or options.quantize_gradients
    layout = [("ranks_per_node", comm.ranks_per_node)] if grouped else []
    return sorted(options.describe().items()) + list(policy.describe().items()) + layout + list(agree_also)


def build_offload(
    options: EngineOptions, module: nn.Module, optimizers: Sequence[Optimizer], topology: Topology
) -> Offload:
    """Check what offload needs of every rank's machine (collective) and open the rank's swap file (named by its
    global rank); without offload the do-nothing :class:`Offload`."""
    comm, shards = topology.world, topology.shard.world_size
    if not (options.offload_optimizer or options.offload_params):
        return Offload(False, False, None, comm.rank)
    needs = {"cpu": 0, "nvme": 0}  # bytes a rank keeps on the host / in its swap file
    if options.offload_optimizer:
        needs[options.offload_optimizer] += offloaded_bytes_per_rank(optimizers, shards)
        prefer_fused_kernels(list(optimizers))
    if options.offload_params == "nvme":
        nbytes = sum(p.numel() * p.element_size() for p in module.parameters())
        if options.offload_optimizer == "nvme":  # gradients rest there too: the held one and an accumulation
            nbytes += 2 * sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        needs["nvme"] += -(-nbytes // shards)
    for target in ("cpu", "nvme"):
        if needs[target] or options.offload_optimizer == target:  # the same checks on every rank
            check_offload(target, options.nvme_path, needs[target], comm)
    return Offload(options.offload_optimizer, options.offload_params, options.nvme_path, comm.rank)


def broadcast_module_states(module: nn.Module, comm: Communicator) -> None:
    """Give every rank rank 0's parameters and buffers, as DDP does at construction."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            comm.broadcast(tensor.data, src=0)


def optimized(optimizers: Sequence[Optimizer]) -> list[nn.Parameter]:
    """Every parameter some optimizer holds, once, in the order of the optimizers and their groups."""
    return list(dict.fromkeys(p for o in optimizers for g in o.param_groups for p in g["params"]))


def trainable_by_group(optimizers: Sequence[Optimizer], held: set[int]) -> list[list[nn.Parameter]]:
    """Per optimizer param group (each parameter in its first group only), its trainable parameters whose ``id`` is
    not in ``held``."""
    seen: set[int] = set()
    groups = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            fresh = [p for p in group["params"] if p.requires_grad and id(p) not in held and id(p) not in seen]
            seen.update(id(p) for p in fresh)
            groups.append(fresh)
    return groups


def assign_owners(owners: OwnerPlan | None, model: ShardedModel, stage: int) -> None:
    """``partition="parameter"``: owners for the trained tensors that have none yet, agreed by every rank
    (collective). Stage 3 shards every trainable tensor, stages 1 and 2 those an optimizer trains."""
    if owners is None:
        return
    trained_by_optimizer = {id(p) for p in optimized(model.optimizers)}
    trained = [p for p in model.names if p.requires_grad and (stage == 3 or id(p) in trained_by_optimizer)]
    if owners.assign(trained):
        owners.agree(model.comm, model.names)


def bind_optimizers(model: ShardedModel) -> None:
    """Tell each optimizer step which of its parameters the trained groups hold; slice full-size optimizer state."""
    where = {id(p): (g, slot) for g in model.trained for slot, p in enumerate(g.buffer.params)}
    stepped_by = Counter(id(p) for step in model.steps for p in optimized([step.optimizer]))
    shared = {key for key, count in stepped_by.items() if count > 1}
    for step in model.steps:
        entries = []
        for param in optimized([step.optimizer]):
            if id(param) not in where:
                continue  # frozen: not trained, nothing to shard
            group, slot = where[id(param)]
            entries.append(StepEntry(param, slot, group.store, group.bucket))  # type: ignore[arg-type]
            _shard_existing_state(step.optimizer, param, group.buffer, slot, model.names[param])
        step.set_entries(entries, shared)
        step.install()
        model.absorb_optimizer_state(step.optimizer)


def _shard_existing_state(
    optimizer: Optimizer, param: nn.Parameter, buffer: FlatParamBuffer, slot: int, name: str
) -> None:
    state = optimizer.state.get(param)
    shape = buffer.layout.slots[slot].shape
    if buffer.layout.whole_tensors:  # the owner keeps its state whole, as it is; the others none
        if state and buffer.owned_elsewhere(slot):
            del optimizer.state[param]
        return
    if state and any(isinstance(v, Tensor) and tuple(v.shape) == shape and v.dim() > 0 for v in state.values()):
        optimizer.state[param] = shard_param_state(state, buffer.pieces[slot], shape, name)
