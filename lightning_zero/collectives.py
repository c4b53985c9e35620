"""A strategy's own collectives (barrier, object broadcast, a logged metric's reduction, the failure notice) for
any loop: Lightning's ``ZeroStrategy`` and a Fabric strategy alike. Imports no ``lightning.pytorch``.

[Note: the strategy's collectives]
They go through the :class:`~lightning_zero.core.comm.Communicator` where it reads failure notices (gloo), so a
rank waiting in a barrier, a broadcast or a reduction stops when another rank raised (see [Note: a rank that raises
and stays alive]); NCCL, other groups and reductions the communicator does not run use torch's (or Lightning
Fabric's ``_sync_ddp``) directly. ``comm`` is ``None`` before the process group is up.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from torch import Tensor

from lightning_zero.core.comm import Communicator

T = TypeVar("T")


def barrier(comm: Communicator | None, device: torch.device) -> None:
    """Wait for every rank (``device``: this rank's, for NCCL)."""
    if not _distributed():
        return
    if torch.distributed.get_backend() == "nccl":
        torch.distributed.barrier(device_ids=[device.index])
    elif comm is not None:
        comm.barrier()
    else:
        torch.distributed.barrier()


def broadcast(comm: Communicator | None, obj: T, src: int = 0) -> T:
    """Rank ``src``'s ``obj`` on every rank."""
    if not _distributed():
        return obj
    if comm is not None:
        return comm.broadcast_object(obj, src)
    wrapped = [obj]
    torch.distributed.broadcast_object_list(wrapped, src)
    return wrapped[0]


def reduce(comm: Communicator | None, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
    """Reduce ``tensor`` over the ranks as Lightning's ``_sync_ddp`` does (``reduce_op``: a name, a ``ReduceOp``,
    or ``None`` for a sum); anything but a tensor is returned as it is."""
    if not isinstance(tensor, Tensor):
        return tensor
    op = plain_reduce_op(reduce_op)
    if group is not None or comm is None or comm.notices is None or op is None:
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
    name, mean = op
    comm.barrier()  # as Lightning's _sync_ddp, whose results these are
    comm.all_reduce(tensor, name, counted=False)
    if not mean:
        return tensor
    if not torch.is_floating_point(tensor):
        return tensor.copy_(tensor / comm.world_size)
    return tensor.div_(comm.world_size)


def post_failure(comm: Communicator | None, exception: BaseException) -> None:
    """Tell the other ranks that this one raised ``exception`` (nothing to tell before the group is up)."""
    if comm is not None:
        comm.post_failure(exception)


def post_finished(comm: Communicator | None, where: str) -> None:
    """Tell the other ranks that this one's fit ended normally, ``where`` (see [Note: a rank that finished])."""
    if comm is not None:
        comm.post_finished(where)


def clear_finished(comm: Communicator | None) -> None:
    """A fit starts: this rank's earlier finished notice no longer holds."""
    if comm is not None:
        comm.clear_finished()


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def plain_reduce_op(reduce_op: Any) -> tuple[str, bool] | None:
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
