"""Host memory for offloaded model states: exact-size buffers (pinned on CUDA), and the host store.

[Note: offloaded optimizer steps]
With ``offload_optimizer`` each trainable buffer's fp32 master shard and the optimizer state live off the device,
and the user's optimizer steps there (ZeRO-Offload). The reduced gradient shard travels to the host in the
training dtype (2 bytes a parameter in the mixed modes) and is widened there; the updated master is rounded to the
training dtype on the host and only then copied back into the device shard. :class:`HostStore` keeps the master
in host memory and lets the optimizer keep its state as usual (its state tensors follow the master onto the
host); :class:`~lightning_zero.core.store.disk.DiskStore` keeps both in a file and pages them in, buffer by
buffer, during the step. On a CPU-only machine "host" and "device" are the same memory: the stores then skip the
copies, and what differs is only where the bytes are counted (``offloaded``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_zero.core.layout.flat_buffer import FlatParamBuffer
from lightning_zero.core.layout.host_memory import HOST, host_empty, host_release
from lightning_zero.core.store.stores import MasterStore


def to_host(grad: Tensor, dtype: torch.dtype) -> Tensor:
    """``grad`` on the host in ``dtype``: moved in its own (training) dtype, widened there."""
    moved = grad if grad.device == HOST else grad.to(HOST, non_blocking=False)
    return moved.to(dtype)


def host_step_grads(
    buffer: FlatParamBuffer, dtype: torch.dtype, slots: Sequence[int], held: Sequence[Tensor], scale: float | None
) -> list[Tensor]:
    """The step gradients of an offloaded store, on the host in the master's ``dtype``, divided by ``scale``.
    Held gradients already there in that dtype (fp32 runs on a CPU) are used in place, as the in-place store does;
    others are copied: moved in their own dtype, widened on the host."""
    if all(grad.device == HOST and grad.dtype == dtype for grad in held):
        if scale is not None:
            for grad in held:
                grad.mul_(1.0 / scale)
        return list(held)
    lo, hi = buffer.bounds
    flat = torch.empty(hi - lo, dtype=dtype, device=HOST)
    grads = []
    for slot, grad in zip(slots, held, strict=True):
        step_grad = buffer.owned(flat, slot)
        step_grad.copy_(to_host(grad, grad.dtype))
        if scale is not None:
            step_grad.mul_(1.0 / scale)
        grads.append(step_grad)
    return grads


def host_release_grads(
    held: Sequence[Tensor], step_grads: Sequence[Tensor], clipped: bool, scale: float | None
) -> None:
    """End the step gradients of :func:`host_step_grads`: held ones used in place get their scale back; a clipped
    copy goes back into the held gradient (torch keeps a clipped gradient)."""
    for grad, step_grad in zip(held, step_grads, strict=True):
        if step_grad.data_ptr() == grad.data_ptr() and step_grad.numel() == grad.numel():
            if scale is not None:
                grad.mul_(scale)
        elif clipped:
            grad.copy_(step_grad * (scale or 1.0))


class HostStore(MasterStore):
    """``offload_optimizer="cpu"``: the master shard in host memory; the optimizer (and its state) steps there.
    See [Note: offloaded optimizer steps].

    Args:
        buffer: the parameters; call while it holds its full values (before ``buffer.cast``).
        master_dtype: the master's dtype (fp32 in every precision, also in 32-true runs: the device keeps the
            parameters, the host the copy the optimizer updates).
    """

    offloaded = True

    def __init__(self, buffer: FlatParamBuffer, master_dtype: torch.dtype) -> None:
        self.buffer = buffer
        lo, hi = buffer.bounds
        self.master = host_empty(hi - lo, master_dtype, pin=buffer.data.device.type == "cuda")
        self.master.copy_(buffer.data[lo:hi])

    def step_grads(self, slots: Sequence[int], held: Sequence[Tensor], scale: float | None) -> list[Tensor]:
        return host_step_grads(self.buffer, self.master.dtype, slots, held, scale)

    def release(self, held: Sequence[Tensor], step_grads: Sequence[Tensor], clipped: bool, scale: float | None) -> None:
        host_release_grads(held, step_grads, clipped, scale)

    def finish(self) -> None:
        self.buffer.assign_shard(self.master)

    def sync_from_params(self) -> None:
        self.buffer.reattach()
        shard = self.buffer.shard.to(HOST)
        changed = shard != self.master.to(shard.dtype)
        torch.where(changed, shard.to(self.master.dtype), self.master, out=self.master)

    def load_owned(self, slot: int, values: Tensor) -> None:
        self.buffer.owned(self.master, slot).copy_(values)
        self.buffer.load_owned(slot, values)

    def close(self) -> None:
        host_release(self.master)

    @property
    def nbytes(self) -> int:
        return 0

    @property
    def offloaded_nbytes(self) -> int:
        return self.master.numel() * self.master.element_size()
