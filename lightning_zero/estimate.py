"""estimate_memory(): the ZeRO paper's per-rank bytes of model states, from parameter counts alone.

Nothing is allocated: the model may live on the meta device, so a 70B-parameter model built under
``with torch.device("meta"):`` is estimated in milliseconds. The formulas are those of the ZeRO
paper (Rajbhandari et al., 2020, section 3 and Figure 1); ``docs/estimate.md`` shows them as a table.

[Note: estimate formulas]
Ψ is the number of trainable parameters (elements), Φ the number of frozen ones, N the shard group's
size: ``world_size``, or ``shard_size`` with hybrid sharding (states sharded inside groups of N consecutive
ranks and replicated across the world_size / N groups, so a rank holds what it would hold in a world of N).
Each precision has a width for parameters and for gradients, and a width for the fp32 master copy
that the optimizer keeps when training runs in 16 bits; the optimizer adds K bytes of element-wise
state per parameter (Adam/AdamW: exp_avg and exp_avg_sq, 8 bytes). Per rank:

    params           = param_width * Ψ + frozen_width * Φ   / N at stage 3
    gradients        = grad_width * Ψ                       / N at stages 2-3
    optimizer_states = (K + master_width) * Ψ               / N at stages 1-3

With ``secondary_shard_size=s`` (stage 3, ZeRO++ hpZ) each unit keeps 1/s of its full buffer from its forward to
its backward (see [Note: secondary shards]); ``params`` then counts the peak between forward and backward, when every
unit's slice is alive (the end of forward), on the device whatever ``offload_params`` says. At that moment the root
unit is gathered in full (it stays so from forward to backward, with or without slices) and keeps no slice. With Ψᵤ
and Φᵤ the trainable and frozen elements of the units ``wrap_policy`` chooses (the engine's own choice, [Note:
stage-3 gather units]), Ψᵣ and Φᵣ those of the root:

    params          += (param_width * Ψᵤ + frozen_width * Φᵤ) / s + param_width * Ψᵣ + frozen_width * Φᵣ

With ``quantize_gradients`` (stages 1-3, ZeRO++ qgZ) over M > 1 nodes each rank keeps error feedback's fp32 residual
of every row of gradients it sends across nodes (see [Note: error feedback]): without ``shard_size`` the M - 1 node
partials of its slice, with it its shard:

    gradients       += 4 * Ψ * (M - 1) / N      (4 * Ψ / N with shard_size)

They stay on the device whatever the offloads (the reduction runs there).

A unit whose outputs need no gradient (frozen, on inputs that need none) keeps no slice either; that depends on the
data, so for such units it is an upper bound.

Frozen parameters have no optimizer and so no fp32 master: the mixed modes keep them in fp32 (autocast
casts them for compute), ``"bf16-true"`` holds them in bf16 like the rest of the module.

Stage 0 is plain DDP (nothing divided), for comparison; it ignores ``shard_size`` (every rank holds everything
whatever the groups), though it still checks it, so the CLI's table shows stage 0 beside the rest. Mixed-precision
Adam is the paper's 2 + 2 + 12 bytes per parameter. Offloading moves optimizer_states (and at stage 3 the parameter
shard) from the device into ``offloaded``; the offloaded optimizer always steps an fp32 master copy, so in
``"32-true"`` it is K + 4 bytes (Adam: 12), not K. With both offloads on NVMe the gradient shard rests in the swap
file too and is counted in ``offloaded``; where gradients accumulate (``accumulate_grad_batches`` > 1) each
reduction's fp32 result also waits in a second region of the swap file until the end of backward folds it into the
shard (see ``ShardGradBucket``): 4 bytes per trained element / N more, held from the first accumulation on. Not
counted: padding of flat buffers (fewer than N elements each), scalar optimizer state (a 4-byte ``step`` per tensor
per rank), buffers, activations, temporary communication buffers and the allocator's fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import nn

from lightning_zero.core.layout.pieces import assign_owners
from lightning_zero.core.memory import MemoryReport
from lightning_zero.core.options import (
    OFFLOAD_TARGETS,
    PARTITIONS,
    OffloadTarget,
    check_choice,
    check_secondary_shard_size,
    check_shard_size,
    resolve_policy,
)
from lightning_zero.core.stage3.units import assign_params, select_units

STAGES = (0, 1, 2, 3)
OFFLOADED_MASTER_BYTES = 4  # the fp32 master the offloaded optimizer steps, in every precision
REDUCE_BYTES = 4  # gradients are reduced in fp32 (ZeroPrecision's default reduce_dtype)


class _Widths(NamedTuple):
    """Bytes per parameter element of one precision."""

    param: int
    grad: int
    master: int  # fp32 master copy kept with the optimizer state; 0 when the parameters are fp32
    frozen: int  # frozen parameters: the mixed modes leave them in fp32, "bf16-true" casts the whole module


# fp32 training keeps nothing extra; 16-bit training keeps an fp32 master copy of each rank's shard.
PRECISIONS: dict[str, _Widths] = {
    "32-true": _Widths(param=4, grad=4, master=0, frozen=4),
    "16-mixed": _Widths(param=2, grad=2, master=4, frozen=4),
    "bf16-mixed": _Widths(param=2, grad=2, master=4, frozen=4),
    "bf16-true": _Widths(param=2, grad=2, master=4, frozen=2),
}

# K: bytes of element-wise fp32 state per trainable parameter (torch.optim defaults).
OPTIMIZER_STATE_BYTES: dict[str, int] = {
    "adamw": 8,  # exp_avg + exp_avg_sq
    "adam": 8,
    "sgd": 0,  # momentum=0 keeps no state
    "sgd_momentum": 4,  # momentum_buffer
    "adagrad": 4,  # sum
    "rmsprop": 4,  # square_avg (momentum=0, centered=False)
}


@dataclass(frozen=True, slots=True)
class MemoryEstimate(MemoryReport):
    """Estimated bytes of model states per rank; ``offloaded`` ones live on CPU/NVMe, the rest on the device.

    The fields (and ``total``) are those of :class:`~lightning_zero.core.memory.MemoryReport`, which measures
    the same quantities from the tensors a rank actually holds.
    """


def estimate_memory(
    model: nn.Module,
    *,
    stage: int,
    world_size: int,
    precision: str = "16-mixed",
    optimizer: str = "adamw",
    offload_optimizer: OffloadTarget = False,
    offload_params: OffloadTarget = False,
    partition: str = "flat",
    accumulate_grad_batches: int = 1,
    shard_size: int | None = None,
    secondary_shard_size: int | None = None,
    quantize_gradients: bool = False,
    num_nodes: int = 1,
    wrap_policy: Any = None,
) -> MemoryEstimate:
    """Estimate the bytes of parameters, gradients and optimizer state that each rank holds.

    Only ``p.numel()`` and ``p.requires_grad`` of ``model.parameters()`` are read (tied parameters
    count once), so the model may be on the meta device. Trainable parameters cost parameter,
    gradient and optimizer bytes; frozen ones cost parameter bytes only (sharded at stage 3 like the
    rest). See [Note: estimate formulas] in this module for the arithmetic.

    Not included: padding (fewer than ``world_size`` elements per flat buffer), small scalars such as
    the optimizer's ``step`` counters (4 bytes per tensor per rank), buffers, activations and
    temporary communication buffers.

    Args:
        model: the module to train, on any device including ``"meta"``.
        stage: 0 (plain DDP, no sharding: for comparison), 1 (optimizer state sharded), 2 (+ gradients)
            or 3 (+ parameters).
        world_size: number of ranks in all.
        precision: ``"32-true"`` (4 + 4 bytes of parameter and gradient per element), or
            ``"16-mixed"``, ``"bf16-mixed"``, ``"bf16-true"`` (2 + 2, plus a 4-byte fp32 master copy
            kept with the optimizer state).
        optimizer: one of ``"adamw"``, ``"adam"`` (8 bytes of state per element), ``"sgd"`` (0),
            ``"sgd_momentum"``, ``"adagrad"``, ``"rmsprop"`` (4 each).
        offload_optimizer: ``False``, ``"cpu"`` or ``"nvme"``; when set (stages 1-3), the optimizer
            states and master copy are counted in ``offloaded`` instead of on the device.
        offload_params: ``False``, ``"cpu"`` or ``"nvme"``; stage 3 only. When set, the parameter
            shard is counted in ``offloaded`` too.
        partition: ``"flat"`` (even shards) or ``"parameter"`` (whole tensors per owner, assigned as the engine
            assigns them): the bytes are the most loaded rank's; ``owned_max`` / ``owned_min`` give the trained
            elements of the most and least loaded rank.
        accumulate_grad_batches: as the Trainer's flag (or several backward passes per optimizer step). Above 1,
            with both offloads ``"nvme"``, ``offloaded`` includes the region where a reduction's fp32 result waits
            until it is added to the gradient shard; otherwise it changes nothing.
        shard_size: hybrid sharding: the states are sharded inside groups of this many consecutive ranks (e.g. the
            processes of one node) and replicated across the groups; a divisor of ``world_size``. ``None`` shards
            over all ranks. Every figure then equals that of ``world_size=shard_size`` without it, owners included
            (``partition="parameter"`` plans over one group's ranks). Ignored at stage 0, where nothing is sharded.
        secondary_shard_size: stage 3 (ZeRO++ hpZ): units keep 1/secondary_shard_size of their parameters from
            forward to backward; ``params`` then counts them too, and the root unit gathered in full, as at the end
            of forward (see [Note: estimate formulas]). A positive int dividing the stage-3 gather group's size
            (``shard_size`` or ``world_size``).
        quantize_gradients: ZeRO++ qgZ: over ``num_nodes`` > 1, ``gradients`` adds error feedback's fp32 residuals
            (see [Note: estimate formulas]); stages 1-3 (stage 0 ignores it).
        num_nodes: the nodes the ``world_size`` ranks run on, the same number on each (read, and checked, with
            ``quantize_gradients`` only).
        wrap_policy: the strategy's ``wrap_policy`` (module classes, their import paths, or a callable); read with
            ``secondary_shard_size`` only: the units other than the root keep slices, the root stays gathered.
            ``None``: the engine's default units, the repeated blocks.

    Returns:
        The per-rank bytes; ``total`` is what stays on the accelerator.

    Raises:
        ValueError: for a ``model`` that is not an ``nn.Module``, an unknown ``stage``, ``precision``,
            ``optimizer`` or offload target, a ``world_size`` or ``accumulate_grad_batches`` below 1,
            ``offload_optimizer`` at stage 0 or ``offload_params`` below stage 3, a ``shard_size`` that is not a
            positive int dividing ``world_size``, a ``secondary_shard_size`` below stage 3 or not dividing the shard
            group's size, with ``quantize_gradients`` a ``num_nodes`` that is not a positive int dividing
            ``world_size``.
    """
    _check_arguments(model, stage, world_size, precision, optimizer, offload_optimizer, offload_params)
    group = shard_group_size(shard_size, world_size)
    check_secondary_shard_size(secondary_shard_size, stage, group)
    check_choice("partition", partition, PARTITIONS)
    accumulating = accumulate_grad_batches
    if isinstance(accumulating, bool) or not isinstance(accumulating, int) or accumulating < 1:
        raise ValueError(f"accumulate_grad_batches={accumulating!r} is not supported; choose a positive int, e.g. 1.")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    widths = PRECISIONS[precision]
    # Offload keeps an fp32 master on the host in every precision, 32-true too (the device keeps the parameters).
    master = OFFLOADED_MASTER_BYTES if offload_optimizer else widths.master
    state_width = OPTIMIZER_STATE_BYTES[optimizer] + master
    owned_max, owned_min = _owned(model, stage, group, partition)

    def sharded(width: int, from_stage: int, extra: int = 0) -> int:
        """One rank's bytes of the trained tensors at ``width`` bytes each (plus ``extra`` bytes sharded evenly),
        sharded from ``from_stage`` on: the most loaded owner's with partition="parameter"."""
        shards = group if stage >= from_stage else 1
        if partition == "parameter" and shards > 1:
            return width * owned_max + _per_rank(extra, shards)
        return _per_rank(width * trainable + extra, shards)

    params = sharded(widths.param, 3, extra=widths.frozen * frozen)  # frozen tensors are sharded flat
    gradients = sharded(widths.grad, 2)
    optimizer_states = sharded(state_width, 1)
    offloaded = 0
    if offload_optimizer:
        offloaded, optimizer_states = offloaded + optimizer_states, 0
    if offload_params:
        offloaded, params = offloaded + params, 0
    if secondary_shard_size is not None:  # the end of forward: the units' slices and the root gathered, on the device
        root, root_frozen = _root_elements(model, wrap_policy)
        params += _per_rank(
            widths.param * (trainable - root) + widths.frozen * (frozen - root_frozen), secondary_shard_size
        )
        params += widths.param * root + widths.frozen * root_frozen
    if offload_optimizer == "nvme" and offload_params == "nvme":  # ZeRO-Infinity: the gradient shard rests there too
        offloaded, gradients = offloaded + gradients, 0
        if accumulating > 1:  # and, accumulating, each reduction's fp32 result until it is folded in
            offloaded += sharded(REDUCE_BYTES, 2)
    if quantize_gradients:  # on the device whatever the offloads (see [Note: estimate formulas])
        residuals = _feedback_residuals(trainable, world_size, group, num_nodes, partition)
        gradients += residuals if stage >= 1 else 0
    return MemoryEstimate(
        params=params,
        gradients=gradients,
        optimizer_states=optimizer_states,
        offloaded=offloaded,
        owned_max=owned_max,
        owned_min=owned_min,
    )


def shard_group_size(shard_size: Any, world_size: int) -> int:
    """The number of ranks the states are sharded over: ``shard_size``, or ``world_size`` when it is ``None``.

    Raises:
        ValueError: ``shard_size`` is not ``None`` nor a positive int, or does not divide ``world_size``.
    """
    check_shard_size(shard_size, world_size)
    return world_size if shard_size is None else shard_size


def _owned(model: nn.Module, stage: int, world_size: int, partition: str) -> tuple[int, int]:
    """Trained elements of the most and the least loaded rank of a shard group of ``world_size`` ranks (all of them
    at stage 0, plain DDP)."""
    numels = [p.numel() for p in model.parameters() if p.requires_grad]
    if stage == 0:
        return sum(numels), sum(numels)
    if partition == "flat":
        return -(-sum(numels) // world_size), sum(numels) // world_size
    _, loads = assign_owners(numels, world_size)  # by elements: every trained tensor has the same widths
    return max(loads), min(loads)


def _root_elements(model: nn.Module, wrap_policy: Any) -> tuple[int, int]:
    """Trainable and frozen elements of the stage-3 root unit when ``wrap_policy`` chooses the others: the
    parameters that keep no secondary slice but stay gathered (see [Note: estimate formulas])."""
    units = select_units(model, resolve_policy("wrap_policy", wrap_policy))
    root = assign_params(model, units)[model]
    return sum(p.numel() for p in root if p.requires_grad), sum(p.numel() for p in root if not p.requires_grad)


def _feedback_residuals(trainable: int, world_size: int, group: int, num_nodes: int, partition: str) -> int:
    """``quantize_gradients``: bytes of error feedback's fp32 residuals per rank, those of the rows it sends across
    ``num_nodes`` nodes (see [Note: estimate formulas]); 0 on one node."""
    if partition != "flat":
        raise ValueError(
            f"quantize_gradients=True needs partition='flat' (got {partition!r}), as ZeroStrategy does: its uneven "
            "parts are not split by the hierarchical reduction."
        )
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1 or world_size % num_nodes:
        raise ValueError(
            f"num_nodes={num_nodes!r} must be a positive int dividing world_size={world_size} (every node runs as "
            "many ranks), e.g. 1."
        )
    if num_nodes == 1:
        return 0
    rows = 1 if group < world_size else num_nodes - 1  # hybrid: the shard; flat: the partials that leave the node
    return rows * _per_rank(REDUCE_BYTES * trainable, group)


def _per_rank(nbytes: int, shards: int) -> int:
    """Bytes of one shard when ``nbytes`` are split evenly over ``shards`` ranks (rounded up)."""
    return -(-nbytes // shards)


def _check_arguments(
    model: Any,
    stage: Any,
    world_size: Any,
    precision: Any,
    optimizer: Any,
    offload_optimizer: Any,
    offload_params: Any,
) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    check_choice("stage", stage, STAGES)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} is not supported; choose a positive int, e.g. world_size=8.")
    check_choice("precision", precision, tuple(PRECISIONS))
    check_choice("optimizer", optimizer, tuple(OPTIMIZER_STATE_BYTES))
    check_choice("offload_optimizer", offload_optimizer, OFFLOAD_TARGETS)
    check_choice("offload_params", offload_params, OFFLOAD_TARGETS)
    if offload_optimizer and stage == 0:
        raise ValueError(
            f"offload_optimizer={offload_optimizer!r} needs stage >= 1, got stage=0 (plain DDP keeps its "
            "optimizer on the device). Use stage=1, 2 or 3, or offload_optimizer=False."
        )
    if offload_params and stage != 3:
        raise ValueError(
            f"offload_params={offload_params!r} needs stage=3, got stage={stage}. Use stage=3 or offload_params=False."
        )
