"""Where the optimizer's copy of a shard lives: the shard itself, or a wider master copy of it.

A store belongs to one :class:`FlatParamBuffer` whose parameters an optimizer trains. It owns everything between
the reduced gradient shard and the new parameter shard: the tensor the optimizer updates for each parameter
(:meth:`ShardStore.step_view`), the gradients it sees during the step (made from the held, reduced gradients:
cast, unscaled), what is saved and gathered (:meth:`ShardStore.best`) and how an update reaches the parameters
(:meth:`ShardStore.finish`). Precision chooses the store once, at setup: :class:`InPlaceStore` for parameters
trained in their own dtype (fp32 runs; batch-norm, complex and integer parameters in 16-bit runs),
:class:`MasterStore` for 16-bit parameters with an fp32 master (see [Note: mixed-precision model states]).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_zero.core.layout.flat_buffer import FlatParamBuffer


class ShardStore(ABC):
    """The optimizer's side of one buffer's shard."""

    offloaded = False  # the optimizer's copy and state live off the device (core/store/host.py, disk.py)
    paged = False  # the optimizer's copy and state are paged in per buffer during the step (core/store/disk.py)

    def __init__(self, buffer: FlatParamBuffer) -> None:
        self.buffer = buffer

    @abstractmethod
    def step_view(self, slot: int) -> Tensor:
        """The 1D tensor the optimizer updates for parameter ``slot`` (its owned elements)."""

    @abstractmethod
    def best(self) -> Tensor:
        """This rank's shard in the best precision held (what checkpoints save and full state dicts gather)."""

    @abstractmethod
    def step_grads(self, slots: Sequence[int], held: Sequence[Tensor], scale: float | None) -> list[Tensor]:
        """The gradients the optimizer sees for ``slots``, made from their ``held`` reduced gradients and divided
        by the loss ``scale``. :meth:`release` ends their life."""

    @abstractmethod
    def release(self, held: Sequence[Tensor], step_grads: Sequence[Tensor], clipped: bool, scale: float | None) -> None:
        """The step is over (or will not come): the held gradients stay what torch would leave in ``grad``, scaled
        as a following backward adds to them; a clipped gradient keeps its clipped value."""

    @abstractmethod
    def finish(self) -> None:
        """After the optimizer updated :meth:`step_view`: the new values reach the shard."""

    @abstractmethod
    def sync_from_params(self) -> None:
        """Take into the optimizer's copy the parameter values written directly (load, in-place edits, a
        parameter given new ``data``)."""

    def load_owned(self, slot: int, values: Tensor) -> None:
        """Set the owned elements of parameter ``slot`` in every copy held."""
        self.buffer.load_owned(slot, values)

    def flush(self) -> None:
        """Make values loaded with :meth:`load_owned` durable where the store holds them (a no-op in memory)."""
        return

    def close(self) -> None:
        """Give back what the store holds outside the tensors (pinned host memory, a swap file's regions)."""
        return

    @property
    def nbytes(self) -> int:
        """Device bytes the store holds beyond the parameters (counted with the optimizer state, as in the paper)."""
        return 0

    @property
    def offloaded_nbytes(self) -> int:
        """Bytes the store holds on the host or on disk."""
        return 0


class InPlaceStore(ShardStore):
    """The optimizer updates the shard itself; its gradients are the held ones, unscaled in place."""

    def step_view(self, slot: int) -> Tensor:
        return self.buffer.owned(self.buffer.shard, slot)

    def best(self) -> Tensor:
        return self.buffer.shard

    def step_grads(self, slots: Sequence[int], held: Sequence[Tensor], scale: float | None) -> list[Tensor]:
        if scale is not None:
            for grad in held:
                grad.mul_(1.0 / scale)
        return list(held)

    def release(self, held: Sequence[Tensor], step_grads: Sequence[Tensor], clipped: bool, scale: float | None) -> None:
        if scale is not None:
            for grad in held:
                grad.mul_(scale)

    def finish(self) -> None:
        """The optimizer wrote the shard itself."""
        self.buffer.shard_written()

    def sync_from_params(self) -> None:
        self.buffer.reattach()  # the optimizer's copy is the shard itself, once every parameter is a view again


class MasterStore(ShardStore):
    """The optimizer updates a copy of the shard in ``master_dtype``; its gradients are wide copies, freed after
    the step, and the updated master is rounded into the shard. See [Note: mixed-precision model states]."""

    master: Tensor  # 1D, layout.shard_numel, master_dtype

    def __init__(self, buffer: FlatParamBuffer, master_dtype: torch.dtype) -> None:
        """Take the master from the buffer's current full values (in their own precision): call while the buffer is
        full and before ``buffer.cast``."""
        super().__init__(buffer)
        lo, hi = buffer.bounds
        self.master = buffer.data[lo:hi].to(master_dtype, copy=True)

    def step_view(self, slot: int) -> Tensor:
        return self.buffer.owned(self.master, slot)

    def best(self) -> Tensor:
        return self.master

    def step_grads(self, slots: Sequence[int], held: Sequence[Tensor], scale: float | None) -> list[Tensor]:
        flat = torch.empty_like(self.master)  # one allocation per buffer; freed with the returned views
        grads = []
        for slot, grad in zip(slots, held, strict=True):
            step_grad = self.buffer.owned(flat, slot)
            step_grad.copy_(grad)
            if scale is not None:
                step_grad.mul_(1.0 / scale)
            grads.append(step_grad)
        return grads

    def release(self, held: Sequence[Tensor], step_grads: Sequence[Tensor], clipped: bool, scale: float | None) -> None:
        if clipped:  # torch keeps a clipped gradient; it accumulates on if zero_grad is not called
            for grad, step_grad in zip(held, step_grads, strict=True):
                grad.copy_(step_grad * (scale or 1.0))

    def finish(self) -> None:
        self.buffer.assign_shard(self.master)

    def sync_from_params(self) -> None:
        self.buffer.reattach()
        shard = self.buffer.shard
        changed = shard != self.master.to(shard.dtype)
        torch.where(changed, shard, self.master, out=self.master)

    def load_owned(self, slot: int, values: Tensor) -> None:
        self.buffer.owned(self.master, slot).copy_(values)
        super().load_owned(slot, values)

    @property
    def nbytes(self) -> int:
        return self.master.numel() * self.master.element_size()
